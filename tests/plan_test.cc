// The planner: memory arithmetic against hand-computed cases, fit reporting, time terms,
// profiles (good, bad, stale), the config it writes, and capacity mode (its model of the
// optimizer pass: tests/plan_optimizer_test.cc; its agreement with the engine's preflight and
// config reading: tests/plan_engine_test.cc).
#include "src/plan/plan.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "src/model/gpt2.h"
#include "src/plan/probe_machine.h"
#include "src/tiers/memory_model.h"
#include "src/tiers/tier_manager.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/log.h"
#include "tests/plan_util.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using test::small_request;
PlacementOption find(const std::string& name) { return test::find_placement(name); }

TEST(Plan, ParamCountMatchesModelLayoutOnRandomShapes) {
  std::mt19937 rng(std::random_device{}());
  for (int i = 0; i < 20; ++i) {
    ModelConfig mc;
    mc.n_head = 1 + int(rng() % 4);
    mc.n_embd = mc.n_head * (8 + int(rng() % 40));
    mc.n_layer = 1 + int(rng() % 6);
    mc.vocab_size = 2 + int(rng() % 1000);
    mc.context = 1 + int(rng() % 300);
    auto arch = create_gpt2(mc);
    ASSERT_TRUE(arch.is_ok());
    EXPECT_EQ(model_params(mc), (*arch)->layout().num_params()) << mc.n_layer << "x" << mc.n_embd;
  }
}

