// Config parser: a table of good configs (with checks on the parsed values) and bad configs
// (each with the substring its error must contain). The key table as a whole, sizes, the batch
// triple, the shipped DeepSpeed config and docs/CONFIG.md: config_keys_test.cc.
#include "strata/config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace strata {
namespace {

// A document with a batch size, so cases about other keys need not repeat one.
std::string J(const std::string& body = "") {
  return "{\"train_batch_size\": 8" + (body.empty() ? "" : ", " + body) + "}";
}

bool has_line(const std::vector<std::string>& lines, const std::string& needle) {
  return std::any_of(lines.begin(), lines.end(),
                     [&](const std::string& l) { return l.find(needle) != std::string::npos; });
}

// DeepSpeed's ZeRO-Infinity example (deepspeed.ai tutorials/zero "offloading to NVMe"), as is.
const char* kZeroInfinity = R"({
  "train_batch_size": 16,
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 8,
  "steps_per_print": 100,
  "wall_clock_breakdown": false,
  "gradient_clipping": 1.0,
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "optimizer": {
    "type": "Adam",
    "params": {"lr": 0.0001, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.0001, "warmup_num_steps": 100}
  },
  "zero_optimization": {
    "stage": 3,
    "contiguous_gradients": true,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_prefetch_bucket_size": 1e7,
    "stage3_param_persistence_threshold": 1e5,
    "reduce_bucket_size": 1e7,
    "sub_group_size": 1e9,
    "offload_optimizer": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "ratio": 0.3,
      "buffer_count": 4,
      "fast_init": false
    },
    "offload_param": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "buffer_count": 5,
      "buffer_size": 1e8,
      "max_in_cpu": 1e9
    }
  },
  "aio": {
    "block_size": 262144,
    "queue_depth": 32,
    "thread_count": 1,
    "single_submit": false,
    "overlap_events": true
  }
})";

// Hugging Face's ds_config_zero3.json: "auto" everywhere the Trainer fills values in.
const char* kHfZero3 = R"({
  "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
           "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
  "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW",
                "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupDecayLR",
                "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                           "warmup_num_steps": "auto", "total_num_steps": "auto"}},
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "offload_param": {"device": "cpu", "pin_memory": true},
    "overlap_comm": true,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  },
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "steps_per_print": 2000,
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "wall_clock_breakdown": false
})";

struct Case {
  const char* name;
  std::string json;
  std::vector<std::string> overrides;
  int world_size;
  const char* error;                         // nullptr: must parse
  std::function<void(const Config&)> check;  // good cases: checks on the result
};

