// Adversarial use, round 2 (docs/RELIABILITY.md): the Hugging Face import and export, the
// metrics log and the checkpoint directory. Each case failed before its fix: a config.json's
// sizes, a model directory an export would overwrite or mix, the metrics of another run, a
// newest checkpoint damaged in its header, the checkpoints a run keeps, weights that are not
// finite, a directory transformers reads otherwise, invalid JSON, a uint32 token past 2^31.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/hf/export_dir.h"
#include "src/hf/hf_checkpoint.h"
#include "src/hf/safetensors.h"
#include "src/model/architecture.h"
#include "src/train/checkpoint_dir.h"
#include "src/train/data.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/log.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::must_train;
using test::name_of;
using test::small_config;
using test::train_status;

std::string temp_dir(const std::string& name) { return test::temp_dir("strata_hard2", name); }

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A copy of the Hugging Face fixture `name` (tests/fixtures/hf/) in `dir`, to be damaged.
std::string fixture_copy(const std::string& name, const std::string& dir) {
  const std::string to = dir + "/" + name;
  fs::create_directories(to);
  for (const auto& e :
       fs::directory_iterator(std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/hf/" + name)) {
    if (e.path().filename() != "reference.safetensors") fs::copy(e.path(), to);
  }
  return to;
}

// small_config's run with model.from_pretrained `dir` (its context 16).
Config pretrained_config(const std::string& run_dir, const std::string& dir,
                         std::vector<std::string> extra = {}) {
  const std::string doc =
      test::read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json");
  json j = json::parse(doc);
  j["model"] = {{"from_pretrained", dir}, {"context", 16}};
  j["scheduler"]["params"]["warmup_num_steps"] = 1;
  std::vector<std::string> ov = {
      "train.checkpoint_dir=\"" + run_dir + "/ckpt\"",
      "zero_optimization.offload_optimizer.nvme_path=\"" + run_dir + "/swap\"",
      "train.eval_interval=0", "train.steps=2", "device.memory_limit=\"64MiB\""};
  ov.insert(ov.end(), extra.begin(), extra.end());
  fs::create_directories(run_dir + "/swap");
  auto cfg = parse_config(j.dump(), "<test>", ov);
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  return cfg.is_ok() ? *cfg : Config{};
}

// parse_config's status for the llama fixture's config.json with `edit` applied.
Status llama_config_with(const std::string& name, const std::function<void(json&)>& edit,
                         std::vector<std::string> extra = {}) {
  const std::string dir = temp_dir(name);
  json c = json::parse(
      test::read_file(std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/hf/llama/config.json"));
  edit(c);
  std::ofstream(dir + "/config.json") << c.dump();
  json doc = {{"model", {{"from_pretrained", dir}}}, {"train_micro_batch_size_per_gpu", 1}};
  return parse_config(doc.dump(), "<test>", extra).status();
}

class Hardening2 : public ::testing::Test {
 protected:
  void SetUp() override { set_log_level(LogLevel::kError); }
};

// ---- BAD 1: a config.json's sizes are bounded as the native model section's are ----------------

TEST_F(Hardening2, PretrainedSizesAreBoundedLikeTheNativeOnes) {
  // A billion layers grew until the OOM killer (or bad_alloc) ended the process.
  Status s = llama_config_with("layers", [](json& c) { c["num_hidden_layers"] = 1000000000; });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "num_hidden_layers")) << s.message();
  EXPECT_TRUE(contains(s.message(), "model.n_layer: 1000000000 out of range [1, 4096]"))
      << s.message();
  s = llama_config_with("vocab", [](json& c) { c["vocab_size"] = 2147483548; });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "vocab_size")) << s.message();
  s = llama_config_with("hidden", [](json& c) {
    c["hidden_size"] = 1 << 24;
    c["head_dim"] = (1 << 24) / 4;
  });
  EXPECT_TRUE(contains(s.message(), "hidden_size")) << s.message();
  s = llama_config_with("mlp", [](json& c) { c["intermediate_size"] = 1 << 30; });
  EXPECT_TRUE(contains(s.message(), "intermediate_size")) << s.message();
  // A context past the native bound says to give a shorter model.context, and that works.
  s = llama_config_with("positions", [](json& c) { c["max_position_embeddings"] = 1 << 30; });
  EXPECT_TRUE(contains(s.message(), "max_position_embeddings")) << s.message();
  EXPECT_TRUE(contains(s.message(), "shorter model.context")) << s.message();
  s = llama_config_with("positions_ctx", [](json& c) { c["max_position_embeddings"] = 1 << 30; },
                        {"model.context=32"});
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  s = llama_config_with("eps", [](json& c) { c["rms_norm_eps"] = 2.0; });
  EXPECT_TRUE(contains(s.message(), "rms_norm_eps")) << s.message();
}

