// The fused attention (Kernels::fused_attention_*) without a GPU:
//   - the CPU backend's (kernels/cpu/flash_attention.cc) against a double-precision scalar
//     reference (tests/attention_reference.h) and against the plain attention
//     (attention_forward/backward) it replaces, in fp32, bf16 and fp16, with grouped-query heads;
//   - the CUDA kernels themselves (kernels/cuda/flash_attention_kernels.cuh) run on a CPU
//     emulation of CUDA (tests/cuda_emu.h) against the same reference, for bf16 and fp16, head
//     sizes 64 and 128, T not a multiple of the tile, grouped-query heads, with the threads of
//     each block scheduled in two orders (which exposes missing barriers) giving identical bits;
//   - both with packed rows (positions: attention masked per sequence), skipped key tiles
//     included.
// What the emulation cannot show (timing, the real fragment layouts, the hardware's fp32
// accumulation order) is left to tests/cuda_flash_attention_test.cc on a GPU.

// clang-format off
#include "tests/cuda_emu.h"  // first: the CPU emulation the kernels below compile against
// clang-format on

#include <gtest/gtest.h>

#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/flash_attention_kernels.cuh"
#include "strata/device.h"
#include "strata/kernels.h"
#include "tests/attention_reference.h"

namespace strata {
namespace {

using test::AttnShape;
using test::Buffer;
using test::compare_close;

constexpr uint64_t kSeed = 20261122;

// Tolerances of the comparison with the double reference (|err| <= rtol (|ref| + rms(ref))):
// fp32 from summation order; bf16/fp16 from rounding the inputs' products' sums, the
// probabilities and dS (the CUDA kernels round them to the input type for the tensor cores)
// and the outputs.
double rtol(DType dt) {
  switch (dt) {
    case DType::kF32:
      return 2e-5;
    case DType::kBF16:
      return 1e-2;
    default:
      return 3e-3;
  }
}

// Sequence lengths of packed windows: short and long ones, so that key tiles of 64 are skipped
// whole (a row deep in a 90-token sequence) and sequences start mid-tile.
const std::vector<int> kPackedLengths = {70, 5, 1, 90, 17, 33};

// The inputs of one forward/backward case, in dtype dt; `packed`: rows hold several sequences
// (positions from kPackedLengths), attention masked per sequence.
struct Case {
  AttnShape s;
  DType dt;
  Buffer qkv, dout, dqkv0;   // dqkv0: the gradient buffer's contents before the backward
  std::vector<int32_t> pos;  // empty: no positions (plain causal)
  std::vector<double> out_ref, lse_ref, dqkv_ref;

  Case(AttnShape shape, DType t, bool packed = false) : s(shape), dt(t) {
    std::mt19937_64 rng(kSeed + shape.T * 131 + shape.hs * 7 + shape.NKV);
    qkv = test::random_buffer(dt, s.qkv_elems(), rng, -2.0f, 2.0f);
    dout = test::random_buffer(dt, s.out_elems(), rng, -1.0f, 1.0f);
    dqkv0 = test::random_buffer(dt, s.qkv_elems(), rng, -1.0f, 1.0f);
    if (packed) pos = test::packed_positions(s.B, s.T, kPackedLengths);
    test::reference_attention_forward(s, qkv.values(), &out_ref, &lse_ref, positions_or_null());
    dqkv_ref =
        test::reference_attention_backward(s, qkv.values(), dout.values(), positions_or_null());
    const std::vector<double> before = dqkv0.values();
    for (size_t i = 0; i < dqkv_ref.size(); ++i) dqkv_ref[i] += before[i];
  }
  const std::vector<int32_t>* positions_or_null() const { return pos.empty() ? nullptr : &pos; }
  const int32_t* pos_ptr() const { return pos.empty() ? nullptr : pos.data(); }
};

std::vector<double> as_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// --- the CPU backend ------------------------------------------------------------------------

class FusedAttentionCpu : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    auto d = create_cpu_device({.capacity = 64 << 20, .threads = 2});
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    dev_ = std::move(d).value();
  }
  // Runs forward and backward on the CPU backend (its device memory is host memory).
  void run(Case& c, Buffer* out, std::vector<float>* lse, Buffer* dqkv) {
    Kernels& k = dev_->kernels();
    Stream& st = dev_->compute_stream();
    ASSERT_TRUE(k.supports(KernelOp::kFusedAttention, {c.dt, c.s.hs}).supported);
    *out = Buffer(c.dt, c.s.out_elems());
    lse->assign(c.s.rows(), 0.0f);
    *dqkv = c.dqkv0;
    std::vector<float> scratch(c.s.rows());
    k.fused_attention_forward(st, c.dt, out->data(), lse->data(), c.qkv.data(), c.pos_ptr(), c.s.B,
                              c.s.T, c.s.NH, c.s.NKV, c.s.hs);
    k.fused_attention_backward(st, c.dt, dqkv->data(), scratch.data(), c.dout.data(), c.qkv.data(),
                               out->data(), lse->data(), c.pos_ptr(), c.s.B, c.s.T, c.s.NH, c.s.NKV,
                               c.s.hs, /*accumulate=*/true);
    ASSERT_TRUE(dev_->synchronize(st).is_ok());
  }
  // The plain attention (attention_gqa_*) on the same case gives the fused op's numbers.
  void plain_equals_fused(bool packed);
  std::unique_ptr<Device> dev_;
};

