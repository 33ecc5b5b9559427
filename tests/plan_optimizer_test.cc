// The planner's model of the optimizer pass (under backward, or deferred): the sub-groups
// its pipeline holds, the peaks of a step deferred to the next forward, the read-ahead during
// backward, the time terms of each schedule and the undo copies (the rest of the planner:
// tests/plan_test.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "src/model/architecture.h"
#include "src/plan/plan.h"
#include "src/tiers/memory_model.h"
#include "strata/config.h"
#include "tests/plan_util.h"

namespace strata {
namespace {

using test::small_request;
PlacementOption find(const std::string& name) { return test::find_placement(name); }

// The optimizer pipeline's sub-groups in host memory at once (OptimizerPipeline::advance):
// buffer_count read ahead, and those with writes in flight (at most 2 x buffer_count writes
// after a step, the new parameters' write queued after that bound).
TEST(Plan, PipelineSubGroupsHeldCountTheWritesInFlight) {
  // Master, moments and parameters on NVMe: 4 read + the stepped one's 2 writes + 6 more
  // writes of 3 each = 4 + 1 + 2.
  EXPECT_EQ(pipeline_sub_groups_held(4, 2, true), 7u);
  EXPECT_EQ(pipeline_sub_groups_held(4, 2, false), 8u);  // 4 + 1 + 6 / 2
  EXPECT_EQ(pipeline_sub_groups_held(1, 2, true), 2u);   // 1 read, the stepped one's 2 writes
  EXPECT_EQ(pipeline_sub_groups_held(4, 0, true), 0u);   // no NVMe optimizer state
}

// A 4-layer model of width 256 with fp32 moments in sub-groups of 65536 elements.
PlanRequest sub_group_request() {
  PlanRequest r = small_request();
  r.set_model(gpt_model("m", 4, 256, 4, 1000, 128));
  r.config.data.seq_len = 128;
  r.config.strata.moment_dtype = DType::kF32;
  r.config.zero.sub_group_size = 65536;
  return r;
}

// Every step deferred to the next forward (the overlap after a step that clipped): no undo
// state; the host holds the read-ahead under backward, and under the next forward the pass's
// reads and writes in flight with the new parameters' pieces. Hand-computed: sub-groups of
// 65536 elements, fp32 master + moments 786,432 bytes, bf16 pieces 131,072; buffer_count 4.
TEST(Plan, DeferredStepPeaksHoldNoUndoState) {
  PlanRequest r = sub_group_request();
  r.config.strata.optimizer_read_ahead = 0;  // the staging only (ReadAhead... below)
  ASSERT_EQ(r.config.zero.offload_optimizer.buffer_count, 4);
  ASSERT_TRUE(r.config.strata.optimizer_overlap && r.config.gradient_clipping > 0);
  auto o = evaluate_placement(r, find("params-nvme+opt-nvme"));
  ASSERT_TRUE(o.is_ok());
  EXPECT_GT(o->nvme.undo, 0u);
  EXPECT_EQ(o->nvme.peak, o->nvme.state + o->nvme.undo);
  EXPECT_EQ(o->nvme.peak_deferred, o->nvme.state);  // no shadow extents
  EXPECT_EQ(o->device.peak_deferred, o->device.peak);
  // One micro-batch: no landing buffers. Under the forward: the fetch ring (3 pieces), the
  // publish staging (buffer_count + 1 = 5 pieces) and 7 sub-groups (4 read, 3 writing); under
  // backward the fetch ring and the pipeline's whole staging read ahead (2 x 4 + 1 = 9
  // sub-groups, OptimizerPipeline::read_ahead_room), more.
  const uint64_t sub = 786'432, piece = 131'072;
  ASSERT_GT(3 * piece + 9 * sub, 3 * piece + 5 * piece + 7 * sub);
  EXPECT_EQ(o->host.peak_deferred, o->host.state + 3 * piece + 9 * sub);
  // Two, their backwards not grouped: under backward also the 2 landing buffers of a block's
  // gradients (3,162,112 bytes each); grouped, none (the parts are added on the device).
  r.config.gradient_accumulation_steps = 2;
  r.config.strata.grouped_backwards = false;
  auto a = evaluate_placement(r, find("params-nvme+opt-nvme"));
  ASSERT_TRUE(a.is_ok());
  EXPECT_EQ(a->host.peak_deferred, a->host.state + 3 * piece + 2 * 3'162'112 + 9 * sub);
  r.config.strata.grouped_backwards = true;
  auto ag = evaluate_placement(r, find("params-nvme+opt-nvme"));
  ASSERT_TRUE(ag.is_ok());
  EXPECT_EQ(ag->host.peak_deferred, ag->host.state + 3 * piece + 9 * sub);
  // Parameters in host memory, stepped in place: no pieces, no parameter writes: 8 sub-groups
  // under the forward, 9 read ahead under backward.
  r.config.gradient_accumulation_steps = 1;
  auto h = evaluate_placement(r, find("params-host+opt-nvme"));
  ASSERT_TRUE(h.is_ok());
  EXPECT_EQ(h->host.peak_deferred, h->host.state + 9 * sub);
}

// strata.optimizer.read_ahead: what the host budget leaves is read during backward, in whole
// sub-groups (the memory model's read_ahead_sub_groups(), as the engine sizes its arena): the
// deferred step reads that much less under the next forward, and the host holds it from
// backward into the pass; the reservation that decides fit is unchanged.
TEST(Plan, ReadAheadMovesStateReadsIntoBackwardAndCountsInThePeak) {
  PlanRequest r = sub_group_request();
  r.profile = default_profile(false);
  // Slow reads, and compute comparable to the disk's time: the deferred step is the part of
  // compute the pass cannot overlap plus the pass's own traffic.
  r.profile.nvme_read_gbps.value = 0.5;
  r.profile.gemm_flops.value = 2e10;
  const uint64_t sub = 786'432;  // a sub-group's master weights and moments
  // The read-ahead's unit: with its new (NVMe-homed) bf16 parameters' staging piece.
  const uint64_t unit = sub + 131'072;
  r.config.strata.optimizer_read_ahead = 0;
  auto o0 = evaluate_placement(r, find("params-nvme+opt-nvme"));
  ASSERT_TRUE(o0.is_ok());
  EXPECT_EQ(o0->host.read_ahead, 0u);
  r.config.strata.optimizer_read_ahead = 3 * unit + 1;
  auto o3 = evaluate_placement(r, find("params-nvme+opt-nvme"));
  ASSERT_TRUE(o3.is_ok());
  EXPECT_EQ(o3->host.read_ahead, 3 * unit);
  EXPECT_EQ(o3->host.peak_deferred, o0->host.peak_deferred + 3 * unit);
  EXPECT_EQ(o3->host.total(), o0->host.total());
  ASSERT_GT(o0->time.step_deferred_s, o0->time.nvme_s);
  // Three more sub-groups read before the pass: their reads leave the pass (in the planner's
  // per-module average sub-group, at most the largest one's bytes).
  const double saved = o0->time.step_deferred_s - o3->time.step_deferred_s;
  EXPECT_GT(saved, 0.8 * 3 * double(sub) / 0.5e9);
  EXPECT_LE(saved, 3 * double(sub) / 0.5e9 + 1e-12);
  r.config.strata.optimizer_read_ahead = SIZE_MAX;  // auto: the small model's whole state
  auto oa = evaluate_placement(r, find("params-nvme+opt-nvme"));
  ASSERT_TRUE(oa.is_ok());
  EXPECT_GT(oa->host.read_ahead, 3 * unit);
  EXPECT_EQ(oa->host.read_ahead % unit, 0u);
  EXPECT_LT(oa->time.step_deferred_s, o3->time.step_deferred_s);
}

TEST(Plan, TimeTermsAreBytesOverRates) {
  PlanRequest r = small_request();
  r.set_model(gpt_model("m", 4, 256, 4, 1000, 128));
  r.config.data.seq_len = 128;
  r.config.gradient_accumulation_steps = 3;
  r.profile = default_profile(false);
  r.profile.gemm_flops.value = 1e12;
  r.profile.optimizer_pps.value = 1e8;
  r.profile.nvme_read_gbps.value = 2.0;
  r.profile.nvme_write_gbps.value = 1.0;
  r.config.strata.optimizer_read_ahead = 0;  // the staging only: 2 x buffer_count + 1
  r.config.zero.offload_optimizer.buffer_count =
      1;  // the optimizer reads ahead 3 sub-groups: the final norm (2C params) and 2 blocks
  r.config.gradient_clipping = 0;  // no clipping, no fp16: no undo copies (see UndoCopies below)
  auto o = evaluate_placement(r, find("opt-nvme"));
  ASSERT_TRUE(o.is_ok());
  const double P = double(model_params(r.config.model));
  // 3 micro-batches x 128 tokens x 3 x (2 x (12 C^2 L + Vp C) + 4 T C L), Vp = 1024.
  const double C = 256, fwd = 2 * (12 * C * C * 4 + 1024 * C) + 4 * 128 * C * 4;
  EXPECT_NEAR(o->time.compute_s, 3 * 128 * 3 * fwd / 1e12, 1e-9);
  EXPECT_NEAR(o->time.cpu_optim_s, P / 1e8, 1e-9);
  // Optimizer state on NVMe: 12 B/param read at 2 GB/s and written at 1 GB/s.
  // NVMe moves whole 4 KiB blocks: each module's master weights (4 B/param), moments (8) and
  // gradient accumulator (4) are an extent each (one sub-group a module here): S and G bytes.
  const double block = 12 * C * C + 13 * C;  // 789,760
  const std::vector<double> modules = {(1024 + 128) * C, block, block, block, block, 2 * C};
  auto blocks = [](double bytes) { return std::ceil(bytes / 4096) * 4096; };
  auto state = [&](double n) { return blocks(4 * n) + blocks(8 * n); };
  double S = 0, G = 0;
  for (double n : modules) {
    S += state(n);
    G += blocks(4 * n);
  }
  EXPECT_NEAR(S, 12 * P, 64 * 1024);
  EXPECT_NEAR(o->time.nvme_s, S / 2e9 + S / 1e9, 1e-9);
  // GPU, optimizer under backward (default): it starts with the last micro-batch's backward,
  // 7/9 of compute in (3 micro-batches of fwd 1 + bwd 2); its NVMe traffic from then on is the
  // state's reads less the final norm and the last 2 blocks read ahead, and its writes.
  const double window = (S - state(2 * C) - 2 * state(block)) / 2e9 + S / 1e9;
  EXPECT_NEAR(
      o->time.step_s,
      std::max({o->time.compute_s, o->time.link_s,
                o->time.compute_s * 7 / 9 + std::max(o->time.cpu_optim_s, window), o->time.nvme_s}),
      1e-9);
  EXPECT_DOUBLE_EQ(o->time.hidden_share, 1.0);
  EXPECT_EQ(o->time.bottleneck, "nvme");
  // Nothing can make a step fall back to stepping after backward without clipping or fp16.
  EXPECT_EQ(o->time.step_after_s, o->time.step_s);
  {  // With clipping, a step after a clipped one reads ahead under backward (in module order:
     // the embedding, (Vp + T) C params, and the first 2 blocks) and is deferred to the next
     // forward, which it overlaps for the first micro-batch's forward: 1/9 of compute.
    PlanRequest rc = r;
    rc.config.gradient_clipping = 1.0;
    rc.config.strata.grouped_forwards = 1;  // one micro-batch's forward at a time (below: 3)
    auto q = evaluate_placement(rc, find("opt-nvme"));
    ASSERT_TRUE(q.is_ok());
    const double dev = std::max(q->time.compute_s, q->time.link_s);
    const double ahead = state((1024 + 128) * C) + 2 * state(block);
    const double window_deferred = (S - ahead) / 2e9 + S / 1e9;
    EXPECT_NEAR(q->time.step_deferred_s,
                std::max(dev * 8 / 9 + std::max({q->time.cpu_optim_s, window_deferred, dev / 9}),
                         q->time.nvme_s),
                1e-9);
    {  // Gradients accumulated on NVMe: the deferred pass also reads each (fp32) once. A
       // slower GEMM makes that window the step's binding term (not the step's NVMe total).
      PlacementOption g = find("opt-nvme");
      g.where.grads = Tier::kNvme;
      PlanRequest rg = rc;
      rg.profile.gemm_flops.value = 4e10;
      auto qg = evaluate_placement(rg, g);
      ASSERT_TRUE(qg.is_ok());
      const double dg = std::max(qg->time.compute_s, qg->time.link_s);
      const double wg = window_deferred + G / 2e9;
      ASSERT_GT(wg, std::max(qg->time.cpu_optim_s, dg / 9));
      ASSERT_GT(dg * 8 / 9 + wg, qg->time.nvme_s);
      EXPECT_NEAR(qg->time.step_deferred_s, dg * 8 / 9 + wg, 1e-9);
      // The pass's bytes, exported for tests/bench/bench_step_bound.sh to put fio's rate on: the
      // state's reads less the read-ahead's and the gradients' reads; the state's writes (after
      // backward, less the last sub-group's, which drains behind).
      EXPECT_NEAR(double(qg->deferred_pass.read), (S - ahead) + G, 1.0);
      EXPECT_NEAR(double(qg->deferred_pass.write), S, 1.0);
      EXPECT_NEAR(double(qg->after_backward_pass.read), (S - ahead) + G, 1.0);
      EXPECT_NEAR(double(qg->after_backward_pass.write), S * 5 / 6, 1.0);
      EXPECT_DOUBLE_EQ(qg->first_forward_share, 1.0 / 9);
      EXPECT_EQ(qg->forward_group, 1);
      // The three micro-batches' forwards grouped (strata.grouped_forwards auto: the 1 GiB
      // device holds their activations and every parameter): the pass overlaps all three,
      // 3/9 of compute; the bytes do not change.
      PlanRequest rk = rg;
      rk.config.strata.grouped_forwards = 0;
      auto qk = evaluate_placement(rk, g);
      ASSERT_TRUE(qk.is_ok());
      EXPECT_EQ(qk->forward_group, 3);
      EXPECT_DOUBLE_EQ(qk->first_forward_share, 3.0 / 9);
      EXPECT_EQ(qk->deferred_pass.read, qg->deferred_pass.read);
      EXPECT_EQ(qk->deferred_pass.write, qg->deferred_pass.write);
      // The device holds one whole activation set and, for each further micro-batch, only
      // what its forward keeps to its backward (the head's and the gradients' buffers shared).
      auto arch = create_architecture(rk.config.model);
      ASSERT_TRUE(arch.is_ok());
      const ActivationSizes a =
          (*arch)->activation_plan(rk.micro_batch(), rk.seq(), rk.dtype(), rk.activations());
      EXPECT_EQ(qg->device.activations, a.bytes);
      EXPECT_EQ(qk->device.activations, a.bytes + 2 * a.slot_bytes);
      EXPECT_GT(a.slot_bytes, 0u);
      EXPECT_LT(a.slot_bytes, a.bytes);
      EXPECT_NEAR(
          qk->time.step_deferred_s,
          std::max(dg * 6 / 9 + std::max({qk->time.cpu_optim_s, wg, dg * 3 / 9}), qk->time.nvme_s),
          1e-9);
      EXPECT_LT(qk->time.step_deferred_s, qg->time.step_deferred_s);
      // ... and their backwards (strata.grouped_backwards, the default): the gradients on NVMe
      // are written once a step instead of three times, and read by the optimizer alone (not
      // by the second and third micro-batches' accumulations first): 2 x 4P fewer bytes each
      // way; the device holds the further micro-batches' gradient parts. Without it, the
      // one-at-a-time bytes.
      PlanRequest rf = rk;
      rf.config.strata.grouped_backwards = false;
      auto qf = evaluate_placement(rf, g);
      ASSERT_TRUE(qf.is_ok());
      EXPECT_EQ(qf->forward_group, 3);
      EXPECT_TRUE(qk->backward_grouped);
      EXPECT_FALSE(qf->backward_grouped);
      EXPECT_EQ(qf->nvme_write_bytes, qg->nvme_write_bytes);
      EXPECT_EQ(qf->nvme_read_bytes, qg->nvme_read_bytes);
      EXPECT_NEAR(double(qg->nvme_write_bytes - qk->nvme_write_bytes), 8 * P, 64 * 1024);
      EXPECT_NEAR(double(qg->nvme_read_bytes - qk->nvme_read_bytes), 8 * P, 64 * 1024);
      EXPECT_GT(qk->device.buffers, qf->device.buffers);
    }
    // Stepped after backward instead: the state read ahead under backward (the embedding's,
    // the first 2 blocks') is stepped first, the pass waits for the rest's reads and for its
    // writes but the last buffer_count sub-groups' (1 of the 6 modules' single sub-groups:
    // embedding, 4 blocks, final norm), which drain behind, within the step's NVMe time.
    // strata.optimizer.defer "auto" (the default) is predicted to keep the faster of the two,
    // as the trainer does; "always" and "never" run the one they name.
    const double window_after = (S - ahead) / 2e9 + S * (5.0 / 6) / 1e9;
    EXPECT_NEAR(q->time.step_plain_s,
                std::max(dev + std::max(q->time.cpu_optim_s, window_after), q->time.nvme_s), 1e-9);
    EXPECT_LT(q->time.step_plain_s, dev + std::max(q->time.cpu_optim_s, q->time.nvme_s));
    EXPECT_EQ(q->time.clipped_deferred, q->time.step_deferred_s <= q->time.step_plain_s);
    EXPECT_EQ(q->time.step_after_s, std::min(q->time.step_deferred_s, q->time.step_plain_s));
    for (const std::string mode : {"always", "never"}) {
      rc.config.strata.optimizer_defer = mode;
      auto m = evaluate_placement(rc, find("opt-nvme"));
      ASSERT_TRUE(m.is_ok());
      EXPECT_EQ(m->time.clipped_deferred, mode == "always") << mode;
      EXPECT_EQ(m->time.step_after_s,
                mode == "always" ? m->time.step_deferred_s : m->time.step_plain_s)
          << mode;
    }
  }
  // Plain schedule: the optimizer phase (max of CPU Adam and its NVMe) follows backward.
  r.config.strata.optimizer_overlap = false;
  auto p = evaluate_placement(r, find("opt-nvme"));
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(p->deferred_pass.read + p->deferred_pass.write, 0u);  // no pass to wait on
  EXPECT_NEAR(
      p->time.step_s,
      std::max(p->time.compute_s, p->time.link_s) + std::max(p->time.cpu_optim_s, p->time.nvme_s),
      1e-9);
  EXPECT_GT(p->time.step_s, o->time.step_s);
  // CPU backend: compute, copies and CPU Adam share the cores; NVMe runs under the whole step
  // (and the optimizer's share of it after the last backward starts) when overlapped, only
  // under the optimizer pass when not.
  r.profile.cpu_backend = true;
  auto c = evaluate_placement(r, find("opt-nvme"));
  ASSERT_TRUE(c.is_ok());
  const auto& t = c->time;
  EXPECT_NEAR(t.step_s,
              t.compute_s + t.link_s + std::max(t.cpu_optim_s, t.nvme_s) + t.collectives_s, 1e-9);
  r.config.strata.optimizer_overlap = true;
  auto co = evaluate_placement(r, find("opt-nvme"));
  ASSERT_TRUE(co.is_ok());
  const auto& u = co->time;
  EXPECT_NEAR(u.step_s,
              std::max({u.compute_s + u.link_s + u.cpu_optim_s + u.collectives_s,
                        (u.compute_s + u.link_s) * 7 / 9 + window, u.nvme_s}),
              1e-9);
}

// The optimizer under backward with clipping keeps an undo copy of every module's master +
// moments in the host tier: in the peak (not the reservation), hand-computed here; when the
// host budget has room for only part of them, that share of the optimizer is hidden.
TEST(Plan, UndoCopiesAreInTheHostPeakAndLimitTheHiddenShare) {
  PlanRequest r = small_request();
  r.set_model(
      gpt_model("m", 4, 256, 4, 1000, 128));  // embedding 1024x256 + 128x256, blocks 789,760
  r.config.data.seq_len = 128;
  r.config.strata.moment_dtype = DType::kF32;
  r.hw.gpu_mem = uint64_t{1} << 30;
  r.hw.host_mem = uint64_t{8} << 30;
  r.profile = default_profile(false);  // a GPU, where the overlap pays: with a slow CPU Adam
  r.profile.optimizer_pps.value = 2e7;
  // Sub-groups (and the parameters' staging pieces) that the budgets below do not shrink.
  r.config.zero.sub_group_size = 65536;
  {  // and a GEMM rate at which compute takes as long as the CPU Adam
    auto f = evaluate_placement(r, find("opt-host"));
    ASSERT_TRUE(f.is_ok());
    r.profile.gemm_flops.value = double(f->flops) / (double(model_params(r.config.model)) / 2e7);
  }
  ASSERT_TRUE(r.config.strata.optimizer_overlap &&
              r.config.gradient_clipping > 0);  // the defaults: clipping at 1.0
  auto o = evaluate_placement(r, find("opt-host"));
  ASSERT_TRUE(o.is_ok());
  // Per module, 4 KiB-rounded master (4 B/param) + moments (8 B/param): embedding 294,912
  // params: 1,179,648 + 2,359,296; each block 789,760: 3,162,112 + 6,320,128; final norm 512:
  // 4,096 + 4,096.
  const uint64_t undo = 1'179'648 + 2'359'296 + 4 * (3'162'112 + 6'320'128) + 8'192;
  EXPECT_EQ(o->host.undo, undo);
  EXPECT_EQ(o->host.total(), o->host.state + o->host.buffers);  // not in the reservation
  // At the end of the speculative pass: the host homes (master, moments, grads) + the copies.
  EXPECT_EQ(o->host.peak, o->host.state + undo);
  EXPECT_DOUBLE_EQ(o->time.hidden_share, 1.0);

  // Room for half of them: half the optimizer runs under backward, half after it.
  r.hw.host_mem = o->host.total() + undo / 2;
  auto h = evaluate_placement(r, find("opt-host"));
  ASSERT_TRUE(h.is_ok());
  EXPECT_EQ(h->host.undo, undo / 2);
  EXPECT_NEAR(h->time.hidden_share, 0.5, 1e-6);
  r.config.strata.optimizer_overlap = false;
  auto plain = evaluate_placement(r, find("opt-host"));
  r.config.strata.optimizer_overlap = true;
  r.hw.host_mem = uint64_t{8} << 30;
  auto full = evaluate_placement(r, find("opt-host"));
  ASSERT_TRUE(plain.is_ok() && full.is_ok());
  EXPECT_EQ(plain->host.undo, 0u);
  EXPECT_GT(h->time.step_s, full->time.step_s);
  EXPECT_LT(h->time.step_s, plain->time.step_s);

  // No clipping and no fp16: no copies.
  r.config.gradient_clipping = 0;
  auto n = evaluate_placement(r, find("opt-host"));
  ASSERT_TRUE(n.is_ok());
  EXPECT_EQ(n->host.undo, 0u);
  EXPECT_LT(n->host.peak, o->host.peak);
}

}  // namespace
}  // namespace strata
