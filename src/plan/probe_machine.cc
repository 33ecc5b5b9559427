#include "src/plan/probe_machine.h"

#include <fmt/format.h>
#include <tbb/parallel_for.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "src/model/architecture.h"
#include "src/plan/plan.h"
#include "src/tiers/placement.h"
#include "strata/comm.h"
#include "strata/cpu_optim.h"
#include "strata/device.h"
#include "strata/io_probe.h"
#include "strata/kernels.h"
#include "strata/log.h"
#include "strata/optimizer.h"

namespace strata {

ModelProbeShapes model_probe_shapes(bool cpu_backend) {
  if (cpu_backend) return {{128, 256, 512, 1024}, {{1, 128}, {4, 128}}};
  return {{768, 1024, 2048, 4096}, {{2, 1024}, {8, 1024}}};
}

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Runs fn warmup + repeats times; returns `work / seconds` of each timed repeat.
template <typename F>
Measured rate_of(int warmup, int repeats, double work, F&& fn) {
  std::vector<double> v;
  for (int i = 0; i < warmup + repeats; ++i) {
    const auto t0 = Clock::now();
    fn();
    const double s = std::max(seconds_since(t0), 1e-9);
    if (i >= warmup) v.push_back(work / s);
  }
  return summarize(std::move(v));
}

json to_json(const Measured& m, double scale = 1.0) {
  json s = json::array();
  for (double x : m.samples) s.push_back(x * scale);
  return {
      {"median", m.median * scale}, {"min", m.min * scale}, {"max", m.max * scale}, {"samples", s}};
}

std::vector<int> thread_counts() {
  const int n = int(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> v;
  for (int t = 1; t < n; t *= 2) v.push_back(t);
  v.push_back(n);
  return v;
}

Status probe_gemm(Device& dev, const MachineProbeOptions& o, json* out) {
  const int N = o.gemm_n, C = o.gemm_c, OC = 4 * o.gemm_c;
  const DType dt = DType::kBF16;
  const size_t es = dtype_size(dt);
  const size_t inp_b = size_t(N) * C * es, w_b = size_t(OC) * C * es, out_b = size_t(N) * OC * es;
  void *inp, *w, *outp, *dinp;
  float* dw;
  STRATA_ASSIGN_OR_RETURN(inp, dev.allocate(inp_b, "probe.gemm.inp"), "GEMM probe");
  STRATA_ASSIGN_OR_RETURN(w, dev.allocate(w_b, "probe.gemm.w"), "GEMM probe");
  STRATA_ASSIGN_OR_RETURN(outp, dev.allocate(out_b, "probe.gemm.out"), "GEMM probe");
  STRATA_ASSIGN_OR_RETURN(dinp, dev.allocate(inp_b, "probe.gemm.dinp"), "GEMM probe");
  STRATA_ASSIGN_OR_RETURN(void* dwv, dev.allocate(size_t(OC) * C * 4, "probe.gemm.dw"),
                          "GEMM probe");
  dw = static_cast<float*>(dwv);
  // Fresh non-zero data (bf16 of small random values) so no path special-cases zeros.
  std::vector<uint16_t> h(std::max({inp_b, w_b, out_b}) / 2);
  uint32_t x = 12345;
  for (auto& e : h) {
    x = x * 1664525u + 1013904223u;
    e = uint16_t(0x3c00 | ((x >> 16) & 0x3ff)) ^ (x & 0x8000);  // |v| in [2^-7, 2^-6)
  }
  Stream& s = dev.compute_stream();
  dev.copy_h2d(s, inp, h.data(), inp_b);
  dev.copy_h2d(s, w, h.data(), w_b);
  dev.copy_h2d(s, outp, h.data(), out_b);
  dev.memset_zero(s, dinp, inp_b);
  dev.memset_zero(s, dw, size_t(OC) * C * 4);
  STRATA_RETURN_IF_ERROR(dev.synchronize(s), "GEMM probe");
  Kernels& k = dev.kernels();
  const double flops = 6.0 * double(N) * C * OC;  // forward 2NCOC + backward 4NCOC
  Status st;
  Measured m = rate_of(o.warmup, o.repeats, flops, [&] {
    k.matmul_forward(s, dt, outp, inp, w, nullptr, N, C, OC);
    k.matmul_backward(s, dt, dinp, dw, nullptr, outp, inp, w, N, C, OC, /*accumulate=*/false);
    Status r = dev.synchronize(s);
    if (!r.is_ok()) st = r;
  });
  for (void* p : {inp, w, outp, dinp, dwv}) dev.release(p);
  STRATA_RETURN_IF_ERROR(st, "GEMM probe");
  (*out)["backend"] = dev.kind() == DeviceKind::kCpu ? "cpu" : "cuda";
  (*out)["name"] = dev.name();
  (*out)["gemm_shape"] = {{"N", N}, {"C", C}, {"OC", OC}, {"dtype", "bf16"}};
  (*out)["gemm_flops"] = m.median;
  (*out)["gemm_flops_spread"] = to_json(m);
  return Status::ok();
}

// Device buffers taken for one probe, all given back when it returns.
class ProbeBuffers {
 public:
  explicit ProbeBuffers(Device& dev) : dev_(dev) {}
  ~ProbeBuffers() {
    for (void* b : bufs_) dev_.release(b);
  }
  ProbeBuffers(const ProbeBuffers&) = delete;
  ProbeBuffers& operator=(const ProbeBuffers&) = delete;
  Result<void*> take(size_t bytes, const char* what) {
    STRATA_ASSIGN_OR_RETURN(void* b, dev_.allocate(bytes, what), "");
    bufs_.push_back(b);
    return b;
  }

 private:
  Device& dev_;
  std::vector<void*> bufs_;
};

// A GPU's memory bandwidth as its optimizer moves it: Kernels::optimizer_step (AdamW) over
// `n` parameters' device-resident fp32 gradient, master weights and moments and a bf16 copy,
// counted as the planner counts the device's optimizer (device_optimizer_bytes_per_param): the
// rate its device-optimizer term divides by (device.mem_gbps; the default is 2000).
Status probe_device_memory(Device& dev, const MachineProbeOptions& o, json* out) {
  const size_t n = o.device_optimizer_params ? o.device_optimizer_params : size_t{64} << 20;
  ProbeBuffers bufs(dev);
  Stream& s = dev.compute_stream();
  void* b[5];
  const size_t bytes[5] = {n * 4, n * 4, n * 4, n * 4, n * 2};  // grad, master, m, v, params
  for (int i = 0; i < 5; ++i) {
    STRATA_ASSIGN_OR_RETURN(b[i], bufs.take(bytes[i], "probe.optimizer"), "device memory probe");
    dev.memset_zero(s, b[i], bytes[i]);
  }
  ShardState sh;
  sh.n = n;
  sh.grad = b[0];
  sh.master = static_cast<float*>(b[1]);
  sh.m = b[2];
  sh.v = b[3];
  sh.lp_out = b[4];
  OptimizerHyper hyper;
  Status st;
  const double per_param = device_optimizer_bytes_per_param(DType::kF32, DType::kBF16);
  Measured m = rate_of(o.warmup, o.repeats, double(n) * per_param, [&] {
    dev.kernels().optimizer_step(s, hyper, sh);
    Status r = dev.synchronize(s);
    if (!r.is_ok() && st.is_ok()) st = r;
  });
  STRATA_RETURN_IF_ERROR(st, "device memory probe");
  (*out)["mem_gbps"] = m.median * 1e-9;
  (*out)["mem_gbps_spread"] = to_json(m, 1e-9);
  (*out)["mem_probe"] = fmt::format("the device's AdamW step over {} parameters' fp32 state", n);
  return Status::ok();
}

Status probe_link(Device& dev, const MachineProbeOptions& o, json* out) {
  const size_t bytes =
      std::min<uint64_t>(o.host_bytes ? o.host_bytes : probe_span_bytes(), uint64_t{256} << 20);
  STRATA_ASSIGN_OR_RETURN(void* d, dev.allocate(bytes, "probe.link"), "link probe");
  std::vector<char> pageable(bytes, 1);
  void* pinned = nullptr;
  auto p = dev.allocate_host(bytes);
  if (p.is_ok()) pinned = *p;
  Stream& s = dev.h2d_stream();
  Status st;
  auto run = [&](bool h2d, void* host) {
    return rate_of(o.warmup, o.repeats, double(bytes), [&] {
      if (h2d) {
        dev.copy_h2d(s, d, host, bytes);
      } else {
        dev.copy_d2h(s, host, d, bytes);
      }
      Status r = dev.synchronize(s);
      if (!r.is_ok()) st = r;
    });
  };
  const double g = 1e-9;
  if (pinned) {
    std::memset(pinned, 1, bytes);
    (*out)["h2d_pinned_gbps"] = run(true, pinned).median * g;
    (*out)["d2h_pinned_gbps"] = run(false, pinned).median * g;
    dev.release_host(pinned);
  }
  (*out)["h2d_pageable_gbps"] = run(true, pageable.data()).median * g;
  (*out)["d2h_pageable_gbps"] = run(false, pageable.data()).median * g;
  if (!pinned) (*out)["h2d_pinned_gbps"] = (*out)["h2d_pageable_gbps"];
  (*out)["bytes"] = bytes;
  dev.release(d);
  return st;
}

// Achieved model FLOP/s of one training micro-batch (strata's GPT, forward + backward, every
// kernel: GEMMs, attention, layernorm, GELU, cross-entropy) at width C, counted with the
// planner's FLOP formula, so that compute time = FLOPs / this rate holds at this width: one rate
// per (B, T) of `batches`, the weights made once for all of them.
Result<std::vector<Measured>> probe_model_rates(Device& dev, int C, int L,
                                                const std::vector<std::pair<int, int>>& batches,
                                                int warmup, int repeats) {
  ModelConfig mc;
  mc.n_layer = L;
  mc.n_embd = C;
  mc.n_head = std::max(1, C / 64);
  mc.vocab_size = 256;
  mc.context = 1;
  for (const auto& [B, T] : batches) mc.context = std::max(mc.context, T);
  STRATA_ASSIGN_OR_RETURN(auto arch, create_architecture(mc), "model probe");
  const ModelLayout& lay = arch->layout();
  const DType dt = DType::kBF16;
  std::vector<const void*> params;
  std::vector<float*> grads;
  ProbeBuffers bufs(dev);
  Stream& s = dev.compute_stream();
  // The device memory first: a device too small says so before the host makes the weights.
  for (size_t i = 0; i < lay.modules.size(); ++i) {
    const size_t n = lay.modules[i].numel;
    STRATA_ASSIGN_OR_RETURN(void* p, bufs.take(n * 2, "probe.params"), "model probe");
    STRATA_ASSIGN_OR_RETURN(void* g, bufs.take(n * 4, "probe.grads"), "model probe");
    params.push_back(p);
    grads.push_back(static_cast<float*>(g));
  }
  for (size_t i = 0; i < lay.modules.size(); ++i) {
    const size_t n = lay.modules[i].numel;
    std::vector<float> master(n);
    std::vector<uint16_t> lp(n);
    // Across the cores, a range at a time (a GPU's widest probe makes 400 M weights).
    constexpr size_t kGrain = size_t{1} << 20;
    tbb::parallel_for(size_t{0}, (n + kGrain - 1) / kGrain, [&](size_t c) {
      const size_t a = c * kGrain, len = std::min(kGrain, n - a);
      arch->init_range(int(i), 7, a, len, master.data() + a);
      convert(master.data() + a, DType::kF32, lp.data() + a, dt, len);
    });
    dev.copy_h2d(s, const_cast<void*>(params[i]), lp.data(), n * 2);
    dev.memset_zero(s, grads[i], n * 4);
    STRATA_RETURN_IF_ERROR(dev.synchronize(s), "model probe");
  }
  std::vector<Measured> rates;
  for (const auto& [B, T] : batches) {
    STRATA_ASSIGN_OR_RETURN(auto model, arch->create_runner(dev, B, T, dt), "model probe");
    std::vector<int32_t> tok(size_t(B) * T), tgt(size_t(B) * T);
    uint32_t x = 99;
    for (size_t i = 0; i < tok.size(); ++i) {
      x = x * 1664525u + 1013904223u;
      tok[i] = int32_t((x >> 8) % 256);
      tgt[i] = int32_t((x >> 20) % 256);
    }
    std::vector<float> losses(tok.size());
    const double flops = double(B) * T * arch->flops_per_token(T, ActivationMode::kKeep).train();
    // Every module stays bound: the program's compute steps run back to back, as on a device
    // that holds the whole model.
    const ModuleBindings bound{params, grads};
    const MicroBatch mb{1.0f / float(B * T), losses.data()};
    Status st;
    rates.push_back(rate_of(warmup, repeats, flops, [&] {
      model->begin_batch(tok.data(), tgt.data());
      for (const ProgramOp& op : arch->program(Pass::kTrain).ops) {
        if (op.kind == ProgramOp::kCompute) model->compute(op, bound, mb);
      }
      Status r = dev.synchronize(s);
      if (!r.is_ok() && st.is_ok()) st = r;
    }));
    STRATA_RETURN_IF_ERROR(st, "model probe");
  }
  return rates;
}

// The optimizer's bytes a parameter: fp32 gradient, master weight and two moments, bf16 copy.
constexpr uint64_t kOptimizerBytesPerParam = 4 * 4 + 2;

// Step 1: host memory bandwidth, a plain copy and the optimizer's read-modify-write.
json probe_host_memory(const MachineProbeOptions& o) {
  const size_t n = (o.host_bytes ? o.host_bytes : probe_span_bytes()) / 4;
  std::vector<float> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = float(i % 1000) * 1e-3f;
    b[i] = float(i % 777) * 1e-3f;
  }
  Measured copy = rate_of(o.warmup, o.repeats, double(n * 4), [&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, n, 1 << 18), [&](const auto& r) {
      std::memcpy(b.data() + r.begin(), a.data() + r.begin(), (r.end() - r.begin()) * 4);
    });
  });
  // One thread copying in module-sized pieces, as a CPU stream's copies run (each on the
  // stream's thread, below the C library's non-temporal threshold): the simulated device's link
  // when slower than its preset's.
  constexpr size_t kPiece = size_t{16} << 20;
  Measured one = rate_of(o.warmup, o.repeats, double(n * 4), [&] {
    for (size_t at = 0; at < n * 4; at += kPiece) {
      std::memcpy(reinterpret_cast<char*>(b.data()) + at,
                  reinterpret_cast<const char*>(a.data()) + at, std::min(kPiece, n * 4 - at));
    }
  });
  Measured rmw = rate_of(o.warmup, o.repeats, double(n * 12), [&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, n, 1 << 18), [&](const auto& r) {
      float* x = a.data();
      const float* y = b.data();
      for (size_t i = r.begin(); i < r.end(); ++i) x[i] = 0.999f * x[i] + 0.001f * y[i];
    });
  });
  return {{"copy_gbps", copy.median * 1e-9},
          {"copy_spread", to_json(copy, 1e-9)},
          {"copy_one_thread_gbps", one.median * 1e-9},
          {"copy_one_thread_spread", to_json(one, 1e-9)},
          {"rmw_gbps", rmw.median * 1e-9},
          {"rmw_spread", to_json(rmw, 1e-9)},
          {"bytes", uint64_t(n) * 4}};
}