TEST(Plan, PresetParamCounts) {
  // GPT-2 124M with the vocab padded to 50304 (llm.c): 124,475,904 parameters.
  auto m = model_preset("gpt2-124m");
  ASSERT_TRUE(m.is_ok());
  EXPECT_EQ(model_params(m->shape), 124'475'904u);
  auto g = model_preset("gpt3-175b");
  ASSERT_TRUE(g.is_ok());
  EXPECT_NEAR(double(model_params(g->shape)) / 1e9, 174.6, 0.5);
  // The Llama family at their config.json shapes: the parameter counts their publishers give
  // (the models' safetensors hold exactly these many elements), since their vocabularies are
  // multiples of 64 (no padding rows).
  const std::pair<const char*, uint64_t> published[] = {
      {"llama2-7b", 6'738'415'616},   {"llama2-13b", 13'015'864'320},
      {"llama2-70b", 68'976'648'192}, {"llama3-8b", 8'030'261'248},
      {"llama3-70b", 70'553'706'496}, {"llama3.1-405b", 405'853'388'800},
      {"qwen2.5-7b", 7'615'616'512},  {"qwen2.5-72b", 72'706'203'648},
      {"qwen3-0.6b", 596'049'920},    {"qwen3-8b", 8'190'735'360},
      {"qwen3-32b", 32'762'123'264},  {"phi4-14b", 14'659'507'200},
      {"mistral-7b", 7'241'732'096}};
  for (const auto& [name, params] : published) {
    auto l = model_preset(name);
    ASSERT_TRUE(l.is_ok()) << name;
    EXPECT_EQ(l->shape.type, std::string(name) == "phi4-14b" ? "phi3" : "llama") << name;
    EXPECT_EQ(model_params(l->shape), params) << name;
  }
  auto bad = model_preset("gpt5");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("gpt2-124m"), std::string::npos);
}

TEST(Plan, MixturePresetsCountTotalAndActiveParameters) {
  // Mixtral 8x7B: embeddings 2 * 32000 * 4096; per layer attention 2 * 4096^2 + 2 * 1024 * 4096,
  // two norms, a router 8 * 4096 and 8 experts of 3 * 4096 * 14336: 46,702,792,704, the
  // published count. 8x22B likewise at its shape: 140,630,071,296.
  const std::pair<const char*, uint64_t> published[] = {{"mixtral-8x7b", 46'702'792'704},
                                                        {"mixtral-8x22b", 140'630'071'296}};
  for (const auto& [name, params] : published) {
    auto m = model_preset(name);
    ASSERT_TRUE(m.is_ok()) << name;
    EXPECT_EQ(m->shape.type, "mixtral") << name;
    EXPECT_EQ(model_params(m->shape), params) << name;
  }
  // Qwen3-30B-A3B at its published count (its 4096-wide attention and query/key norms).
  auto q = model_preset("qwen3-30b-a3b");
  ASSERT_TRUE(q.is_ok());
  EXPECT_EQ(model_params(q->shape), 30'532'122'624u);
  // FLOPs per token from the ACTIVE weights: 2 experts of 8 (2 * 3 * 4096 * 14336 per layer),
  // the attention, the router and the head, plus attention's 4 T A per layer.
  auto m = model_preset("mixtral-8x7b");
  auto arch = create_architecture(m->shape);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  const double C = 4096, L = 32, per_layer = 2 * C * C + 2 * 1024 * C + 8 * C + 2 * 3 * C * 14336;
  const double T = 512;
  EXPECT_DOUBLE_EQ((*arch)->flops_per_token(int(T), ActivationMode::kKeep).forward,
                   2 * per_layer * L + 4 * T * C * L + 2 * 32000 * C);
  EXPECT_NE((*arch)->describe().find("12879.93M active per token"), std::string::npos)
      << (*arch)->describe();
}

TEST(Plan, HandComputedDeviceBytesOneLayer) {
  // L=1, C=64, V=64 (padded 64), T=64: embedding 64*64 + 64*64 = 8192 elements, the block
  // 12*64^2 + 13*64 = 49984, final norm 128. All on the device, each object rounded to 256 B:
  //   embedding: params 16384 + master 32768 + moments 65536 + grads 32768   = 147456
  //   block:     params 99968 -> 100096, master/grads 199936 each, moments 399872 = 899840
  //   final:     params 256, master 512, moments 1024, grads 512               = 2304
  // total 1,049,600 bytes.
  PlanRequest r = small_request();
  auto o = evaluate_placement(r, find("all-device"));
  ASSERT_TRUE(o.is_ok());
  EXPECT_EQ(o->device.state, 1'049'600u);
  EXPECT_EQ(o->host.state, 0u);
  EXPECT_EQ(o->nvme.state, 0u);
  // Activations are model.h's activation_bytes, exactly.
  const ModelConfig mc = test::gpt_shape(1, 1, 64, 64, 64);
  auto arch = create_gpt2(mc);
  ASSERT_TRUE(arch.is_ok());
  EXPECT_EQ(o->device.activations,
            (*arch)->activation_plan(1, 64, DType::kBF16, ActivationMode::kKeep).bytes);
}

TEST(Plan, BytesPerParamMixedPrecisionAdam) {
  // ZeRO's 16 B/param for mixed-precision Adam = fp16 params 2 + fp16 grads 2 + fp32 master 4 +
  // fp32 moments 8. strata keeps fp32 gradients: 2 + 4 + 4 + 8 = 18 B/param (14 with bf16
  // moments). A large model makes the per-object rounding negligible.
  PlanRequest r = small_request();
  r.set_model(gpt_model("m", 8, 1024, 16, 50257, 1024));
  r.config.data.seq_len = 128;
  r.hw.gpu_mem = uint64_t{64} << 30;
  const double P = double(model_params(r.config.model));
  auto all = evaluate_placement(r, find("all-device"));
  ASSERT_TRUE(all.is_ok());
  EXPECT_NEAR(double(all->device.state) / P, 18.0, 0.001);
  auto host = evaluate_placement(r, find("params-host"));
  ASSERT_TRUE(host.is_ok());
  EXPECT_NEAR(double(host->host.state) / P, 18.0, 0.01);
  EXPECT_EQ(host->device.state, 0u);
  auto nv = evaluate_placement(r, find("params-nvme+opt-nvme"));
  ASSERT_TRUE(nv.is_ok());
  EXPECT_NEAR(double(nv->nvme.state) / P, 14.0, 0.01);  // params 2 + master 4 + moments 8
  EXPECT_NEAR(double(nv->host.state) / P, 4.0, 0.01);   // fp32 grads stay on the host
  r.config.strata.moment_dtype = DType::kBF16;
  auto b = evaluate_placement(r, find("all-device"));
  ASSERT_TRUE(b.is_ok());
  EXPECT_NEAR(double(b->device.state) / P, 14.0, 0.001);
  // Sharded over 4 ranks: a quarter of the state per rank on the device.
  r.config.strata.moment_dtype = DType::kF32;
  r.hw.gpus = 4;
  auto s = evaluate_placement(r, find("all-device"));
  ASSERT_TRUE(s.is_ok());
  EXPECT_NEAR(double(s->device.state) / P, 18.0 / 4, 0.001);
}

// ZeRO++ in the planner: on 4 ranks (one node) qwZ halves a bf16 gather (+ the scales), hpZ
// keeps 1/h of every module on the device, qgZ sends int4 gradients instead of fp32; the
// collectives' time scales with the bytes; the device buffers grow by exactly what the engine
// allocates for them (ZeroPPShape over the shards: the largest group's qwZ buffer, every
// module's secondary chunk, one bucket's qgZ scratch), nothing else changes.
TEST(Plan, ZeroPlusPlusShrinksTheCollectivesAndAddsHpzMemory) {
  PlanRequest r = small_request();
  r.hw.gpus = 4;
  r.config.model.dtype = DType::kBF16;
  const PlacementOption p = find("all-device");
  auto base = evaluate_placement(r, p);
  ASSERT_TRUE(base.is_ok());
  ASSERT_GT(base->time.collectives_s, 0);
  const double P = double(model_params(r.config.model));
  // Plain ZeRO-3: 3/4 of the model twice in bf16 and once in fp32 per micro-batch.
  const ZeroPPTraffic plain = zeropp_traffic({}, 4, 4, P, DType::kBF16);
  EXPECT_NEAR(plain.gather_forward, 0.75 * P * 2, 1e-6 * P);
  EXPECT_NEAR(plain.reduce, 0.75 * P * 4, 1e-6 * P);
  r.config.zero.zero_quantized_weights = true;
  r.config.zero.zero_quantized_gradients = true;
  r.config.zero.zero_hpz_partition_size = 2;
  auto zpp = evaluate_placement(r, p);
  ASSERT_TRUE(zpp.is_ok());
  const ZeroPPTraffic z = zeropp_traffic(r.zeropp(), 4, 4, P, DType::kBF16);
  const double unit = 1.0 + 4.0 / kWeightBlock, q4 = 0.5 + 4.0 / kGradBlock;
  EXPECT_NEAR(z.gather_forward, 0.75 * P * unit, 1e-6 * P);
  EXPECT_NEAR(z.gather_backward, 0.5 * P * unit, 1e-6 * P);  // 1 peer, half the model
  EXPECT_NEAR(z.reduce, 0.75 * P * q4, 1e-6 * P);
  EXPECT_NEAR(zpp->time.collectives_s / base->time.collectives_s,
              (z.gather_forward + z.gather_backward + z.reduce) /
                  (plain.gather_forward + plain.gather_backward + plain.reduce),
              1e-9);
  auto arch = create_architecture(r.config.model);
  ASSERT_TRUE(arch.is_ok());
  auto homes =
      module_homes((*arch)->layout(), p.where, 4, DType::kBF16, r.moment_dtype(), false, 0);
  ASSERT_TRUE(homes.is_ok());
  ZeroPPShape shape;
  shape.quantized_weights = shape.quantized_gradients = true;
  shape.hpz = 2;
  shape.world = shape.per_node = 4;
  size_t qwz = 0, sec = 0, max_sn = 0;
  for (const auto& h : *homes) {
    qwz = std::max(qwz, round_up(shape.qwz_buffer_bytes(h.shard_numel, DType::kBF16), 256));
    sec += round_up(shape.secondary_bytes(h.shard_numel, DType::kBF16), 256);
    max_sn = std::max(max_sn, h.shard_numel);
  }
  const size_t k = std::clamp<size_t>(r.config.zero.reduce_bucket_size / 4, 1, max_sn);
  const size_t scratch = round_up(shape.qgz_scratch_bytes(k, true), 256);
  EXPECT_GT(qwz * sec * scratch, 0u);
  EXPECT_EQ(zpp->device.buffers - base->device.buffers, qwz + sec + scratch);
  // hpZ's secondary chunks: half of every module's packed int8 group (2 of 4 units), padding
  // included.
  EXPECT_GE(double(sec), 0.5 * P * unit);
  EXPECT_EQ(zpp->device.state, base->device.state);
  // Two nodes of two: qgZ's second level sends one chunk across.
  const ZeroPPTraffic two = zeropp_traffic(r.zeropp(), 4, 2, P, DType::kBF16);
  EXPECT_NEAR(two.reduce, (1 * 2 + 1) * P / 4 * q4, 1e-6 * P);
}

// A Llama preset is planned with Llama's own layout and writes a config whose model is that
// Llama (grouped-query attention, SwiGLU width, untied head, q/k/v biases for Qwen2): the config
// read back builds an architecture with the preset's parameter count, and the plan's device
// state for all-device is the memory model's 18 B per parameter (plus 256 B rounding per object).
TEST(Plan, LlamaPresetsPlanTheirOwnArchitecture) {
  for (const char* name : {"llama3-8b", "qwen2.5-7b"}) {
    PlanRequest r = small_request();
    auto m = model_preset(name);
    ASSERT_TRUE(m.is_ok());
    r.set_model(*m);
    r.config.data.seq_len = 256;
    r.hw.gpu_mem = uint64_t{1} << 40;
    r.hw.host_mem = uint64_t{1} << 40;
    auto rep = make_plan(r);
    ASSERT_TRUE(rep.is_ok()) << rep.status().to_string();
    const double P = double(model_params(r.config.model));
    EXPECT_EQ(uint64_t(P), rep->params);
    const PlanOption& all = rep->options[0];
    ASSERT_EQ(all.placement.name, "all-device");
    EXPECT_NEAR(double(all.device.state), 18 * P, 4 * 256 * 40.0) << name;
    auto cfg = parse_config(plan_config_json(*rep, all), "plan");
    ASSERT_TRUE(cfg.is_ok()) << cfg.status().message();
    EXPECT_EQ(cfg->model.type, "llama");
    EXPECT_EQ(cfg->model.num_key_value_heads, m->shape.num_key_value_heads);
    EXPECT_EQ(cfg->model.intermediate_size, m->shape.intermediate_size);
    EXPECT_EQ(cfg->model.attention_bias, m->shape.attention_bias);
    EXPECT_FALSE(cfg->model.tied_embeddings);
    auto arch = create_architecture(cfg->model);
    ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
    EXPECT_EQ(double((*arch)->layout().num_params()), P) << name;
    // The FLOPs are the architecture's: SwiGLU's three matrices and the narrow K/V projections.
    const FlopsPerToken f = (*arch)->flops_per_token(256, ActivationMode::kKeep);
    EXPECT_EQ(all.flops, uint64_t(f.train() * 256 * r.micro_batch() * r.accumulation()));
  }
}

// Recompute trades device bytes for one more block forward; offload also moves the block inputs
// over the link and holds them in the host tier. The table and the JSON list every mode.
TEST(Plan, ActivationModesTradeMemoryForWork) {
  PlanRequest r = small_request();
  r.set_model(gpt_model("m", 4, 256, 4, 1000, 128));
  r.config.data.seq_len = 128;
  r.config.train_micro_batch_size_per_gpu = 4;
  r.config.gradient_accumulation_steps = 2;
  // One micro-batch at a time in every mode (offload cannot group): the link bytes compared are
  // the activations' alone, not a backward group's gradient drains.
  r.config.strata.grouped_forwards = 1;
  std::vector<PlanOption> o;
  for (const ActivationMode mode :
       {ActivationMode::kKeep, ActivationMode::kRecompute, ActivationMode::kOffload}) {
    r.config.strata.activations = activation_mode_name(mode);
    auto x = evaluate_placement(r, find("params-host"));
    ASSERT_TRUE(x.is_ok());
    o.push_back(*x);
  }
  EXPECT_LT(o[1].device.activations, o[0].device.activations);
  EXPECT_LT(o[2].device.activations, o[1].device.activations);
  EXPECT_EQ(o[0].host.activations, 0u);
  EXPECT_EQ(o[1].host.activations, 0u);
  // 3 of 4 block inputs (4 x 128 rows x 256 channels x 2 bytes) in the host tier.
  const uint64_t input = 4ull * 128 * 256 * 2;
  EXPECT_EQ(o[2].host.activations, 3 * input);
  // One more forward of the blocks: 2*12*C^2*L + 4*T*C*L FLOPs per token, A*B*T tokens.
  const double extra = (2.0 * 12 * 256 * 256 * 4 + 4.0 * 128 * 256 * 4) * 2 * 4 * 128;
  EXPECT_NEAR(double(o[1].flops - o[0].flops), extra, extra * 1e-6);
  EXPECT_EQ(o[2].flops, o[1].flops);
  // Out and back per micro-batch.
  EXPECT_EQ(o[2].link_bytes - o[1].link_bytes, 2 * 2 * 3 * input);
  auto rep = make_plan(r);
  ASSERT_TRUE(rep.is_ok());
  const std::string t = plan_table(*rep);
  EXPECT_NE(t.find("activations (strata.activations): keep"), std::string::npos) << t;
  EXPECT_NE(t.find("offload [this plan]"), std::string::npos) << t;
  const std::string j = plan_json(*rep);
  EXPECT_NE(j.find("\"recompute\""), std::string::npos);
  EXPECT_NE(plan_config_json(*rep, rep->options[0]).find("\"activations\": \"offload\""),
            std::string::npos);
}

TEST(Plan, ExpectedPeaksFollowTheirRules) {
  PlanRequest r = small_request();
  r.set_model(gpt_model("m", 4, 256, 4, 1000, 128));
  r.config.data.seq_len = 128;
  const uint64_t P = model_params(r.config.model);
  // Room for everything: device peak = reservation + every module's fp32 gradient buffer
  // + the cache of offloaded bf16 params.
  r.hw.gpu_mem = uint64_t{1} << 30;
  auto o = evaluate_placement(r, find("params-nvme+opt-nvme"));
  ASSERT_TRUE(o.is_ok());
  EXPECT_EQ(o->device.peak, o->device.total() + P * 4 + P * 2);
  // Extents, not swap slack; with the optimizer under backward (clipping) the pre-step master +
  // moments stay on the disk until the step is validated: their bytes once more (the sum of
  // UndoCopiesAreInTheHostPeakAndLimitTheHiddenShare), and no host copies.
  EXPECT_EQ(o->nvme.undo, 41'476'096u);
  EXPECT_EQ(o->host.undo, 0u);
  EXPECT_EQ(o->nvme.peak, o->nvme.state + o->nvme.undo);
  EXPECT_GT(o->nvme.total(), o->nvme.state);
  // A device just big enough: the cache fills it, the peak is the capacity.
  r.hw.gpu_mem = o->device.total() + P;
  auto c = evaluate_placement(r, find("params-nvme+opt-nvme"));
  ASSERT_TRUE(c.is_ok());
  EXPECT_TRUE(c->fits);
  EXPECT_EQ(c->device.peak, r.hw.gpu_mem);
  // Params on the device (no undo copies): the host stages their new bf16 values a sub-group
  // at a time (publish_staging_pieces: 2 pieces of 65536 x 2 bytes), never every module's; and,
  // where a micro-batch after the first drains its own gradients (its backward not grouped with
  // the first's), lands 2 of the largest module's fp32 gradients (a block: 789,760 x 4 bytes,
  // 3,162,112 rounded to pages) before adding them.
  r.hw.gpu_mem = uint64_t{1} << 30;
  r.config.gradient_clipping = 0;
  r.config.zero.sub_group_size = 65536;
  r.config.gradient_accumulation_steps = 2;
  r.config.strata.grouped_backwards = false;
  auto d = evaluate_placement(r, find("opt-host"));
  ASSERT_TRUE(d.is_ok());
  EXPECT_EQ(d->host.peak, d->host.state + 2 * 3'162'112 + 2 * 131'072);
  // Both micro-batches' backwards as one group: their gradients are added on the device and
  // drained once, through no landing buffer.
  r.config.strata.grouped_backwards = true;
  auto g = evaluate_placement(r, find("opt-host"));
  ASSERT_TRUE(g.is_ok());
  EXPECT_EQ(g->host.peak, g->host.state + 2 * 131'072);
  r.config.gradient_accumulation_steps =
      1;  // one micro-batch is copied into the accumulator: no landing buffers
  auto d1 = evaluate_placement(r, find("opt-host"));
  ASSERT_TRUE(d1.is_ok());
  EXPECT_EQ(d1->host.peak, d1->host.state + 2 * 131'072);
}

TEST(Plan, NonFittingPlanIsReportedAsSuch) {
  PlanRequest r = small_request();
  auto m = model_preset("gpt2-1.5b");
  ASSERT_TRUE(m.is_ok());
  r.set_model(*m);
  r.config.data.seq_len = 1024;
  r.hw.gpu_mem = uint64_t{1} << 30;   // 1 GiB device
  r.hw.host_mem = uint64_t{2} << 30;  // 2 GiB host
  r.hw.nvme_paths = {};               // no NVMe
  auto rep = make_plan(r);
  ASSERT_TRUE(rep.is_ok());
  EXPECT_EQ(rep->best, -1);
  for (const auto& o : rep->options) {
    EXPECT_FALSE(o.fits) << o.placement.name;
    EXPECT_FALSE(o.why.empty()) << o.placement.name;
  }
  EXPECT_NE(rep->options[0].why[0].find("device needs"), std::string::npos);
  const std::string table = plan_table(*rep);
  EXPECT_NE(table.find("no placement fits"), std::string::npos) << table;
  auto j = nlohmann::json::parse(plan_json(*rep));
  EXPECT_TRUE(j["best"].is_null());
}

TEST(Plan, FittingPlanPicksTheFastestFeasible) {
  PlanRequest r = small_request();
  r.set_model(gpt_model("m", 4, 256, 4, 1000, 128));
  r.config.data.seq_len = 128;
  r.hw.gpu_mem = uint64_t{1} << 30;
  auto rep = make_plan(r);
  ASSERT_TRUE(rep.is_ok());
  ASSERT_GE(rep->best, 0);
  for (const auto& o : rep->options) {
    if (o.fits && o.runnable) {
      EXPECT_LE(rep->options[size_t(rep->best)].time.step_s, o.time.step_s);
    }
  }
}

// The CPU backend's compute rate: log-log in width at each probed token count, then in tokens.
TEST(Plan, ComputeRateInterpolatesWidthThenTokens) {
  MachineProfile p = default_profile(true);
  p.gemm_by_width = {{128, 128, 1e10}, {512, 128, 4e10}, {128, 512, 2e10}, {512, 512, 8e10}};
  EXPECT_NEAR(gemm_rate_at(p, 128, 128), 1e10, 1);
  EXPECT_NEAR(gemm_rate_at(p, 256, 128), 2e10, 1e3);  // sqrt(1e10 * 4e10)
  EXPECT_NEAR(gemm_rate_at(p, 256, 512), 4e10, 1e3);  // sqrt(2e10 * 8e10)
  EXPECT_NEAR(gemm_rate_at(p, 256, 256), std::sqrt(2e10 * 4e10), 1e3);
  EXPECT_NEAR(gemm_rate_at(p, 64, 64), 1e10, 1);      // clamped below
  EXPECT_NEAR(gemm_rate_at(p, 4096, 4096), 8e10, 1);  // and above
  p.gemm_by_width.clear();
  EXPECT_EQ(gemm_rate_at(p, 256, 256), p.gemm_flops.value);
}

// The probe's default span leaves the caches: four times the last-level cache the system
// reports, within 256 MiB-2 GiB and 1/8 of the available memory.
TEST(Plan, ProbeSpansMoreThanTheCaches) {
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  const uint64_t span = probe_span_bytes(), avail = host_available_bytes();
  EXPECT_GE(span, uint64_t{64} << 20);
  EXPECT_LE(span, uint64_t{2} << 30);
  if (avail > 0) {
    EXPECT_LE(span, std::max<uint64_t>(avail / 8, uint64_t{64} << 20));
  }
  const uint64_t four = llc > 0 ? uint64_t(llc) * 4 : 0;
  if (four > 0 && four <= (uint64_t{2} << 30) && (avail == 0 || avail / 8 >= four)) {
    EXPECT_GE(span, four) << "a span the last-level cache (" << llc << " bytes) holds";
  }
}

TEST(Plan, ProfileFromTheProbeIsReadBack) {
  set_log_level(LogLevel::kError);
  MachineProbeOptions po = test::tiny_probe_options();
  po.include_cuda = false;
  int calls = 0;
  auto text = run_machine_probe(po, [&](int, int, const std::string&) { ++calls; });
  ASSERT_TRUE(text.is_ok()) << text.status().to_string();
  EXPECT_EQ(calls, 7);
  auto p = parse_machine_profile(*text, "p.json");
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_TRUE(p->cpu_backend);
  EXPECT_GT(p->gemm_flops.value, 0);
  EXPECT_GT(p->optimizer_pps.value, 0);
  EXPECT_EQ(p->gemm_by_width.size(), 8u);  // 4 widths x 2 token counts
  EXPECT_NE(p->gemm_flops.source.find("p.json"), std::string::npos);
  // Fastest-pass rates are the spreads' maxima: never below the medians.
  auto f = parse_machine_profile(*text, "p.json", /*fastest=*/true);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_GE(f->gemm_flops.value, p->gemm_flops.value);
  EXPECT_GE(f->optimizer_pps.value, p->optimizer_pps.value);
  EXPECT_GE(f->host_copy_gbps.value, p->host_copy_gbps.value);
  for (size_t i = 0; i < p->gemm_by_width.size(); ++i) {
    EXPECT_GE(f->gemm_by_width[i].flops, p->gemm_by_width[i].flops);
  }
  auto j = nlohmann::json::parse(*text);
  EXPECT_DOUBLE_EQ(f->gemm_flops.value, j["device"]["gemm_flops_spread"]["max"].get<double>());
}

// A GPU's compute rate from one GEMM (the defaults, or a profile of an earlier probe) is said
// to be one: on an H200 it put GPT-2's step at 50 ms for 35. With the probe's model-step rates
// the plan uses theirs and says nothing; the CPU backend's defaults are not a GPU's.
TEST(Plan, AGpuRateFromOneGemmIsSaidToBeOne) {
  const std::string note = "note: the compute rate is one GEMM's";
  PlanRequest r = test::small_request();
  r.profile = default_profile(/*cpu_backend=*/false);
  auto one = make_plan(r);
  ASSERT_TRUE(one.is_ok()) << one.status().to_string();
  EXPECT_NE(plan_table(*one).find(note), std::string::npos) << plan_table(*one);
  r.profile.gemm_by_width = {{64, 64, 4e14}};
  auto steps = make_plan(r);
  ASSERT_TRUE(steps.is_ok()) << steps.status().to_string();
  const std::string t = plan_table(*steps);
  EXPECT_EQ(t.find(note), std::string::npos) << t;
  EXPECT_NE(t.find("(model step at width 64, 64 tokens per micro-batch: 400)"), std::string::npos)
      << t;
  r.profile = default_profile(/*cpu_backend=*/true);
  auto cpu = make_plan(r);
  ASSERT_TRUE(cpu.is_ok()) << cpu.status().to_string();
  EXPECT_EQ(plan_table(*cpu).find(note), std::string::npos);
}

// The fields a machine profile must have, with the CPU optimizer at `optimizer_pps`.
nlohmann::json minimal_profile(double optimizer_pps) {
  return {{"magic", "strata-machine-profile"},
          {"version", kMachineProfileVersion},
          {"device", {{"backend", "cpu"}, {"gemm_flops", 1e11}}},
          {"host", {{"copy_gbps", 10.0}}},
          {"cpu_optimizer", {{"params_per_s", optimizer_pps}}}};
}

TEST(Plan, BadOrStaleProfileIsRefusedWithHowToRegenerate) {
  nlohmann::json good = minimal_profile(1e8);
  ASSERT_TRUE(parse_machine_profile(good.dump(), "g.json").is_ok());
  auto expect_refused = [](const nlohmann::json& j, const std::string& what) {
    auto p = parse_machine_profile(j.dump(), "m.json");
    ASSERT_FALSE(p.is_ok()) << what;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find("m.json"), std::string::npos) << p.status().message();
    EXPECT_NE(p.status().message().find("strata probe"), std::string::npos) << p.status().message();
    EXPECT_NE(p.status().message().find(what), std::string::npos) << p.status().message();
  };
  auto j = good;
  j["magic"] = "strata-io-probe";
  expect_refused(j, "magic");
  j = good;
  j["version"] = kMachineProfileVersion - 1;
  expect_refused(j, "version");
  j = good;
  j["cpu_optimizer"].erase("params_per_s");
  expect_refused(j, "cpu_optimizer.params_per_s");
  j = good;
  j["device"].erase("gemm_flops");
  expect_refused(j, "device.gemm_flops");
  // A rate the planner divides by: 0, negative or absurd planned nan or inf steps, exit 0.
  for (double bad : {0.0, -1.0, 1e308}) {
    j = good;
    j["host"]["copy_gbps"] = bad;
    expect_refused(j, "host.copy_gbps");
  }
  // Found by fuzz_profile: a width beyond int was converted unchecked (undefined behaviour).
  j = good;
  j["device"]["gemm_by_width"] = {{{"C", 1.3e31}, {"gemm_flops", 5e10}}};
  expect_refused(j, "C, B and T must be integers");
  j["device"]["gemm_by_width"] = {{{"C", 512}, {"B", -4}, {"gemm_flops", 5e10}}};
  expect_refused(j, "C, B and T must be integers");
  j = good;
  j["nvme"] = {
      {"read_gbps", 2.0},
      {"write_gbps", 2.0},
      {"io_probe", {{"cases", {{{"op", "read"}, {"block_size", 2.5e40}, {"queue_depth", 8}}}}}}};
  expect_refused(j, "block_size must be an integer");
  // Found by fuzz_profile: nvme.aio's block size was converted unchecked too.
  j = good;
  j["nvme"] = {{"read_gbps", 2.0},
               {"write_gbps", 2.0},
               {"aio", {{"backend", "io_uring"}, {"block_size", 4.4e23}}}};
  expect_refused(j, "nvme.aio: block_size must be an integer");
  j["nvme"]["aio"] = {{"queue_depth", 0}};
  expect_refused(j, "nvme.aio: block_size must be an integer");
  j["nvme"]["aio"] = {{"block_size", 1048576}, {"queue_depth", 32}};
  auto ok = parse_machine_profile(j.dump(), "m.json");
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(ok->aio_block_size, 1048576u);
  EXPECT_EQ(ok->aio_queue_depth, 32);
  auto p = parse_machine_profile("{not json", "m.json");
  ASSERT_FALSE(p.is_ok());
  EXPECT_NE(p.status().message().find("strata probe"), std::string::npos);
}

// The optimizer's rate beside a device: cpu_optimizer.by_threads at one thread fewer than the
// most measured (between two counts: linear), the fastest pass's with `fastest`; without
// per-thread rates (or with only malformed ones) none, and optimizer_pps stands.
TEST(Plan, OptimizerRateBesideTheLauncherIsOneThreadFewer) {
  nlohmann::json j = minimal_profile(2.0e9);
  auto none = parse_machine_profile(j.dump(), "p.json");
  ASSERT_TRUE(none.is_ok()) << none.status().to_string();
  EXPECT_EQ(none->optimizer_pps_beside, 0.0);
  j["cpu_optimizer"]["by_threads"] = {
      {{"threads", 4}, {"params_per_s", 2.0e9}, {"spread", {{"max", 2.2e9}}}},
      {{"threads", 1}, {"params_per_s", 0.8e9}, {"spread", {{"max", 0.9e9}}}},
      {{"threads", 2}, {"params_per_s", 1.4e9}, {"spread", {{"max", 1.5e9}}}},
      {{"threads", "many"}, {"params_per_s", 9e9}},
      {{"threads", 8}}};
  auto p = parse_machine_profile(j.dump(), "p.json");
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_DOUBLE_EQ(p->optimizer_pps_beside, 1.4e9 + (2.0e9 - 1.4e9) * 0.5);  // 3 of 4 threads
  auto f = parse_machine_profile(j.dump(), "p.json", /*fastest=*/true);
  ASSERT_TRUE(f.is_ok());
  EXPECT_DOUBLE_EQ(f->optimizer_pps_beside, 1.5e9 + (2.2e9 - 1.5e9) * 0.5);
  j["cpu_optimizer"]["by_threads"] = {{{"threads", 1}, {"params_per_s", 0.8e9}},
                                      {{"threads", 2}, {"params_per_s", 1.4e9}}};
  auto two = parse_machine_profile(j.dump(), "p.json");
  ASSERT_TRUE(two.is_ok());
  EXPECT_DOUBLE_EQ(two->optimizer_pps_beside, 0.8e9) << "two cores: the one-thread rate";
}

TEST(Plan, WrittenConfigParsesAndKeepsThePlacement) {
  PlanRequest r = small_request();
  r.set_model(gpt_model("m", 4, 256, 4, 1000, 128));
  r.config.data.seq_len = 128;
  r.config.train_micro_batch_size_per_gpu = 2;
  r.config.gradient_accumulation_steps = 2;
  r.profile.aio_block_size = 4 << 20;
  r.profile.aio_queue_depth = 32;
  auto rep = make_plan(r);
  ASSERT_TRUE(rep.is_ok());
  for (const auto& o : rep->options) {
    auto cfg = parse_config(plan_config_json(*rep, o), "plan");
    ASSERT_TRUE(cfg.is_ok()) << o.placement.name << ": " << cfg.status().message();
    auto back = placement_of_config(*cfg);
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    EXPECT_TRUE(back->where == o.placement.where) << o.placement.name;
    EXPECT_EQ(back->name, o.placement.name);
    EXPECT_EQ(cfg->aio.block_size, size_t{4} << 20);
    EXPECT_EQ(cfg->aio.queue_depth, 32);
    EXPECT_EQ(cfg->model.n_embd, 256);
    EXPECT_EQ(cfg->train_micro_batch_size_per_gpu, 2);
    // The planner's view of that config is the same request.
    PlanRequest again = request_from_config(*cfg, r.hw, r.profile);
    EXPECT_EQ(again.micro_batch(), 2);
    EXPECT_EQ(again.accumulation(), 2);
    EXPECT_EQ(again.seq(), 128);
    EXPECT_EQ(again.config.zero.stage3_prefetch_bucket_size,
              r.config.zero.stage3_prefetch_bucket_size);
  }
}

TEST(Plan, CapacityModeFindsTheBoundary) {
  PlanRequest r = small_request();
  r.set_model(gpt_model("m", 1, 512, 8, 1000, 128));
  r.config.data.seq_len = 128;
  r.hw.gpu_mem = uint64_t{256} << 20;
  r.hw.host_mem = uint64_t{512} << 20;
  r.hw.nvme_paths = {};
  auto c = max_model(r);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_GE(c->report.best, 0);
  PlanRequest more = r;
  more.config.model.n_layer = c->model.shape.n_layer + 1;
  auto rep = make_plan(more);
  ASSERT_TRUE(rep.is_ok());
  EXPECT_EQ(rep->best, -1) << "one more layer should not fit";
  // Too small for even one layer: reported, not a zero-layer model.
  r.hw.gpu_mem = 1 << 20;
  EXPECT_EQ(max_model(r).status().code(), StatusCode::kOutOfMemory);
}

TEST(Plan, SvgHasOneBarGroupPerPlacement) {
  PlanRequest r = small_request();
  r.set_model(gpt_model("m", 4, 256, 4, 1000, 128));
  r.config.data.seq_len = 128;
  auto rep = make_plan(r);
  ASSERT_TRUE(rep.is_ok());
  const std::string svg = plan_svg(*rep);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  size_t lines = 0;
  for (size_t at = svg.find("<line"); at != std::string::npos; at = svg.find("<line", at + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, rep->options.size());
  // Well-formed XML: every '<' opens a tag (no raw "<->" in text).
  for (size_t at = svg.find('<'); at != std::string::npos; at = svg.find('<', at + 1)) {
    const char c = svg[at + 1];
    EXPECT_TRUE(std::isalpha(static_cast<unsigned char>(c)) || c == '/' || c == '?')
        << svg.substr(at, 20);
  }
}

}  // namespace
// The model section the planner writes reads back to the shape it was written from, for any
// model.* key (here Llama 3.1's rope scaling and a Qwen2's biases), with the defaults left out.
TEST(Plan, ModelSectionReadsBackToItsShape) {
  ModelConfig m;
  m.type = "llama";
  m.n_layer = 3;
  m.n_head = 8;
  m.n_embd = 256;
  m.vocab_size = 1000;
  m.context = 512;
  m.num_key_value_heads = 2;
  m.intermediate_size = 704;
  m.attention_bias = true;
  m.tied_embeddings = false;
  m.rope_scaling.type = "llama3";
  m.rope_scaling.factor = 32;
  const std::string section = model_section_json(m);
  EXPECT_EQ(section.find("rms_norm_eps"), std::string::npos) << section;  // a default
  auto cfg = parse_config("{\"train_batch_size\": 1, \"model\": " + section + "}", "section");
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  auto a = create_architecture(m), b = create_architecture(cfg->model);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_EQ((*a)->shape_string(), (*b)->shape_string());
  EXPECT_EQ(cfg->model.rope_scaling.factor, 32.0);
}

}  // namespace strata