// ---- BAD 2, 3 and the export directory's weak points
// ----------------------------------------------

TEST_F(Hardening2, ExportIntoTheBaseModelIsRefusedBeforeTraining) {
  const auto dir = temp_dir("export_base");
  const std::string base = fixture_copy("gpt2", dir);
  const std::string before = test::read_file(base + "/model.safetensors");
  int steps = 0;
  TrainOptions o;
  o.progress = false;
  o.on_step_end = [&](int64_t) { ++steps; };
  // The same directory spelled differently is still the same directory.
  auto r = train(pretrained_config(dir, base, {"train.export_dir=\"" + base + "/./\""}), o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(steps, 0) << "trained before refusing";
  EXPECT_TRUE(contains(r.status().message(), "train.export_dir")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "model.from_pretrained")) << r.status().message();
  EXPECT_EQ(test::read_file(base + "/model.safetensors"), before);
  fs::remove_all(dir);
}

TEST_F(Hardening2, ExportDirIsCheckedInThePreflight) {
  const auto dir = temp_dir("export_pre");
  std::ofstream(dir + "/a-file") << "x";
  int steps = 0;
  TrainOptions o;
  o.progress = false;
  o.on_step_end = [&](int64_t) { ++steps; };
  for (const std::string& bad : {dir + "/a-file", dir + "/a-file/below", std::string("/sys/x")}) {
    auto r =
        train(small_config(dir + "/run", {"train.steps=2", "train.export_dir=\"" + bad + "\""}), o);
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_EQ(steps, 0) << bad << ": trained before refusing";
    EXPECT_TRUE(contains(r.status().message(), "train.export_dir")) << r.status().message();
  }
  fs::remove_all(dir);
}

TEST_F(Hardening2, FailedExportSaysTheCheckpointIsSavedAndHowToFinish) {
  const auto dir = temp_dir("export_fail");
  const std::string out = dir + "/hf";
  TrainOptions o;
  o.progress = false;
  // Passes the preflight, then is made a file before the export.
  o.on_step_end = [&](int64_t) { std::ofstream(out) << "in the way"; };
  auto r =
      train(small_config(dir + "/run", {"train.steps=2", "train.export_dir=\"" + out + "\""}), o);
  ASSERT_FALSE(r.is_ok());
  const std::string& m = r.status().message();
  EXPECT_TRUE(contains(m, "train.export_dir")) << m;
  EXPECT_TRUE(contains(m, "is saved")) << m;
  EXPECT_TRUE(contains(m, "strata export --config")) << m;
  EXPECT_TRUE(contains(m, name_of(2))) << m;
  EXPECT_TRUE(fs::exists(dir + "/run/" + name_of(2)));
  fs::remove_all(dir);
}

// Writes a stand-in export: config.json and model.safetensors with `text`.
Status fake_export(const std::string& dir, const std::string& text) {
  fs::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors"}) {
    const std::string tmp = dir + "/" + f + ".tmp";
    std::ofstream(tmp) << text;
    fs::rename(tmp, dir + "/" + f);
  }
  return Status::ok();
}

