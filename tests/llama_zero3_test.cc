// A Llama under ZeRO-3 across real MPI ranks, through the `strata` command as a user runs it:
// `mpirun -np 2 strata train` with its state sharded (parameters and optimizer in host memory,
// or on NVMe), then `strata export` and `strata eval` of the sharded checkpoint.
//
// What is checked:
//   - Two ranks train to the same losses bit for bit whether the state lives in host memory, on
//     NVMe or on the device, and along the one-rank curve within the tolerance of
//     tests/zero3_test.cc (the same sequences, a different fp32 summation order: GEMMs over fewer
//     rows, the reduce-scatter summing two partial gradients; see there).
//   - The sharded checkpoint's export (its shards gathered through a scratch file) has the same
//     bytes as the export of the same weights re-sharded onto one rank (--resume on one rank,
//     which loads each rank's part of the old shards and saves one whole checkpoint).
//   - `strata eval` of the sharded checkpoint on one rank equals, bit for bit, the eval of its
//     export as model.from_pretrained (bf16 -> fp32 -> bf16 is exact); on two ranks (each its
//     share of the windows, ZeRO-3 gathers) within float rounding of the sum.
// MoeZero3: a mixture of experts whose idle experts still take part in every collective.
// Without MPI the tests report skipped.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/test_util.h"

#ifndef STRATA_SOURCE_DIR
#error "STRATA_SOURCE_DIR must point at the repository"
#endif
#ifndef STRATA_BIN
#error "STRATA_BIN must point at the strata binary"
#endif
#ifndef STRATA_MPIEXEC
#define STRATA_MPIEXEC ""
#endif

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr double kLossTolerance = 5e-3;  // tests/zero3_test.cc's, with its reasoning
constexpr int kSteps = 8;

struct Cmd {
  int exit_code = -1;
  std::string output;
};

