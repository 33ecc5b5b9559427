// A quantized LoRA base (lora.base_quantization; src/model/base_quant.h). The stored layout and
// its fill (any byte range equals the same bytes of the whole; nf4 is src/base/nf4.h's bits,
// int8 Kernels::quantize(8)'s), the device's dequantization (the host values rounded once to the
// model dtype), and training: a run over an nf4 or int8 base has, bit for bit, the losses of
// the same run with base_quantization none over a checkpoint holding the dequantized weights;
// it stores 0.56 (nf4) / ~1 (int8) bytes per block parameter in the tiers, trains alike on the
// device, host and NVMe placements, and resumes exactly. Bad sections are refused naming
// lora.base_quantization / lora.double_quant.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "src/base/nf4.h"
#include "src/hf/hf_checkpoint.h"
#include "src/model/architecture.h"
#include "src/model/base_quant.h"
#include "src/tiers/memory_model.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/dtype.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string fixture(const std::string& name) {
  return std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/hf/" + name;
}

std::vector<float> randoms(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, 0.05f);
  std::vector<float> v(n);
  for (float& x : v) x = d(g);
  return v;
}

// A module of 3 + 96x130 (a weight whose rows are not a multiple of 64 long) + 5 + 64x64 + 7
// elements.
constexpr size_t kModule = 3 + 96 * 130 + 5 + 64 * 64 + 7;
std::vector<QuantWeight> weights() { return {{3 + 96 * 130 + 5, 64, 64}, {3, 96, 130}}; }

std::vector<uint8_t> fill_all(const BaseQuant& q, const std::vector<float>& x, size_t piece) {
  std::vector<uint8_t> out(q.bytes + 100, 0xEE);
  for (size_t a = 0; a < out.size(); a += piece) {
    const size_t c = std::min(piece, out.size() - a);
    const Status s = base_quant_fill(q, a, c, out.data() + a, [&](size_t b, size_t n, float* o) {
      EXPECT_LE(b + n, x.size());
      std::memcpy(o, x.data() + b, n * 4);
      return Status::ok();
    });
    EXPECT_TRUE(s.is_ok()) << s.to_string();
  }
  return out;
}

TEST(BaseQuant, AnyRangeOfTheStoredBytesIsTheWholesSame) {
  const std::vector<float> x = randoms(kModule, 1);
  for (BaseQuantKind kind : {BaseQuantKind::kNf4, BaseQuantKind::kInt8}) {
    const BaseQuant q = base_quant_layout(kind, kModule, weights());
    EXPECT_EQ(q.quantized_numel, 96u * 130 + 64 * 64);
    EXPECT_EQ(q.segments.size(), 5u);  // raw, weight, raw, weight, raw
    const std::vector<uint8_t> whole = fill_all(q, x, q.bytes + 100);
    for (size_t piece : {1, 7, 64, 1000, 4096}) {
      EXPECT_EQ(fill_all(q, x, piece), whole) << base_quant_name(kind) << " piece " << piece;
    }
    for (size_t i = q.bytes; i < whole.size(); ++i) ASSERT_EQ(whole[i], 0) << i;
    // The stored size: codes + fp32 scales per weight, fp32 raw runs, each aligned to 64.
    size_t exact = (3 + 5 + 7) * 4;
    for (const QuantWeight& w : weights()) {
      const size_t n = w.rows * w.cols;
      exact += kind == BaseQuantKind::kNf4 ? n / 2 + (n + 63) / 64 * 4 : n + w.rows * 4;
    }
    EXPECT_GE(q.bytes, exact);
    EXPECT_LT(q.bytes, exact + 8 * kQuantAlign);
  }
}