TEST_F(Hardening2, ExportNeverMixesTwoModels) {
  const auto dir = temp_dir("export_mix");
  const std::string base = fixture_copy("llama", dir);  // 3 shards and an index
  std::ofstream(base + "/generation_config.json") << "{}";
  std::ofstream(base + "/README.md") << "notes";
  ExportTarget t{base, "--out", "run-a", 7, "", false, ", or add --force to replace it"};
  // Another model: refused, naming what is there; nothing written.
  Status s = export_as_owner(t, [&] { return fake_export(base, "new"); });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "LlamaForCausalLM")) << s.message();
  EXPECT_TRUE(contains(s.message(), "config.json")) << s.message();
  EXPECT_TRUE(contains(s.message(), "--force")) << s.message();
  EXPECT_TRUE(fs::exists(base + "/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(base + "/model.safetensors"));
  // --force: the new model, and none of the old one's model files beside it.
  t.force = true;
  ASSERT_TRUE(export_as_owner(t, [&] { return fake_export(base, "new"); }).is_ok());
  EXPECT_EQ(test::read_file(base + "/model.safetensors"), "new");
  for (const char* gone : {"model.safetensors.index.json", "model-00001-of-00003.safetensors",
                           "model-00003-of-00003.safetensors", "generation_config.json"}) {
    EXPECT_FALSE(fs::exists(base + "/" + gone)) << gone << " of the old model is still there";
  }
  EXPECT_TRUE(fs::exists(base + "/README.md"));  // not a model file: kept
  // The same lineage exports again without --force; another lineage is refused, named.
  t.force = false;
  EXPECT_TRUE(export_as_owner(t, [&] { return fake_export(base, "newer"); }).is_ok());
  EXPECT_EQ(test::read_file(base + "/model.safetensors"), "newer");
  ExportTarget other = t;
  other.run_id = "run-b";
  s = check_export_owner(other);
  EXPECT_TRUE(contains(s.message(), "lineage run-a, step 7")) << s.message();
  fs::remove_all(dir);
}

TEST_F(Hardening2, FailedExportLeavesNoEmptyDirectory) {
  const auto dir = temp_dir("export_empty");
  ExportTarget t{dir + "/new/deeper", "--out", "run-a", 1, "", false, ""};
  Status s = export_as_owner(t, [&] {
    fs::create_directories(t.dir);
    return io_error("the export failed");
  });
  EXPECT_FALSE(s.is_ok());
  EXPECT_FALSE(fs::exists(dir + "/new")) << "an empty export directory was left behind";
  // A directory that was there stays.
  fs::create_directories(dir + "/mine");
  t.dir = dir + "/mine";
  EXPECT_FALSE(export_as_owner(t, [] { return io_error("failed"); }).is_ok());
  EXPECT_TRUE(fs::is_directory(dir + "/mine"));
  fs::remove_all(dir);
}

// ---- BAD 4: logs are appended per run, never truncated ----------------------------------------

std::vector<json> log_lines(const std::string& path) {
  std::vector<json> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) out.push_back(json::parse(line));
  return out;
}

TEST_F(Hardening2, FreshRunKeepsAnotherRunsMetrics) {
  const auto dir = temp_dir("metrics");
  must_train(small_config(dir, {"train.steps=3"}));
  // A fresh run of fewer steps in the same directory (it overwrites no checkpoint of the first).
  must_train(small_config(dir, {"train.steps=2"}));
  const auto lines = log_lines(dir + "/metrics.jsonl");
  int losses = 0;
  std::vector<std::string> runs;
  for (const json& l : lines) {
    losses += l.contains("loss");
    if (l.contains("run_id")) runs.push_back(l["run_id"]);
  }
  EXPECT_EQ(losses, 3 + 2) << "the first run's metrics were lost";
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_NE(runs[0], runs[1]);
  // An existing train.log_file keeps what it held.
  const std::string log = dir + "/my.log";
  std::ofstream(log) << "{\"mine\": 1}\n";
  must_train(small_config(dir + "/b", {"train.steps=1", "train.log_file=\"" + log + "\""}));
  EXPECT_TRUE(log_lines(log).at(0).contains("mine"));
  fs::remove_all(dir);
}

TEST_F(Hardening2, FreshRunKeepsAnotherRunsCsvMetrics) {
  const auto dir = temp_dir("csv");
  const std::vector<std::string> csv = {"csv_monitor.enabled=true",
                                        "csv_monitor.output_path=\"" + dir + "/mon\"",
                                        "csv_monitor.job_name=\"j\""};
  auto with = [&](std::vector<std::string> ov) {
    ov.insert(ov.end(), csv.begin(), csv.end());
    return ov;
  };
  must_train(small_config(dir + "/a", with({"train.steps=3"})));
  must_train(small_config(dir + "/b", with({"train.steps=2"})));
  // As DeepSpeed's csv_monitor ("a+"): each run appends its header and its rows.
  std::ifstream f(dir + "/mon/j/loss.csv");
  int headers = 0, rows = 0;
  for (std::string line; std::getline(f, line);) (line == "step,loss" ? headers : rows) += 1;
  EXPECT_EQ(headers, 2);
  EXPECT_EQ(rows, 3 + 2) << "the first run's rows were lost";
  fs::remove_all(dir);
}

