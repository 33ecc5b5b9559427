// bench_device_ops: what tools/gpu_check.py measures on a device, through strata's own Device
// and Kernels table (so it measures the ops the engine runs, not a hand-tuned stand-in).
//
//   bench_device_ops gemm      [options]  matmul_forward / matmul_backward (cuBLASLt on CUDA) at
//                                         GPT-2 124M's shapes: TFLOP/s and share of --peak-tflops;
//                                         then the fused ops against the calls they replace
//                                         (the "fused" rows: the residual add + norm, the GELU
//                                         in the up-projection's epilogue and its gradient in
//                                         the down-projection's backward), ms each and speedup;
//                                         then the elementwise ops (bench_device_elementwise.cc):
//                                         GB/s against --peak-gbs, and on CUDA the 16-byte
//                                         packs against one element a thread's access
//   bench_device_ops copy      [options]  host<->device copies, pinned and pageable, GB/s
//   bench_device_ops attention [options]  plain (attention_gqa_*) vs fused (fused_attention_*,
//                                         the backend's own kernels), and cuDNN's fused attention
//                                         where the device runs the shape on it ("cudnn" rows,
//                                         its deterministic backward, with cuDNN's TFLOP/s over
//                                         the own kernels'; "cudnn-nd" rows: its
//                                         non-deterministic backward, device.deterministic
//                                         false): forward and backward time, TFLOP/s, the
//                                         attention memory each needs (cuDNN's workspace in its
//                                         path), and how far the plain and fused outputs differ
//   bench_device_ops kernels   [options]  the elementwise ops, the gradient statistics and the
//                                         optimizer step, each called once at the shapes above
//                                         (a 4 GiB arena): for a kernel profiler attached to the
//                                         process, e.g. Nsight Compute (docs/GPU.md)
//   bench_device_ops validate-json FILE [KEY...]   exit 0 if FILE parses and has every KEY
//
// options: --backend cuda|cpu (default cuda; cpu runs the same code on the CPU backend, which is
//          how tools/gpu_check.py --self-test checks this tool without a GPU)
//          --quick (small shapes, for the self-test)  --warmup N (1)  --repeats N (5)
//          --peak-tflops X (the device's dense bf16 peak, for the GEMM share)
//          --peak-gbs X (the device memory's GB/s, for the elementwise share)
//          --json FILE  --md FILE  (default: JSON on stdout)
//
// Each case: `warmup` discarded passes, then `repeats` timed passes (wall time of enqueue +
// synchronize of `iters` calls); the median is the result, min and max the spread. A benchmark,
// not a test: it never fails on timing; it exits 1 only when an op fails.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/kernels.h"
#include "strata/kernels_wrapper.h"
#include "tests/bench/bench_device_common.h"