// Runs `args` with the strata binary, under `mpirun -np N` when np > 0; stdout and stderr
// together in output (stderr only when `stdout_only` is false).
Cmd strata(int np, const std::string& args, bool stdout_only = false) {
  std::string cmd = std::string(STRATA_BIN) + " " + args;
  if (np > 0) {
    cmd = fmt::format(
        "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 {} --allow-run-as-root "
        "--oversubscribe -np {} -x STRATA_COMM_TIMEOUT_S=120 {}",
        STRATA_MPIEXEC, np, cmd);
  }
  cmd += stdout_only ? " 2>/dev/null" : " 2>&1";
  Cmd r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = ::pclose(p);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

// configs/tiny-cpu.json with a tiny Llama (grouped-query attention, untied head) and `model`
// replacing its model section when given; written to dir/<name>.json.
std::string write_config(const std::string& dir, const std::string& name,
                         const json& model = nullptr) {
  json c = json::parse(test::read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json"));
  c["model"] = model.is_null() ? json{{"type", "llama"},     {"n_layer", 2},
                                      {"n_head", 4},         {"num_key_value_heads", 2},
                                      {"n_embd", 64},        {"intermediate_size", 96},
                                      {"vocab_size", 256},   {"tied_embeddings", false},
                                      {"rope_theta", 50000}, {"context", 32}}
                               : model;
  c["train_batch_size"] = 8;
  c["train_micro_batch_size_per_gpu"] = "auto";
  c["gradient_accumulation_steps"] = 2;
  c["steps_per_print"] = 1;
  c["scheduler"]["params"]["warmup_num_steps"] = 2;
  c["data"] = {{"source", "synthetic"}, {"synthetic_tokens", 16384}};
  c["device"] = {{"backend", "cpu"}, {"memory_limit", "64MiB"}, {"cpu_threads", 1}};
  c["train"] = {{"steps", kSteps}, {"eval_interval", 0}, {"seed", 7}};
  c["zero_optimization"]["offload_optimizer"]["nvme_path"] = dir + "/swap";
  c["zero_optimization"]["offload_param"]["nvme_path"] = dir + "/swap";
  const std::string path = dir + "/" + name + ".json";
  std::ofstream(path) << c.dump(2);
  return path;
}

// Parameters and optimizer state in host memory ("cpu"), on NVMe ("nvme") or on the device
// ("none").
std::string placement(const std::string& where) {
  return fmt::format(
      "--set 'zero_optimization.offload_param.device=\"{0}\"' "
      "--set 'zero_optimization.offload_optimizer.device=\"{0}\"'",
      where);
}

// The per-step losses rank 0 logged (steps_per_print = 1).
std::vector<double> logged_losses(const std::string& ckpt_dir) {
  std::vector<double> out;
  std::ifstream f(ckpt_dir + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    json e = json::parse(line, nullptr, false);
    if (e.is_object() && e.contains("loss")) out.push_back(e["loss"].get<double>());
  }
  return out;
}

// Trains `cfg` once per (ranks, placement) of `runs` (0 ranks: no mpirun) into
// dir/ckpt_np<ranks>_<placement>; returns each run's per-step losses (empty on a failed run).
std::vector<std::vector<double>> train_runs(const std::string& dir, const std::string& cfg,
                                            const std::vector<std::pair<int, std::string>>& runs) {
  std::vector<std::vector<double>> curves;
  for (const auto& [np, where] : runs) {
    const std::string ckpt = fmt::format("{}/ckpt_np{}_{}", dir, np, where);
    Cmd r =
        strata(np, fmt::format("train --config {} --quiet --set 'train.checkpoint_dir=\"{}\"' {}",
                               cfg, ckpt, placement(where)));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    curves.push_back(logged_losses(ckpt));
    EXPECT_EQ(curves.back().size(), size_t(kSteps)) << r.output;
    if (curves.back().size() != size_t(kSteps)) curves.back().clear();
  }
  return curves;
}

// curves[0]: one rank; curves[1]: two ranks in host memory; the others: two ranks elsewhere,
// which must equal curves[1] bit for bit. Two ranks follow one within kLossTolerance, and the
// one-rank loss falls by at least `drop`.
void expect_curves(const std::vector<std::vector<double>>& curves,
                   const std::vector<std::string>& names, const char* model, double drop) {
  for (const auto& c : curves) {
    if (c.size() != size_t(kSteps)) return;  // reported by train_runs
  }
  double worst = 0;
  for (size_t s = 0; s < size_t(kSteps); ++s) {
    for (size_t i = 2; i < curves.size(); ++i) {
      EXPECT_EQ(curves[i][s], curves[1][s])
          << "2 ranks, " << names[i] << " vs host, step " << s + 1;
    }
    EXPECT_NEAR(curves[1][s], curves[0][s], kLossTolerance) << "2 ranks vs 1, step " << s + 1;
    worst = std::max(worst, std::fabs(curves[1][s] - curves[0][s]));
  }
  std::printf("%s loss %.4f -> %.4f; 2 ranks vs 1: worst |dloss| %.3g\n", model, curves[0].front(),
              curves[0].back(), worst);
  EXPECT_LT(curves[0].back(), curves[0].front() - drop)
      << "the tiny " << model << " does not learn";
}

double eval_loss(const Cmd& r) {
  EXPECT_EQ(r.exit_code, 0) << r.output;
  json j = json::parse(r.output, nullptr, false);
  EXPECT_TRUE(j.is_object() && j.contains("loss")) << r.output;
  return j.is_object() && j.contains("loss") ? j["loss"].get<double>() : NAN;
}

TEST(LlamaZero3, TwoRanksTrainExportAndEvaluateAsOne) {
  if (std::string(STRATA_MPIEXEC).empty()) {
    GTEST_SKIP() << "built without MPI (STRATA_WITH_MPI=OFF or Open MPI not found): no "
                    "multi-rank run possible";
  }
  const std::string dir = test::temp_dir("strata_llama_zero3", "run");
  fs::create_directories(dir + "/swap");
  const std::string cfg = write_config(dir, "llama");

  // Training: one rank in host memory; two ranks in host memory, on NVMe and on the device.
  const auto curves = train_runs(dir, cfg, {{0, "cpu"}, {2, "cpu"}, {2, "nvme"}, {2, "none"}});
  expect_curves(curves, {"", "", "nvme", "device"}, "llama", 0.1);
  ASSERT_FALSE(HasFailure());

  // The two-rank checkpoint: a manifest and one shard file per rank.
  const std::string manifest = fmt::format("{}/ckpt_np2_cpu/ckpt-{:08}.bin", dir, kSteps);
  ASSERT_TRUE(fs::exists(manifest));
  ASSERT_TRUE(fs::exists(manifest + ".rank1-of-2")) << "no shard file (naming changed?)";
  Cmd ex = strata(
      0, fmt::format("export --config {} --checkpoint {} --out {}/hf_sharded", cfg, manifest, dir));
  ASSERT_EQ(ex.exit_code, 0) << ex.output;
  // The same weights re-sharded onto one rank (resume at the last step: nothing trained, the
  // final checkpoint written whole), then exported.
  Cmd re = strata(0, fmt::format("train --config {} --quiet --resume {} "
                                 "--set 'train.checkpoint_dir=\"{}/ckpt_resharded\"' {}",
                                 cfg, manifest, dir, placement("cpu")));
  ASSERT_EQ(re.exit_code, 0) << re.output;
  const std::string whole = fmt::format("{}/ckpt_resharded/ckpt-{:08}.bin", dir, kSteps);
  ex = strata(0,
              fmt::format("export --config {} --checkpoint {} --out {}/hf_whole", cfg, whole, dir));
  ASSERT_EQ(ex.exit_code, 0) << ex.output;
  const std::string a = test::read_file(dir + "/hf_sharded/model.safetensors");
  const std::string b = test::read_file(dir + "/hf_whole/model.safetensors");
  ASSERT_GT(a.size(), 100000u);
  EXPECT_TRUE(a == b) << "the sharded checkpoint's export differs from the gathered weights'";
  EXPECT_EQ(test::read_file(dir + "/hf_sharded/config.json"),
            test::read_file(dir + "/hf_whole/config.json"));

  // Eval of the sharded checkpoint: one rank, two ranks, and its export as from_pretrained.
  const std::string evalset = "--json --set data.synthetic_tokens=4096 " + placement("cpu");
  const double one = eval_loss(
      strata(0, fmt::format("eval --config {} --checkpoint {} {}", cfg, manifest, evalset), true));
  const double two = eval_loss(
      strata(2, fmt::format("eval --config {} --checkpoint {} {}", cfg, manifest, evalset), true));
  const std::string from_export = write_config(
      dir, "from_export", json{{"from_pretrained", dir + "/hf_sharded"}, {"context", 32}});
  const double exported =
      eval_loss(strata(0, fmt::format("eval --config {} {}", from_export, evalset), true));
  EXPECT_EQ(exported, one);
  EXPECT_NEAR(two, one, 1e-6 * one);
  // Generation from the sharded checkpoint (a small module's second shard holds padding only:
  // it was refused as "past its elements") gives its export's tokens.
  const std::string gen = "--prompt-ids 1,2,3 --max-new-tokens 5 --json";
  Cmd g_ckpt =
      strata(0, fmt::format("generate --config {} --checkpoint {} {}", cfg, manifest, gen), true);
  Cmd g_export = strata(0, fmt::format("generate --config {} {}", from_export, gen), true);
  ASSERT_EQ(g_ckpt.exit_code, 0) << g_ckpt.output;
  ASSERT_EQ(g_export.exit_code, 0) << g_export.output;
  EXPECT_EQ(g_ckpt.output, g_export.output);
  std::printf("eval of the sharded checkpoint: 1 rank %.9f, 2 ranks %.9f, its export %.9f\n", one,
              two, exported);
  fs::remove_all(dir);
}

// A mixture of experts under ZeRO-3: each expert is its own module, sharded, offloaded and
// prefetched like any other, and every rank acquires and reduce-scatters every expert of a layer
// whether its tokens were routed there or not. 40 experts, top 2, micro-batches of 4 sequences
// of 4 tokens (2 per rank on two ranks): each micro-batch routes 32 (16 per rank) token slots,
// so at least 8 experts of every layer (24 per rank on two ranks) receive no token in every
// micro-batch. Two ranks finish (no collective waits for a rank that skipped an expert), give
// the same losses on host memory and on NVMe bit for bit, and follow the one-rank curve.
TEST(MoeZero3, IdleExpertsTakePartInEveryCollective) {
  if (std::string(STRATA_MPIEXEC).empty()) {
    GTEST_SKIP() << "built without MPI (STRATA_WITH_MPI=OFF or Open MPI not found): no "
                    "multi-rank run possible";
  }
  const std::string dir = test::temp_dir("strata_moe_zero3", "run");
  fs::create_directories(dir + "/swap");
  const std::string cfg = write_config(dir, "mixtral",
                                       json{{"type", "mixtral"},
                                            {"n_layer", 2},
                                            {"n_head", 4},
                                            {"num_key_value_heads", 2},
                                            {"n_embd", 64},
                                            {"intermediate_size", 16},
                                            {"num_experts", 40},
                                            {"num_experts_per_tok", 2},
                                            {"vocab_size", 256},
                                            {"tied_embeddings", false},
                                            {"rope_theta", 50000},
                                            {"router_aux_loss_coef", 0.01},
                                            {"context", 4}});
  const auto curves = train_runs(dir, cfg, {{0, "cpu"}, {2, "cpu"}, {2, "nvme"}});
  // 8 steps of 4-token sequences: measured 5.563 -> 5.507.
  expect_curves(curves, {"", "", "nvme"}, "mixture", 0.03);
  // The load-balancing loss is reported apart from the loss, by one rank and by two.
  for (const char* run : {"ckpt_np0_cpu", "ckpt_np2_cpu"}) {
    std::ifstream f(dir + "/" + run + "/metrics.jsonl");
    json e;
    for (std::string line; std::getline(f, line) && !e.contains("loss");) {
      e = json::parse(line, nullptr, false);
    }
    ASSERT_TRUE(e.is_object() && e.contains("aux_loss")) << run << ": " << e.dump();
    EXPECT_GT(e["aux_loss"].get<double>(), 0.0) << run << ": " << e.dump();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