TEST(BaseQuant, TheValuesAreNf4sAndTheInt8KernelsBits) {
  const std::vector<float> x = randoms(kModule, 2);
  const QuantWeight w = weights()[1];  // 96 x 130 at element 3
  const size_t n = w.rows * w.cols;
  // nf4: src/base/nf4.h's quantize then dequantize of the weight, flattened.
  {
    const BaseQuant q = base_quant_layout(BaseQuantKind::kNf4, kModule, weights());
    const std::vector<uint8_t> stored = fill_all(q, x, 1 << 20);
    std::vector<float> v(kModule);
    base_quant_values(q, stored.data(), v.data());
    std::vector<uint8_t> codes(nf4_packed_bytes(n));
    std::vector<float> absmax(nf4_blocks(n)), want(n);
    nf4_quantize(x.data() + w.begin, n, codes.data(), absmax.data());
    nf4_dequantize(codes.data(), absmax.data(), n, want.data());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(v[w.begin + i], want[i]) << i;
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(v[i], x[i]);  // raw: exact
  }
  // int8: the CPU kernels' quantize(8) with block = a row, then dequantize.
  {
    const BaseQuant q = base_quant_layout(BaseQuantKind::kInt8, kModule, weights());
    const std::vector<uint8_t> stored = fill_all(q, x, 1 << 20);
    std::vector<float> v(kModule);
    base_quant_values(q, stored.data(), v.data());
    auto dev = create_cpu_device(CpuDeviceOptions{});
    ASSERT_TRUE(dev.is_ok());
    Device& d = **dev;
    Stream& s = d.compute_stream();
    std::vector<int8_t> codes(n);
    std::vector<float> scales(w.rows), want(n);
    d.kernels().quantize(s, 8, DType::kF32, codes.data(), scales.data(), x.data() + w.begin, n,
                         int(w.cols));
    d.kernels().dequantize(s, 8, DType::kF32, want.data(), codes.data(), scales.data(), n,
                           int(w.cols), false);
    ASSERT_TRUE(d.synchronize(s).is_ok());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(v[w.begin + i], want[i]) << i;
    // The stored codes and scales are the kernel's.
    const QuantSegment& g = q.segments[1];
    EXPECT_EQ(std::memcmp(stored.data() + g.at, codes.data(), n), 0);
    EXPECT_EQ(std::memcmp(stored.data() + g.scales_at, scales.data(), w.rows * 4), 0);
  }
}

TEST(BaseQuant, TheDeviceDequantizesToTheValuesRoundedOnce) {
  const std::vector<float> x = randoms(kModule, 3);
  CpuDeviceOptions o;
  o.capacity = size_t{64} << 20;
  auto dev = create_cpu_device(o);
  ASSERT_TRUE(dev.is_ok());
  Device& d = **dev;
  Stream& s = d.compute_stream();
  for (BaseQuantKind kind : {BaseQuantKind::kNf4, BaseQuantKind::kInt8}) {
    const BaseQuant q = base_quant_layout(kind, kModule, weights());
    const std::vector<uint8_t> stored = fill_all(q, x, 1 << 20);
    std::vector<float> v(kModule);
    base_quant_values(q, stored.data(), v.data());
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      void* in = *d.allocate(q.bytes, "test.stored");
      void* out = *d.allocate(kModule * dtype_size(dt), "test.out");
      d.copy_h2d(s, in, stored.data(), q.bytes);
      base_quant_dequantize(q, d.kernels(), s, dt, in, out);
      std::vector<uint8_t> got(kModule * dtype_size(dt)), want(got.size());
      d.copy_d2h(s, got.data(), out, got.size());
      ASSERT_TRUE(d.synchronize(s).is_ok());
      convert(v.data(), DType::kF32, want.data(), dt, kModule);
      EXPECT_EQ(got, want) << base_quant_name(kind) << " " << dtype_name(dt);
      d.release(in);
      d.release(out);
    }
  }
}

// ---- configs -------------------------------------------------------------------------------

