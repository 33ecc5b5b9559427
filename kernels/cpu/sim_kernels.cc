#include "kernels/cpu/sim_kernels.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "strata/simulated_device.h"

namespace strata {

void SimClock::run(double seconds, Clock::time_point start) {
  Clock::time_point until;
  {
    std::lock_guard<std::mutex> l(mu_);
    const auto begin = std::max(start, busy_until_);
    busy_until_ = begin + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(std::max(0.0, seconds)));
    until = busy_until_;
  }
  const auto ahead = std::chrono::duration<double, std::micro>(until - Clock::now()).count();
  if (ahead > kSleepAheadUs) std::this_thread::sleep_until(until);
}

SimClock::Clock::time_point SimClock::end() {
  std::lock_guard<std::mutex> l(mu_);
  return busy_until_;
}

namespace {

class SimKernels final : public Kernels {
 public:
  SimKernels(Device& dev, SimClocks& clocks, const SimulatedDeviceOptions& p, SimWroteFn wrote)
      : dev_(&dev), clocks_(&clocks), p_(p), wrote_(std::move(wrote)) {}
  // The tally: every op adds its time to `tally` and enqueues nothing.
  SimKernels(const SimulatedDeviceOptions& p, SimTally* tally) : p_(p), tally_(tally) {}

