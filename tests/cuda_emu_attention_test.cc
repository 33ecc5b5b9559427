// The CUDA backend's attention kernels (kernels/cuda/attention.cu, flash_attention.cu,
// attention_decode.cu) on the CPU emulation against the CPU backend's, as cuda_emu_kernels_test.cc
// does for the other ops (its fixture: tests/cuda_emu_kernels_fixture.h), with and without
// positions (attention masked per sequence).
#include "tests/cuda_emu_kernels_fixture.h"

namespace strata {
namespace {

// Every dtype, each without and with positions.
std::vector<std::pair<DType, bool>> dtypes_with_and_without_positions() {
  std::vector<std::pair<DType, bool>> v;
  for (DType dt : kDtypes) {
    for (bool p : {false, true}) v.emplace_back(dt, p);
  }
  return v;
}

// Generation's attention against a key/value cache: a prompt filling an empty cache, and a few
// positions after a cache longer than one block's chunk of keys (256); the caches' new rows are
// the same bits.
TEST_F(EmulatedKernels, AttentionDecodeAgainstTheCache) {
  const int B = 2, NH = 6, KVH = 2, hs = 10, maxT = 300;
  const size_t W = size_t(NH + 2 * KVH) * hs, cache = size_t(B) * maxT * KVH * hs;
  struct Case {
    int pos0, T;
  };
  for (const Case c : {Case{0, 37}, Case{270, 3}, Case{299, 1}}) {
    for (DType dt : kDtypes) {
      check_op(
          name("attention_decode", dt) + " at " + std::to_string(c.pos0),
          {floats(size_t(B) * c.T * NH * hs, dt), floats(cache, dt, -2, 2), floats(cache, dt),
           floats(size_t(B) * c.T * W, dt, -2, 2)},
          [&](Kernels& k, Stream& s, void* const* p) {
            k.attention_decode(s, dt, p[0], p[1], p[2], p[3], B, c.T, c.pos0, maxT, NH, KVH, hs);
          },
          [&](cudaStream_t s, void* const* p) {
            return cuda_attention_decode(s, dt, p[0], p[1], p[2], p[3], B, c.T, c.pos0, maxT, NH,
                                         KVH, hs);
          },
          {{0, "out", tol(dt, 5e-5)}, {1, "kcache"}, {2, "vcache"}});
    }
  }
}

TEST_F(EmulatedKernels, AttentionWithGroupedQueryHeads) {
  const int B = 2, T = 37, NH = 6, KVH = 2, hs = 10;
  const size_t W = size_t(NH + 2 * KVH) * hs, att = size_t(B) * NH * T * T;
  // Positions (attention masked per sequence): any values, as the contract clamps them to
  // [0, t]; a packed window's are a special case.
  const Buf positions = ints(size_t(B) * T, 0, T - 1);
  const std::vector<int32_t> host_pos = as_ints(positions);
  for (const auto& [dt_case, pos_case] : dtypes_with_and_without_positions()) {
    // Copies of the bindings: the lambdas below capture them (clang before 16 cannot capture a
    // structured binding).
    const DType dt = dt_case;
    const bool with_pos = pos_case;
    const auto pos = [&](void* const* p, int i) {
      return with_pos ? static_cast<const int32_t*>(p[i]) : nullptr;
    };
    const std::string what = with_pos ? " with positions" : "";
    const Buf qkv = floats(size_t(B) * T * W, dt, -2, 2);
    check_op(
        name("attention_gqa_forward", dt) + what,
        {floats(size_t(B) * T * NH * hs, dt), floats(att, DType::kF32), qkv, positions},
        [&](Kernels& k, Stream& s, void* const* p) {
          k.attention_gqa_forward(s, dt, p[0], static_cast<float*>(p[1]), p[2], pos(p, 3), B, T, NH,
                                  KVH, hs);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_attention_gqa_forward(s, dt, p[0], static_cast<float*>(p[1]), p[2], pos(p, 3),
                                            B, T, NH, KVH, hs);
        },
        {{0, "out", tol(dt, 5e-5)}, {1, "att", 5e-5}});
    // The backward from the CPU's probabilities (a valid softmax), so both start alike.
    std::vector<uint8_t> out(size_t(B) * T * NH * hs * dtype_size(dt));
    std::vector<float> probs(att);
    cpu_->kernels().attention_gqa_forward(cpu_->compute_stream(), dt, out.data(), probs.data(),
                                          qkv.bytes.data(), with_pos ? host_pos.data() : nullptr, B,
                                          T, NH, KVH, hs);
    ASSERT_TRUE(cpu_->synchronize(cpu_->compute_stream()).is_ok());
    check_op(
        name("attention_gqa_backward", dt) + what,
        {floats(size_t(B) * T * W, dt),
         floats(att, DType::kF32),
         floats(size_t(B) * T * NH * hs, dt),
         qkv,
         {to_bytes(probs, DType::kF32), DType::kF32},
         positions},
        [&](Kernels& k, Stream& s, void* const* p) {
          k.attention_gqa_backward(s, dt, p[0], static_cast<float*>(p[1]), p[2], p[3],
                                   static_cast<float*>(p[4]), pos(p, 5), B, T, NH, KVH, hs);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_attention_gqa_backward(s, dt, p[0], static_cast<float*>(p[1]), p[2], p[3],
                                             static_cast<float*>(p[4]), pos(p, 5), B, T, NH, KVH,
                                             hs);
        },
        {{0, "dqkv", tol(dt, 5e-5)}});
  }
}

TEST_F(EmulatedKernels, FusedAttention) {
  const int B = 1, T = 77, NH = 4, NKV = 2;
  const Buf positions = ints(size_t(B) * T, 0, T - 1);  // clamped to [0, t] as the contract says
  const std::vector<int32_t> host_pos = as_ints(positions);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (int hs : {64, 128}) {
      for (bool with_pos : {false, true}) {
        const auto pos = [&](void* const* p, int i) {
          return with_pos ? static_cast<const int32_t*>(p[i]) : nullptr;
        };
        const std::string what =
            std::string(" hs ") + std::to_string(hs) + (with_pos ? " with positions" : "");
        const size_t W = size_t(NH + 2 * NKV) * hs, rows = size_t(B) * NH * T;
        const Buf qkv = floats(size_t(B) * T * W, dt, -2, 2);
        const double t = dt == DType::kBF16 ? 2e-2 : 4e-3;  // tensor-core rounding of P and dS
        check_op(
            name("fused_attention_forward", dt) + what,
            {floats(size_t(B) * T * NH * hs, dt), floats(rows, DType::kF32), qkv, positions},
            [&](Kernels& k, Stream& s, void* const* p) {
              k.fused_attention_forward(s, dt, p[0], static_cast<float*>(p[1]), p[2], pos(p, 3), B,
                                        T, NH, NKV, hs);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_fused_attention_forward(s, dt, p[0], static_cast<float*>(p[1]), p[2],
                                                  pos(p, 3), B, T, NH, NKV, hs);
            },
            {{0, "out", t}, {1, "lse", 1e-4}});
        std::vector<uint8_t> out(size_t(B) * T * NH * hs * dtype_size(dt));
        std::vector<float> lse(rows);
        cpu_->kernels().fused_attention_forward(
            cpu_->compute_stream(), dt, out.data(), lse.data(), qkv.bytes.data(),
            with_pos ? host_pos.data() : nullptr, B, T, NH, NKV, hs);
        ASSERT_TRUE(cpu_->synchronize(cpu_->compute_stream()).is_ok());
        check_op(
            name("fused_attention_backward", dt) + what,
            {floats(size_t(B) * T * W, dt),
             floats(rows, DType::kF32),
             floats(size_t(B) * T * NH * hs, dt),
             qkv,
             {out, dt},
             {to_bytes(lse, DType::kF32), DType::kF32},
             positions},
            [&](Kernels& k, Stream& s, void* const* p) {
              k.fused_attention_backward(s, dt, p[0], static_cast<float*>(p[1]), p[2], p[3], p[4],
                                         static_cast<float*>(p[5]), pos(p, 6), B, T, NH, NKV, hs,
                                         /*accumulate=*/true);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_fused_attention_backward(s, dt, p[0], static_cast<float*>(p[1]), p[2],
                                                   p[3], p[4], static_cast<float*>(p[5]), pos(p, 6),
                                                   B, T, NH, NKV, hs);
            },
            {{0, "dqkv", t}});
      }
    }
  }
}

}  // namespace
}  // namespace strata