// ---- WEAK: every kind of damage to the newest checkpoint falls back -----------------------------

TEST_F(Hardening2, EveryDamageOfTheNewestCheckpointFallsBack) {
  struct Damage {
    const char* name;
    std::function<void(const std::string&)> apply;
  };
  const std::vector<Damage> kinds = {
      {"truncated", [](const std::string& p) { fs::resize_file(p, fs::file_size(p) / 2); }},
      {"zero-filled",
       [](const std::string& p) {
         const auto n = fs::file_size(p);
         std::ofstream(p, std::ios::binary | std::ios::trunc) << std::string(n, '\0');
       }},
      {"empty", [](const std::string& p) { fs::resize_file(p, 0); }},
      {"header",
       [](const std::string& p) {
         std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(0);
         f.write("XXXXXXXX", 8);
       }},
  };
  for (const Damage& d : kinds) {
    const auto dir = temp_dir(std::string("damage_") + d.name);
    TrainOptions stop;
    stop.stop_at_step = 8;
    must_train(small_config(dir, {"train.steps=12", "train.checkpoint_interval=4"}), stop);
    d.apply(dir + "/" + name_of(8));
    TrainOptions o;
    o.resume = "latest";
    TrainResult r =
        must_train(small_config(dir, {"train.steps=12", "train.checkpoint_interval=4"}), o);
    EXPECT_EQ(r.start_step, 4) << d.name;
    EXPECT_EQ(r.end_step, 12) << d.name;
    fs::remove_all(dir);
  }
}

// ---- WEAK: room for the checkpoints a run keeps, plus the one it writes next ------------------

TEST_F(Hardening2, CheckpointSpaceCountsTheCheckpointsARunKeeps) {
  const auto dir = temp_dir("keep");
  EXPECT_EQ(checkpoints_to_come(dir, ""), kKeepCheckpoints + 1);
  TrainOptions stop;
  stop.stop_at_step = 4;
  must_train(small_config(dir, {"train.steps=8", "train.checkpoint_interval=2"}), stop);
  // Two of its lineage are there already: one more at the peak.
  EXPECT_EQ(checkpoints_to_come(dir, "latest"), 1);
  Status s = check_checkpoint_dir(dir, uint64_t{1} << 60, 3);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_TRUE(contains(s.message(), std::to_string(uint64_t{3} << 60) + " bytes")) << s.message();
  EXPECT_TRUE(contains(s.message(), "3 more checkpoints")) << s.message();
  // On a file system with room for one checkpoint but not three: refused before step 1.
  const std::string mnt = dir + "/mnt";
  fs::create_directories(mnt);
  const std::string one = dir + "/" + name_of(4);
  const uint64_t bytes = fs::file_size(one);
  const std::string opts = "size=" + std::to_string(bytes * 2 + 65536);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, opts.c_str()) != 0) {
    fs::remove_all(dir);
    GTEST_SKIP() << "cannot mount a tmpfs here (not root): " << std::strerror(errno);
  }
  int steps = 0;
  TrainOptions o;
  o.progress = false;
  o.on_step_end = [&](int64_t) { ++steps; };
  auto r = train(
      small_config(mnt, {"train.steps=8", "train.checkpoint_interval=2",
                         "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\""}),
      o);
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace) << r.status().to_string();
  EXPECT_EQ(steps, 0) << "the run trained, to fail at its third checkpoint";
  ::umount(mnt.c_str());
  fs::remove_all(dir);
}

// ---- WEAK: imported weights that are not finite are named at import -----------------------------

