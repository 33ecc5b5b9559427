// Inputs that crashed or were misread become errors naming the input: deep JSON, invalid UTF-8 in
// an override, a profile field of the wrong type, number overflow, a directory as data, an llm.c
// header that miscounts, invalid JSON (its line and column), a uint32 token past 2^31.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>

#include "src/plan/probe_machine.h"
#include "src/train/data.h"
#include "src/train/trainer.h"
#include "strata/io_probe.h"
#include "tests/adversarial_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

using namespace adversarial;

// ---- 6. crashes become errors
// --------------------------------------------------------------------

TEST_F(Hardening, DeepJsonIsRefused) {
  for (const char* open_close : {"[]", "{}"}) {
    std::string deep;
    for (int i = 0; i < 100000; ++i) deep += open_close[0] == '[' ? "[" : "{\"a\":";
    deep += open_close[0] == '[' ? "1" : "1";
    for (int i = 0; i < 100000; ++i) deep += open_close[1];
    auto r = parse_config("{\"model\": " + deep + "}", "deep.json");
    ASSERT_FALSE(r.is_ok());
    EXPECT_TRUE(contains(r.status().message(), "nested deeper than")) << r.status().message();
    auto o = parse_config("{}", "x.json", {"model=" + deep});
    ASSERT_FALSE(o.is_ok());
    EXPECT_TRUE(contains(o.status().message(), "nested deeper than")) << o.status().message();
  }
}

// Found by fuzz_config: an override value that is not JSON is taken as a string; invalid UTF-8
// in it made the "got ..." message throw (nlohmann type_error 316) and abort.
TEST_F(Hardening, OverrideWithInvalidUtf8IsAnErrorNotAnAbort) {
  auto r = parse_config("{}", "x.json", {"zero_optimization.stage=ac\xb4\xff"});
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(contains(r.status().message(), "zero_optimization.stage")) << r.status().message();
}

TEST_F(Hardening, ProfileFieldOfTheWrongTypeIsAnErrorNotAnAbort) {
  const char* text = R"({"magic": "strata-machine-profile", "version": 1,
    "device": {"backend": "cpu", "gemm_flops": 1e11, "gemm_by_width": [{"C": "x", "gemm_flops": 1}]},
    "host": {"copy_gbps": 10}, "cpu_optimizer": {"params_per_s": 1e8}})";
  auto p = parse_machine_profile(text, "p.json");
  ASSERT_FALSE(p.is_ok());
  EXPECT_TRUE(contains(p.status().message(), "p.json")) << p.status().message();
  EXPECT_TRUE(contains(p.status().message(), "strata probe")) << p.status().message();
}

TEST_F(Hardening, NumberOverflowIsRefused) {
  auto r = parse_config(R"({"optimizer": {"params": {"lr": 1e400}}})", "x.json");
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(contains(r.status().message(), "1e400")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "x.json")) << r.status().message();
  auto o = parse_config("{}", "x.json", {"optimizer.params.lr=1e400"});
  ASSERT_FALSE(o.is_ok());
  auto big = parse_config(R"({"aio": {"block_size": 2e19}})", "x.json");
  ASSERT_FALSE(big.is_ok());
  EXPECT_TRUE(contains(big.status().message(), "too large")) << big.status().message();
  EXPECT_FALSE(contains(big.status().message(), "out of range [0, inf)"));
}

TEST_F(Hardening, DataSourceDirectoryIsRefused) {
  const auto dir = temp_dir("datadir");
  DataConfig dc;
  dc.source = dir;
  auto d = Dataset::load(dc, 256, 1);
  ASSERT_FALSE(d.is_ok());
  EXPECT_TRUE(contains(d.status().message(), "is a directory")) << d.status().message();
  fs::remove_all(dir);
}

// A device or a pipe is not read (it may never end: /dev/zero filled memory until the process
// died); the message names the key and the path.
TEST_F(Hardening, DataSourceThatIsNoRegularFileIsRefused) {
  DataConfig dc;
  dc.source = "/dev/zero";
  auto d = Dataset::load(dc, 256, 1);
  ASSERT_FALSE(d.is_ok());
  EXPECT_TRUE(contains(d.status().message(), "data.source: '/dev/zero' is not a regular file"))
      << d.status().message();
}