  void encoder_forward(Stream& s, DType dt, void*, const int32_t*, const int32_t* pos, const void*,
                       const void* wpe, int B, int T, int C) override {
    mem(s, double(B) * T * (C * es(dt) * (wpe ? 3 : 2) + (pos ? 8 : 4)));
  }
  void encoder_backward(Stream& s, DType dt, float*, float* dwpe, const void*, const int32_t*,
                        const int32_t* pos, int B, int T, int C) override {
    mem(s, double(B) * T * (C * (es(dt) + 8.0 * (dwpe ? 2 : 1)) + (pos ? 8 : 4)));
  }
  void layernorm_forward(Stream& s, DType dt, void*, float*, float*, const void*, const void*,
                         const void*, int N, int C) override {
    mem(s, double(N) * (2.0 * C * es(dt) + 8));
  }
  void layernorm_backward(Stream& s, DType dt, void*, const void* dres, float*, float*, const void*,
                          const void*, const void*, const float*, const float*, int N,
                          int C) override {
    // dout and inp read, dinp written, dres read when given; mean and rstd; the parameters.
    mem(s, double(N) * ((dres ? 4.0 : 3.0) * C * es(dt) + 8) + 16.0 * C);
  }
  void matmul_forward(Stream& s, DType dt, void*, const void*, const void*, const void*, int N,
                      int C, int OC) override {
    gemm(s, 2.0 * N * C * OC, (double(N) * C + double(OC) * C + double(N) * OC) * es(dt));
  }
  void matmul_gelu_forward(Stream& s, DType dt, void*, void*, const void*, const void*, const void*,
                           int N, int C, int OC) override {
    // One GEMM whose epilogue writes both the pre-activation and the GELU.
    gemm(s, 2.0 * N * C * OC, (double(N) * C + double(OC) * C + 2.0 * N * OC) * es(dt));
  }
  // inp read, dinp written (and read before, when accumulated), dout and the weight read.
  void matmul_backward(Stream& s, DType dt, void*, float* dweight, float* dbias, const void*,
                       const void*, const void*, int N, int C, int OC, bool accumulate) override {
    const double products = dweight ? 2.0 : 1.0;
    double bytes = ((accumulate ? 3.0 : 2.0) * N * C + double(N) * OC + double(OC) * C) * es(dt);
    if (dweight) bytes += 8.0 * OC * C;  // fp32 accumulate: read and write
    if (dbias) bytes += double(N) * OC * es(dt);
    gemm(s, products * 2.0 * N * C * OC, bytes);
  }
  // The DGELU epilogue reads pre once more than matmul_backward; gelu_backward's launch and its
  // four passes over [N,C] are gone.
  void matmul_backward_gelu(Stream& s, DType dt, void*, float* dweight, float* dbias, const void*,
                            const void*, const void*, const void*, int N, int C, int OC) override {
    const double products = dweight ? 2.0 : 1.0;
    double bytes = (3.0 * N * C + double(N) * OC + double(OC) * C) * es(dt);
    if (dweight) bytes += 8.0 * OC * C;
    if (dbias) bytes += double(N) * OC * es(dt);
    gemm(s, products * 2.0 * N * C * OC, bytes);
  }
  // One launch: a and b read, res and out written (the norm reads res back from the cache).
  void residual_layernorm_forward(Stream& s, DType dt, void*, void*, float*, float*, const void*,
                                  const void*, const void*, const void*, int N, int C) override {
    mem(s, double(N) * (4.0 * C * es(dt) + 8));
  }
  void residual_rmsnorm_forward(Stream& s, DType dt, void*, void*, float*, const void*, const void*,
                                const void*, float, int N, int C) override {
    mem(s, double(N) * (4.0 * C * es(dt) + 4));
  }
  // What the CUDA backend's own kernels support (its cuDNN path is a faster rate, not modeled).
  KernelSupport supports(KernelOp op, const OpShape& shape) const override {
    switch (op) {
      case KernelOp::kFusedAttention:
        if (shape.dt == DType::kF32 || (shape.hs != 64 && shape.hs != 128)) {
          return {false, "simulated: the CUDA fused attention runs bf16/fp16 with hs 64 or 128"};
        }
        return {true, "simulated"};
      case KernelOp::kMatmulGelu:
        if (shape.OC <= 0 || shape.OC % 8 != 0) {
          return {false, "simulated: cuBLASLt's GELU epilogue needs OC a multiple of 8"};
        }
        return {true, "simulated"};
      case KernelOp::kResidualNorm:
        return {true, "simulated"};
      case KernelOp::kMatmulBackwardGelu:
        if (shape.C <= 0 || shape.C % 8 != 0) {
          return {false, "simulated: cuBLASLt's DGELU epilogue needs C a multiple of 8"};
        }
        return {true, "simulated"};
      case KernelOp::kDropout:
      case KernelOp::kAttentionDecode:
        return {true, "simulated"};
    }
    return {false, "unknown op"};
  }
  // Attention with positions (masked per sequence) is timed as the full causal call: the
  // simulated device does not read the positions, and a packed window's time is at most that.
  void fused_attention_forward(Stream& s, DType dt, void*, float*, const void*, const int32_t*,
                               int B, int T, int NH, int NKV, int hs) override {
    attention(s, square_flops(B, T, NH, hs), false, 1.0,
              double(B) * T * (NH + 2.0 * NKV + NH) * hs * es(dt));
  }
  // qkv read, dqkv written (and read before, when accumulated), out and dout read.
  void fused_attention_backward(Stream& s, DType dt, void*, float*, const void*, const void*,
                                const void*, const float*, const int32_t*, int B, int T, int NH,
                                int NKV, int hs, bool accumulate) override {
    attention(
        s, square_flops(B, T, NH, hs), true, 1.0,
        double(B) * T * ((accumulate ? 3.0 : 2.0) * (NH + 2.0 * NKV) + 2.0 * NH) * hs * es(dt));
  }
  void attention_gqa_forward(Stream& s, DType dt, void*, float*, const void*, const int32_t*, int B,
                             int T, int NH, int KVH, int hs) override {
    // The plain kernels: the [B,NH,T,T] probabilities through memory, ~1/50 of the fused rate.
    attention(s, square_flops(B, T, NH, hs), false, kPlainSlowdown,
              double(B) * T * (NH + 2.0 * KVH + NH) * hs * es(dt) + 4.0 * B * NH * T * T);
  }
  void attention_gqa_backward(Stream& s, DType dt, void*, float*, const void*, const void*,
                              const float*, const int32_t*, int B, int T, int NH, int KVH,
                              int hs) override {
    attention(s, square_flops(B, T, NH, hs), true, kPlainSlowdown,
              double(B) * T * (2.0 * (NH + 2.0 * KVH) + NH) * hs * es(dt) + 8.0 * B * NH * T * T);
  }
  void rmsnorm_forward(Stream& s, DType dt, void*, float*, const void*, const void*, float, int N,
                       int C) override {
    mem(s, double(N) * (2.0 * C * es(dt) + 4));
  }
  void rmsnorm_backward(Stream& s, DType dt, void*, const void* dres, float*, const void*,
                        const void*, const void*, const float*, int N, int C) override {
    mem(s, double(N) * ((dres ? 4.0 : 3.0) * C * es(dt) + 4) + 8.0 * C);
  }
  void swiglu_forward(Stream& s, DType dt, void*, const void*, int N, int H) override {
    mem(s, 3.0 * N * H * es(dt));
  }
  void swiglu_backward(Stream& s, DType dt, void*, const void*, const void*, int N,
                       int H) override {
    mem(s, 5.0 * N * H * es(dt));
  }
  void rope_forward(Stream& s, DType dt, void*, const RopeParams&, const int32_t*, int B, int T,
                    int NH, int KVH, int hs) override {
    mem(s, 2.0 * B * T * (NH + KVH) * hs * es(dt));
  }
  void rope_backward(Stream& s, DType dt, void*, const RopeParams&, const int32_t*, int B, int T,
                     int NH, int KVH, int hs) override {
    mem(s, 2.0 * B * T * (NH + KVH) * hs * es(dt));
  }
  // Read the query and key heads, write them and their saved copy.
  void qk_norm_forward(Stream& s, DType dt, void*, void*, float*, const void*, const void*, float,
                       int N, int NH, int NKV, int hs) override {
    mem(s, double(N) * (NH + NKV) * (3.0 * hs * es(dt) + 4));
  }
  // Read the gradient heads twice (weights' sums, then the input gradient) and the saved heads
  // twice, write the gradient heads.
  void qk_norm_backward(Stream& s, DType dt, void*, float*, float*, const void*, const void*,
                        const void*, const float*, int N, int NH, int NKV, int hs) override {
    mem(s, double(N) * (NH + NKV) * (5.0 * hs * es(dt) + 8));
  }
  void gelu_forward(Stream& s, DType dt, void*, const void*, size_t n) override {
    mem(s, 2.0 * n * es(dt));
  }
  void gelu_backward(Stream& s, DType dt, void*, const void*, const void*, size_t n) override {
    mem(s, 4.0 * n * es(dt));
  }
  void residual_forward(Stream& s, DType dt, void*, const void*, const void*, size_t n) override {
    mem(s, 3.0 * n * es(dt));
  }
  void add_inplace(Stream& s, DType dt, void*, const void*, size_t n) override {
    mem(s, 3.0 * n * es(dt));
  }
  void gather_rows(Stream& s, DType dt, void*, const void*, const int32_t*, const float*, int n,
                   int C) override {
    mem(s, 2.0 * n * C * es(dt) + 8.0 * n);
  }
  void scatter_add_rows(Stream& s, DType dt, void*, const void*, const int32_t*, const float*,
                        int n, int C) override {
    mem(s, 3.0 * n * C * es(dt) + 8.0 * n);
  }
  void row_dots(Stream& s, DType dt, float*, const void*, const int32_t*, const void*, int n,
                int C) override {
    mem(s, 2.0 * n * C * es(dt) + 8.0 * n);
  }
  void crossentropy_forward_backward(Stream& s, DType dt, float* losses, void*, const int32_t*,
                                     float, int N, int V, int Vp) override {
    // Read the logits, write their gradients; the losses those of a model that knows nothing.
    const double bytes = 2.0 * N * Vp * es(dt) + 8.0 * N;
    const double t = p_.launch_us * 1e-6 + bytes / hbm();
    if (tally_) {
      add(t, 0, bytes);
      return;
    }
    SimClock* clock = &clocks_->of(*dev_, s);
    const float loss = std::log(float(V));
    const SimWroteFn* wrote = &wrote_;
    const auto launched = SimClock::Clock::now();
    dev_->host_fn(s, [clock, t, losses, N, loss, wrote, launched] {
      std::fill(losses, losses + N, loss);
      if (*wrote) (*wrote)(losses, size_t(N) * sizeof(float));
      clock->run(t, launched);
    });
  }
  void cast(Stream& s, void*, DType dst_t, const void*, DType src_t, size_t n) override {
    mem(s, double(n) * (dtype_size(dst_t) + dtype_size(src_t)));
  }
  void norm_sq_and_nonfinite(Stream& s, double*, const float*, size_t n) override {
    mem(s, 4.0 * n);  // the trainer takes the norm from device.simulate_grad_norm
  }
  void scale(Stream& s, float*, float, size_t n) override { mem(s, 8.0 * n); }
  void scale_rows(Stream& s, DType dt, void*, const float*, int rows, size_t row_elems) override {
    mem(s, 2.0 * double(dtype_size(dt)) * double(rows) * double(row_elems));
  }
  void dropout(Stream& s, DType dt, void*, const void*, size_t n, float, uint64_t) override {
    mem(s, 2.0 * n * es(dt));
  }
  // Reads every cached key and value up to each new position once per query head group.
  void attention_decode(Stream& s, DType dt, void*, void*, void*, const void*, int B, int T,
                        int pos0, int, int NH, int KVH, int hs) override {
    const double keys = double(B) * T * (pos0 + (T + 1) / 2.0);
    mem(s, (keys * 2.0 * KVH + double(B) * T * (2.0 * NH + 2.0 * KVH)) * hs * es(dt));
  }
  void quantize(Stream& s, int bits, DType dt, void*, float*, const void*, size_t n,
                int block) override {
    mem(s, double(n) * es(dt) + double(quantized_bytes(bits, n)) + 4.0 * quantize_blocks(n, block));
  }
  void dequantize(Stream& s, int bits, DType dt, void*, const void*, const float*, size_t n,
                  int block, bool accumulate) override {
    mem(s, double(n) * es(dt) * (accumulate ? 2 : 1) + double(quantized_bytes(bits, n)) +
               4.0 * quantize_blocks(n, block));
  }
  void dequantize_nf4(Stream& s, DType dt, void*, const uint8_t*, const float*, size_t n) override {
    mem(s, double(n) * es(dt) + n / 2.0 + n / 16.0);
  }
  void optimizer_step(Stream& s, const OptimizerHyper&, const ShardState& st) override {
    // grad, master, moments read and written, the new parameters written.
    const double moments = 2.0 * dtype_size(st.moment_dtype);
    mem(s, double(st.n) * (dtype_size(st.grad_dtype) + 8.0 + 2.0 * moments +
                           (st.lp_out ? dtype_size(st.lp_dtype) : 0)));
  }