TEST_P(FusedAttentionCpu, MatchesTheScalarReference) {
  const DType dt = GetParam();
  for (AttnShape s :
       {AttnShape{2, 45, 3, 3, 16}, AttnShape{1, 130, 4, 2, 64}, AttnShape{2, 70, 2, 1, 128}}) {
    SCOPED_TRACE(s.name());
    Case c(s, dt);
    Buffer out, dqkv;
    std::vector<float> lse;
    run(c, &out, &lse, &dqkv);
    EXPECT_EQ(compare_close(out.values(), c.out_ref, rtol(dt)), "") << "out";
    EXPECT_EQ(compare_close(as_double(lse), c.lse_ref, 1e-5), "") << "lse";
    EXPECT_EQ(compare_close(dqkv.values(), c.dqkv_ref, rtol(dt)), "") << "dqkv";
  }
}

// Packed rows (positions): each query sees only its own sequence, as the reference.
TEST_P(FusedAttentionCpu, PackedRowsMatchTheScalarReference) {
  const DType dt = GetParam();
  for (AttnShape s : {AttnShape{2, 150, 2, 1, 16}, AttnShape{3, 100, 4, 2, 32}}) {
    SCOPED_TRACE(s.name());
    Case c(s, dt, /*packed=*/true);
    Buffer out, dqkv;
    std::vector<float> lse;
    run(c, &out, &lse, &dqkv);
    EXPECT_EQ(compare_close(out.values(), c.out_ref, rtol(dt)), "") << "out";
    EXPECT_EQ(compare_close(as_double(lse), c.lse_ref, 1e-5), "") << "lse";
    EXPECT_EQ(compare_close(dqkv.values(), c.dqkv_ref, rtol(dt)), "") << "dqkv";
  }
}

// With as many key/value heads as query heads the fused op takes the plain op's [B,T,3C] input
// and must give its numbers.
TEST_P(FusedAttentionCpu, MatchesThePlainAttention) {
  for (bool packed : {false, true}) {
    SCOPED_TRACE(packed ? "packed" : "one sequence per row");
    plain_equals_fused(packed);
  }
}