// Every file read whole (a config, a machine profile) must be a regular file: /dev/zero was read
// until the memory was gone.
TEST_F(Hardening, FilesReadWholeMustBeRegular) {
  auto c = load_config("/dev/zero");
  ASSERT_FALSE(c.is_ok());
  EXPECT_TRUE(contains(c.status().message(), "the config '/dev/zero' is not a regular file"))
      << c.status().message();
  auto p = load_machine_profile("/dev/zero");
  ASSERT_FALSE(p.is_ok());
  EXPECT_TRUE(contains(p.status().message(), "--profile '/dev/zero' is not a regular file"))
      << p.status().message();
  const auto dir = temp_dir("config_dir");
  auto d = load_config(dir);
  ASSERT_FALSE(d.is_ok());
  EXPECT_TRUE(contains(d.status().message(), "is a directory")) << d.status().message();
}

// The memory probe's two buffers of --host-bytes: more than the host has was a bad_alloc.
TEST_F(Hardening, ProbeHostBytesBeyondTheHostAreRefused) {
  MachineProbeOptions o;
  o.host_bytes = uint64_t{1} << 60;
  o.include_cuda = false;
  auto r = run_machine_probe(o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(contains(r.status().message(), "--host-bytes")) << r.status().message();
  o.host_bytes = 100;
  r = run_machine_probe(o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(contains(r.status().message(), "at least 4 KiB")) << r.status().message();
}

// strata probe --path with an NVMe file of no whole block (--nvme-bytes 0 or 1.5 MiB) is refused
// naming --nvme-bytes before any probe runs (it ran the memory, optimizer and GEMM probes, then
// refused naming strata probe io's --size).
TEST_F(Hardening, ProbeNvmeBytesOfNoWholeBlockAreRefusedFirst) {
  const auto dir = temp_dir("probe_nvme_bytes");
  MachineProbeOptions o;
  o.include_cuda = false;
  o.nvme_paths = {dir};
  for (uint64_t bytes : {uint64_t{0}, uint64_t{3} << 19}) {
    o.nvme_file_bytes = bytes;
    int steps = 0;
    auto r = run_machine_probe(o, [&](int, int, const std::string&) { ++steps; });
    ASSERT_FALSE(r.is_ok()) << bytes;
    EXPECT_TRUE(contains(r.status().message(), fmt::format("--nvme-bytes {}: ", bytes)))
        << r.status().message();
    EXPECT_EQ(steps, 0) << r.status().message();
  }
  fs::remove_all(dir);
}

// strata probe io: a queue depth the storage engine refuses is refused before the sweep's
// buffers are made (a depth of 6000 made 6 GiB of them, then every case was skipped, exit 0).
TEST_F(Hardening, ProbeIoQueueDepthsOutsideTheEnginesRangeAreRefused) {
  const auto dir = temp_dir("probe_io");
  IoProbeOptions o;
  o.paths = {dir};
  o.file_bytes = 1 << 20;
  o.block_sizes = {1 << 20};
  for (int qd : {0, 4097}) {
    o.queue_depths = {4, qd};
    auto r = run_io_probe(o, nullptr);
    ASSERT_FALSE(r.is_ok()) << qd;
    EXPECT_TRUE(contains(r.status().message(), "must be between 1 and 4096"))
        << r.status().message();
  }
}

// strata probe io with a file of no whole block (--size 0 reported zeros, exit 0) or a negative
// warm-up (fewer passes than asked, silently).
TEST_F(Hardening, ProbeIoFileOfNoBlockOrNegativeWarmupIsRefused) {
  const auto dir = temp_dir("probe_io_size");
  IoProbeOptions o;
  o.paths = {dir};
  o.block_sizes = {1 << 20};
  o.queue_depths = {4};
  for (uint64_t bytes : {uint64_t{0}, uint64_t{1} << 19}) {
    o.file_bytes = bytes;
    auto r = run_io_probe(o, nullptr);
    ASSERT_FALSE(r.is_ok()) << bytes;
    EXPECT_TRUE(contains(r.status().message(), "give --size at least the largest block size"))
        << r.status().message();
  }
  o.file_bytes = 1 << 20;
  o.warmup = -1;
  auto r = run_io_probe(o, nullptr);
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(contains(r.status().message(), "(--warmup)")) << r.status().message();
}

// data.eval_batches beyond the held-out set wrapped around it (2147483647 ran for days and a
// SIGTERM waited for the eval): an eval stops at the batches that hold every held-out window
// once, the same loss as asking for exactly those; and a stop signal on one rank leaves an
// eval off (the checkpoint then comes at once). A stop in the eval before step 1 writes the
// checkpoint of the initial state and trains no step (it had trained step 1 first).
TEST_F(Hardening, EvalBatchesStopAtTheHeldOutSetAndAtAStop) {
  const auto dir = temp_dir("eval_cap");
  const std::vector<std::string> base = {"train.steps=1", "train.eval_interval=1",
                                         "data.synthetic_tokens=65536",
                                         "scheduler.params.warmup_num_steps=1"};
  Config probe = test::tiny_cpu(dir + "/probe", base);
  auto data = Dataset::load(probe.data, probe.model.vocab_size, probe.train.seed);
  ASSERT_TRUE(data.is_ok()) << data.status().to_string();
  const int64_t rows = probe.train_micro_batch_size_per_gpu;
  const int64_t whole = (int64_t(data->eval_windows(probe.model.context)) + rows - 1) / rows;
  ASSERT_GT(whole, 1);
  auto with = [&](const std::string& sub, int64_t batches) {
    std::vector<std::string> ov = base;
    ov.push_back("data.eval_batches=" + std::to_string(batches));
    return test::tiny_cpu(dir + "/" + sub, ov);
  };
  const TrainResult huge = test::must_train(with("huge", 2147483647));
  const TrainResult exact = test::must_train(with("exact", whole));
  const TrainResult fewer = test::must_train(with("fewer", whole - 1));
  ASSERT_EQ(huge.eval_losses.size(), 2u);
  ASSERT_EQ(exact.eval_losses.size(), 2u);
  EXPECT_EQ(huge.eval_losses, exact.eval_losses);
  EXPECT_NE(huge.eval_losses[0].second, fewer.eval_losses[0].second);

  std::atomic<int> stop{SIGTERM};
  TrainOptions o;
  o.stop_signal = &stop;
  Config three = with("stopped", 2147483647);
  three.train.steps = 3;
  const TrainResult stopped = test::must_train(three, o);
  EXPECT_TRUE(stopped.stopped_early);
  EXPECT_TRUE(stopped.losses.empty()) << "a step trained after the stop";
  EXPECT_EQ(stopped.end_step, 0);
  EXPECT_TRUE(stopped.eval_losses.empty());
  EXPECT_FALSE(stopped.last_checkpoint.empty());
  // --resume from it trains the three steps, as a run that never stopped does.
  stop = 0;
  TrainOptions resume;
  resume.resume = stopped.last_checkpoint;
  Config again = three;
  const TrainResult resumed = test::must_train(again, resume);
  EXPECT_EQ(resumed.start_step, 0);
  EXPECT_EQ(resumed.end_step, 3);
  EXPECT_EQ(resumed.losses.size(), 3u);
}

// The optimizer's sub-groups are capped at an eighth of the host budget, so the host tier's
// need grows with the budget: a user who set strata.host_memory_limit to the need a refusal
// named was refused again. The refusal now names the least budget whose need fits (the
// bisected least budget the preflight accepts), and that budget trains.
TEST_F(Hardening, TheHostRefusalNamesABudgetThatIsAccepted) {
  const auto dir = temp_dir("least_host");
  auto make = [&](size_t budget) {
    return test::tiny_cpu(
        fmt::format("{}/{}", dir, budget),
        {"train.steps=2", "scheduler.params.warmup_num_steps=1",
         "zero_optimization.offload_param.device=\"nvme\"",
         "zero_optimization.offload_optimizer.device=\"nvme\"",
         "zero_optimization.offload_optimizer.buffer_count=1",
         "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\"",
         "zero_optimization.offload_param.nvme_path=\"" + dir + "/swap\"", "aio.backend=\"posix\"",
         "strata.placement.grads=\"host\"", fmt::format("strata.host_memory_limit={}", budget)});
  };
  const Status st = test::train_status(make(size_t{1} << 20));
  ASSERT_FALSE(st.is_ok());
  const std::string& m = st.message();
  const std::string key = "(default 90% of MemAvailable) to at least ";
  const size_t at = m.find(key);
  ASSERT_NE(at, std::string::npos) << m;
  const size_t open = m.find('(', at + key.size());
  ASSERT_NE(open, std::string::npos) << m;
  const size_t named = std::stoull(m.substr(open + 1));
  const size_t least = test::least_accepted_budget(make, size_t{1} << 20, size_t{256} << 20, 4096);
  EXPECT_LE(named, least + 4096) << m;
  EXPECT_GE(named + 4096, least) << m;
  Config at_named = make(named);
  at_named.train.checkpoint_dir += "-named";  // the bisection may have trained at that budget
  const TrainResult r = test::must_train(at_named);
  EXPECT_EQ(r.losses.size(), 2u);
}

TEST_F(Hardening, LlmcHeaderMustCountEveryToken) {
  const auto dir = temp_dir("llmc");
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = 100;  // but 150 tokens follow
  std::vector<uint16_t> tokens(150, 3);
  {
    std::ofstream f(dir + "/t.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(header.data()), 1024);
    f.write(reinterpret_cast<const char*>(tokens.data()), 300);
  }
  DataConfig dc;
  dc.source = dir + "/t.bin";
  auto d = Dataset::load(dc, 256, 1);
  ASSERT_FALSE(d.is_ok());
  EXPECT_TRUE(contains(d.status().message(), "header says 100 tokens")) << d.status().message();
  EXPECT_TRUE(contains(d.status().message(), "150 tokens")) << d.status().message();
  fs::remove_all(dir);
}

// ---- WEAK: invalid JSON is named with its line and column ---------------------------------------

TEST_F(Hardening2, InvalidJsonNamesLineAndColumn) {
  const auto dir = temp_dir("json");
  std::ofstream(dir + "/config.json") << "{\"architectures\": [\"LlamaForCausalLM\"],\n"
                                         "  \"hidden_size\": 32,,\n}";
  Status s =
      parse_config(json{{"model", {{"from_pretrained", dir}}}}.dump(), "<test>", {}).status();
  EXPECT_TRUE(contains(s.message(), dir + "/config.json: invalid JSON at line 2 column"))
      << s.message();
  const std::string base = fixture_copy("llama", dir);
  std::ofstream(base + "/model.safetensors.index.json") << "{\"weight_map\": {\n\n  \"a\": }";
  Config cfg = pretrained_config(dir, base);
  auto arch = create_architecture(cfg.model);
  ASSERT_TRUE(arch.is_ok());
  s = HfCheckpointReader::open(base, **arch).status();
  EXPECT_TRUE(contains(s.message(), "invalid JSON at line 3 column")) << s.message();
  fs::remove_all(dir);
}

// ---- WEAK: a uint32 token past 2^31 is named as the file holds it -------------------------------

TEST_F(Hardening2, Uint32TokenIsReportedUnsigned) {
  const auto dir = temp_dir("u32");
  const std::string file = dir + "/tokens.u32";
  std::vector<uint32_t> tokens(256, 5);
  tokens[100] = 4294967295u;
  std::ofstream(file, std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * 4));
  DataConfig dc;
  dc.source = file;
  auto d = Dataset::load(dc, 64, 1);
  ASSERT_FALSE(d.is_ok());
  EXPECT_TRUE(contains(d.status().message(), "token 4294967295 at index 100"))
      << d.status().message();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