// configs/tiny-cpu.json over the llama fixture (fp32) with every block linear layer adapted
// and `quant` as lora.base_quantization, then `extra`.
Result<Config> qlora_config(const std::string& base, const std::string& quant,
                            std::vector<std::string> extra = {}) {
  json doc =
      json::parse(test::read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json"));
  doc.erase("model");
  doc["model"] = {{"from_pretrained", base}, {"context", 16}};
  doc["scheduler"]["params"]["warmup_num_steps"] = 1;
  doc["lora"] = {{"r", 4},
                 {"lora_alpha", 8},
                 {"base_quantization", quant},
                 {"target_modules",
                  {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}}};
  extra.insert(extra.begin(), "bf16.enabled=false");
  return parse_config(doc.dump(), "<qlora test>", extra);
}

TEST(QloraConfig, BadSectionsAreRefusedNamingTheKey) {
  auto bad = qlora_config(fixture("llama"), "nf3");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("lora.base_quantization"), std::string::npos)
      << bad.status().message();
  bad = qlora_config(fixture("llama"), "nf4", {"lora.double_quant=true"});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("lora.double_quant"), std::string::npos)
      << bad.status().message();
  bad = qlora_config(fixture("llama"), "int8", {"zero_optimization.zero_quantized_weights=true"});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("lora.base_quantization"), std::string::npos)
      << bad.status().message();
  // nf4 without adapters: the key alone does not turn them on.
  json doc =
      json::parse(test::read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json"));
  doc["lora"] = {{"base_quantization", "nf4"}};
  bad = parse_config(doc.dump(), "<qlora test>", {});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("lora.base_quantization: nf4"), std::string::npos)
      << bad.status().message();
  auto none = parse_config(
      json::parse(test::read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json"))
          .dump(),
      "<qlora test>", {"lora.base_quantization=\"nf4\""});
  ASSERT_FALSE(none.is_ok());
  // And a model built from a shape that skipped the parser's check.
  ModelConfig m = (*qlora_config(fixture("llama"), "nf4")).model;
  m.lora.enabled = false;
  auto arch = create_architecture(m);
  ASSERT_FALSE(arch.is_ok());
  EXPECT_NE(arch.status().message().find("lora.base_quantization"), std::string::npos)
      << arch.status().message();
}

// The tiers hold each block at its stored size; nothing else of the base changes.
TEST(QloraTiers, TheBaseIsStoredAtItsQuantizedSize) {
  for (const char* quant : {"nf4", "int8"}) {
    auto cfg = qlora_config(fixture("llama"), quant);
    ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
    auto arch = create_architecture(cfg->model);
    ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
    auto plain_cfg = qlora_config(fixture("llama"), "none");
    auto plain = create_architecture(plain_cfg->model);
    ASSERT_TRUE(plain.is_ok());
    EXPECT_NE((*arch)->shape_string(), (*plain)->shape_string());  // a resume compares it
    for (DType dt : {DType::kF32, DType::kBF16}) {
      auto h = module_homes((*arch)->layout(), Placement{}, 1, dt, DType::kF32, false, 0);
      auto p = module_homes((*plain)->layout(), Placement{}, 1, dt, DType::kF32, false, 0);
      ASSERT_TRUE(h.is_ok() && p.is_ok());
      size_t blocks = 0;
      for (size_t m = 0; m < h->size(); ++m) {
        auto q = (*arch)->base_quant(int(m));
        if (!q) {
          EXPECT_EQ((*h)[m].params.bytes, (*p)[m].params.bytes) << (*h)[m].name;
          continue;
        }
        ++blocks;
        const size_t es = dtype_size(dt);
        EXPECT_EQ((*h)[m].params.bytes, (q->bytes + es - 1) / es * es) << (*h)[m].name;
        EXPECT_EQ((*h)[m].master.bytes, 0u);
        // Every block weight quantized, the two norm weights (2C) not; the stored size is the
        // codes (nf4 0.5 B, int8 1 B per weight) + an fp32 scale per 64 (nf4) or per row (int8)
        // + the norms in fp32, plus at most one alignment per segment.
        const ModelConfig& sh = (*arch)->shape();
        EXPECT_EQ(q->quantized_numel + 2 * size_t(sh.n_embd), (*arch)->layout().modules[m].numel);
        size_t exact = 2 * size_t(sh.n_embd) * 4;
        for (const QuantSegment& g : q->segments) {
          if (g.block) exact += q->code_bytes(g) + g.blocks() * 4;
        }
        const size_t n = q->quantized_numel;
        if (std::string(quant) == "nf4") {
          EXPECT_EQ(exact, 2 * size_t(sh.n_embd) * 4 + n / 2 + n / 64 * 4);
        }
        EXPECT_GE(q->bytes, exact);
        EXPECT_LT(q->bytes, exact + q->segments.size() * kQuantAlign);
        EXPECT_LT((*h)[m].params.bytes, (*p)[m].params.bytes);
      }
      EXPECT_EQ(blocks, size_t((*arch)->shape().n_layer));
    }
  }
}