namespace strata {
namespace {

using bench::Buffers;
using bench::fmt_num;
using bench::json;
using bench::Options;
using bench::Spread;
using bench::time_per_call;
using bench::to_json;

// --- fused ops ----------------------------------------------------------------------------------

// Each optional fused op (KernelOp::kResidualNorm, kMatmulGelu, kMatmulBackwardGelu) against the
// calls a model makes without it, at GPT-2 124M's shapes (N = 8 x 1024 rows, C = 768) and, for
// RMSNorm, a ~1B Llama's width (C = 2048). A row the device does not support says why. Then
// rows every backend runs: an input gradient written by matmul_backward against zeroed and
// accumulated into, and the norm backwards adding the residual gradient against a copy of it
// accumulated into.
Status bench_fused(Device& dev, const Options& o, json* out, std::string* md) {
  const int N = o.quick ? 128 : 8 * 1024, C = o.quick ? 64 : 768, CL = o.quick ? 96 : 2048;
  const DType dt = DType::kBF16;
  const size_t es = dtype_size(dt);
  const int iters = dev.kind() == DeviceKind::kCuda ? 20 : 1;
  Kernels& k = dev.kernels();
  Stream& s = dev.compute_stream();
  Buffers b(dev);
  const size_t wide = size_t(N) * 4 * C;  // the MLP's hidden activations
  STRATA_ASSIGN_OR_RETURN(void* x, b.random(size_t(N) * CL, dt), "fused x");
  STRATA_ASSIGN_OR_RETURN(void* y, b.random(size_t(N) * CL, dt), "fused y");
  STRATA_ASSIGN_OR_RETURN(void* res, b.random(size_t(N) * CL, dt), "fused res");
  STRATA_ASSIGN_OR_RETURN(void* ln, b.random(size_t(N) * CL, dt), "fused ln");
  STRATA_ASSIGN_OR_RETURN(void* w, b.random(size_t(CL), dt, 0.5, 1.5), "fused norm weight");
  STRATA_ASSIGN_OR_RETURN(void* stats, b.random(2 * size_t(N), DType::kF32), "fused stats");
  STRATA_ASSIGN_OR_RETURN(void* pre, b.random(wide, dt, -3, 3), "fused pre");
  STRATA_ASSIGN_OR_RETURN(void* act, b.random(wide, dt), "fused act");
  STRATA_ASSIGN_OR_RETURN(void* dpre, b.random(wide, dt), "fused dpre");
  STRATA_ASSIGN_OR_RETURN(void* dact, b.random(wide, dt), "fused dact");
  STRATA_ASSIGN_OR_RETURN(void* wfc, b.random(size_t(4) * C * C, dt), "fused fc weight");
  STRATA_ASSIGN_OR_RETURN(void* bfc, b.random(size_t(4) * C, dt), "fused fc bias");
  STRATA_ASSIGN_OR_RETURN(void* dw, b.random(size_t(4) * C * C, DType::kF32), "fused dweight");
  STRATA_ASSIGN_OR_RETURN(void* db, b.random(size_t(4) * C, DType::kF32), "fused dbias");
  float* mean = static_cast<float*>(stats);
  float* rstd = mean + N;
  float* dwf = static_cast<float*>(dw);
  float* dbf = static_cast<float*>(db);
  struct Case {
    const char* name;
    std::optional<KernelOp> op;  // none: every backend runs both
    OpShape shape;
    std::function<void()> unfused, fused;
  };
  const Case cases[] = {
      {"residual_layernorm", KernelOp::kResidualNorm, OpShape{.dt = dt, .N = N, .C = C},
       [&] {
         k.residual_forward(s, dt, res, x, y, size_t(N) * C);
         k.layernorm_forward(s, dt, ln, mean, rstd, res, w, w, N, C);
       },
       [&] { k.residual_layernorm_forward(s, dt, res, ln, mean, rstd, x, y, w, w, N, C); }},
      {"residual_rmsnorm", KernelOp::kResidualNorm, OpShape{.dt = dt, .N = N, .C = CL},
       [&] {
         k.residual_forward(s, dt, res, x, y, size_t(N) * CL);
         k.rmsnorm_forward(s, dt, ln, rstd, res, w, 1e-5f, N, CL);
       },
       [&] { k.residual_rmsnorm_forward(s, dt, res, ln, rstd, x, y, w, 1e-5f, N, CL); }},
      {"matmul_gelu_forward", KernelOp::kMatmulGelu, OpShape{.dt = dt, .N = N, .C = C, .OC = 4 * C},
       [&] {
         k.matmul_forward(s, dt, pre, x, wfc, bfc, N, C, 4 * C);
         k.gelu_forward(s, dt, act, pre, wide);
       },
       [&] { k.matmul_gelu_forward(s, dt, act, pre, x, wfc, bfc, N, C, 4 * C); }},
      {"matmul_backward_gelu", KernelOp::kMatmulBackwardGelu,
       OpShape{.dt = dt, .N = N, .C = 4 * C, .OC = C},
       [&] {  // GPT-2's MLP backward without the fusion: dact written, dpre zeroed, two ops
         k.matmul_backward(s, dt, dact, dwf, dbf, y, act, wfc, N, 4 * C, C, /*accumulate=*/false);
         dev.memset_zero(s, dpre, wide * es);
         k.gelu_backward(s, dt, dpre, pre, dact, wide);
       },
       [&] { k.matmul_backward_gelu(s, dt, dpre, dwf, dbf, y, act, wfc, pre, N, 4 * C, C); }},
      {"matmul_backward dinp written", std::nullopt, OpShape{.dt = dt, .N = N, .C = C, .OC = 4 * C},
       [&] {  // the MLP's up-projection backward, dinp [N,C] zeroed and accumulated into
         dev.memset_zero(s, x, size_t(N) * C * es);
         k.matmul_backward(s, dt, x, dwf, dbf, dact, ln, wfc, N, C, 4 * C, /*accumulate=*/true);
       },
       [&] {
         k.matmul_backward(s, dt, x, dwf, dbf, dact, ln, wfc, N, C, 4 * C, /*accumulate=*/false);
       }},
      {"layernorm_backward adds the residual gradient", std::nullopt,
       OpShape{.dt = dt, .N = N, .C = C},
       [&] {  // a block's half: the residual gradient copied, the norm's accumulated into it
         dev.copy_d2d(s, res, y, size_t(N) * C * es);
         k.layernorm_backward(s, dt, res, res, dwf, dbf, x, ln, w, mean, rstd, N, C);
       },
       [&] { k.layernorm_backward(s, dt, res, y, dwf, dbf, x, ln, w, mean, rstd, N, C); }},
      {"rmsnorm_backward adds the residual gradient", std::nullopt,
       OpShape{.dt = dt, .N = N, .C = CL},
       [&] {
         dev.copy_d2d(s, res, y, size_t(N) * CL * es);
         k.rmsnorm_backward(s, dt, res, res, dwf, x, ln, w, rstd, N, CL);
       },
       [&] { k.rmsnorm_backward(s, dt, res, y, dwf, x, ln, w, rstd, N, CL); }},
  };
  json rows = json::array();
  *md += "\n| fused op (bf16, N=" + std::to_string(N) +
         ") | path | unfused ms | fused ms | speedup |\n|---|---|---|---|---|\n";
  Status st;
  for (const Case& c : cases) {
    const KernelSupport sup =
        c.op ? k.supports(*c.op, c.shape) : KernelSupport{true, "every backend"};
    json row = {{"name", c.name},   {"N", c.shape.N},   {"C", c.shape.C},
                {"OC", c.shape.OC}, {"path", sup.path}, {"supported", sup.supported}};
    auto timed = [&](const std::function<void()>& fn) {
      return time_per_call(
          o, iters,
          [&] {
            for (int i = 0; i < iters; ++i) fn();
            return dev.synchronize(s);
          },
          &st);
    };
    const Spread u = timed(c.unfused);
    row["unfused_s"] = to_json(u);
    std::string fused_ms = "n/a", speedup = "n/a";
    if (sup.supported) {
      const Spread f = timed(c.fused);
      row["fused_s"] = to_json(f);
      row["speedup"] = u.median / f.median;
      fused_ms = fmt_num(f.median * 1e3, 3);
      speedup = fmt_num(u.median / f.median, 2) + "x";
    }
    STRATA_RETURN_IF_ERROR(st, std::string("fused op ") + c.name);
    rows.push_back(row);
    *md += std::string("| ") + c.name + " | " + sup.path + " | " + fmt_num(u.median * 1e3, 3) +
           " | " + fused_ms + " | " + speedup + " |\n";
  }
  (*out)["fused"] = rows;
  return Status::ok();
}

// --- gemm ---------------------------------------------------------------------------------------

Status bench_gemm(Device& dev, Device* one_element, const Options& o, json* out, std::string* md) {
  // GPT-2 124M: C = 768, 4C MLP, padded vocabulary 50304; N = B*T rows of a micro-batch.
  const int N = o.quick ? 128 : 8 * 1024, C = o.quick ? 64 : 768, Vp = o.quick ? 512 : 50304;
  struct Shape {
    const char* name;
    int C, OC;
  };
  const Shape shapes[] = {{"qkv", C, 3 * C},
                          {"attn_proj", C, C},
                          {"fc", C, 4 * C},
                          {"fc_proj", 4 * C, C},
                          {"lm_head", C, Vp}};
  const DType dt = DType::kBF16;
  const int iters = dev.kind() == DeviceKind::kCuda ? 20 : 1;
  Kernels& k = dev.kernels();
  Stream& s = dev.compute_stream();
  json rows = json::array();
  *md += "| GEMM (bf16, N=" + std::to_string(N) +
         ") | C | OC | forward TFLOP/s | backward TFLOP/s | forward % of peak | backward % of "
         "peak |\n|---|---|---|---|---|---|---|\n";
  Status st;
  for (const Shape& sh : shapes) {
    Buffers b(dev);
    STRATA_ASSIGN_OR_RETURN(void* inp, b.random(size_t(N) * sh.C, dt), sh.name);
    STRATA_ASSIGN_OR_RETURN(void* w, b.random(size_t(sh.OC) * sh.C, dt), sh.name);
    STRATA_ASSIGN_OR_RETURN(void* bias, b.random(sh.OC, dt), sh.name);
    STRATA_ASSIGN_OR_RETURN(void* y, b.random(size_t(N) * sh.OC, dt), sh.name);
    STRATA_ASSIGN_OR_RETURN(void* dinp, b.random(size_t(N) * sh.C, dt), sh.name);
    STRATA_ASSIGN_OR_RETURN(void* dw, b.random(size_t(sh.OC) * sh.C, DType::kF32), sh.name);
    STRATA_ASSIGN_OR_RETURN(void* db, b.random(sh.OC, DType::kF32), sh.name);
    const double fwd_flops = 2.0 * N * sh.C * sh.OC;
    const Spread f = time_per_call(
        o, iters,
        [&] {
          for (int i = 0; i < iters; ++i) k.matmul_forward(s, dt, y, inp, w, bias, N, sh.C, sh.OC);
          return dev.synchronize(s);
        },
        &st);
    const Spread bw = time_per_call(
        o, iters,
        [&] {
          for (int i = 0; i < iters; ++i) {
            k.matmul_backward(s, dt, dinp, static_cast<float*>(dw), static_cast<float*>(db), y, inp,
                              w, N, sh.C, sh.OC, /*accumulate=*/false);
          }
          return dev.synchronize(s);
        },
        &st);
    STRATA_RETURN_IF_ERROR(st, std::string("GEMM ") + sh.name);
    const double tf = fwd_flops / f.median / 1e12, tb = 2 * fwd_flops / bw.median / 1e12;
    json row = {{"name", sh.name},
                {"N", N},
                {"C", sh.C},
                {"OC", sh.OC},
                {"forward_s", to_json(f)},
                {"backward_s", to_json(bw)},
                {"forward_tflops", tf},
                {"backward_tflops", tb}};
    std::string pf = "n/a", pb = "n/a";
    if (o.peak_tflops > 0) {
      row["forward_peak_share"] = tf / o.peak_tflops;
      row["backward_peak_share"] = tb / o.peak_tflops;
      pf = fmt_num(100 * tf / o.peak_tflops) + "%";
      pb = fmt_num(100 * tb / o.peak_tflops) + "%";
    }
    rows.push_back(row);
    *md += std::string("| ") + sh.name + " | " + std::to_string(sh.C) + " | " +
           std::to_string(sh.OC) + " | " + fmt_num(tf) + " | " + fmt_num(tb) + " | " + pf + " | " +
           pb + " |\n";
  }
  (*out)["dtype"] = "bf16";
  (*out)["peak_tflops"] = o.peak_tflops > 0 ? json(o.peak_tflops) : json(nullptr);
  (*out)["shapes"] = rows;
  STRATA_RETURN_IF_ERROR(bench_fused(dev, o, out, md), "");
  return bench::bench_elementwise(dev, one_element, o, out, md);
}

// --- copy ---------------------------------------------------------------------------------------

Status bench_copy(Device& dev, const Options& o, json* out, std::string* md) {
  const size_t bytes = o.quick ? size_t{4} << 20 : size_t{256} << 20;
  STRATA_ASSIGN_OR_RETURN(void* d, dev.allocate(bytes, "bench.copy"), "copy benchmark");
  STRATA_ASSIGN_OR_RETURN(void* d2, dev.allocate(bytes, "bench.copy2"), "copy benchmark");
  auto pinned = dev.allocate_host(bytes);
  auto pinned2 = dev.allocate_host(bytes);
  std::vector<char> pageable(bytes, 1);
  Status st;
  json cases = json::object();
  *md += "| copy (" + std::to_string(bytes >> 20) +
         " MiB) | GB/s (median) | min..max |\n|---|---|---|\n";
  auto add = [&](const std::string& name, const Spread& sp, double total_bytes) {
    const double g = total_bytes / sp.median / 1e9;
    cases[name] = {{"gbps", g}, {"seconds", to_json(sp)}};
    *md += "| " + name + " | " + fmt_num(g) + " | " + fmt_num(total_bytes / sp.max / 1e9) + ".." +
           fmt_num(total_bytes / sp.min / 1e9) + " |\n";
  };
  auto one = [&](bool h2d, void* host) {
    return time_per_call(
        o, 1,
        [&] {
          Stream& s = h2d ? dev.h2d_stream() : dev.d2h_stream();
          if (h2d) {
            dev.copy_h2d(s, d, host, bytes);
          } else {
            dev.copy_d2h(s, host, d, bytes);
          }
          return dev.synchronize(s);
        },
        &st);
  };
  if (pinned.is_ok() && pinned2.is_ok()) {
    std::memset(*pinned, 1, bytes);
    add("h2d_pinned", one(true, *pinned), double(bytes));
    add("d2h_pinned", one(false, *pinned), double(bytes));
    // Both directions at once, on the two copy streams.
    add("bidirectional_pinned",
        time_per_call(
            o, 1,
            [&] {
              dev.copy_h2d(dev.h2d_stream(), d, *pinned, bytes);
              dev.copy_d2h(dev.d2h_stream(), *pinned2, d2, bytes);
              Status a = dev.synchronize(dev.h2d_stream());
              Status b = dev.synchronize(dev.d2h_stream());
              return a.is_ok() ? b : a;
            },
            &st),
        2.0 * double(bytes));
  } else {
    cases["pinned"] = "n/a: " + (pinned.is_ok() ? pinned2.status() : pinned.status()).to_string();
  }
  add("h2d_pageable", one(true, pageable.data()), double(bytes));
  add("d2h_pageable", one(false, pageable.data()), double(bytes));
  if (pinned.is_ok()) dev.release_host(*pinned);
  if (pinned2.is_ok()) dev.release_host(*pinned2);
  dev.release(d);
  dev.release(d2);
  STRATA_RETURN_IF_ERROR(st, "copy benchmark");
  (*out)["bytes"] = bytes;
  (*out)["cases"] = cases;
  return Status::ok();
}

// --- attention ----------------------------------------------------------------------------------

// `nd`: a second device whose cuDNN backward is non-deterministic (null: none); its kernels run
// on `dev`'s buffers and stream (one GPU, one process), its errors come back from its own sink.
struct AttnCase {
  const char* name;
  int B, T, NH, NKV, hs;
  // The first cells of its markdown rows: "| name | B | T | NH/NKV | hs | ".
  std::string md_cells() const {
    return std::string("| ") + name + " | " + std::to_string(B) + " | " + std::to_string(T) +
           " | " + std::to_string(NH) + "/" + std::to_string(NKV) + " | " + std::to_string(hs) +
           " | ";
  }
};

// row["cudnn_over_own"]: cuDNN's TFLOP/s over the own kernels' (> 1: cuDNN is faster), where both
// were timed; and its markdown row.
void cudnn_over_own(const AttnCase& sh, json& row, std::string* md) {
  if (!row["cudnn"].is_object() || !row["fused"].is_object()) return;
  const double fr =
      row["cudnn"]["forward_tflops"].get<double>() / row["fused"]["forward_tflops"].get<double>();
  const double br =
      row["cudnn"]["backward_tflops"].get<double>() / row["fused"]["backward_tflops"].get<double>();
  row["cudnn_over_own"] = {{"forward", fr}, {"backward", br}};
  *md += std::string("| ") + sh.name + " | | | | | cudnn / own | " + fmt_num(fr, 2) + "x | " +
         fmt_num(br, 2) + "x | | | |\n";
}

// The relative RMS difference of two bf16 device arrays of n elements (a sanity check of the
// fused output against the plain one, not a test).
Result<double> rel_rms_bf16(Device& dev, Stream& s, const void* ref, const void* got, size_t n) {
  std::vector<uint16_t> a(n), c(n);
  dev.copy_d2h(s, a.data(), ref, n * 2);
  dev.copy_d2h(s, c.data(), got, n * 2);
  STRATA_RETURN_IF_ERROR(dev.synchronize(s), "reading the outputs back");
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = bf16_to_f32(a[i]), z = bf16_to_f32(c[i]);
    num += (x - z) * (x - z);
    den += x * x;
  }
  return den > 0 ? std::sqrt(num / den) : 0.0;
}

// The attention phase's shapes: GPT-2 124M's, then long sequences with head size 128.
std::vector<AttnCase> attention_cases(bool quick) {
  if (quick) return {{"tiny", 2, 128, 2, 2, 64}, {"tiny-gqa", 1, 100, 4, 2, 64}};
  return {{"gpt2-124m", 8, 1024, 12, 12, 64},
          {"t2048-h16", 2, 2048, 16, 16, 128},
          {"t4096-h32", 1, 4096, 32, 32, 128},
          {"t4096-gqa", 1, 4096, 32, 8, 128},
          {"t16384-h16", 1, 16384, 16, 16, 128}};
}

Status bench_attention(Device& dev, Device* nd, const Options& o, json* out, std::string* md) {
  using Shape = AttnCase;
  const std::vector<Shape> shapes = attention_cases(o.quick);
  const DType dt = DType::kBF16;
  Kernels& k = dev.kernels();
  Stream& s = dev.compute_stream();
  const size_t free_bytes = dev.memory_stats().capacity - dev.memory_stats().used;
  json rows = json::array();
  *md +=
      "| attention (bf16, causal) | B | T | NH/NKV | hs | kernel | forward ms | backward ms | "
      "fwd TFLOP/s | bwd TFLOP/s | attention memory |\n|---|---|---|---|---|---|---|---|---|---|"
      "---|\n";
  for (const Shape& sh : shapes) {
    const size_t W = size_t(sh.NH + 2 * sh.NKV) * sh.hs, C = size_t(sh.NH) * sh.hs;
    const size_t bt = size_t(sh.B) * sh.T, rows_n = size_t(sh.B) * sh.NH * sh.T;
    // Causal: half of 4*B*NH*T^2*hs for QK^T and PV; the backward does 2.5 times that.
    const double fwd_flops = 2.0 * double(sh.B) * sh.NH * double(sh.T) * sh.T * sh.hs;
    Buffers b(dev);
    STRATA_ASSIGN_OR_RETURN(void* qkv, b.random(bt * W, dt, -2, 2), sh.name);
    STRATA_ASSIGN_OR_RETURN(void* dout, b.random(bt * C, dt), sh.name);
    STRATA_ASSIGN_OR_RETURN(void* y_fused, b.random(bt * C, dt), sh.name);
    STRATA_ASSIGN_OR_RETURN(void* dqkv, b.random(bt * W, dt), sh.name);
    json row = {{"name", sh.name}, {"B", sh.B},     {"T", sh.T},
                {"NH", sh.NH},     {"NKV", sh.NKV}, {"hs", sh.hs}};
    auto record = [&](const char* kernel, const Spread& f, const Spread& bw, size_t mem) {
      row[kernel] = {{"forward_s", to_json(f)},
                     {"backward_s", to_json(bw)},
                     {"forward_tflops", fwd_flops / f.median / 1e12},
                     {"backward_tflops", 2.5 * fwd_flops / bw.median / 1e12},
                     {"memory_bytes", mem}};
      *md += sh.md_cells() + kernel + " | " + fmt_num(f.median * 1e3, 3) + " | " +
             fmt_num(bw.median * 1e3, 3) + " | " + fmt_num(fwd_flops / f.median / 1e12) + " | " +
             fmt_num(2.5 * fwd_flops / bw.median / 1e12) + " | " +
             fmt_num(double(mem) / (1 << 20)) + " MiB |\n";
    };
    Status st;
    // fused: lse + scratch, [B,NH,T] fp32 each. Where the device runs this shape on a library
    // (cuDNN), both that and the backend's own kernels (below the library layer) are timed.
    auto* layered = dynamic_cast<KernelsWrapper*>(&k);
    Kernels& own = layered != nullptr ? *layered->wrapped() : k;
    const KernelSupport lib =
        k.supports(KernelOp::kFusedAttention, {dt, sh.hs, sh.B, sh.T, sh.NH, sh.NKV});
    const bool on_library = lib.supported && layered != nullptr && lib.path.rfind("cudnn", 0) == 0;
    auto time_fused = [&](Kernels& kk, const char* label) -> Status {
      STRATA_ASSIGN_OR_RETURN(void* lse, b.random(rows_n, DType::kF32), sh.name);
      STRATA_ASSIGN_OR_RETURN(void* scr, b.random(rows_n, DType::kF32), sh.name);
      auto* L = static_cast<float*>(lse);
      const Spread f = time_per_call(
          o, 1,
          [&] {
            kk.fused_attention_forward(s, dt, y_fused, L, qkv, nullptr, sh.B, sh.T, sh.NH, sh.NKV,
                                       sh.hs);
            return dev.synchronize(s);
          },
          &st);
      const Spread bw = time_per_call(
          o, 1,
          [&] {
            kk.fused_attention_backward(s, dt, dqkv, static_cast<float*>(scr), dout, qkv, y_fused,
                                        L, nullptr, sh.B, sh.T, sh.NH, sh.NKV, sh.hs,
                                        /*accumulate=*/false);
            return dev.synchronize(s);
          },
          &st);
      STRATA_RETURN_IF_ERROR(st, std::string(label) + " attention " + sh.name);
      record(label, f, bw, 2 * rows_n * 4);
      return Status::ok();
    };
    if (on_library) {
      STRATA_RETURN_IF_ERROR(time_fused(k, "cudnn"), lib.path);
      row["cudnn"]["path"] = lib.path;
    } else {
      row["cudnn"] = "n/a: " + lib.path;
    }
    if (nd != nullptr) {
      const KernelSupport nd_lib =
          nd->kernels().supports(KernelOp::kFusedAttention, {dt, sh.hs, sh.B, sh.T, sh.NH, sh.NKV});
      if (nd_lib.supported && nd_lib.path.rfind("cudnn", 0) == 0) {
        STRATA_RETURN_IF_ERROR(time_fused(nd->kernels(), "cudnn-nd"), nd_lib.path);
        STRATA_RETURN_IF_ERROR(nd->synchronize(nd->compute_stream()), nd_lib.path);
        row["cudnn-nd"]["path"] = nd_lib.path;
      } else {
        row["cudnn-nd"] = "n/a: " + nd_lib.path;
      }
    }
    if (own.supports(KernelOp::kFusedAttention, {dt, sh.hs}).supported) {
      STRATA_RETURN_IF_ERROR(time_fused(own, "fused"), "the own fused kernels");
    } else {
      row["fused"] = "n/a: not supported for this dtype and head size";
    }
    cudnn_over_own(sh, row, md);
    // plain: att + scratch, [B,NH,T,T] fp32 each; only GQA-free shapes, and only if it fits.
    const size_t plain_mem = 2 * rows_n * size_t(sh.T) * 4;
    if (sh.NKV != sh.NH) {
      row["plain"] = "n/a: the plain kernels have no grouped-query heads";
    } else if (sh.T > 2048) {
      row["plain"] = "n/a: not timed above T=2048 (slow; it would need " +
                     fmt_num(double(plain_mem) / (1 << 30), 2) + " GiB)";
      *md += sh.md_cells() + "plain | not timed | | | | " + fmt_num(double(plain_mem) / (1 << 20)) +
             " MiB |\n";
    } else if (plain_mem + (dev.kind() == DeviceKind::kCuda ? size_t{1} << 30 : 0) > free_bytes) {
      row["plain"] = "n/a: needs " + fmt_num(double(plain_mem) / (1 << 30), 2) +
                     " GiB for the [B,NH,T,T] probabilities";
    } else {
      STRATA_ASSIGN_OR_RETURN(void* y, b.random(bt * C, dt), sh.name);
      STRATA_ASSIGN_OR_RETURN(void* att, dev.allocate(rows_n * sh.T * 4, "bench.att"), sh.name);
      auto scr = dev.allocate(rows_n * sh.T * 4, "bench.scratch");
      if (!scr.is_ok()) {
        dev.release(att);
        return scr.status().with_context(sh.name);
      }
      auto* A = static_cast<float*>(att);
      const Spread f = time_per_call(
          o, 1,
          [&] {
            k.attention_gqa_forward(s, dt, y, A, qkv, nullptr, sh.B, sh.T, sh.NH, sh.NH,
                                    (int(C)) / sh.NH);
            return dev.synchronize(s);
          },
          &st);
      const Spread bw = time_per_call(
          o, 1,
          [&] {
            k.attention_gqa_backward(s, dt, dqkv, static_cast<float*>(*scr), dout, qkv, A, nullptr,
                                     sh.B, sh.T, sh.NH, sh.NH, (int(C)) / sh.NH);
            return dev.synchronize(s);
          },
          &st);
      if (st.is_ok() && row.contains("fused") && row["fused"].is_object()) {
        Result<double> rms = rel_rms_bf16(dev, s, y, y_fused, bt * C);
        if (rms.is_ok()) {
          row["fused_vs_plain_rel_rms"] = *rms;
        } else {
          st = rms.status();
        }
      }
      dev.release(att);
      dev.release(*scr);
      STRATA_RETURN_IF_ERROR(st, std::string("plain attention ") + sh.name);
      record("plain", f, bw, plain_mem);
    }
    rows.push_back(row);
  }
  (*out)["dtype"] = "bf16";
  (*out)["flops_convention"] =
      "forward 2*B*NH*T^2*hs (causal half of QK^T and PV), backward 2.5x forward";
  (*out)["shapes"] = rows;
  return Status::ok();
}

// --- main ---------------------------------------------------------------------------------------

int validate_json(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: bench_device_ops validate-json FILE [KEY...]\n");
    return 2;
  }
  std::ifstream f(argv[2]);
  if (!f) {
    std::fprintf(stderr, "validate-json: cannot read %s\n", argv[2]);
    return 1;
  }
  json j = json::parse(f, nullptr, false);
  if (j.is_discarded()) {
    std::fprintf(stderr, "validate-json: %s is not valid JSON\n", argv[2]);
    return 1;
  }
  for (int i = 3; i < argc; ++i) {
    // KEY may be a path: a/b/c.
    const json* cur = &j;
    std::stringstream ss(argv[i]);
    std::string part;
    while (std::getline(ss, part, '/')) {
      if (!cur->is_object() || !cur->contains(part)) {
        std::fprintf(stderr, "validate-json: %s has no '%s'\n", argv[2], argv[i]);
        return 1;
      }
      cur = &(*cur)[part];
    }
  }
  return 0;
}