// Step 2: the CPU optimizer (AdamW) per thread count; the best count is the headline.
json probe_cpu_optimizer(const MachineProbeOptions& o) {
  const size_t n =
      o.optimizer_params
          ? o.optimizer_params
          : std::max<uint64_t>(probe_span_bytes() / kOptimizerBytesPerParam, uint64_t{1} << 20);
  std::vector<float> grad(n), master(n), m(n, 0.0f), v(n, 0.0f);
  std::vector<uint16_t> lp(n);
  for (size_t i = 0; i < n; ++i) {
    grad[i] = float(int(i % 2001) - 1000) * 1e-4f;
    master[i] = float(i % 997) * 1e-3f;
  }
  OptimizerHyper h;
  h.lr = 1e-4f;
  h.weight_decay = 0.1f;
  ShardState s;
  s.n = n;
  s.grad = grad.data();
  s.master = master.data();
  s.m = m.data();
  s.v = v.data();
  s.lp_out = lp.data();
  json by = json::array();
  double best = 0;
  for (int t : thread_counts()) {
    Measured r = rate_of(o.warmup, o.repeats, double(n), [&] {
      optimizer_step(h, s, t);
      ++h.step;
    });
    by.push_back({{"threads", t}, {"params_per_s", r.median}, {"spread", to_json(r)}});
    best = std::max(best, r.median);
  }
  return {{"params_per_s", best},
          {"isa", cpu_isa_name(active_cpu_isa())},
          {"params", n},
          {"by_threads", by}};
}