std::vector<Case> cases() {
  std::vector<Case> c;
  auto good = [&](const char* name, std::string json, std::function<void(const Config&)> check,
                  std::vector<std::string> ov = {}, int ws = 1) {
    c.push_back({name, std::move(json), std::move(ov), ws, nullptr, std::move(check)});
  };
  auto bad = [&](const char* name, std::string json, const char* error,
                 std::vector<std::string> ov = {}, int ws = 1) {
    c.push_back({name, std::move(json), std::move(ov), ws, error, nullptr});
  };

  // --- batch triple: train = micro * accum * world_size ----------------------------------
  good(
      "batch_train_only", R"({"train_batch_size": 32})",
      [](const Config& g) {
        EXPECT_EQ(g.train_micro_batch_size_per_gpu, 8);
        EXPECT_EQ(g.gradient_accumulation_steps, 1);
      },
      {}, 4);
  good(
      "batch_micro_only", R"({"train_micro_batch_size_per_gpu": 3})",
      [](const Config& g) {
        EXPECT_EQ(g.train_batch_size, 6);
        EXPECT_EQ(g.gradient_accumulation_steps, 1);
      },
      {}, 2);
  good(
      "batch_train_micro", R"({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2})",
      [](const Config& g) { EXPECT_EQ(g.gradient_accumulation_steps, 4); }, {}, 3);
  good(
      "batch_train_accum", R"({"train_batch_size": 24, "gradient_accumulation_steps": 2})",
      [](const Config& g) { EXPECT_EQ(g.train_micro_batch_size_per_gpu, 4); }, {}, 3);
  good(
      "batch_micro_accum",
      R"({"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 3})",
      [](const Config& g) { EXPECT_EQ(g.train_batch_size, 30); }, {}, 2);
  good(
      "batch_all_three_consistent",
      R"({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2,
           "gradient_accumulation_steps": 3})",
      [](const Config& g) { EXPECT_EQ(g.train_batch_size, 12); }, {}, 2);
  bad("batch_all_three_inconsistent",
      R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 2})",
      "train_batch_size (32) must equal train_micro_batch_size_per_gpu (4) * "
      "gradient_accumulation_steps (2) * world_size (1) = 8");
  bad("batch_not_divisible", R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})",
      "train_batch_size (10) must equal");
  bad("batch_train_below_world", R"({"train_batch_size": 2})", "world_size (4)", {}, 4);
  bad("batch_none", R"({"optimizer": {"type": "Adam"}})",
      "no batch size: give train_batch_size or train_micro_batch_size_per_gpu");
  bad("batch_accum_only", R"({"gradient_accumulation_steps": 4})",
      "gradient_accumulation_steps (4) alone does not fix the batch");
  // The trainer holds both in an int; their product (times the world) must not wrap.
  bad("batch_micro_beyond_int", R"({"train_micro_batch_size_per_gpu": 2147483648})",
      "train_micro_batch_size_per_gpu: 2147483648 out of range [1, 2147483647]");
  bad("batch_product_too_large",
      R"({"train_micro_batch_size_per_gpu": 2147483647, "gradient_accumulation_steps": 2147483647})",
      "is too large a batch", {}, 4);
  bad("batch_zero", R"({"train_batch_size": 0})", "train_batch_size: 0 out of range [1, ");
  good(
      "batch_auto_all",
      R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": "auto"})",
      [](const Config& g) {
        EXPECT_EQ(g.train_batch_size, 2);
        EXPECT_EQ(g.train_micro_batch_size_per_gpu, 1);
        EXPECT_TRUE(has_line(g.resolved_auto, "train_batch_size = 2 (auto)"));
        EXPECT_TRUE(has_line(g.resolved_auto, "gradient_accumulation_steps = 1 (auto)"));
      },
      {}, 2);
  good("batch_auto_with_micro",
       R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
           "gradient_accumulation_steps": 2})",
       [](const Config& g) {
         EXPECT_EQ(g.train_batch_size, 8);
         EXPECT_TRUE(has_line(g.resolved_auto, "train_batch_size = 8 (auto)"));
       });

  // --- unknown keys with a suggestion, at several depths ----------------------------------
  bad("unknown_top", J(R"("gradient_clip": 1.0)"),
      "gradient_clip: unknown key; did you mean gradient_clipping?");
  bad("unknown_depth2", J(R"("zero_optimization": {"stag": 3})"),
      "zero_optimization.stag: unknown key; did you mean stage?");
  bad("unknown_depth2_section", J(R"("zero_optimization": {"stage": 3, "offload_parm": {}})"),
      "zero_optimization.offload_parm: unknown key; did you mean offload_param?");
  bad("unknown_depth3",
      J(R"("zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": true}})"),
      "zero_optimization.offload_param.pin_memroy: unknown key; did you mean pin_memory?");
  bad("unknown_optimizer_param", J(R"("optimizer": {"type": "Adam", "params": {"betas1": 0.9}})"),
      "optimizer.params.betas1: unknown key; did you mean betas?");
  bad("unknown_strata", J(R"("strata": {"io": {"checksums": true}})"),
      "strata.io.checksums: unknown key; did you mean checksum?");
  bad("unknown_misplaced", J(R"("offload_param": {"device": "cpu"})"),
      "offload_param: unknown key; did you mean zero_optimization.offload_param?");
  bad("unknown_misplaced_leaf", J(R"("optimizer": {"type": "Adam", "lr": 0.1})"),
      "optimizer.lr: unknown key; did you mean optimizer.params.lr?");
  bad("duplicate_key", R"({"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}})",
      "zero_optimization.stage: key given twice in one object");
  bad("unknown_aio", J(R"("aio": {"queue_dept": 8})"),
      "aio.queue_dept: unknown key; did you mean queue_depth?");

  // --- types -------------------------------------------------------------------------------
  bad("type_int_string", J(R"("zero_optimization": {"stage": "3"})"),
      "zero_optimization.stage: expected integer, got \"3\"");
  bad("type_int_fraction", J(R"("model": {"n_layer": 2.5})"),
      "model.n_layer: expected integer, got 2.5");
  bad("type_bool", J(R"("fp16": {"enabled": 1})"), "fp16.enabled: expected boolean, got 1");
  bad("type_number", J(R"("gradient_clipping": "1.0")"),
      "gradient_clipping: expected number, got \"1.0\"");
  bad("type_section", J(R"("aio": 5)"), "aio: expected object, got 5");
  bad("type_betas", J(R"("optimizer": {"type": "Adam", "params": {"betas": [0.9]}})"),
      "optimizer.params.betas: expected [beta1, beta2], got [0.9]");
  bad("type_string", J(R"("train": {"checkpoint_dir": 7})"),
      "train.checkpoint_dir: expected string, got 7");
  bad("type_nvme_path", J(R"("zero_optimization": {"stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": [1]}})"),
      "zero_optimization.offload_param.nvme_path: expected string or list of strings");
  bad("auto_not_allowed", J(R"("steps_per_print": "auto")"),
      "steps_per_print: expected integer, got \"auto\"; \"auto\" is not accepted here");
  bad("top_level_not_object", "[1, 2]", "expected a JSON object at the top level");
  bad("invalid_json", "{\n  \"train_batch_size\": 8,\n}", "invalid JSON at line 3");
  good("integral_float_ok", J(R"("zero_optimization": {"stage": 2.0})"),
       [](const Config& g) { EXPECT_EQ(g.zero.stage, 2); });
  good("null_means_default", J(R"("zero_optimization": {"offload_param": null, "stage": 1})"),
       [](const Config& g) { EXPECT_EQ(g.zero.offload_param.device, "none"); });

  // --- ranges ------------------------------------------------------------------------------
  bad("range_stage", J(R"("zero_optimization": {"stage": 4})"),
      "zero_optimization.stage: 4 out of range [0, 3]");
  bad("range_beta", J(R"("optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}})"),
      "optimizer.params.betas[1]: 1.0 out of range [0, 1)");
  bad("range_beta_negative",
      J(R"("optimizer": {"type": "Adam", "params": {"betas": [-0.1, 0.9]}})"),
      "optimizer.params.betas[0]: -0.1 out of range [0, 1)");
  bad("range_lr_zero", J(R"("optimizer": {"type": "Adam", "params": {"lr": 0}})"),
      "optimizer.params.lr: 0 out of range (0, 3.4028234663852886e+38]");
  bad("range_lr_negative", J(R"("optimizer": {"type": "Adam", "params": {"lr": -0.001}})"),
      "optimizer.params.lr: -0.001 out of range (0, 3.4028234663852886e+38]");
  bad("range_queue_depth", J(R"("aio": {"queue_depth": 0})"),
      "aio.queue_depth: 0 out of range [1, 4096]");
  bad("range_queue_depth_high", J(R"("aio": {"queue_depth": 70000})"),
      "aio.queue_depth: 70000 out of range [1, 4096]");
  bad("range_block_size_multiple", J(R"("aio": {"block_size": 5000})"),
      "aio.block_size: 5000 is not a multiple of 4096");
  bad("range_block_size_zero", J(R"("aio": {"block_size": 0})"), "aio.block_size: 0 out of range");
  bad("range_ratio", J(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 1.5}})"),
      "zero_optimization.offload_optimizer.ratio: 1.5 out of range [0, 1]");
  bad("range_n_embd_n_head", J(R"("model": {"n_embd": 100, "n_head": 3})"),
      "model.n_embd: 100 is not divisible by model.n_head (3)");
  bad("range_padded_vocab", J(R"("model": {"vocab_size": 1000, "padded_vocab_size": 999})"),
      "model.padded_vocab_size: 999 is smaller than model.vocab_size (1000)");
  bad("range_seq_len", J(R"("model": {"context": 64}, "data": {"seq_len": 65})"),
      "data.seq_len: 65 is longer than model.context (64)");
  bad("range_eps", J(R"("optimizer": {"type": "Adam", "params": {"eps": 0}})"),
      "optimizer.params.eps: 0 out of range (0, 1]");
  // The optimizer steps in fp32: a rate or decay past its largest finite value would be inf
  // there (it was a failed check at the first step).
  bad("range_lr_fp32", J(R"("optimizer": {"type": "Adam", "params": {"lr": 1e39}})"),
      "optimizer.params.lr: 1e+39 out of range (0, 3.4028234663852886e+38]");
  bad("range_weight_decay_fp32",
      J(R"("optimizer": {"type": "AdamW", "params": {"weight_decay": 1e300}})"),
      "optimizer.params.weight_decay: 1e+300 out of range [0, 3.4028234663852886e+38]");
  bad("range_warmup_max_lr_fp32",
      J(R"("scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e39}})"),
      "scheduler.params.warmup_max_lr: 1e+39 out of range");
  bad("range_synthetic_tokens", J(R"("data": {"synthetic_tokens": 1e15})"),
      "data.synthetic_tokens");
  bad("range_min_loss_scale", J(R"("fp16": {"enabled": true, "min_loss_scale": 0})"),
      "fp16.min_loss_scale: 0 out of range (0, inf)");
  bad("range_cos_min_ratio",
      J(R"("scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 2}})"),
      "scheduler.params.cos_min_ratio: 2 out of range [0, 1]");
  bad("range_ordinal", J(R"("device": {"ordinal": -2})"), "device.ordinal: -2 out of range [-1, ");

  // --- enums -------------------------------------------------------------------------------
  bad("enum_offload_device",
      J(R"("zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}})"),
      "zero_optimization.offload_param.device: \"disk\" is not one of none, cpu, nvme");
  bad("enum_optimizer", J(R"("optimizer": {"type": "Lamb"})"),
      "optimizer.type: \"Lamb\" is not one of Adam, AdamW, Adagrad, Lion");
  bad("enum_scheduler", J(R"("scheduler": {"type": "OneCycle"})"),
      "scheduler.type: \"OneCycle\" is not one of WarmupLR, WarmupDecayLR, WarmupCosineLR");
  bad("enum_aio_backend", J(R"("aio": {"backend": "spdk"})"),
      "aio.backend: \"spdk\" is not one of auto, io_uring, libaio, posix");
  bad("enum_device_backend", J(R"("device": {"backend": "rocm"})"),
      "device.backend: \"rocm\" is not one of auto, cpu, cuda");
  bad("enum_moment_dtype", J(R"("strata": {"optimizer": {"moment_dtype": "fp8"}})"),
      "strata.optimizer.moment_dtype: \"fp8\" is not one of fp32, bf16");
  // A dtype the optimizers do not step moments in: refused with the config, not at the first
  // step (it was a failed check there).
  bad("enum_moment_dtype_fp16", J(R"("strata": {"optimizer": {"moment_dtype": "fp16"}})"),
      "strata.optimizer.moment_dtype: \"fp16\" is not one of fp32, bf16");
  good("moment_dtype_alias", J(R"("strata": {"optimizer": {"moment_dtype": "bfloat16"}})"),
       [](const Config& g) { EXPECT_EQ(g.strata.moment_dtype, DType::kBF16); });
  bad("enum_warmup_type",
      J(R"("scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}})"),
      "scheduler.params.warmup_type: \"cosine\" is not one of log, linear");
  good("enum_case_insensitive", J(R"("optimizer": {"type": "adamw"})"),
       [](const Config& g) { EXPECT_EQ(g.optimizer.type, "AdamW"); });
  good("enum_dtype_alias", J(R"("strata": {"optimizer": {"moment_dtype": "bfloat16"}})"),
       [](const Config& g) { EXPECT_EQ(g.strata.moment_dtype, DType::kBF16); });

  // --- sizes -------------------------------------------------------------------------------
  good("size_number_and_strings", J(R"("device": {"memory_limit": "16GiB", "reserve": "512MB"},
            "zero_optimization": {"reduce_bucket_size": 1e8, "allgather_bucket_size": "100 MiB"},
            "data": {"synthetic_tokens": "4k"})"),
       [](const Config& g) {
         EXPECT_EQ(g.device.memory_limit, size_t{16} << 30);
         EXPECT_EQ(g.device.reserve, size_t{512'000'000});
         EXPECT_EQ(g.zero.reduce_bucket_size, size_t{100'000'000});
         EXPECT_EQ(g.zero.allgather_bucket_size, size_t{100} << 20);
         EXPECT_EQ(g.data.synthetic_tokens, size_t{4000});
       });
  bad("size_negative_number", J(R"("device": {"memory_limit": -1})"),
      "device.memory_limit: -1 out of range [0, inf)");
  bad("size_negative_string", J(R"("device": {"memory_limit": "-4GiB"})"),
      "device.memory_limit: \"-4GiB\": negative size");
  bad("size_garbage", J(R"("device": {"memory_limit": "lots"})"),
      "device.memory_limit: \"lots\": not a size");
  bad("size_bad_unit", J(R"("device": {"memory_limit": "4 parsecs"})"),
      "device.memory_limit: \"4 parsecs\": unknown unit \"parsecs\"");
  bad("size_fraction", J(R"("zero_optimization": {"reduce_bucket_size": 1.5})"),
      "zero_optimization.reduce_bucket_size: 1.5 is not a whole number");
  bad("size_type", J(R"("device": {"reserve": true})"), "device.reserve: expected size");
  good("block_size_string", J(R"("aio": {"block_size": "1MiB"})"),
       [](const Config& g) { EXPECT_EQ(g.aio.block_size, size_t{1} << 20); });

  // --- auto --------------------------------------------------------------------------------
  good("auto_hf_zero3", kHfZero3, [](const Config& g) {
    EXPECT_EQ(g.model.dtype, DType::kF32);
    EXPECT_DOUBLE_EQ(g.optimizer.lr, 1e-3);
    EXPECT_DOUBLE_EQ(g.optimizer.beta2, 0.999);
    EXPECT_DOUBLE_EQ(g.gradient_clipping, 1.0);
    EXPECT_DOUBLE_EQ(g.scheduler.warmup_max_lr, 1e-3);
    EXPECT_EQ(g.scheduler.total_num_steps, g.train.steps);
    EXPECT_EQ(g.scheduler.warmup_num_steps, 20);  // 10% of 200 steps
    const size_t h = static_cast<size_t>(g.model.n_embd);
    EXPECT_EQ(g.zero.reduce_bucket_size, h * h);
    EXPECT_EQ(g.zero.stage3_prefetch_bucket_size, h * h * 9 / 10);
    EXPECT_EQ(g.zero.stage3_param_persistence_threshold, 10 * h);
    for (const char* line :
         {"optimizer.params.lr = 0.001 (auto)", "optimizer.params.betas = [0.9, 0.999] (auto)",
          "optimizer.params.eps = 1e-08 (auto)", "optimizer.params.weight_decay = 0 (auto)",
          "scheduler.params.warmup_max_lr = 0.001 (auto)", "fp16.enabled = false (auto)",
          "bf16.enabled = false (auto)", "gradient_clipping = 1 (auto)",
          "zero_optimization.reduce_bucket_size = 16384 (auto)",
          "scheduler.params.total_num_steps = 200 (auto)", "train_batch_size = 1 (auto)",
          "scheduler.params.warmup_num_steps = 20 (10% of train.steps 200, rounded up) (auto)"}) {
      EXPECT_TRUE(has_line(g.resolved_auto, line)) << line;
    }
  });
  // The same config for a bf16 checkpoint trains in bf16, as the Hugging Face Trainer run with
  // --bf16 for it would; a short run still warms up (at least one step).
  const std::string hf = std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/hf/";
  good("auto_hf_zero3_bf16_checkpoint", kHfZero3,
       [](const Config& g) {
         EXPECT_TRUE(g.bf16.enabled);
         EXPECT_FALSE(g.fp16.enabled);
         EXPECT_EQ(g.model.dtype, DType::kBF16);
         EXPECT_EQ(g.scheduler.warmup_num_steps, 1);
         for (const char* line :
              {"bf16.enabled = true (model.from_pretrained's dtype is bf16) (auto)",
               "fp16.enabled = false (model.from_pretrained's dtype is bf16) (auto)",
               "scheduler.params.warmup_num_steps = 1 (10% of train.steps 5, rounded up) (auto)"}) {
           EXPECT_TRUE(has_line(g.resolved_auto, line)) << line;
         }
       },
       {"model.from_pretrained=\"" + hf + "llama-bf16\"", "train.steps=5"});
  good("auto_hf_zero3_fp32_checkpoint", kHfZero3,
       [](const Config& g) {
         EXPECT_FALSE(g.bf16.enabled);
         EXPECT_FALSE(g.fp16.enabled);
         EXPECT_EQ(g.model.dtype, DType::kF32);
       },
       {"model.from_pretrained=\"" + hf + "llama\""});
  good("auto_lr_from_warmup_max", J(R"("optimizer": {"type": "Adam", "params": {"lr": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4}})"),
       [](const Config& g) { EXPECT_DOUBLE_EQ(g.optimizer.lr, 3e-4); });
  good("auto_model_data",
       J(R"("model": {"vocab_size": 50257, "padded_vocab_size": "auto", "context": 128},
            "data": {"seq_len": "auto"})"),
       [](const Config& g) {
         EXPECT_EQ(g.model.padded_vocab_size, 50304);
         EXPECT_EQ(g.data.seq_len, 128);
         EXPECT_TRUE(has_line(g.resolved_auto, "model.padded_vocab_size = 50304 (auto)"));
         EXPECT_TRUE(has_line(g.resolved_auto, "data.seq_len = 128 (auto)"));
       });

  // --- overrides ---------------------------------------------------------------------------
  good("override_number", J(), [](const Config& g) { EXPECT_EQ(g.zero.stage, 3); },
       {"zero_optimization.stage=3"});
  good("override_string_and_new_section", J(),
       [](const Config& g) {
         EXPECT_EQ(g.zero.offload_param.device, "nvme");
         EXPECT_EQ(g.zero.offload_param.nvme_path, std::vector<std::string>{"/mnt/nvme0"});
         EXPECT_EQ(g.model.n_layer, 2);
       },
       {"zero_optimization.stage=3", "zero_optimization.offload_param.device=nvme",
        "zero_optimization.offload_param.nvme_path=/mnt/nvme0", "model.n_layer=2"});
  good("override_replaces_file_value", J(R"("fp16": {"enabled": true})"),
       [](const Config& g) {
         EXPECT_FALSE(g.fp16.enabled);
         EXPECT_TRUE(g.bf16.enabled);
         EXPECT_EQ(g.model.dtype, DType::kBF16);
       },
       {"fp16.enabled=false", "bf16.enabled=true"});
  good("override_json_list", J(),
       [](const Config& g) { EXPECT_DOUBLE_EQ(g.optimizer.beta2, 0.95); },
       {"optimizer.type=Adam", "optimizer.params.betas=[0.9, 0.95]"});
  good("override_alias_replaces_canonical", J(R"("aio": {"intra_op_parallelism": 2})"),
       [](const Config& g) { EXPECT_EQ(g.aio.intra_op_parallelism, 6); }, {"aio.thread_count=6"});
  bad("override_unknown", J(),
      "--set zero_optimization.offload_parm.device=nvme: "
      "zero_optimization.offload_parm: unknown key; did you mean offload_param?",
      {"zero_optimization.offload_parm.device=nvme"});
  bad("override_unknown_top", J(), "trian: unknown key; did you mean train?", {"trian.steps=5"});
  bad("override_no_equals", J(), "expected path=value", {"zero_optimization.stage"});
  bad("override_into_value", J(), "zero_optimization.stage is a value, not a section",
      {"zero_optimization.stage.x=1"});
  bad("override_validated", J(), "zero_optimization.stage: 7 out of range [0, 3]",
      {"zero_optimization.stage=7"});

  // --- precision ---------------------------------------------------------------------------
  bad("fp16_and_bf16", J(R"("fp16": {"enabled": true}, "bf16": {"enabled": true})"),
      "fp16.enabled and bf16.enabled are both true");
  good("dtype_bf16", J(R"("bf16": {"enabled": true})"),
       [](const Config& g) { EXPECT_EQ(g.model.dtype, DType::kBF16); });
  good("dtype_fp16", J(R"("fp16": {"enabled": true, "loss_scale_window": 500, "hysteresis": 4,
                                   "consecutive_hysteresis": true, "initial_scale_power": 12})"),
       [](const Config& g) {
         EXPECT_EQ(g.model.dtype, DType::kF16);
         EXPECT_EQ(g.fp16.loss_scale_window, 500);
         EXPECT_EQ(g.fp16.hysteresis, 4);
         EXPECT_EQ(g.fp16.consecutive_hysteresis, 1);
         EXPECT_EQ(g.fp16.initial_scale_power, 12);
       });
  good("dtype_fp32", J(), [](const Config& g) { EXPECT_EQ(g.model.dtype, DType::kF32); });

  // --- cross-key rules -----------------------------------------------------------------------
  bad("offload_param_needs_stage3",
      J(R"("zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}})"),
      "zero_optimization.offload_param.device: cpu needs zero_optimization.stage 3 (got 2)");
  bad("partial_offload_needs_stage3",
      J(R"("zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}})"),
      "zero_optimization.offload_optimizer.ratio: 0.5 (partial offload) needs");
  bad("nvme_needs_path",
      J(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}})"),
      "zero_optimization.offload_optimizer.nvme_path: required when device is nvme");
  bad("alias_twice", J(R"("aio": {"thread_count": 2, "intra_op_parallelism": 2})"),
      "given twice (as aio.intra_op_parallelism and aio.thread_count)");
  bad("scheduler_param_of_other_type",
      J(R"("scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}})"),
      "scheduler.params.total_num_steps: not a parameter of WarmupLR");
  bad("scheduler_needs_type", J(R"("scheduler": {"params": {"warmup_num_steps": 10}})"),
      "scheduler.type: required when scheduler.params is given");
  bad("optimizer_needs_type", J(R"("optimizer": {"params": {"lr": 0.1}})"),
      "optimizer.type: required when optimizer.params is given");
  bad("warmup_longer_than_total", J(R"("scheduler": {"type": "WarmupDecayLR",
                         "params": {"warmup_num_steps": 50, "total_num_steps": 10}})"),
      "scheduler.params.warmup_num_steps: 50 is longer than total_num_steps (10)");
  good("overlap_comm_default_follows_stage", J(R"("zero_optimization": {"stage": 3})"),
       [](const Config& g) { EXPECT_TRUE(g.zero.overlap_comm); });
  good("alias_fp16_weights",
       J(R"("zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": true})"),
       [](const Config& g) { EXPECT_TRUE(g.zero.stage3_gather_16bit_weights_on_model_save); });

  bad("wandb_refused", J(R"("wandb": {"enabled": true, "project": "p"})"),
      "wandb.enabled: true is not supported");
  good("metrics_keys", J(R"("train": {"log_interval": 5}, "csv_monitor": {"enabled": true,
            "job_name": "j"})"),
       [](const Config& g) {
         EXPECT_EQ(g.train.log_interval, 5);
         EXPECT_TRUE(g.csv_monitor.enabled);
         EXPECT_EQ(g.csv_monitor.job_name, "j");
         EXPECT_EQ(g.csv_monitor.output_path, "");
         EXPECT_FALSE(g.tensorboard.enabled);
       });

  // dpo: TRL's loss types (one or a list), their weights and the f-divergences.
  good("dpo_loss_type_string_is_a_list", J(R"("dpo": {"loss_type": "IPO"})"),
       [](const Config& g) { EXPECT_EQ(g.dpo.loss_type, std::vector<std::string>{"ipo"}); });
  good("dpo_mpo", J(R"("dpo": {"loss_type": ["sigmoid", "bco_pair", "sft"],
            "loss_weights": [0.8, 0.2, 1.0]})"),
       [](const Config& g) {
         EXPECT_EQ(g.dpo.loss_type.size(), 3u);
         EXPECT_EQ(g.dpo.loss_weights, (std::vector<double>{0.8, 0.2, 1.0}));
         EXPECT_EQ(g.dpo.f_divergence_type, "reverse_kl");
       });
  good("dpo_f_divergence", J(R"("dpo": {"loss_type": ["sigmoid", "sft"],
            "f_divergence_type": "js_divergence"})"),
       [](const Config& g) { EXPECT_EQ(g.dpo.f_divergence_type, "js_divergence"); });
  bad("dpo_unknown_loss_type", J(R"("dpo": {"loss_type": ["sigmoid", "kto"]})"),
      "dpo.loss_type: \"kto\" is not one of sigmoid, hinge, ipo");
  bad("dpo_empty_loss_type", J(R"("dpo": {"loss_type": []})"),
      "dpo.loss_type is an empty list: name one or more of sigmoid, hinge");
  bad("dpo_weights_per_type", J(R"("dpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1]})"),
      "dpo.loss_weights has 1 weights for 2 loss types");
  bad("dpo_weight_not_a_number", J(R"("dpo": {"loss_weights": ["x"]})"), "dpo.loss_weights[0]");
  bad("dpo_f_divergence_of_pairwise_loss",
      J(R"("dpo": {"loss_type": ["sigmoid", "bco_pair"], "f_divergence_type": "forward_kl"})"),
      "dpo.f_divergence_type \"forward_kl\" does not apply to dpo.loss_type bco_pair");
  bad("dpo_exo_needs_smoothing", J(R"("dpo": {"loss_type": "exo_pair"})"),
      "dpo.loss_type exo_pair needs dpo.label_smoothing above 0");

  // --- not acted on ------------------------------------------------------------------------
  good("not_acted_on_lines",
       J(R"("zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
              "nvme_path": "/nvme"}, "contiguous_gradients": true},
            "aio": {"queue_depth": 8, "block_size": 262144, "single_submit": true},
            "wall_clock_breakdown": true, "gradient_clipping": 1.0, "steps_per_print": 5,
            "tensorboard": {"enabled": true, "output_path": "tb/"},
            "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": false},
            "amp": {"enabled": false, "opt_level": "O1"},
            "zero_allow_untested_optimizer": true)"),
       [](const Config& g) {
         const auto& n = g.not_acted_on;
         // Acted on since the tier manager landed: no line.
         EXPECT_FALSE(has_line(n, "offload_param.device"));
         EXPECT_FALSE(has_line(n, "aio.block_size"));
         EXPECT_TRUE(has_line(n, "zero_optimization.stage = 3: accepted;"));
         EXPECT_TRUE(has_line(n, "aio.single_submit = true: accepted;"));
         EXPECT_TRUE(has_line(n, "wall_clock_breakdown = true: accepted;"));
         // Acted on: the trainer writes TensorBoard event files there.
         EXPECT_FALSE(has_line(n, "tensorboard."));
         EXPECT_TRUE(g.tensorboard.enabled);
         EXPECT_EQ(g.tensorboard.output_path, "tb/");
         // Acted on: partition_activations turns on recompute (and says so).
         EXPECT_FALSE(has_line(n, "partition_activations"));
         EXPECT_EQ(g.strata.activations, "recompute");
         EXPECT_TRUE(has_line(g.resolved_auto,
                              "strata.activations = recompute (from "
                              "activation_checkpointing.partition_activations)"));
         EXPECT_TRUE(has_line(n, "zero_allow_untested_optimizer = true"));
         // Defaults and acted-on settings produce no line.
         EXPECT_FALSE(has_line(n, "contiguous_gradients"));
         EXPECT_FALSE(has_line(n, "queue_depth"));
         EXPECT_FALSE(has_line(n, "cpu_checkpointing"));
         EXPECT_FALSE(has_line(n, "amp"));
         EXPECT_FALSE(has_line(n, "gradient_clipping"));
         EXPECT_FALSE(has_line(n, "steps_per_print"));
       });
  good("other_deepspeed_keys_accepted",
       J(R"("zero_force_ds_cpu_optimizer": false, "gradient_predivide_factor": 2.0,
            "prescale_gradients": false, "communication_data_type": "bf16",
            "activation_checkpointing": {"partition_activations": false,
              "cpu_checkpointing": false, "contiguous_memory_optimization": false,
              "number_checkpoints": null, "synchronize_checkpoint_boundary": false,
              "profile": false},
            "flops_profiler": {"enabled": false, "profile_step": 1, "module_depth": -1,
              "top_modules": 1, "detailed": true, "output_file": null},
            "wandb": {"enabled": false, "project": "x"},
            "csv_monitor": {"enabled": false, "output_path": "", "job_name": "j"},
            "comms_logger": {"enabled": true, "verbose": false, "prof_all": true,
              "debug": false, "prof_ops": ["all_reduce"]},
            "amp": {"enabled": true, "opt_level": "O2"},
            "data_types": {"grad_accum_dtype": "fp32"},
            "memory_breakdown": false, "dump_state": false)"),
       [](const Config& g) {
         EXPECT_TRUE(has_line(g.not_acted_on, "gradient_predivide_factor = 2.0"));
         EXPECT_TRUE(has_line(g.not_acted_on, "communication_data_type = bf16"));
         EXPECT_TRUE(has_line(g.not_acted_on, "comms_logger.enabled = true"));
         EXPECT_TRUE(has_line(g.not_acted_on, "amp = {"));
         EXPECT_TRUE(has_line(g.not_acted_on, "wandb.project = x"));
         EXPECT_FALSE(has_line(g.not_acted_on, "memory_breakdown"));
       });
  // --- activation checkpointing: DeepSpeed's keys map onto strata.activations ---------------
  good("cpu_checkpointing_offloads",
       J(R"("activation_checkpointing": {"partition_activations": true,
              "cpu_checkpointing": true})"),
       [](const Config& g) {
         EXPECT_EQ(g.strata.activations, "offload");
         EXPECT_TRUE(has_line(g.resolved_auto,
                              "strata.activations = offload (from "
                              "activation_checkpointing.cpu_checkpointing)"));
         EXPECT_FALSE(has_line(g.not_acted_on, "cpu_checkpointing"));
       });
  good("number_checkpoints_recomputes", J(R"("activation_checkpointing": {"number_checkpoints": 4,
              "contiguous_memory_optimization": true})"),
       [](const Config& g) {
         EXPECT_EQ(g.strata.activations, "recompute");
         // The count itself is not honoured: every block's input is saved; said so.
         EXPECT_TRUE(has_line(g.not_acted_on, "activation_checkpointing.number_checkpoints = 4"));
         EXPECT_TRUE(has_line(g.not_acted_on,
                              "activation_checkpointing.contiguous_memory_optimization = true"));
       });
  good("strata_activations_wins", J(R"("activation_checkpointing": {"cpu_checkpointing": true},
            "strata": {"activations": "keep"})"),
       [](const Config& g) {
         EXPECT_EQ(g.strata.activations, "keep");
         EXPECT_FALSE(has_line(g.resolved_auto, "strata.activations"));
       });
  good("activation_checkpointing_off_keeps",
       J(R"("activation_checkpointing": {"partition_activations": false,
              "number_checkpoints": 0})"),
       [](const Config& g) { EXPECT_EQ(g.strata.activations, "keep"); });
  bad("strata_activations_unknown", J(R"("strata": {"activations": "discard"})"),
      "strata.activations: \"discard\" is not one of keep, recompute, offload");
  bad("other_key_checked", J(R"("flops_profiler": {"enabled": "yes"})"),
      "flops_profiler.enabled: expected boolean, got \"yes\"");
  bad("other_key_unknown", J(R"("activation_checkpointing": {"partition_activation": true})"),
      "activation_checkpointing.partition_activation: unknown key; did you mean "
      "partition_activations?");

  // --- full realistic DeepSpeed configs ----------------------------------------------------
  good("deepspeed_zero_infinity", kZeroInfinity, [](const Config& g) {
    EXPECT_EQ(g.zero.stage, 3);
    EXPECT_EQ(g.zero.offload_param.device, "nvme");
    EXPECT_EQ(g.zero.offload_optimizer.nvme_path, std::vector<std::string>{"/local_nvme"});
    EXPECT_DOUBLE_EQ(g.zero.offload_optimizer.ratio, 0.3);
    EXPECT_EQ(g.zero.offload_param.buffer_size, size_t{100'000'000});
    EXPECT_EQ(g.zero.stage3_prefetch_bucket_size, size_t{10'000'000});
    EXPECT_EQ(g.aio.block_size, size_t{262144});
    EXPECT_EQ(g.aio.queue_depth, 32);
    EXPECT_EQ(g.aio.intra_op_parallelism, 1);
    EXPECT_DOUBLE_EQ(g.optimizer.beta2, 0.95);
    EXPECT_EQ(g.optimizer.type, "Adam");
    EXPECT_EQ(g.scheduler.type, "WarmupLR");
    EXPECT_EQ(g.scheduler.warmup_num_steps, 100);
    EXPECT_EQ(g.model.dtype, DType::kF16);
    EXPECT_TRUE(g.resolved_auto.empty());
  });
  good("strata_sections", J(R"(
        "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 300,
                  "padded_vocab_size": 320, "context": 32, "tied_embeddings": false},
        "data": {"source": "tokens.bin", "format": "uint16", "seq_len": 16,
                 "eval_fraction": 0.1, "eval_batches": 2, "synthetic_tokens": 1000},
        "device": {"backend": "cpu", "memory_limit": "256MiB", "reserve": 0, "cpu_threads": 2,
                   "ordinal": 0},
        "train": {"steps": 10, "eval_interval": 5, "checkpoint_dir": "runs/x",
                  "checkpoint_interval": 5, "seed": 7, "log_file": "m.jsonl"},
        "strata": {"io": {"checksum": true}, "optimizer": {"moment_dtype": "bf16",
                   "delayed_update": true}, "comm": {"backend": "mpi"},
                   "activations": "recompute", "log_level": "debug"})"),
       [](const Config& g) {
         EXPECT_EQ(g.model.n_embd, 64);
         EXPECT_FALSE(g.model.tied_embeddings);
         EXPECT_EQ(g.model.padded_vocab_size, 320);
         EXPECT_EQ(g.data.format, "uint16");
         EXPECT_DOUBLE_EQ(g.data.eval_fraction, 0.1);
         EXPECT_EQ(g.device.memory_limit, size_t{256} << 20);
         EXPECT_EQ(g.train.seed, 7u);
         EXPECT_EQ(g.train.log_file, "m.jsonl");
         EXPECT_TRUE(g.strata.io_checksum);
         EXPECT_EQ(g.strata.moment_dtype, DType::kBF16);
         EXPECT_EQ(g.strata.comm_backend, "mpi");
         EXPECT_EQ(g.strata.activations, "recompute");
         EXPECT_EQ(g.strata.log_level, "debug");
         EXPECT_FALSE(has_line(g.not_acted_on, "strata.activations"));
         EXPECT_FALSE(has_line(g.not_acted_on, "log_level"));
         EXPECT_FALSE(has_line(g.not_acted_on, "model."));
       });
  return c;
}

TEST(Config, TableOfGoodAndBadConfigs) {
  for (const Case& tc : cases()) {
    SCOPED_TRACE(tc.name);
    Result<Config> r = parse_config(tc.json, "configs/x.json", tc.overrides, tc.world_size);
    if (tc.error == nullptr) {
      ASSERT_TRUE(r.is_ok()) << tc.name << ": " << r.status().to_string();
      tc.check(*r);
    } else {
      ASSERT_FALSE(r.is_ok()) << tc.name << ": parsed, expected an error containing: " << tc.error;
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
      const std::string& m = r.status().message();
      // The origin: the file, or the override that gave the key (config_keys_test).
      EXPECT_TRUE(m.rfind("configs/x.json", 0) == 0 ||
                  (!tc.overrides.empty() && m.rfind("--set ", 0) == 0))
          << tc.name << ": " << m;
      EXPECT_NE(m.find(tc.error), std::string::npos)
          << tc.name << ":\n  got:      " << m << "\n  expected: " << tc.error;
    }
  }
}

}  // namespace
}  // namespace strata