const char kUsage[] =
    "usage: bench_device_ops gemm|copy|attention|kernels [--backend cuda|cpu] [--quick]\n"
    "                        [--warmup N]\n"
    "                        [--repeats N] [--peak-tflops X] [--peak-gbs X] [--json FILE]\n"
    "                        [--md FILE]\n"
    "       bench_device_ops validate-json FILE [KEY...]\n";

int run(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "validate-json") return validate_json(argc, argv);
  Options o;
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  o.mode = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* v = nullptr;
    if (a == "--quick") {
      o.quick = true;
    } else if ((a == "--backend" || a == "--json" || a == "--md" || a == "--warmup" ||
                a == "--repeats" || a == "--peak-tflops" || a == "--peak-gbs") &&
               (v = value()) != nullptr) {
      if (a == "--backend") o.backend = v;
      if (a == "--json") o.json_path = v;
      if (a == "--md") o.md_path = v;
      if (a == "--warmup") o.warmup = std::max(0, std::atoi(v));
      if (a == "--repeats") o.repeats = std::max(1, std::atoi(v));
      if (a == "--peak-tflops") o.peak_tflops = std::atof(v);
      if (a == "--peak-gbs") o.peak_gbs = std::atof(v);
    } else {
      std::fprintf(stderr, "bench_device_ops: bad option '%s'\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  if (o.mode != "gemm" && o.mode != "copy" && o.mode != "attention" && o.mode != "kernels") {
    std::fprintf(stderr, "bench_device_ops: unknown mode '%s'\n%s", o.mode.c_str(), kUsage);
    return 2;
  }
  if (o.backend != "cuda" && o.backend != "cpu") {
    std::fprintf(stderr, "bench_device_ops: --backend must be cuda or cpu\n");
    return 2;
  }
  // The CUDA arena holds the benchmarks' buffers (24 GiB: the plain attention's probabilities at
  // T 2048 are the largest); the rest of the GPU stays free for cuDNN's workspaces, whose
  // deterministic backward keeps B*NH*T^2 bf16 scores on Hopper (8 GiB at T 16384, 16 heads).
  // `kernels` takes 4 GiB: a profiler that saves and restores the memory a kernel can reach
  // between its replays then copies no more than that.
  const size_t cuda_bytes = o.mode == "kernels" ? size_t{4} << 30 : size_t{24} << 30;
  auto dev = o.backend == "cuda"
                 ? create_cuda_device({.ordinal = 0, .capacity = cuda_bytes})
                 : create_cpu_device({.capacity = o.quick ? size_t{256} << 20 : size_t{8} << 30});
  if (!dev.is_ok()) {
    std::fprintf(stderr, "bench_device_ops: %s\n", dev.status().to_string().c_str());
    return 1;
  }
  // The attention's "cudnn-nd" rows: a second device on the same GPU (its arena only what its
  // streams need) whose kernels take cuDNN's non-deterministic backward.
  Result<std::unique_ptr<Device>> nd_dev = unavailable("not wanted");
  if (o.backend == "cuda" && o.mode == "attention") {
    nd_dev =
        create_cuda_device({.ordinal = 0, .capacity = size_t{64} << 20, .deterministic = false});
    if (!nd_dev.is_ok()) {
      std::fprintf(stderr, "bench_device_ops: no cudnn-nd rows: %s\n",
                   nd_dev.status().to_string().c_str());
    }
  }
  Device* nd = nd_dev.is_ok() ? nd_dev->get() : nullptr;
  // The elementwise rows' "one element a thread" column: a second device on the same GPU whose
  // kernel table read STRATA_CUDA_PACKED=0 when it was created.
  Result<std::unique_ptr<Device>> one_dev = unavailable("not wanted");
  if (o.backend == "cuda" && o.mode == "gemm") {
    const char* was = std::getenv("STRATA_CUDA_PACKED");
    const std::string saved = was ? was : "";
    ::setenv("STRATA_CUDA_PACKED", "0", 1);
    one_dev = create_cuda_device({.ordinal = 0, .capacity = size_t{8} << 30});
    if (was) {
      ::setenv("STRATA_CUDA_PACKED", saved.c_str(), 1);
    } else {
      ::unsetenv("STRATA_CUDA_PACKED");
    }
    if (!one_dev.is_ok()) {
      std::fprintf(stderr, "bench_device_ops: no one-element column: %s\n",
                   one_dev.status().to_string().c_str());
    }
  }
  Device* one = one_dev.is_ok() ? one_dev->get() : nullptr;
  json out = {{"mode", o.mode},   {"backend", o.backend}, {"device", (*dev)->name()},
              {"quick", o.quick}, {"warmup", o.warmup},   {"repeats", o.repeats}};
  std::string md;
  Status st = o.mode == "gemm"      ? bench_gemm(**dev, one, o, &out, &md)
              : o.mode == "copy"    ? bench_copy(**dev, o, &out, &md)
              : o.mode == "kernels" ? bench::run_kernels_once(**dev, o, &out, &md)
                                    : bench_attention(**dev, nd, o, &out, &md);
  if (!st.is_ok()) {
    std::fprintf(stderr, "bench_device_ops %s: %s\n", o.mode.c_str(), st.to_string().c_str());
    return 1;
  }
  if (o.json_path.empty()) {
    std::cout << out.dump(2) << "\n";
  } else {
    std::ofstream(o.json_path) << out.dump(2) << "\n";
  }
  if (!o.md_path.empty()) std::ofstream(o.md_path) << md;
  std::fputs(md.c_str(), stderr);
  return 0;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) { return strata::run(argc, argv); }