// The device the GEMM and link steps measure: CUDA when asked for and present (else why not,
// in `j`'s link_reason), the CPU backend otherwise.
Result<std::unique_ptr<Device>> open_probe_device(const MachineProbeOptions& o, json* j) {
  std::unique_ptr<Device> dev;
  if (o.include_cuda) {
    auto c = create_cuda_device({.capacity = o.cuda_bytes});
    if (c.is_ok()) {
      dev = std::move(*c);
    } else {
      (*j)["link_reason"] = c.status().message();
    }
  }
  if (!dev) {
    CpuDeviceOptions co;
    co.capacity = size_t{512} << 20;
    STRATA_ASSIGN_OR_RETURN(dev, create_cpu_device(co), "machine probe");
  }
  return dev;
}

// Step 3: the device GEMM rate, and whole micro-batches' rates by width and tokens.
Result<json> probe_device(Device& dev, const MachineProbeOptions& o) {
  json d;
  STRATA_RETURN_IF_ERROR(probe_gemm(dev, o, &d), "probe: device GEMM rate");
  // A step is more than its largest GEMM: the non-GEMM kernels and per-op costs (a large share
  // of a step on the CPU backend, where small GEMMs also run far from the headline rate), and
  // on a GPU GEMMs of training's sizes run well above a single small one's rate. So whole
  // training micro-batches (2 layers) are timed at several widths and micro-batch sizes (on the
  // CPU backend, per-kernel costs make small micro-batches slower per FLOP: bench-25m's 512
  // tokens a step took 529 ms as 1 micro-batch of 4 x 128 and 693 ms as 2 of 2 x 128); the
  // planner interpolates at its width and tokens per micro-batch.
  const bool cpu = dev.kind() == DeviceKind::kCpu;
  if (!cpu) {
    Status mem = probe_device_memory(dev, o, &d);
    if (mem.code() == StatusCode::kOutOfMemory) {
      d["mem_note"] = "not measured: " + mem.message();  // the planner keeps its default
    } else {
      STRATA_RETURN_IF_ERROR(mem, "probe: device memory");
    }
  }
  const ModelProbeShapes shapes =
      o.model_shapes.widths.empty() ? model_probe_shapes(cpu) : o.model_shapes;
  json by = json::array();
  for (int c : shapes.widths) {
    auto rates = probe_model_rates(dev, c, 2, shapes.batches, o.warmup, o.repeats);
    if (!rates.is_ok()) {
      // A device too small for the widest micro-batches (the planner clamps at the widest
      // measured), or one whose micro-batches fail from some width on: the table stops there
      // and says why (d["gemm_by_width_note"]); with no width measured the planner takes the
      // GEMM rate. The rest of the profile stands either way.
      d["gemm_by_width_note"] =
          fmt::format("widths from {} not measured: {}", c, rates.status().message());
      if (rates.status().code() != StatusCode::kOutOfMemory) {
        log_warn("probe: model steps at width {}: {}", c, rates.status().message());
      }
      break;
    }
    const std::vector<Measured>& r = *rates;
    for (size_t i = 0; i < r.size(); ++i) {
      by.push_back({{"C", c},
                    {"layers", 2},
                    {"B", shapes.batches[i].first},
                    {"T", shapes.batches[i].second},
                    {"gemm_flops", r[i].median},
                    {"gemm_flops_min", r[i].min},
                    {"gemm_flops_max", r[i].max}});
    }
  }
  // Sorted as the profile keeps them: by tokens, then width.
  std::stable_sort(by.begin(), by.end(), [](const json& a, const json& b) {
    return a["B"].get<int>() * a["T"].get<int>() < b["B"].get<int>() * b["T"].get<int>();
  });
  if (cpu) d["gemm_isa"] = cpu_gemm_path();
  d["gemm_by_width"] = by;
  return d;
}

