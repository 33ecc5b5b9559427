// The planner on a simulated fast device (device.simulate, MachineProfile::simulated): compute
// at the preset's rates by its kernels' rule, the host's rates for the rest; the schedule the
// run picks and its step (TimeTerms::expected_s); the optimizer ratio it recommends
// (advise_optimizer_ratio). Deterministic arithmetic on fixed profiles: no timing.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "src/plan/plan.h"
#include "strata/config.h"
#include "strata/device.h"
#include "tests/plan_util.h"

namespace strata {
namespace {

using test::find_placement;

// The host: the CPU backend's defaults with a 1 Gparam/s optimizer and 20 GB/s copies.
MachineProfile host_profile() {
  MachineProfile p = default_profile(true);
  p.optimizer_pps = {1.0e9, "test"};
  p.host_copy_gbps = {20.0, "test"};
  return p;
}

// GPT-2 124M's shape (vocabulary 50304, a multiple of 64: no padding), 8 x 1024 tokens, two
// micro-batches, on a simulated H200 with clipping at 1.0 and the simulated norm `norm`.
PlanRequest gpt2_request(double norm) {
  Config c = plan_default_config();
  c.model = gpt_model("gpt2", 12, 768, 12, 50304, 1024).shape;
  c.train_micro_batch_size_per_gpu = 8;
  c.gradient_accumulation_steps = 2;
  c.data.seq_len = 1024;
  c.gradient_clipping = 1.0;
  c.device.backend = "cpu";
  c.device.simulate = "h200";
  c.device.simulate_grad_norm = norm;
  Hardware hw;
  hw.gpu_mem = uint64_t{140} << 30;
  hw.host_mem = uint64_t{64} << 30;
  return request_from_config(c, hw, host_profile());
}

// The optimizer ratio advice for the request's opt-host placement.
RatioAdvice opt_host_advice(const PlanRequest& req) {
  auto rep = make_plan(req);
  EXPECT_TRUE(rep.is_ok());
  if (!rep.is_ok()) return {};
  auto asked = add_placement(*rep, find_placement("opt-host"));
  EXPECT_TRUE(asked.is_ok());
  if (!asked.is_ok()) return {};
  EXPECT_TRUE(advise_optimizer_ratio(*rep, *asked).is_ok());
  const RatioAdvice* a = rep->advice_for(*asked);
  EXPECT_NE(a, nullptr);
  return a ? *a : RatioAdvice{};
}

TEST(PlanSimulated, ProfileTakesThePresetsRatesAndTheHostsOptimizer) {
  const PlanRequest r = gpt2_request(0.5);
  auto sim = simulated_device_preset("h200");
  ASSERT_TRUE(sim.is_ok());
  const MachineProfile& p = r.profile;
  EXPECT_TRUE(p.simulated);
  EXPECT_FALSE(p.cpu_backend) << "the simulated device is not host-addressable";
  EXPECT_EQ(p.gemm_flops.value, sim->gemm_tflops * 1e12);
  EXPECT_EQ(p.device_mem_gbps.value, sim->hbm_gbps);
  EXPECT_EQ(p.link_gbps.value, 20.0) << "the host's copies, slower than the preset's link";
  EXPECT_EQ(p.optimizer_pps.value, 1.0e9);
  // A device.simulate_* key changes the rate the planner divides by, as it does the kernels'.
  Config c = r.config;
  c.device.simulate_gemm_tflops = 100;
  c.device.simulate_link_gbps = 5;
  const PlanRequest r2 = request_from_config(c, r.hw, host_profile());
  EXPECT_EQ(r2.profile.gemm_flops.value, 100e12);
  EXPECT_EQ(r2.profile.link_gbps.value, 5.0);
}

// The simulated device's copies are each one memcpy by its stream's thread: where the profile
// measured one thread's copy (host.copy_one_thread_gbps) the link is that, when slower than the
// preset's, not the all-threads copy rate.
TEST(PlanSimulated, TheLinkIsOneThreadsCopy) {
  Config c = gpt2_request(0.5).config;
  MachineProfile host = host_profile();
  host.stream_copy_gbps = {7.0, "test"};
  const PlanRequest r = request_from_config(c, Hardware{}, host);
  EXPECT_EQ(r.profile.link_gbps.value, 7.0);
  EXPECT_EQ(r.profile.host_copy_gbps.value, 20.0) << "the undo copies keep the host's rate";
  host.stream_copy_gbps = {80.0, "test"};
  EXPECT_EQ(request_from_config(c, Hardware{}, host).profile.link_gbps.value, 55.0)
      << "the preset's link, slower than the copy";
}

// Compute: every kernel of the step as the simulated device charges it. With the HBM taken
// as unbounded and no launch time, that is GPT-2's GEMMs (24 C^2 per layer and token, 2 V C for
// the head; forward, and twice that backward) at 580 TFLOP/s and causal attention (half of
// 4 T C per layer and token) forward at 250 TFLOP/s and 2.5 times that backward at 180; each
// kernel's launch adds launch_us; the elementwise kernels' bytes add the rest.
TEST(PlanSimulated, ComputeIsTheKernelsModeledTime) {
  PlanRequest r = gpt2_request(0.5);
  const Config base = r.config;
  Config c = base;
  c.device.simulate_hbm_gbps = 1e15;
  c.device.simulate_launch_us = 0;
  r = request_from_config(c, r.hw, host_profile());
  auto o = evaluate_placement(r, find_placement("opt-host"));
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  const double C = 768, L = 12, V = 50304, T = 1024, tokens = 8 * 1024 * 2;
  const double gemm = 3.0 * (24.0 * C * C * L + 2.0 * V * C) * tokens / 580e12;
  const double causal = 4.0 * T * C * L / 2.0 * tokens;
  const double attention = causal / 250e12 + 2.5 * causal / 180e12;
  // (and the losses' copy to the host, 32 KiB a micro-batch over the link, in the stream's order)
  const double losses = tokens * 4 / 55e9;
  EXPECT_NEAR(o->time.compute_s, gemm + attention + losses, 1e-6 * (gemm + attention));
  // Per micro-batch and layer at least the forward's norm, 4 GEMMs, attention, residual add +
  // norm and residual add (8), and the backward's 4 GEMMs, attention and 2 norms (7); the same
  // kernels at any rate.
  const uint64_t kernels = o->time.device_kernels;
  EXPECT_GE(kernels, 2u * (12u * 15u));
  c.device.simulate_launch_us = 4;
  auto launched =
      evaluate_placement(request_from_config(c, r.hw, host_profile()), find_placement("opt-host"));
  ASSERT_TRUE(launched.is_ok());
  EXPECT_EQ(launched->time.device_kernels, kernels);
  EXPECT_NEAR(launched->time.compute_s - o->time.compute_s, double(kernels) * 4e-6, 1e-9);
  // The preset's HBM: the elementwise kernels' bytes take time of their own.
  auto preset = evaluate_placement(request_from_config(base, r.hw, host_profile()),
                                   find_placement("opt-host"));
  ASSERT_TRUE(preset.is_ok());
  EXPECT_GT(preset->time.compute_s, launched->time.compute_s + 1e-3);
  // The CPU optimizer at the host's rate: every parameter (the wte head tied).
  const double params = 12.0 * (12 * C * C + 13 * C) + V * C + T * C + 2 * C;
  EXPECT_NEAR(o->time.cpu_optim_s, params / 1e9, 1e-3 * params / 1e9);
}

TEST(PlanSimulated, ExpectedStepIsTheScheduleTheRunPicks) {
  // Under the threshold: speculated under backward ("always"), or as a clipped step ("never").
  PlanRequest r = gpt2_request(0.5);
  r.config.strata.optimizer_speculate = "always";
  auto under = evaluate_placement(r, find_placement("opt-host"));
  ASSERT_TRUE(under.is_ok());
  EXPECT_EQ(under->time.schedule, "under backward");
  EXPECT_EQ(under->time.expected_s, under->time.step_s);
  // The simulated copies are the host's memcpys: under backward the gradients' drains (two
  // thirds of the link's bytes; the new parameters cross beside the optimizer's steps) share
  // the host with the optimizer (a GPU's DMA would not) until every gradient is final.
  EXPECT_GE(under->time.step_s, std::max(under->time.cpu_optim_s, under->time.link_s * 2.0 / 3.0));
  PlanRequest gpu = r;
  gpu.profile.simulated = false;
  gpu.config.strata.optimizer_speculate = "always";
  auto dma = evaluate_placement(gpu, find_placement("opt-host"));
  ASSERT_TRUE(dma.is_ok());
  EXPECT_LT(dma->time.step_s, under->time.step_s);
  r.config.strata.optimizer_speculate = "never";
  r.config.strata.optimizer_defer = "always";
  auto deferred = evaluate_placement(r, find_placement("opt-host"));
  ASSERT_TRUE(deferred.is_ok());
  EXPECT_EQ(deferred->time.schedule, "next forward");
  EXPECT_EQ(deferred->time.expected_s, deferred->time.step_deferred_s);
  // The deferred pass hides under the first forwards' compute, never under the backward's
  // gradient drains (here, at 7 GB/s, longer than the compute).
  PlanRequest slow_copies = r;
  slow_copies.profile.link_gbps = {7.0, "test"};
  auto d7 = evaluate_placement(slow_copies, find_placement("opt-host"));
  ASSERT_TRUE(d7.is_ok());
  ASSERT_GT(d7->time.link_s * 2.0 / 3.0, d7->time.compute_s);
  EXPECT_GE(d7->time.step_deferred_s, d7->time.link_s * 2.0 / 3.0 + d7->time.cpu_optim_s);
  // "auto": the faster of the two.
  r.config.strata.optimizer_speculate = "auto";
  auto chosen = evaluate_placement(r, find_placement("opt-host"));
  ASSERT_TRUE(chosen.is_ok());
  EXPECT_EQ(chosen->time.expected_s, std::min(chosen->time.step_s, chosen->time.step_after_s));
  // Over it every step clips: after backward with defer "never", whatever speculate says.
  PlanRequest over = gpt2_request(3.0);
  over.config.strata.optimizer_speculate = "always";
  over.config.strata.optimizer_defer = "never";
  auto clipped = evaluate_placement(over, find_placement("opt-host"));
  ASSERT_TRUE(clipped.is_ok());
  EXPECT_EQ(clipped->time.schedule, "after backward");
  EXPECT_EQ(clipped->time.expected_s, clipped->time.step_plain_s);
  // The overlap off: the plain schedule, the optimizer after the compute.
  over.config.strata.optimizer_overlap = false;
  auto plain = evaluate_placement(over, find_placement("opt-host"));
  ASSERT_TRUE(plain.is_ok());
  EXPECT_EQ(plain->time.schedule, "plain");
  EXPECT_GT(plain->time.expected_s, plain->time.compute_s + plain->time.cpu_optim_s - 1e-12);
}

// The report says where a step that does not clip runs (strata.optimizer.speculate) beside a
// step that clips: "auto" the faster of the two as expected, "never" as a clipped step; no such
// line where every step clips (the simulated norm over the threshold).
TEST(PlanSimulated, TheReportSaysWhereAStepThatDidNotClipRuns) {
  auto notes = [](PlanRequest r, const std::string& speculate) {
    r.config.strata.optimizer_speculate = speculate;
    auto rep = make_plan(r);
    EXPECT_TRUE(rep.is_ok());
    if (!rep.is_ok()) return std::string();
    auto k = add_placement(*rep, find_placement("opt-host"));
    EXPECT_TRUE(k.is_ok());
    return k.is_ok() ? schedule_notes(*rep, rep->options[size_t(*k)]) : std::string();
  };
  const std::string line = "a step after one that did not clip: ";
  const std::string a = notes(gpt2_request(0.5), "auto");
  EXPECT_NE(a.find(line), std::string::npos) << a;
  EXPECT_NE(a.find("speculate auto times both on the run's first such steps and keeps the "
                   "faster: expected "),
            std::string::npos)
      << a;
  const std::string n = notes(gpt2_request(0.5), "never");
  EXPECT_NE(n.find("speculate never runs it as one that clipped"), std::string::npos) << n;
  const std::string o = notes(gpt2_request(3.0), "auto");
  EXPECT_NE(o.find("a step after one that clipped"), std::string::npos) << o;
  EXPECT_EQ(o.find(line), std::string::npos) << "every step clips: " << o;
}

// Under backward the modules are stepped by the thread that launches the kernels, between its
// launches: at the optimizer's rate with one thread fewer (optimizer_pps_beside). A slower rate
// there lengthens that schedule alone, and the ratio the planner recommends keeps as much or
// more of the optimizer on the device.
TEST(PlanSimulated, TheOptimizerUnderBackwardRunsAtItsRateBesideTheLauncher) {
  PlanRequest r = gpt2_request(0.5);
  r.config.strata.optimizer_speculate = "always";
  r.config.gradient_clipping = 0;  // no undo state: speculated throughout
  PlanRequest slow = r;
  slow.profile.optimizer_pps_beside = 0.5e9;  // half the rate alone
  auto a = evaluate_placement(r, find_placement("opt-host"));
  auto b = evaluate_placement(slow, find_placement("opt-host"));
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_NEAR(b->time.step_s - a->time.step_s, a->time.cpu_optim_s, 1e-9)
      << "under backward the optimizer takes twice its time alone";
  EXPECT_EQ(b->time.step_plain_s, a->time.step_plain_s);
  EXPECT_LE(opt_host_advice(slow).ratio, opt_host_advice(r).ratio);
}

// The rate a run measured beside the device (`strata plan --cpu-optimizer-rate`) replaces the
// rate beside the launcher and scales the rate alone alike; a slower one plans a longer step at
// ratio 1 and keeps as much or more of the optimizer on the device.
TEST(PlanSimulated, TheMeasuredRateBesideTheDeviceReplacesTheProbes) {
  PlanRequest r = gpt2_request(0.5);
  r.profile.optimizer_pps_beside = 0.8e9;
  PlanRequest slow = r;
  set_cpu_optimizer_rate(&slow.profile, 0.4e9, "--cpu-optimizer-rate");
  EXPECT_EQ(slow.profile.optimizer_pps_beside, 0.4e9);
  EXPECT_DOUBLE_EQ(slow.profile.optimizer_pps.value, 0.5e9) << "alone: scaled as beside";
  EXPECT_NE(slow.profile.optimizer_pps.source.find("--cpu-optimizer-rate"), std::string::npos);
  auto a = evaluate_placement(r, find_placement("opt-host"));
  auto b = evaluate_placement(slow, find_placement("opt-host"));
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_GT(b->time.step_s, a->time.step_s);
  EXPECT_LE(opt_host_advice(slow).ratio, opt_host_advice(r).ratio);
  // A profile without per-thread rates: the rate given is the optimizer's one rate.
  PlanRequest flat = gpt2_request(0.5);
  flat.profile.optimizer_pps_beside = 0;
  set_cpu_optimizer_rate(&flat.profile, 0.25e9, "--cpu-optimizer-rate");
  EXPECT_DOUBLE_EQ(flat.profile.optimizer_pps.value, 0.25e9);
  EXPECT_EQ(flat.profile.optimizer_pps_beside, 0);
}

// A deferred pass (every step clips) runs beside the forwards' launches and the host's copies
// for as long as the first forward group's compute lasts: through that window at the
// optimizer's rate beside the launcher, after it at its own. Halving the rate beside slows a
// pass longer than the window (ratio 1) by half the window, a shorter one by no more. On a GPU
// the thread that launches the kernels and waits for them holds its core the whole step, so
// the whole pass steps beside it: halving the rate slows a pass longer than the window by its
// time alone, a shorter one by no more.
TEST(PlanSimulated, ADeferredPassStepsBesideTheLauncherThroughTheForwards) {
  PlanRequest r = gpt2_request(3.0);
  r.config.strata.optimizer_defer = "always";
  r.profile.optimizer_pps_beside = r.profile.optimizer_pps.value;
  PlanRequest slow = r;
  slow.profile.optimizer_pps_beside = 0.5 * r.profile.optimizer_pps.value;
  for (bool simulated : {true, false})
    for (double ratio : {1.0, 0.2}) {
      SCOPED_TRACE("ratio " + std::to_string(ratio) + (simulated ? ", simulated" : ", a GPU"));
      PlacementOption where = find_placement("opt-host");
      where.where.optimizer_ratio = ratio;
      r.profile.simulated = slow.profile.simulated = simulated;
      auto a = evaluate_placement(r, where);
      auto b = evaluate_placement(slow, where);
      ASSERT_TRUE(a.is_ok() && b.is_ok());
      const double window = (a->time.compute_s + a->time.device_optim_s) * a->first_forward_share;
      const double pass = b->time.step_deferred_s - a->time.step_deferred_s;
      if (!simulated && ratio == 1.0) {
        EXPECT_NEAR(pass, a->time.cpu_optim_s, 1e-9) << "the whole pass at half its rate";
      } else if (!simulated) {
        EXPECT_GE(pass, 0.0);
        EXPECT_LE(pass, a->time.cpu_optim_s + 1e-9);
      } else if (ratio == 1.0) {
        EXPECT_NEAR(pass, 0.5 * window, 1e-9) << "a pass longer than the window";
      } else {
        EXPECT_GE(pass, 0.0);
        EXPECT_LE(pass, 0.5 * window + 1e-9);
      }
      EXPECT_EQ(b->time.step_plain_s, a->time.step_plain_s);
    }
}

// With undo state in host memory (clipping on) the speculation stops once every gradient is
// final and the modules left are stepped after backward; on a simulated device the host's copies
// (memcpys: the drains, then each module's new parameters after its step) keep a core busy
// beside the optimizer to the pass's end all the same, so it steps at its rate beside the
// launcher throughout: halving that rate costs the optimizer's time alone, as without undo
// state.
TEST(PlanSimulated, UnderBackwardTheCopiesKeepTheOptimizerBesideTheLauncherToTheEnd) {
  PlanRequest r = gpt2_request(0.5);
  r.config.strata.optimizer_speculate = "always";
  PlanRequest slow = r;
  slow.profile.optimizer_pps_beside = 0.5e9;  // half the rate alone
  auto a = evaluate_placement(r, find_placement("opt-host"));
  auto b = evaluate_placement(slow, find_placement("opt-host"));
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  ASSERT_EQ(a->time.schedule, "under backward");
  // (At the rate alone the stopped pass's own model is a little longer than the floor.)
  EXPECT_GT(b->time.step_s - a->time.step_s, 0.9 * a->time.cpu_optim_s);
  EXPECT_LE(b->time.step_s - a->time.step_s, a->time.cpu_optim_s + 1e-9);
  // Without undo state: the same.
  r.config.gradient_clipping = slow.config.gradient_clipping = 0;
  auto c = evaluate_placement(r, find_placement("opt-host"));
  auto d = evaluate_placement(slow, find_placement("opt-host"));
  ASSERT_TRUE(c.is_ok() && d.is_ok());
  EXPECT_NEAR(d->time.step_s - c->time.step_s, c->time.cpu_optim_s, 1e-9);
}

// Parameters in host RAM, the whole optimizer on the device (ratio 0): the device's optimizer
// copies the new parameters down into their home on the d2h stream without the host waiting,
// beside the compute (src/tiers/device_optimizer.cc), so a step with the copies shorter than the
// compute takes the compute, whichever schedule; the same copies of a host-stepped share follow
// its steps.
TEST(PlanSimulated, TheDevicesOptimizerCopiesDownBesideTheCompute) {
  for (double norm : {0.5, 3.0}) {
    SCOPED_TRACE(norm);
    PlanRequest r = gpt2_request(norm);
    // Copies at 10 GB/s: the new parameters' (249 MB) longer than the first forward's share of
    // the compute and than the compute after backward's first modules, shorter than all of it.
    r.profile.host_copy_gbps = {10.0, "test"};
    r.profile.link_gbps = {10.0, "test"};
    PlacementOption where = find_placement("params-host");
    where.where.optimizer_ratio = 0.0;
    auto o = evaluate_placement(r, where);
    ASSERT_TRUE(o.is_ok()) << o.status().to_string();
    const TimeTerms& t = o->time;
    ASSERT_GT(t.link_s, 0.0) << "the new parameters cross the link";
    ASSERT_LT(t.link_s, t.compute_s) << "the test wants copies shorter than the compute";
    EXPECT_EQ(t.cpu_optim_s, 0.0);
    const double dev = t.compute_s + t.device_optim_s;
    EXPECT_NEAR(t.expected_s, dev, 1e-9) << t.schedule;
    // At ratio 1 the host steps everything and its copies follow its steps.
    where.where.optimizer_ratio = 1.0;
    auto host = evaluate_placement(r, where);
    ASSERT_TRUE(host.is_ok());
    EXPECT_GT(host->time.expected_s, host->time.cpu_optim_s);
  }
}

// The host's optimizer publishes each module's new parameters on the h2d stream while it steps
// the next: the plain step's optimizer pass is the longer of the two, not their sum, and ends
// with the copy of its last piece (a module's: the largest, GPT-2's embedding with its 50304
// x 768 + 1024 x 768 bf16 parameters).
TEST(PlanSimulated, TheHostsNewParametersCrossBesideItsSteps) {
  PlanRequest r = gpt2_request(0.5);
  r.config.strata.optimizer_overlap = false;
  auto o = evaluate_placement(r, find_placement("opt-host"));
  ASSERT_TRUE(o.is_ok());
  const TimeTerms& t = o->time;
  // Parameters on the device: the link is the gradients' fp32 drains (the two micro-batches'
  // backwards grouped: once) and the new bf16 parameters.
  const double publish_s = t.link_s / 3.0;  // 2 bytes of the 6 a parameter crosses
  ASSERT_LT(publish_s, t.cpu_optim_s) << "the test wants the copies shorter than the optimizer";
  const double drains_s = t.link_s - publish_s;
  const double piece_s = (50304.0 + 1024.0) * 768 * 2 / (r.profile.link_gbps.value * 1e9);
  EXPECT_NEAR(t.expected_s, std::max(t.compute_s, drains_s) + t.cpu_optim_s + piece_s, 1e-9);
}

// The host's optimizer (124M parameters at 1 Gparam/s) takes longer than the device's compute:
// the ratio moves the first modules' optimizer onto the device until the step is within
// kRatioSlack of the fastest; at a rate that hides it, the ratio stays 1; without device
// memory for more, too.
TEST(PlanSimulated, RatioAdviceMovesJustEnoughOptimizerOntoTheDevice) {
  PlanRequest r = gpt2_request(3.0);
  auto rep = make_plan(r);
  ASSERT_TRUE(rep.is_ok());
  auto asked = add_placement(*rep, find_placement("opt-host"));
  ASSERT_TRUE(asked.is_ok());
  ASSERT_TRUE(advise_optimizer_ratio(*rep, *asked).is_ok());
  const RatioAdvice* a = rep->advice_for(*asked);
  ASSERT_NE(a, nullptr);
  EXPECT_GT(a->candidates, 10) << "one ratio per module boundary";
  EXPECT_LT(a->ratio, 1.0);
  EXPECT_GT(a->ratio, 0.0);
  EXPECT_LE(a->time.expected_s, kRatioSlack * a->fastest_s);
  EXPECT_LT(a->time.expected_s, a->step_at_1_s);
  EXPECT_LT(a->time.cpu_optim_s, rep->options[size_t(*asked)].time.cpu_optim_s);
  // The written config carries the ratio; train reads it back as the same placement.
  const std::string text = plan_config_json(*rep, rep->options[size_t(*asked)]);
  EXPECT_NE(text.find("\"ratio\""), std::string::npos) << text;
  auto cfg = parse_config(text, "written");
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  EXPECT_DOUBLE_EQ(cfg->zero.offload_optimizer.ratio, a->ratio);

  // An optimizer fast enough to hide under the compute: nothing moves.
  PlanRequest fast = gpt2_request(3.0);
  fast.profile.optimizer_pps = {1.0e13, "test"};
  fast.profile.link_gbps = {1.0e4, "test"};
  auto frep = make_plan(fast);
  ASSERT_TRUE(frep.is_ok());
  auto fasked = add_placement(*frep, find_placement("opt-host"));
  ASSERT_TRUE(fasked.is_ok());
  ASSERT_TRUE(advise_optimizer_ratio(*frep, *fasked).is_ok());
  EXPECT_EQ(frep->advice_for(*fasked)->ratio, 1.0);

  // The optimizer on the device already: no advice.
  auto dev = add_placement(*rep, find_placement("all-device"));
  ASSERT_TRUE(dev.is_ok());
  ASSERT_TRUE(advise_optimizer_ratio(*rep, *dev).is_ok());
  EXPECT_EQ(rep->advice_for(*dev), nullptr);
}

// With clipping on and the norm unknown (a device not simulated: no device.simulate_grad_norm
// says whether steps clip), the ratio is chosen for the step a clipped step runs, the longer,
// so that it holds whatever the clipping: the ratio weighing the simulated norm over the
// threshold recommends, no more than the one under it, and the steps it weighs are the clipped
// ones.
// The own attention kernels' rates (device.simulate_attention_*): a slower compute.
TEST(PlanSimulated, WithTheNormUnknownTheRatioHoldsForAStepThatClips) {
  auto own_kernels = [](double norm) {
    PlanRequest q = gpt2_request(norm);
    q.config.device.simulate_attention_fwd_tflops = 55;
    q.config.device.simulate_attention_bwd_tflops = 30;
    return request_from_config(q.config, q.hw, host_profile());
  };
  const RatioAdvice over = opt_host_advice(own_kernels(3.0));
  const RatioAdvice under = opt_host_advice(own_kernels(0.5));
  PlanRequest r = own_kernels(0.5);
  r.config.device.simulate.clear();  // the same rates, the norm not known
  const RatioAdvice unknown = opt_host_advice(r);
  EXPECT_FALSE(over.clipped);
  EXPECT_FALSE(under.clipped);
  ASSERT_TRUE(unknown.clipped);
  EXPECT_EQ(unknown.ratio, over.ratio);
  // Under the threshold the backward hides no less (with undo state in host memory, what its
  // speculation leaves is stepped after backward, so at these rates the two ratios meet).
  EXPECT_LE(unknown.ratio, under.ratio);
  EXPECT_EQ(unknown.step_s, unknown.time.step_after_s);
  EXPECT_GE(unknown.time.step_after_s, unknown.time.expected_s);
  // Without clipping the expected step is weighed.
  r.config.gradient_clipping = 0;
  EXPECT_FALSE(opt_host_advice(r).clipped);
}

}  // namespace
}  // namespace strata
