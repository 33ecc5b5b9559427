// bench_device_ops gemm's elementwise rows: the bandwidth-bound ops of a training step (residual
// adds, the norms and their backwards, GELU, SwiGLU, the head's cross-entropy, the embedding's
// gradient over tokens that repeat as a text's do, the rotary embedding) at GPT-2 124M's
// shapes (N = 8 x 1024 rows, C = 768, the MLP's 4C, the padded vocabulary) and a ~1B Llama's
// (C = 2048, SwiGLU 5632, 32 query and 4 key-value heads of 64): ms per call, and GB/s of the bytes
// the op must move at least (each array read or written once) against the device's memory bandwidth
// (--peak-gbs). On CUDA each row also runs on a second device whose kernels take one element a
// thread's access (STRATA_CUDA_PACKED=0) instead of 16-byte packs, and gives the packs' speedup.
// Last, the gradient statistics and the device's optimizer step over a GPT-2 block's parameters.
// `bench_device_ops kernels` runs each of these ops once, for a kernel profiler.
#include <string>
#include <vector>

#include "strata/kernels.h"
#include "strata/optimizer.h"
#include "tests/bench/bench_device_common.h"

namespace strata::bench {
namespace {

struct ElemCase {
  std::string name, shape;
  double bytes;  // moved per call, at least
  std::function<void()> run;
};

// The cases on `dev`, their buffers in `b`.
Result<std::vector<ElemCase>> elementwise_cases(Device& dev, Buffers& b, bool quick) {
  const int N = quick ? 128 : 8 * 1024, C = quick ? 64 : 768, CL = quick ? 96 : 2048;
  const int H = quick ? 160 : 5632, Vp = quick ? 512 : 50304, V = quick ? 500 : 50257;
  const DType dt = DType::kBF16;
  const double es = double(dtype_size(dt)), n = double(N) * C, nl = double(N) * CL;
  const double n4 = 4 * n, nh = double(N) * H;
  // The rotary embedding rotates the query and key heads of a qkv row in place.
  const int NH = quick ? 4 : 32, KVH = quick ? 2 : 4, hs = quick ? 16 : 64;
  const double roped = double(N) * (NH + KVH) * hs;
  const RopeParams rope;
  const size_t big = std::max(
      {size_t(N) * 4 * C, size_t(N) * 2 * H, size_t(N) * CL, size_t(N) * (NH + 2 * KVH) * hs});
  Kernels& k = dev.kernels();
  Stream& s = dev.compute_stream();
  STRATA_ASSIGN_OR_RETURN(void* x, b.random(big, dt), "elementwise x");
  STRATA_ASSIGN_OR_RETURN(void* y, b.random(big, dt), "elementwise y");
  STRATA_ASSIGN_OR_RETURN(void* z, b.random(big, dt), "elementwise z");
  STRATA_ASSIGN_OR_RETURN(void* out, b.random(big, dt), "elementwise out");
  STRATA_ASSIGN_OR_RETURN(void* w, b.random(size_t(CL), dt, 0.5, 1.5), "elementwise weight");
  STRATA_ASSIGN_OR_RETURN(void* stats, b.random(2 * size_t(N), DType::kF32, 0.5, 1.5),
                          "elementwise stats");
  STRATA_ASSIGN_OR_RETURN(void* dw, b.random(2 * size_t(CL), DType::kF32), "elementwise dweight");
  STRATA_ASSIGN_OR_RETURN(void* logits, b.random(size_t(N) * Vp, dt, -4, 4), "logits");
  STRATA_ASSIGN_OR_RETURN(void* losses, b.random(size_t(N), DType::kF32), "losses");
  std::vector<int32_t> t(N);
  for (int i = 0; i < N; ++i) t[i] = int32_t((uint64_t(i) * 2654435761u) % uint64_t(V));
  STRATA_ASSIGN_OR_RETURN(void* targets, dev.allocate(t.size() * 4, "bench"), "targets");
  b.keep(targets);
  dev.copy_h2d(dev.h2d_stream(), targets, t.data(), t.size() * 4);
  // Tokens for the embedding's gradient: 2048 distinct, each repeated, the rows of one token
  // spread over the batch.
  const int distinct = std::min(N, 2048);
  std::vector<int32_t> tok(N);
  for (int i = 0; i < N; ++i) tok[i] = int32_t((uint64_t(i) * 2654435761u) % uint64_t(distinct));
  STRATA_ASSIGN_OR_RETURN(void* tokens, dev.allocate(tok.size() * 4, "bench"), "tokens");
  b.keep(tokens);
  dev.copy_h2d(dev.h2d_stream(), tokens, tok.data(), tok.size() * 4);
  STRATA_ASSIGN_OR_RETURN(void* dwte, b.random(size_t(V) * C, DType::kF32), "embedding gradient");
  // A GPT-2 block's parameters (12 C^2 + 13 C): the gradient statistics and the device's
  // optimizer step over its fp32 gradient, master weights and moments, new bf16 parameters.
  const size_t P = size_t(12) * C * C + size_t(13) * C;
  STRATA_ASSIGN_OR_RETURN(void* grad, b.random(P, DType::kF32, -1e-3f, 1e-3f), "block gradient");
  STRATA_ASSIGN_OR_RETURN(void* master, b.random(P, DType::kF32), "block master weights");
  STRATA_ASSIGN_OR_RETURN(void* m1, b.random(P, DType::kF32, -1e-4f, 1e-4f), "block moment 1");
  STRATA_ASSIGN_OR_RETURN(void* m2, b.random(P, DType::kF32, 0.0f, 1e-6f), "block moment 2");
  STRATA_ASSIGN_OR_RETURN(void* lp, b.random(P, dt), "block parameters");
  STRATA_ASSIGN_OR_RETURN(void* norm_sq, b.random(2, DType::kF32), "gradient norm");  // a double
  OptimizerHyper hyper;
  hyper.kind = OptimizerKind::kAdamW;
  hyper.lr = 1e-4f;
  hyper.weight_decay = 0.1f;
  hyper.step = 10;
  const ShardState shard{.n = P,
                         .grad = grad,
                         .grad_dtype = DType::kF32,
                         .master = static_cast<float*>(master),
                         .m = m1,
                         .v = m2,
                         .moment_dtype = DType::kF32,
                         .lp_out = lp,
                         .lp_dtype = dt};
  STRATA_RETURN_IF_ERROR(dev.synchronize(dev.h2d_stream()), "uploading the targets");
  float* mean = static_cast<float*>(stats);
  float* rstd = mean + N;
  float* dwf = static_cast<float*>(dw);
  const auto* tg = static_cast<const int32_t*>(targets);
  const auto* tk = static_cast<const int32_t*>(tokens);
  const int T = std::min(N, 1024), B = N / T;
  auto rows = [](int r, int c) { return std::to_string(r) + " x " + std::to_string(c); };
  return std::vector<ElemCase>{
      {"residual_forward", rows(N, C), 3 * n * es,
       [=, &k, &s] { k.residual_forward(s, dt, out, x, y, size_t(n)); }},
      {"add_inplace", rows(N, C), 3 * n * es,
       [=, &k, &s] { k.add_inplace(s, dt, out, x, size_t(n)); }},
      {"layernorm_forward", rows(N, C), 2 * n * es,
       [=, &k, &s] { k.layernorm_forward(s, dt, out, mean, rstd, x, w, w, N, C); }},
      {"residual_layernorm_forward", rows(N, C), 4 * n * es,
       [=, &k, &s] { k.residual_layernorm_forward(s, dt, out, z, mean, rstd, x, y, w, w, N, C); }},
      {"layernorm_backward (dres)", rows(N, C), 4 * n * es,
       [=, &k, &s] {
         k.layernorm_backward(s, dt, out, z, dwf, dwf + C, y, x, w, mean, rstd, N, C);
       }},
      {"rmsnorm_forward", rows(N, CL), 2 * nl * es,
       [=, &k, &s] { k.rmsnorm_forward(s, dt, out, rstd, x, w, 1e-5f, N, CL); }},
      {"residual_rmsnorm_forward", rows(N, CL), 4 * nl * es,
       [=, &k, &s] { k.residual_rmsnorm_forward(s, dt, out, z, rstd, x, y, w, 1e-5f, N, CL); }},
      {"rmsnorm_backward (dres)", rows(N, CL), 4 * nl * es,
       [=, &k, &s] { k.rmsnorm_backward(s, dt, out, z, dwf, y, x, w, rstd, N, CL); }},
      {"gelu_forward", rows(N, 4 * C), 2 * n4 * es,
       [=, &k, &s] { k.gelu_forward(s, dt, out, x, size_t(n4)); }},
      {"gelu_backward", rows(N, 4 * C), 4 * n4 * es,
       [=, &k, &s] { k.gelu_backward(s, dt, out, x, y, size_t(n4)); }},
      {"swiglu_forward", rows(N, H), 3 * nh * es,
       [=, &k, &s] { k.swiglu_forward(s, dt, out, x, N, H); }},
      {"swiglu_backward", rows(N, H), 5 * nh * es,
       [=, &k, &s] { k.swiglu_backward(s, dt, out, x, y, N, H); }},
      {"rope_forward", rows(N, (NH + 2 * KVH) * hs), 2 * roped * es,
       [=, &k, &s] { k.rope_forward(s, dt, out, rope, nullptr, B, T, NH, KVH, hs); }},
      {"rope_backward", rows(N, (NH + 2 * KVH) * hs), 2 * roped * es,
       [=, &k, &s] { k.rope_backward(s, dt, out, rope, nullptr, B, T, NH, KVH, hs); }},
      {"crossentropy_forward_backward", rows(N, Vp), 2 * double(N) * Vp * es,
       [=, &k, &s] {
         k.crossentropy_forward_backward(s, dt, static_cast<float*>(losses), logits, tg, 1.0f / N,
                                         N, V, Vp);
       }},
      {"encoder_backward (" + std::to_string(distinct) + " tokens)", rows(N, C),
       n * es + 2.0 * distinct * C * 4,
       [=, &k, &s] {
         k.encoder_backward(s, dt, static_cast<float*>(dwte), nullptr, y, tk, nullptr, B, T, C);
       }},
      {"norm_sq_and_nonfinite (fp32)", std::to_string(P), 4.0 * double(P),
       [=, &k, &s] {
         k.norm_sq_and_nonfinite(s, static_cast<double*>(norm_sq), static_cast<float*>(grad), P);
       }},
      {"optimizer_step (AdamW, fp32 state)", std::to_string(P), (4.0 + 24.0 + es) * double(P),
       [=, &k, &s] { k.optimizer_step(s, hyper, shard); }},
  };
}

// Seconds per call of each case on `dev`.
Result<std::vector<Spread>> time_cases(Device& dev, const Options& o,
                                       std::vector<ElemCase>* cases_out) {
  Buffers b(dev);
  STRATA_ASSIGN_OR_RETURN(std::vector<ElemCase> cases, elementwise_cases(dev, b, o.quick),
                          "elementwise buffers on " + dev.name());
  const int iters = dev.kind() == DeviceKind::kCuda ? 20 : 1;
  Stream& s = dev.compute_stream();
  std::vector<Spread> t;
  Status st;
  for (const ElemCase& c : cases) {
    t.push_back(time_per_call(
        o, iters,
        [&] {
          for (int i = 0; i < iters; ++i) c.run();
          return dev.synchronize(s);
        },
        &st));
    STRATA_RETURN_IF_ERROR(st, "elementwise op " + c.name);
  }
  if (cases_out) *cases_out = std::move(cases);
  return t;
}

}  // namespace

Status run_kernels_once(Device& dev, const Options& o, json* out, std::string* md) {
  Buffers b(dev);
  STRATA_ASSIGN_OR_RETURN(std::vector<ElemCase> cases, elementwise_cases(dev, b, o.quick),
                          "elementwise buffers on " + dev.name());
  Stream& s = dev.compute_stream();
  *md += "\n| op (bf16), one call | shape | ms, with its launch |\n|---|---|---|\n";
  json rows = json::array();
  for (const ElemCase& c : cases) {
    const auto t0 = std::chrono::steady_clock::now();
    c.run();
    STRATA_RETURN_IF_ERROR(dev.synchronize(s), "op " + c.name);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rows.push_back({{"name", c.name}, {"shape", c.shape}, {"time_s", secs}});
    *md += "| " + c.name + " | " + c.shape + " | " + fmt_num(secs * 1e3, 3) + " |\n";
  }
  (*out)["kernels"] = rows;
  return Status::ok();
}

Status bench_elementwise(Device& dev, Device* one_element, const Options& o, json* out,
                         std::string* md) {
  std::vector<ElemCase> cases;
  STRATA_ASSIGN_OR_RETURN(std::vector<Spread> t, time_cases(dev, o, &cases), "");
  std::vector<Spread> t1;
  if (one_element) {
    STRATA_ASSIGN_OR_RETURN(t1, time_cases(*one_element, o, nullptr), "");
  }
  *md += "\n| elementwise op (bf16) | shape | MB moved | ms | GB/s | % of " +
         (o.peak_gbs > 0 ? fmt_num(o.peak_gbs, 0) + " GB/s" : std::string("peak (unknown)")) +
         " | one element a thread: ms | packs' speedup |\n|---|---|---|---|---|---|---|---|\n";
  json rows = json::array();
  for (size_t i = 0; i < cases.size(); ++i) {
    const ElemCase& c = cases[i];
    const double gbs = c.bytes / t[i].median / 1e9;
    json row = {{"name", c.name},
                {"shape", c.shape},
                {"bytes", c.bytes},
                {"time_s", to_json(t[i])},
                {"gbps", gbs}};
    std::string share = "n/a", one = "n/a", speedup = "n/a";
    if (o.peak_gbs > 0) {
      row["peak_share"] = gbs / o.peak_gbs;
      share = fmt_num(100 * gbs / o.peak_gbs) + "%";
    }
    if (!t1.empty()) {
      row["one_element_s"] = to_json(t1[i]);
      row["packed_speedup"] = t1[i].median / t[i].median;
      one = fmt_num(t1[i].median * 1e3, 3);
      speedup = fmt_num(t1[i].median / t[i].median, 2) + "x";
    }
    rows.push_back(row);
    *md += "| " + c.name + " | " + c.shape + " | " + fmt_num(c.bytes / 1e6) + " | " +
           fmt_num(t[i].median * 1e3, 3) + " | " + fmt_num(gbs, 0) + " | " + share + " | " + one +
           " | " + speedup + " |\n";
  }
  (*out)["peak_gbps"] = o.peak_gbs > 0 ? json(o.peak_gbs) : json(nullptr);
  (*out)["elementwise"] = rows;
  return Status::ok();
}

}  // namespace strata::bench