// The NVMe probe's sweep: a short grid on the given paths, striped.
IoProbeOptions nvme_probe_options(const MachineProbeOptions& o) {
  IoProbeOptions io;
  io.paths = o.nvme_paths;
  io.file_bytes = o.nvme_file_bytes;
  io.block_sizes = {size_t{1} << 20};
  io.queue_depths = {8, 32};
  io.warmup = o.warmup;
  io.repeats = std::max(2, o.repeats / 2);
  return io;
}

// Step 5: NVMe read/write on the given paths (striped, and each alone when several).
Result<json> probe_nvme(const MachineProbeOptions& o) {
  if (o.nvme_paths.empty()) return json("n/a: no --path given");
  const IoProbeOptions io = nvme_probe_options(o);
  STRATA_ASSIGN_OR_RETURN(IoProbeReport rep, run_io_probe(io), "NVMe probe");
  double rd = 0, wr = 0;
  for (const auto& c : rep.cases) {
    if (c.backend != rep.rec_backend || c.block_size != rep.rec_block_size ||
        c.queue_depth != rep.rec_queue_depth) {
      continue;
    }
    (c.op == IoOp::kRead ? rd : wr) = c.median;
  }
  // Several paths: each alone too (the striped numbers above are all of them at once).
  json per_path = json::array();
  if (o.nvme_paths.size() > 1) {
    for (const auto& path : o.nvme_paths) {
      IoProbeOptions one = io;
      one.paths = {path};
      one.backends = {rep.rec_backend};
      one.queue_depths = {rep.rec_queue_depth};
      STRATA_ASSIGN_OR_RETURN(IoProbeReport r1, run_io_probe(one), "NVMe probe of " + path);
      double r = 0, w = 0;
      for (const auto& c : r1.cases) (c.op == IoOp::kRead ? r : w) = c.median;
      per_path.push_back({{"path", path}, {"read_gbps", r}, {"write_gbps", w}});
    }
  }
  return json{{"paths", rep.paths},
              {"per_path", per_path},
              {"read_gbps", rd},
              {"write_gbps", wr},
              {"aio",
               {{"backend", rep.rec_backend},
                {"block_size", rep.rec_block_size},
                {"queue_depth", rep.rec_queue_depth}}},
              {"io_probe", json::parse(io_probe_json(rep))}};
}