// ---- training --------------------------------------------------------------------------------

// The llama fixture with every block's weights replaced by what `quant` stores (base_quant_values)
// written as one model.safetensors (fp32) beside its config.json, in `dir`.
void write_dequantized_fixture(const Architecture& arch, const std::string& dir) {
  fs::create_directories(dir);
  fs::copy_file(fixture("llama") + "/config.json", dir + "/config.json",
                fs::copy_options::overwrite_existing);
  auto hf = HfCheckpointReader::open(fixture("llama"), arch);
  ASSERT_TRUE(hf.is_ok()) << hf.status().to_string();
  json header = json::object();
  std::string data;
  const ModelLayout& lay = arch.layout();
  for (size_t m = 0; m < lay.modules.size(); ++m) {
    const std::vector<HfTensor> ts = arch.hf_tensors(int(m));
    if (ts.empty()) continue;  // an adapter
    std::vector<float> v(lay.modules[m].numel);
    ASSERT_TRUE((*hf)->read_module(int(m), v.data()).is_ok());
    if (auto q = arch.base_quant(int(m))) {
      std::vector<uint8_t> stored(q->bytes);
      ASSERT_TRUE(
          base_quant_fill(*q, 0, q->bytes, stored.data(), [&](size_t b, size_t n, float* o) {
            std::memcpy(o, v.data() + b, n * 4);
            return Status::ok();
          }).is_ok());
      base_quant_values(*q, stored.data(), v.data());
    }
    for (const HfTensor& t : ts) {
      ASSERT_FALSE(t.transposed);
      size_t n = 1;
      for (int64_t d : t.shape) n *= size_t(d);
      const size_t at = lay.modules[m].tensors[size_t(t.tensor)].offset;
      header[t.name] = {{"dtype", "F32"},
                        {"shape", t.shape},
                        {"data_offsets", {data.size(), data.size() + n * 4}}};
      data.append(reinterpret_cast<const char*>(v.data() + at), n * 4);
    }
  }
  std::string h = header.dump();
  while (h.size() % 8) h += ' ';
  std::ofstream f(dir + "/model.safetensors", std::ios::binary);
  const uint64_t len = h.size();
  f.write(reinterpret_cast<const char*>(&len), 8);
  f << h << data;
  ASSERT_TRUE(f.good());
}

std::vector<std::string> run_overrides(const std::string& dir, int steps,
                                       std::vector<std::string> extra = {}) {
  fs::create_directories(dir + "/swap");
  std::vector<std::string> ov = {
      "train.checkpoint_dir=\"" + dir + "/ckpt\"",
      "train.steps=" + std::to_string(steps),
      "train.eval_interval=0",
      "steps_per_print=1000",
      "train_batch_size=4",
      "train_micro_batch_size_per_gpu=2",
      "gradient_accumulation_steps=2",
      "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\"",
      "zero_optimization.offload_param.nvme_path=\"" + dir + "/swap\"",
      "optimizer.params.lr=1e-2",
      "data.synthetic_tokens=20000"};
  ov.insert(ov.end(), extra.begin(), extra.end());
  return ov;
}

TEST(QloraTrain, LossesEqualThoseOverTheDequantizedBase) {
  const std::string dir = test::temp_dir("strata_qlora", "dequantized");
  for (const char* quant : {"nf4", "int8"}) {
    for (const char* bf16 : {"false", "true"}) {
      const std::string tag = std::string(quant) + "_bf16_" + bf16;
      auto cfg =
          qlora_config(fixture("llama"), quant,
                       run_overrides(dir + "/q_" + tag, 6, {std::string("bf16.enabled=") + bf16}));
      ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
      auto arch = create_architecture(cfg->model);
      ASSERT_TRUE(arch.is_ok());
      const std::string deq = dir + "/base_" + quant;
      if (!fs::exists(deq + "/model.safetensors")) write_dequantized_fixture(**arch, deq);
      auto plain = qlora_config(
          deq, "none", run_overrides(dir + "/n_" + tag, 6, {std::string("bf16.enabled=") + bf16}));
      ASSERT_TRUE(plain.is_ok()) << plain.status().to_string();
      const TrainResult q = test::must_train(*cfg);
      const TrainResult n = test::must_train(*plain);
      ASSERT_EQ(q.losses.size(), 6u);
      EXPECT_EQ(q.losses, n.losses) << tag;
      EXPECT_EQ(q.weights_crc, n.weights_crc) << tag;  // the adapters trained alike
      if (std::string(bf16) == "false") {              // and the quantization did change the base
        auto orig = qlora_config(fixture("llama"), "none",
                                 run_overrides(dir + "/o_" + tag, 6, {"bf16.enabled=false"}));
        ASSERT_TRUE(orig.is_ok());
        const TrainResult o = test::must_train(*orig);
        EXPECT_NE(q.losses[0], o.losses[0]) << tag;
        EXPECT_NEAR(q.losses[0], o.losses[0], 0.05 * o.losses[0]) << tag;
      }
    }
  }
}