TEST_F(Hardening2, NonFiniteImportedWeightIsNamed) {
  const auto dir = temp_dir("nan");
  const std::string base = fixture_copy("gpt2", dir);
  const std::string file = base + "/model.safetensors";
  uint64_t offset = 0;
  {
    auto f = SafetensorsFile::open(file);
    ASSERT_TRUE(f.is_ok());
    const SafetensorsTensor* t = (*f)->find("transformer.h.1.mlp.c_fc.weight");
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->dtype, DType::kF32);
    offset = t->offset + 4 * 77;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(offset));
    f.write(reinterpret_cast<const char*>(&nan), 4);
  }
  Status s = train_status(pretrained_config(dir, base));
  EXPECT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "transformer.h.1.mlp.c_fc.weight")) << s.message();
  EXPECT_TRUE(contains(s.message(), file)) << s.message();
  EXPECT_TRUE(contains(s.message(), "byte offset " + std::to_string(offset))) << s.message();
  EXPECT_FALSE(contains(s.message(), "diverged")) << s.message();
  fs::remove_all(dir);
}

// ---- WEAK: directories transformers reads one way are read the same way ----------------------

TEST_F(Hardening2, SingleFileWinsOverAnIndexAsInTransformers) {
  const auto dir = temp_dir("both");
  const std::string both = fixture_copy("llama", dir);  // fp32 shards and their index
  fs::copy(std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/hf/llama-bf16/model.safetensors",
           both + "/model.safetensors");  // the same weights rounded to bf16
  Config cfg = pretrained_config(dir, both);
  auto arch = create_architecture(cfg.model);
  ASSERT_TRUE(arch.is_ok());
  auto read = [&](const std::string& d) {
    auto r = HfCheckpointReader::open(d, **arch);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    std::vector<float> w((*arch)->layout().modules[0].numel);
    EXPECT_TRUE((*r)->read_module(0, w.data()).is_ok());
    return w;
  };
  EXPECT_EQ(read(both), read(std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/hf/llama-bf16"));
  fs::remove_all(dir);
}

// Appends tensor `name` (F32, `shape`, `values`) to the safetensors file `path`.
void add_tensor(const std::string& path, const std::string& name, std::vector<int64_t> shape,
                const std::vector<float>& values) {
  const std::string bytes = test::read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  json header = json::parse(bytes.substr(8, n));
  std::string data = bytes.substr(8 + n);
  header[name] = {{"dtype", "F32"},
                  {"shape", shape},
                  {"data_offsets", {data.size(), data.size() + values.size() * 4}}};
  data.append(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t len = text.size();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << text << data;
}

TEST_F(Hardening2, TiedConfigWithADistinctHeadLoadsUntiedAsInTransformers) {
  const auto dir = temp_dir("tied");
  for (const bool distinct : {true, false}) {
    const std::string base = fixture_copy("llama3", dir + (distinct ? "/distinct" : "/same"));
    std::vector<float> embed(100 * 32);
    {
      auto f = SafetensorsFile::open(base + "/model.safetensors");
      ASSERT_TRUE(f.is_ok());
      const SafetensorsTensor* t = (*f)->find("model.embed_tokens.weight");
      ASSERT_NE(t, nullptr);
      ASSERT_EQ(t->numel(), embed.size());
      ASSERT_TRUE((*f)->read_as(*t, DType::kF32, embed.data()).is_ok());
    }
    std::vector<float> head = embed;
    if (distinct) {  // not a constant shift (the softmax would not see it)
      for (size_t i = 0; i < head.size(); ++i) head[i] += 0.01f * float(i % 7);
    }
    add_tensor(base + "/model.safetensors", "lm_head.weight", {100, 32}, head);
    Config cfg = pretrained_config(dir, base);
    // transformers ties them only when they are equal.
    EXPECT_EQ(cfg.model.tied_embeddings, !distinct);
    if (!distinct) continue;
    auto arch = create_architecture(cfg.model);
    ASSERT_TRUE(arch.is_ok());
    auto r = HfCheckpointReader::open(base, **arch);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    bool found = false;
    const ModelLayout& layout = (*arch)->layout();
    for (size_t m = 0; m < layout.modules.size(); ++m) {
      for (const TensorSpec& t : layout.modules[m].tensors) {
        if (t.name != "lm_head") continue;
        found = true;
        std::vector<float> w(layout.modules[m].numel);
        ASSERT_TRUE((*r)->read_module(int(m), w.data()).is_ok());
        EXPECT_TRUE(std::equal(head.begin(), head.end(), w.begin() + std::ptrdiff_t(t.offset)))
            << "the head is not the checkpoint's lm_head.weight";
      }
    }
    EXPECT_TRUE(found) << "no lm_head tensor in the untied layout";
  }
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