// Step 6: collective bus bandwidth, under mpirun only (rank 0 reports it).
Result<json> probe_collectives(const MachineProbeOptions& o) {
  if (!launched_with_multiple_ranks()) {
    return json("n/a: single process (run under mpirun -np N to measure)");
  }
  CommProbeOptions co;
  co.ops = {"all_gather", "reduce_scatter"};
  co.min_bytes = size_t{1} << 20;
  co.max_bytes = size_t{64} << 20;
  co.repeats = o.repeats;
  co.json_path = fmt::format("/tmp/strata-probe-comm-{}.json", getpid());
  STRATA_RETURN_IF_ERROR(run_comm_probe_command(co), "collectives probe");
  std::ifstream in(co.json_path);
  if (!in) return json("n/a: measured on rank 0");  // rank 0 wrote it
  std::stringstream ss;
  ss << in.rdbuf();
  STRATA_ASSIGN_OR_RETURN(CommProbeReport rep, parse_comm_probe_json(ss.str(), co.json_path), "");
  double best = 0;
  for (const auto& c : rep.cases) best = std::max(best, c.busbw);
  std::remove(co.json_path.c_str());
  return json{{"busbw_gbps", best},
              {"world_size", rep.world_size},
              {"backend", rep.backend},
              {"comm_probe", json::parse(comm_probe_json(rep))}};
}

}  // namespace