TEST(QloraTrain, EveryPlacementTrainsAlike) {
  const std::string dir = test::temp_dir("strata_qlora", "placements");
  const std::vector<std::vector<std::string>> placements = {
      {"zero_optimization.offload_param.device=\"none\"",
       "zero_optimization.offload_optimizer.device=\"none\"", "device.memory_limit=\"64MiB\""},
      {"zero_optimization.offload_param.device=\"cpu\"",
       "zero_optimization.offload_optimizer.device=\"cpu\""},
      {"zero_optimization.offload_param.device=\"nvme\"",
       "zero_optimization.offload_optimizer.device=\"cpu\"", "aio.backend=\"posix\""},
  };
  std::vector<double> first;
  for (size_t i = 0; i < placements.size(); ++i) {
    std::vector<std::string> ov = placements[i];
    ov.insert(ov.end(), {"train.eval_interval=16", "data.eval_batches=4", "bf16.enabled=true"});
    auto cfg = qlora_config(fixture("llama"), "nf4",
                            run_overrides(dir + "/p" + std::to_string(i), 16, ov));
    ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
    const TrainResult r = test::must_train(*cfg);
    ASSERT_EQ(r.losses.size(), 16u);
    ASSERT_EQ(r.eval_losses.size(), 2u);
    EXPECT_LT(r.eval_losses[1].second, r.eval_losses[0].second - 0.05)
        << "placement " << i << " " << ::testing::PrintToString(r.eval_losses);
    if (i == 0) {
      first = r.losses;
    } else {
      EXPECT_EQ(r.losses, first) << "placement " << i;
    }
  }
}

TEST(QloraTrain, AResumedRunEqualsTheUninterruptedOne) {
  const std::string dir = test::temp_dir("strata_qlora", "resume");
  auto cfg = [&](const std::string& d) {
    auto c = qlora_config(fixture("llama"), "nf4",
                          run_overrides(d, 12,
                                        {"zero_optimization.offload_param.device=\"nvme\"",
                                         "aio.backend=\"posix\"", "bf16.enabled=true"}));
    EXPECT_TRUE(c.is_ok()) << c.status().to_string();
    return *c;
  };
  const TrainResult whole = test::must_train(cfg(dir + "/whole"));
  TrainOptions stop;
  stop.stop_at_step = 6;
  const TrainResult a = test::must_train(cfg(dir + "/half"), stop);
  ASSERT_EQ(a.losses.size(), 6u);
  TrainOptions o;
  o.resume = "latest";
  const TrainResult b = test::must_train(cfg(dir + "/half"), o);
  std::vector<double> joined = a.losses;
  joined.insert(joined.end(), b.losses.begin(), b.losses.end());
  EXPECT_EQ(joined, whole.losses);
  EXPECT_EQ(b.weights_crc, whole.weights_crc);
  // A checkpoint of the nf4 run does not resume over an unquantized base (the shape differs).
  auto plain = qlora_config(fixture("llama"), "none",
                            run_overrides(dir + "/half", 12, {"bf16.enabled=true"}));
  ASSERT_TRUE(plain.is_ok());
  auto refused = train(*plain, o);
  EXPECT_FALSE(refused.is_ok());
}

}  // namespace
}  // namespace strata