 private:
  // The plain attention kernels' rate against the fused ones' (H200: 0.78 vs 44.8 TFLOP/s
  // forward, 1.49 vs 29.7 backward at GPT-2 124M's shape).
  static constexpr double kPlainSlowdown = 50.0;

  static double es(DType dt) { return double(dtype_size(dt)); }
  double hbm() const { return p_.hbm_gbps * 1e9; }
  // Attention's multiply-adds, forward: QK^T and PV over the whole T x T square (causal
  // attention does half: simulated_attention_seconds).
  static double square_flops(int B, int T, int NH, int hs) {
    return 4.0 * B * NH * double(T) * T * hs;
  }
  // The op takes `seconds` after its launch; `flops` and `bytes` are what the tally counts.
  void charge(Stream& s, double seconds, double flops, double bytes) {
    const double t = p_.launch_us * 1e-6 + seconds;
    if (tally_) {
      add(t, flops, bytes);
      return;
    }
    SimClock* clock = &clocks_->of(*dev_, s);
    const auto launched = SimClock::Clock::now();
    dev_->host_fn(s, [clock, t, launched] { clock->run(t, launched); });
  }
  void add(double t, double flops, double bytes) {
    tally_->seconds += t;
    ++tally_->kernels;
    tally_->flops += flops;
    tally_->bytes += bytes;
  }
  void mem(Stream& s, double bytes) { charge(s, bytes / hbm(), 0, bytes); }
  void gemm(Stream& s, double flops, double bytes) {
    charge(s, std::max(flops / (p_.gemm_tflops * 1e12), bytes / hbm()), flops, bytes);
  }
  // Causal attention over `square` (square_flops), the plain kernels `slowdown` times slower
  // than the fused ones.
  void attention(Stream& s, double square, bool backward, double slowdown, double bytes) {
    const double seconds = slowdown * simulated_attention_seconds(p_, square, backward);
    charge(s, std::max(seconds, bytes / hbm()), (backward ? 2.5 : 1.0) * square / 2.0, bytes);
  }

  Device* dev_ = nullptr;  // null in the tally
  SimClocks* clocks_ = nullptr;
  const SimulatedDeviceOptions p_;
  const SimWroteFn wrote_;
  SimTally* tally_ = nullptr;
};

}  // namespace

std::unique_ptr<Kernels> create_sim_kernels(Device& device, SimClocks& clocks,
                                            const SimulatedDeviceOptions& peaks, SimWroteFn wrote) {
  return std::make_unique<SimKernels>(device, clocks, peaks, std::move(wrote));
}

std::unique_ptr<Kernels> create_simulated_kernel_tally(const SimulatedDeviceOptions& peaks,
                                                       SimTally* tally) {
  return std::make_unique<SimKernels>(peaks, tally);
}

}  // namespace strata