Measured summarize(std::vector<double> v) {
  Measured m;
  m.samples = v;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  m.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  m.min = v.front();
  m.max = v.back();
  return m;
}

uint64_t probe_span_bytes() {
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  uint64_t span =
      std::clamp<uint64_t>(llc > 0 ? uint64_t(llc) * 4 : 0, uint64_t{256} << 20, uint64_t{2} << 30);
  if (const uint64_t avail = host_available_bytes(); avail > 0) {
    span = std::min(span, std::max<uint64_t>(avail / 8, uint64_t{64} << 20));
  }
  return span;
}

Result<std::string> run_machine_probe(
    const MachineProbeOptions& o,
    const std::function<void(int, int, const std::string&)>& progress) {
  // The memory probe takes two buffers of host_bytes (and the link probe one of up to 256 MiB).
  if (o.host_bytes > 0 && o.host_bytes < 4096) {
    return invalid_argument(fmt::format("--host-bytes {}: give at least 4 KiB", o.host_bytes));
  }
  if (const uint64_t avail = host_available_bytes();
      o.host_bytes > 0 && avail > 0 && o.host_bytes > avail / 2) {
    return invalid_argument(fmt::format(
        "--host-bytes {}: the memory probe takes two buffers of it, more than the {} bytes "
        "available; give at most {}",
        o.host_bytes, avail, avail / 2));
  }
  // The NVMe probe's file holds whole blocks: refused here, before the probes ahead of it run
  // (the storage probe's own refusal came minutes later and named strata probe io's --size).
  if (!o.nvme_paths.empty()) {
    const size_t block = nvme_probe_options(o).block_sizes.front();
    if (o.nvme_file_bytes < block || o.nvme_file_bytes % block != 0) {
      return invalid_argument(fmt::format(
          "--nvme-bytes {}: the NVMe probe moves blocks of {} bytes; give a whole number of "
          "them (e.g. 256MiB, the default)",
          o.nvme_file_bytes, block));
    }
  }
  const int total = 6;
  auto step = [&](int i, const std::string& what) {
    if (progress) progress(i, total, what);
  };
  json j;
  j["magic"] = "strata-machine-profile";
  j["version"] = kMachineProfileVersion;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  j["hostname"] = host;
  j["cores"] = std::thread::hardware_concurrency();
  j["method"] =
      fmt::format("{} warm-up pass(es) discarded, median of {} timed passes", o.warmup, o.repeats);

  step(0, "host memory bandwidth");
  j["host"] = probe_host_memory(o);
  step(1, "CPU optimizer (AdamW) per thread count");
  j["cpu_optimizer"] = probe_cpu_optimizer(o);

  // 3-4. Device GEMM and host<->device link.
  step(2, "device GEMM rate");
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> dev, open_probe_device(o, &j), "");
  STRATA_ASSIGN_OR_RETURN(j["device"], probe_device(*dev, o), "");
  step(3, "host<->device bandwidth");
  if (dev->kind() == DeviceKind::kCuda) {
    json l;
    STRATA_RETURN_IF_ERROR(probe_link(*dev, o, &l), "probe: host<->device link");
    j["link"] = l;
  } else {
    j["link"] = "n/a: no GPU; the CPU backend's copies are host memcpy (host.copy_gbps)";
  }
  dev.reset();

  step(4, "NVMe read/write");
  STRATA_ASSIGN_OR_RETURN(j["nvme"], probe_nvme(o), "");
  step(5, "collectives");
  STRATA_ASSIGN_OR_RETURN(j["collectives"], probe_collectives(o), "");
  step(total, "done");
  return j.dump(2) + "\n";
}

}  // namespace strata