void FusedAttentionCpu::plain_equals_fused(bool packed) {
  const DType dt = GetParam();
  const AttnShape s{2, 77, 4, 4, 32};
  const int C = s.NH * s.hs;
  Case c(s, dt, packed);
  Buffer out, dqkv;
  std::vector<float> lse;
  run(c, &out, &lse, &dqkv);

  Buffer out_plain(dt, s.out_elems());
  Buffer dqkv_plain = c.dqkv0;
  std::vector<float> att(size_t(s.B) * s.NH * s.T * s.T), scratch(att.size());
  Kernels& k = dev_->kernels();
  Stream& st = dev_->compute_stream();
  k.attention_gqa_forward(st, dt, out_plain.data(), att.data(), c.qkv.data(), c.pos_ptr(), s.B, s.T,
                          s.NH, s.NH, C / s.NH);
  k.attention_gqa_backward(st, dt, dqkv_plain.data(), scratch.data(), c.dout.data(), c.qkv.data(),
                           att.data(), c.pos_ptr(), s.B, s.T, s.NH, s.NH, C / s.NH);
  ASSERT_TRUE(dev_->synchronize(st).is_ok());
  // Both compute in fp32 from the same inputs; they differ in summation order (and, for the
  // backward, in taking rowsum(dout * out) from the rounded output).
  const double tol = dt == DType::kF32 ? 2e-5 : rtol(dt);
  EXPECT_EQ(compare_close(out.values(), out_plain.values(), tol), "") << "out";
  EXPECT_EQ(compare_close(dqkv.values(), dqkv_plain.values(), tol), "") << "dqkv";
  EXPECT_EQ(compare_close(dqkv_plain.values(), c.dqkv_ref, rtol(dt)), "") << "plain dqkv";
  EXPECT_EQ(compare_close(out_plain.values(), c.out_ref, rtol(dt)), "") << "plain out";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedAttentionCpu,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// --- the CUDA kernels on the emulation --------------------------------------------------------

namespace fl = strata::flash;
using emu::Order;
using emu::Runtime;

// The launches of kernels/cuda/flash_attention.cu, on the emulation.
template <typename T, int HS>
void emulated(const AttnShape& s, Order order, const Buffer& qkv, const Buffer& dout,
              const int32_t* pos, Buffer* out, std::vector<float>* lse, Buffer* dqkv) {
  auto* x = reinterpret_cast<const T*>(qkv.bytes.data());
  auto* g = reinterpret_cast<const T*>(dout.bytes.data());
  auto* y = reinterpret_cast<T*>(out->bytes.data());
  auto* dx = reinterpret_cast<T*>(dqkv->bytes.data());
  float* L = lse->data();
  std::vector<float> D(s.rows(), 0.0f);
  const unsigned tiles = unsigned((s.T + fl::kBr - 1) / fl::kBr);
  Runtime& rt = Runtime::get();
  rt.launch({tiles, unsigned(s.NH), unsigned(s.B)}, fl::kThreads, fl::ForwardSmem<HS>::kBytes,
            order, [&] { fl::flash_forward_kernel<T, HS>(y, L, x, pos, s.T, s.NH, s.NKV); });
  const unsigned dot_blocks =
      unsigned((s.rows() + fl::kDotRowsPerBlock - 1) / fl::kDotRowsPerBlock);
  rt.launch({dot_blocks, 1, 1}, 32 * fl::kDotRowsPerBlock, 0, order,
            [&] { fl::flash_backward_dot_kernel<T>(D.data(), g, y, s.B, s.T, s.NH, HS); });
  rt.launch(
      {tiles, unsigned(s.NKV), unsigned(s.B)}, fl::kThreads, fl::BackwardSmem<HS>::kBytes, order,
      [&] { fl::flash_backward_dkdv_kernel<T, HS>(dx, x, g, L, D.data(), pos, s.T, s.NH, s.NKV); });
  rt.launch(
      {tiles, unsigned(s.NH), unsigned(s.B)}, fl::kThreads, fl::BackwardSmem<HS>::kBytes, order,
      [&] { fl::flash_backward_dq_kernel<T, HS>(dx, x, g, L, D.data(), pos, s.T, s.NH, s.NKV); });
}

struct EmuParam {
  DType dt;
  AttnShape s;
  bool packed = false;  // several sequences per row (positions)
};
void PrintTo(const EmuParam& p, std::ostream* os) {
  *os << dtype_name(p.dt) << " " << p.s.name() << (p.packed ? " packed" : "");
}

class FusedAttentionEmulated : public ::testing::TestWithParam<EmuParam> {};

TEST_P(FusedAttentionEmulated, CudaKernelsMatchTheReferenceInBothThreadOrders) {
  const auto [dt, s, packed] = GetParam();
  Case c(s, dt, packed);
  const int32_t* pos = c.pos_ptr();
  Buffer out[2], dqkv[2];
  std::vector<float> lse[2];
  for (int o = 0; o < 2; ++o) {
    out[o] = Buffer(dt, s.out_elems());
    lse[o].assign(s.rows(), 0.0f);
    dqkv[o] = c.dqkv0;
    const Order order = o == 0 ? Order::kForward : Order::kReverse;
    try {
      if (dt == DType::kBF16 && s.hs == 64) {
        emulated<__nv_bfloat16, 64>(s, order, c.qkv, c.dout, pos, &out[o], &lse[o], &dqkv[o]);
      } else if (dt == DType::kBF16) {
        emulated<__nv_bfloat16, 128>(s, order, c.qkv, c.dout, pos, &out[o], &lse[o], &dqkv[o]);
      } else if (s.hs == 64) {
        emulated<__half, 64>(s, order, c.qkv, c.dout, pos, &out[o], &lse[o], &dqkv[o]);
      } else {
        emulated<__half, 128>(s, order, c.qkv, c.dout, pos, &out[o], &lse[o], &dqkv[o]);
      }
    } catch (const std::exception& e) {
      FAIL() << e.what();
    }
    SCOPED_TRACE(o == 0 ? "thread order forward" : "thread order reverse");
    EXPECT_EQ(compare_close(out[o].values(), c.out_ref, rtol(dt)), "") << "out";
    EXPECT_EQ(compare_close(as_double(lse[o]), c.lse_ref, 1e-5), "") << "lse";
    EXPECT_EQ(compare_close(dqkv[o].values(), c.dqkv_ref, rtol(dt)), "") << "dqkv";
  }
  EXPECT_EQ(out[0].bytes, out[1].bytes) << "the thread order changed the output";
  EXPECT_EQ(std::memcmp(lse[0].data(), lse[1].data(), lse[0].size() * 4), 0);
  EXPECT_EQ(dqkv[0].bytes, dqkv[1].bytes) << "the thread order changed the gradient";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, FusedAttentionEmulated,
    ::testing::Values(EmuParam{DType::kBF16, {1, 64, 1, 1, 64}},        // exactly one tile
                      EmuParam{DType::kBF16, {2, 100, 2, 2, 64}},       // T not a multiple of 64
                      EmuParam{DType::kF16, {1, 130, 4, 2, 64}},        // GQA, 3 tiles
                      EmuParam{DType::kBF16, {1, 77, 2, 1, 128}},       // MQA, hs 128
                      EmuParam{DType::kF16, {1, 40, 2, 2, 128}},        // T below one tile
                      EmuParam{DType::kF16, {2, 200, 2, 1, 64}, true},  // packed: tiles skipped
                      EmuParam{DType::kBF16, {1, 130, 2, 2, 128}, true}),
    [](const auto& info) {
      return std::string(dtype_name(info.param.dt)) + "_" + info.param.s.name() +
             (info.param.packed ? "_packed" : "");
    });

}  // namespace
}  // namespace strata
