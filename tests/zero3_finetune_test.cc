// ZeRO-3 across ranks for fine-tuning: the masked (SFT) loss as the global mean over ranks, and
// LoRA over a frozen base (bf16 and NF4) sharded over two ranks. Part of the zero3_test binary
// (tests/zero3_util.h: the worker and the launcher).
#include <gtest/gtest.h>

#include "tests/zero3_util.h"

namespace strata {
namespace {

using namespace zero3;  // NOLINT(build/namespaces)

TEST(Zero3Masked, MaskedLossIsTheGlobalMeanOverRanks) {
  STRATA_NEEDS_MPI();
  const std::string dir = temp_dir("masked");
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  test::chat_corpus(2000, 256, 5, &tokens, &mask);
  const std::string data = test::write_masked(dir + "/chat.bin", tokens, mask);
  WorkerArgs a;
  a.out = dir + "/np1";
  a.steps = 14;
  a.set = {"data.source=\"" + data + "\"", "train.eval_interval=7", "optimizer.params.lr=1e-3"};
  fs::create_directories(a.out);
  ASSERT_TRUE(run_worker(a).is_ok());
  const json ref = rank_result(a.out, 0);
  const std::string out = dir + "/np2";
  fs::create_directories(out);
  Launch l = launch(2, fmt::format("{} host 14 --set data.source={} --set train.eval_interval=7 "
                                   "--set optimizer.params.lr=1e-3",
                                   out, data));
  ASSERT_EQ(l.exit_code, 0) << l.output;
  for (int r = 0; r < 2; ++r) {
    expect_same_curve(ref, rank_result(out, r), 0, fmt::format("masked np=2 rank {}", r),
                      kLossTolerance);
  }
  fs::remove_all(dir);
}

// A LoRA config's one-rank reference under `dir`/np1 (parameters on NVMe): the worker's
// arguments (for a resume), its result, and the config's pairs as mpirun --set arguments.
struct LoraReference {
  WorkerArgs args;
  json result;
  std::string sets;
};
LoraReference lora_reference(const std::string& dir, const std::vector<std::string>& lora) {
  LoraReference ref;
  for (const std::string& kv : lora) ref.sets += " --set '" + kv + "'";
  ref.args.out = dir + "/np1";
  ref.args.placement = "nvme";
  ref.args.set = lora;
  fs::create_directories(ref.args.out);
  const Status st = run_worker(ref.args);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  if (st.is_ok()) ref.result = rank_result(ref.args.out, 0);
  return ref;
}

// LoRA over a frozen base under ZeRO-3: the base modules' parameters are sharded like any
// module's (and have no other state), the adapters are sharded with their optimizer state. Two
// ranks train along the one-rank curve; a 2-rank run stopped at step 10 resumes on 2 ranks bit
// for bit and on 1 rank along the curve (the frozen base re-initialized, the adapters resharded).
TEST(Zero3Lora, TwoRanksTrainTheAdaptersAsOneRankAndResumeOnOne) {
  STRATA_NEEDS_MPI();
  const std::string dir = temp_dir("lora");
  const std::vector<std::string> lora = {"lora.r=8", "lora.lora_alpha=16",
                                         "lora.target_modules=[\"c_attn\",\"c_fc\"]"};
  const LoraReference one = lora_reference(dir, lora);
  const json& ref = one.result;
  const std::string& sets = one.sets;
  ASSERT_TRUE(ref.is_object());
  const std::string full2 = dir + "/full2", part2 = dir + "/part2", res2 = dir + "/res2";
  for (const auto& d : {full2, part2, res2}) fs::create_directories(d);
  Launch l = launch(2, fmt::format("{} nvme {}{}", full2, kSteps, sets));
  ASSERT_EQ(l.exit_code, 0) << l.output;
  for (int r = 0; r < 2; ++r) {
    expect_same_curve(ref, rank_result(full2, r), 0, fmt::format("lora np=2 rank {}", r),
                      kLossTolerance);
  }
  EXPECT_LT(ref["losses"].back().get<double>(), ref["losses"].front().get<double>() - 0.05);
  l = launch(2, fmt::format("{} nvme {} --stop-at 10{}", part2, kSteps, sets));
  ASSERT_EQ(l.exit_code, 0) << l.output;
  const std::string ckpt = rank_result(part2, 0)["checkpoint"].get<std::string>();
  l = launch(2, fmt::format("{} nvme {} --resume {}{}", res2, kSteps, ckpt, sets));
  ASSERT_EQ(l.exit_code, 0) << l.output;
  expect_same_curve(rank_result(full2, 0), rank_result(res2, 0), 10, "lora resume 2 -> 2", 0.0);
  WorkerArgs b = one.args;
  b.out = dir + "/res1";
  b.resume = ckpt;
  fs::create_directories(b.out);
  ASSERT_TRUE(run_worker(b).is_ok());
  expect_same_curve(ref, rank_result(b.out, 0), 10, "lora resume 2 -> 1", kLossTolerance);
  fs::remove_all(dir);
}

// A quantized base (lora.base_quantization nf4) sharded over two ranks: each rank holds half of
// every block's stored bytes, the gathers put them back together bit for bit, and the curve is
// one rank's (GPT-2: its biases and LayerNorms are the stored module's fp32 segments).
TEST(Zero3Lora, AnNf4BaseShardedOverTwoRanksTrainsAsOnOne) {
  STRATA_NEEDS_MPI();
  const std::string dir = temp_dir("qlora");
  const std::vector<std::string> lora = {"lora.r=8", "lora.lora_alpha=16",
                                         "lora.target_modules=[\"c_attn\",\"c_fc\"]",
                                         "lora.base_quantization=\"nf4\""};
  const LoraReference one = lora_reference(dir, lora);
  const json& ref = one.result;
  const std::string& sets = one.sets;
  ASSERT_TRUE(ref.is_object());
  const std::string two = dir + "/np2";
  fs::create_directories(two);
  const Launch l = launch(2, fmt::format("{} nvme {}{}", two, kSteps, sets));
  ASSERT_EQ(l.exit_code, 0) << l.output;
  for (int r = 0; r < 2; ++r) {
    expect_same_curve(ref, rank_result(two, r), 0, fmt::format("qlora np=2 rank {}", r),
                      kLossTolerance);
  }
  EXPECT_LT(ref["losses"].back().get<double>(), ref["losses"].front().get<double>() - 0.05);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
