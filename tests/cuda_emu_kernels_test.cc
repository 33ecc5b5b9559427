// Every kernel file of the CUDA backend (kernels/cuda/*.cu), its launchers unchanged, on the CPU
// emulation of CUDA (tests/cuda_emu/): each op runs in both thread orders (blocks, warps and
// lanes forward, then reversed, which exposes a missing barrier or a block that reads another's
// output) on fresh device buffers between guard pages, poisoned with NaN, and is compared with
// the CPU backend's kernel on the same inputs: bit for bit where the two do the same arithmetic,
// else within the stated tolerance. Sizes are odd on purpose (not multiples of a block, of 8 or
// of 64). The two orders must agree bit for bit: no kernel sums floats with atomics, whose order
// would be the hardware's choice.
//
// What this cannot prove (the GPU's own math functions and fp32 summation order, timing, the
// real memory model) is left to tests/cuda_backend_test.cc on a GPU; docs/GPU.md has the list.
// The attention kernels are in cuda_emu_attention_test.cc, the norms and the linear layer's
// backward in cuda_emu_norms_test.cc, on the same fixture (tests/cuda_emu_kernels_fixture.h).
#include "tests/cuda_emu_kernels_fixture.h"

namespace strata {
namespace {

TEST_F(EmulatedKernels, Encoder) {
  const int B = 3, T = 37, C = 45, V = 29;
  for (DType dt : kDtypes) {
    check_op(
        name("encoder_forward", dt),
        {floats(size_t(B) * T * C, dt), ints(size_t(B) * T, 0, V - 1), floats(size_t(V) * C, dt),
         floats(size_t(T) * C, dt)},
        [&](Kernels& k, Stream& s, void* const* p) {
          k.encoder_forward(s, dt, p[0], static_cast<int32_t*>(p[1]), nullptr, p[2], p[3], B, T, C);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_encoder_forward(s, dt, p[0], static_cast<int32_t*>(p[1]), nullptr, p[2], p[3],
                                      B, T, C);
        },
        {{0, "out"}});
    check_op(
        name("encoder_backward", dt),
        {floats(size_t(V) * C, DType::kF32), floats(size_t(T) * C, DType::kF32),
         floats(size_t(B) * T * C, dt), ints(size_t(B) * T, 0, V - 1)},
        [&](Kernels& k, Stream& s, void* const* p) {
          k.encoder_backward(s, dt, static_cast<float*>(p[0]), static_cast<float*>(p[1]), p[2],
                             static_cast<int32_t*>(p[3]), nullptr, B, T, C);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_encoder_backward(s, dt, static_cast<float*>(p[0]), static_cast<float*>(p[1]),
                                       p[2], static_cast<int32_t*>(p[3]), nullptr, B, T, C,
                                       reduce_);
        },
        {{0, "dwte"}, {1, "dwpe"}});
    // Positions of packed sequences (any value below T, as a window restarting them gives).
    check_op(
        name("encoder_forward with positions", dt),
        {floats(size_t(B) * T * C, dt), ints(size_t(B) * T, 0, V - 1), floats(size_t(V) * C, dt),
         floats(size_t(T) * C, dt), ints(size_t(B) * T, 0, T - 1)},
        [&](Kernels& k, Stream& s, void* const* p) {
          k.encoder_forward(s, dt, p[0], static_cast<int32_t*>(p[1]), static_cast<int32_t*>(p[4]),
                            p[2], p[3], B, T, C);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_encoder_forward(s, dt, p[0], static_cast<int32_t*>(p[1]),
                                      static_cast<int32_t*>(p[4]), p[2], p[3], B, T, C);
        },
        {{0, "out"}});
    check_op(
        name("encoder_backward with positions", dt),
        {floats(size_t(V) * C, DType::kF32), floats(size_t(T) * C, DType::kF32),
         floats(size_t(B) * T * C, dt), ints(size_t(B) * T, 0, V - 1),
         ints(size_t(B) * T, 0, T - 1)},
        [&](Kernels& k, Stream& s, void* const* p) {
          k.encoder_backward(s, dt, static_cast<float*>(p[0]), static_cast<float*>(p[1]), p[2],
                             static_cast<int32_t*>(p[3]), static_cast<int32_t*>(p[4]), B, T, C);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_encoder_backward(s, dt, static_cast<float*>(p[0]), static_cast<float*>(p[1]),
                                       p[2], static_cast<int32_t*>(p[3]),
                                       static_cast<int32_t*>(p[4]), B, T, C, reduce_);
        },
        {{0, "dwte"}, {1, "dwpe"}});
  }
}

// The sums that gather rows from many blocks: the embedding's gradients with few distinct
// tokens (long runs of one key, rows over several 128-row tiles and 1024-key chunks of the
// ranking) are the CPU backend's bits; a bias gradient over six 256-row chunks, launched twice
// (the tile counters back at 0 after each launch), is the same in either block order
// (check_op). Then again with the scratch's capacities lowered: the embedding's rows 150 at a
// time, the bias gradient in two chunks of 750 rows.
TEST_F(EmulatedKernels, SumsAcrossBlocksKeepTheirBitsInEveryBlockOrder) {
  const int C = 45, V = 5;
  for (bool small : {false, true})
    for (DType dt : kDtypes) {
      // 2100 rows (three 1024-key chunks of the ranking; more rows than the sums by key have
      // blocks) once, else 400.
      const int B = dt == DType::kBF16 && !small ? 21 : 4, T = 100;
      SCOPED_TRACE(small ? "scratch capacities lowered" : "full scratch");
      if (small) {
        reduce_.row_capacity = 150;
        reduce_.partial_floats = 80;
      }
      for (bool with_pos : {false, true}) {
        SCOPED_TRACE(with_pos ? "positions" : "no positions");
        check_op(
            name("encoder_backward, few tokens", dt),
            {floats(size_t(V) * C, DType::kF32), floats(size_t(T) * C, DType::kF32),
             floats(size_t(B) * T * C, dt), ints(size_t(B) * T, 0, V - 1),
             ints(size_t(B) * T, 0, 6)},
            [&](Kernels& k, Stream& s, void* const* p) {
              k.encoder_backward(s, dt, static_cast<float*>(p[0]), static_cast<float*>(p[1]), p[2],
                                 static_cast<int32_t*>(p[3]),
                                 with_pos ? static_cast<int32_t*>(p[4]) : nullptr, B, T, C);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_encoder_backward(
                  s, dt, static_cast<float*>(p[0]), static_cast<float*>(p[1]), p[2],
                  static_cast<int32_t*>(p[3]), with_pos ? static_cast<int32_t*>(p[4]) : nullptr, B,
                  T, C, reduce_);
            },
            {{0, "dwte"}, {1, "dwpe"}});
      }
      const int N = 1500, K = 8, OC = 40;
      check_op(
          name("matmul_backward's bias gradient, twice", dt),
          {floats(size_t(N) * K, dt), floats(size_t(OC) * K, DType::kF32), floats(OC, DType::kF32),
           floats(size_t(N) * OC, dt), floats(size_t(N) * K, dt), floats(size_t(OC) * K, dt)},
          [&](Kernels& k, Stream& s, void* const* p) {
            for (int i = 0; i < 2; ++i) {
              k.matmul_backward(s, dt, p[0], static_cast<float*>(p[1]), static_cast<float*>(p[2]),
                                p[3], p[4], p[5], N, K, OC, /*accumulate=*/true);
            }
          },
          [&](cudaStream_t s, void* const* p) {
            for (int i = 0; i < 2; ++i) {
              STRATA_RETURN_IF_ERROR(
                  cuda_matmul_backward(s, blas_, reduce_, dt, p[0], static_cast<float*>(p[1]),
                                       static_cast<float*>(p[2]), p[3], p[4], p[5], N, K, OC,
                                       /*accumulate=*/true),
                  "a launch");
            }
            return Status::ok();
          },
          {{0, "dinp", tol(dt, 5e-5)}, {1, "dweight", tol(dt, 5e-5)}, {2, "dbias", 5e-5}});
    }
}

// With the kernel table's algorithm cache, cuBLASLt's heuristic is asked once per problem: the
// same product again (both orders, then a second op check) reuses its algorithm; an operand at
// a lower alignment is another problem (the stand-in's algorithm remembers the alignments it was
// chosen for and fails a call below them), and gives the right result.
TEST_F(EmulatedKernels, CublasLtIsAskedOncePerProblem) {
  CublasLtAlgos algos;
  blas_.algos = &algos;
  const int N = 37, C = 48, OC = 32;
  const DType dt = DType::kBF16;
  const size_t es = dtype_size(dt);
  const uint64_t before = emu::cublaslt_heuristic_queries();
  for (size_t shift : {size_t(0), size_t(0), es}) {
    SCOPED_TRACE("input shifted by " + std::to_string(shift) + " bytes");
    auto in = [shift](void* p) { return static_cast<char*>(p) + shift; };
    check_op(
        name("matmul_forward", dt),
        {floats(size_t(N) * OC, dt), floats(size_t(N) * C + 1, dt), floats(size_t(OC) * C, dt),
         floats(OC, dt)},
        [&](Kernels& k, Stream& s, void* const* p) {
          k.matmul_forward(s, dt, p[0], in(p[1]), p[2], p[3], N, C, OC);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_matmul_forward(s, blas_, dt, p[0], in(p[1]), p[2], p[3], N, C, OC);
        },
        {{0, "out", tol(dt, 5e-5)}});
  }
  EXPECT_EQ(emu::cublaslt_heuristic_queries() - before, 2u);
  EXPECT_EQ(algos.size(), 2u);
}

TEST_F(EmulatedKernels, SwiGluRopeGelu) {
  const int N = 37;
  const size_t n = 1001;
  for (DType dt : kDtypes) {
    // H = 45 takes the one-element kernels, H = 48 the 16-byte packs.
    for (int H : {45, 48})
      for (bool packed : {true, false}) {
        SCOPED_TRACE("H " + std::to_string(H) + (packed ? ", packed" : ", one element"));
        check_op(
            name("swiglu_forward", dt),
            {floats(size_t(N) * H, dt), floats(size_t(N) * 2 * H, dt, -3, 3)},
            [&](Kernels& k, Stream& s, void* const* p) {
              k.swiglu_forward(s, dt, p[0], p[1], N, H);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_swiglu_forward(s, dt, p[0], p[1], N, H, packed);
            },
            {{0, "out", tol(dt, 1e-5)}});
        check_op(
            name("swiglu_backward", dt),
            {floats(size_t(N) * 2 * H, dt), floats(size_t(N) * 2 * H, dt, -3, 3),
             floats(size_t(N) * H, dt)},
            [&](Kernels& k, Stream& s, void* const* p) {
              k.swiglu_backward(s, dt, p[0], p[1], p[2], N, H);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_swiglu_backward(s, dt, p[0], p[1], p[2], N, H, packed);
            },
            {{0, "dinp", tol(dt, 1e-5)}});
      }
    // hs 18: a thread a pair; hs 16: the halves fill 16-byte packs (bf16/fp16 8, fp32 4), taken
    // unless `packed` is off. B * T = 74 rows: the last block of 4 rows holds 2.
    for (int hs : {18, 16})
      for (bool packed : {true, false})
        for (bool llama3 : {false, true}) {
          if (hs == 18 && !packed) continue;
          SCOPED_TRACE("hs " + std::to_string(hs) + (packed ? ", packed" : ", one pair a thread"));
          const int B = 2, T = 37, NH = 6, KVH = 2;
          RopeParams rope;
          rope.llama3 = llama3;
          rope.original_max_position = 16;
          const size_t qkv = size_t(B) * T * (NH + 2 * KVH) * hs;
          // Forward and backward, without positions and with those of packed sequences or a
          // decode step (any value, past T too).
          for (bool with_pos : {false, true})
            for (bool inverse : {false, true}) {
              std::vector<Buf> bufs = {floats(qkv, dt, -2, 2)};
              if (with_pos) bufs.push_back(ints(size_t(B) * T, 0, 3 * T));
              auto pos = [&](void* const* p) {
                return with_pos ? static_cast<const int32_t*>(p[1]) : nullptr;
              };
              check_op(
                  name(inverse ? "rope_backward" : "rope_forward", dt) +
                      (with_pos ? " with positions" : "") + (llama3 ? " llama3" : ""),
                  bufs,
                  [&](Kernels& k, Stream& s, void* const* p) {
                    if (inverse) {
                      k.rope_backward(s, dt, p[0], rope, pos(p), B, T, NH, KVH, hs);
                    } else {
                      k.rope_forward(s, dt, p[0], rope, pos(p), B, T, NH, KVH, hs);
                    }
                  },
                  [&](cudaStream_t s, void* const* p) {
                    return inverse ? cuda_rope_backward(s, dt, p[0], rope, pos(p), B, T, NH, KVH,
                                                        hs, packed)
                                   : cuda_rope_forward(s, dt, p[0], rope, pos(p), B, T, NH, KVH, hs,
                                                       packed);
                  },
                  {{0, "qkv", tol(dt, 1e-5)}});
            }
        }
    check_op(
        name("gelu_forward", dt), {floats(n, dt), floats(n, dt, -4, 4)},
        [&](Kernels& k, Stream& s, void* const* p) { k.gelu_forward(s, dt, p[0], p[1], n); },
        [&](cudaStream_t s, void* const* p) { return cuda_gelu_forward(s, dt, p[0], p[1], n); },
        {{0, "out", tol(dt, 1e-5)}});
    check_op(
        name("gelu_backward", dt), {floats(n, dt), floats(n, dt, -4, 4), floats(n, dt)},
        [&](Kernels& k, Stream& s, void* const* p) { k.gelu_backward(s, dt, p[0], p[1], p[2], n); },
        [&](cudaStream_t s, void* const* p) {
          return cuda_gelu_backward(s, dt, p[0], p[1], p[2], n);
        },
        {{0, "dinp", tol(dt, 1e-5)}});
  }
}

// A mixture of experts' row dispatch (moe.cu): gather with and without a per-row scale, the
// scaled scatter-add into distinct rows (other rows untouched), the row dots.
TEST_F(EmulatedKernels, MixtureDispatchIsBitExact) {
  const int M = 53, n = 29, C = 45;
  std::vector<int32_t> perm(M);
  for (int i = 0; i < M; ++i) perm[size_t(i)] = i;
  std::shuffle(perm.begin(), perm.end(), rng_);
  Buf idx{std::vector<uint8_t>(size_t(n) * 4), DType::kF32};
  std::memcpy(idx.bytes.data(), perm.data(), idx.bytes.size());  // n distinct rows of M
  for (DType dt : kDtypes) {
    for (bool scaled : {false, true}) {
      Buf scale = scaled ? floats(size_t(n), DType::kF32, -2, 2) : Buf{};
      check_op(
          name(scaled ? "gather_rows scaled" : "gather_rows", dt),
          {floats(size_t(n) * C, dt), floats(size_t(M) * C, dt), idx, scale},
          [&](Kernels& k, Stream& s, void* const* p) {
            k.gather_rows(s, dt, p[0], p[1], static_cast<const int32_t*>(p[2]),
                          static_cast<const float*>(p[3]), n, C);
          },
          [&](cudaStream_t s, void* const* p) {
            return cuda_gather_rows(s, dt, p[0], p[1], static_cast<const int32_t*>(p[2]),
                                    static_cast<const float*>(p[3]), n, C);
          },
          {{0, "out"}});
      check_op(
          name(scaled ? "scatter_add_rows scaled" : "scatter_add_rows", dt),
          {floats(size_t(M) * C, dt), floats(size_t(n) * C, dt), idx, scale},
          [&](Kernels& k, Stream& s, void* const* p) {
            k.scatter_add_rows(s, dt, p[0], p[1], static_cast<const int32_t*>(p[2]),
                               static_cast<const float*>(p[3]), n, C);
          },
          [&](cudaStream_t s, void* const* p) {
            return cuda_scatter_add_rows(s, dt, p[0], p[1], static_cast<const int32_t*>(p[2]),
                                         static_cast<const float*>(p[3]), n, C);
          },
          {{0, "out"}});
    }
    check_op(
        name("row_dots", dt),
        {floats(size_t(n), DType::kF32), floats(size_t(M) * C, dt), idx, floats(size_t(n) * C, dt)},
        [&](Kernels& k, Stream& s, void* const* p) {
          k.row_dots(s, dt, static_cast<float*>(p[0]), p[1], static_cast<const int32_t*>(p[2]),
                     p[3], n, C);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_row_dots(s, dt, static_cast<float*>(p[0]), p[1],
                               static_cast<const int32_t*>(p[2]), p[3], n, C);
        },
        {{0, "out"}});
  }
}

TEST_F(EmulatedKernels, ResidualCastAndScaleAreExact) {
  const size_t n = 100003;
  for (DType dt : kDtypes) {
    check_op(
        name("residual_forward", dt), {floats(n, dt), floats(n, dt), floats(n, dt)},
        [&](Kernels& k, Stream& s, void* const* p) {
          k.residual_forward(s, dt, p[0], p[1], p[2], n);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_residual_forward(s, dt, p[0], p[1], p[2], n);
        },
        {{0, "out"}});
    check_op(
        name("add_inplace", dt), {floats(n, dt), floats(n, dt)},
        [&](Kernels& k, Stream& s, void* const* p) { k.add_inplace(s, dt, p[0], p[1], n); },
        [&](cudaStream_t s, void* const* p) { return cuda_add_inplace(s, dt, p[0], p[1], n); },
        {{0, "dst"}});
    for (DType to : kDtypes) {
      check_op(
          name("cast", dt) + " to " + dtype_name(to), {floats(n, to), floats(n, dt, -70000, 70000)},
          [&](Kernels& k, Stream& s, void* const* p) { k.cast(s, p[0], to, p[1], dt, n); },
          [&](cudaStream_t s, void* const* p) { return cuda_cast(s, p[0], to, p[1], dt, n); },
          {{0, "dst"}});
    }
  }
  check_op(
      "scale", {floats(n, DType::kF32)},
      [&](Kernels& k, Stream& s, void* const* p) {
        k.scale(s, static_cast<float*>(p[0]), 0.37f, n);
      },
      [&](cudaStream_t s, void* const* p) {
        return cuda_scale(s, static_cast<float*>(p[0]), 0.37f, n);
      },
      {{0, "x"}});
}

// The elementwise kernels in 16-byte packs give the one-element kernels' bits (the same
// arithmetic per element), with `packed` false and with arrays one element off alignment (the
// launcher falls back to one element a thread); n = 1003 leaves a tail after the packs.
TEST_F(EmulatedKernels, PackedElementwiseKernelsGiveTheOneElementBits) {
  const int N = 19, H = 48;
  const size_t n = 1003, nh = size_t(N) * H;
  struct Op {
    const char* name;
    size_t out_n;              // elements of p[0], the output (read too where it accumulates)
    std::vector<size_t> in_n;  // elements of each input
    std::function<Status(DType, void* const*, bool)> run;
  };
  const Op ops[] = {
      {"residual_forward",
       n,
       {n, n},
       [&](DType dt, void* const* p, bool packed) {
         return cuda_residual_forward(stream_, dt, p[0], p[1], p[2], n, packed);
       }},
      {"add_inplace",
       n,
       {n},
       [&](DType dt, void* const* p, bool packed) {
         return cuda_add_inplace(stream_, dt, p[0], p[1], n, packed);
       }},
      {"gelu_forward",
       n,
       {n},
       [&](DType dt, void* const* p, bool packed) {
         return cuda_gelu_forward(stream_, dt, p[0], p[1], n, packed);
       }},
      {"gelu_backward",
       n,
       {n, n},
       [&](DType dt, void* const* p, bool packed) {
         return cuda_gelu_backward(stream_, dt, p[0], p[1], p[2], n, packed);
       }},
      {"swiglu_forward",
       nh,
       {2 * nh},
       [&](DType dt, void* const* p, bool packed) {
         return cuda_swiglu_forward(stream_, dt, p[0], p[1], N, H, packed);
       }},
      {"swiglu_backward",
       2 * nh,
       {2 * nh, nh},
       [&](DType dt, void* const* p, bool packed) {
         return cuda_swiglu_backward(stream_, dt, p[0], p[1], p[2], N, H, packed);
       }},
      // In place on N rows of 2 query, 1 key and 1 value head of 16.
      {"rope_forward",
       size_t(N) * 4 * 16,
       {},
       [&](DType dt, void* const* p, bool packed) {
         return cuda_rope_forward(stream_, dt, p[0], RopeParams{}, nullptr, 1, N, 2, 1, 16, packed);
       }},
      {"rope_backward",
       size_t(N) * 4 * 16,
       {},
       [&](DType dt, void* const* p, bool packed) {
         return cuda_rope_backward(stream_, dt, p[0], RopeParams{}, nullptr, 1, N, 2, 1, 16,
                                   packed);
       }},
  };
  for (DType dt : kDtypes) {
    for (const Op& op : ops) {
      SCOPED_TRACE(name(op.name, dt));
      std::vector<Buf> host = {floats(op.out_n, dt)};
      for (size_t m : op.in_n) host.push_back(floats(m, dt, -3, 3));
      // The output after the op, packed or not, its arrays `offset` elements past an aligned
      // address.
      auto run = [&](bool packed, size_t offset) {
        return run_emulated(
            host, [&](cudaStream_t, void* const* p) { return op.run(dt, p, packed); }, offset)[0];
      };
      const std::vector<uint8_t> packed = run(true, 0);
      EXPECT_NE(packed, host[0].bytes) << "the op wrote nothing";
      EXPECT_EQ(first_difference(packed, run(false, 0), dt), "") << "packed against one element";
      EXPECT_EQ(first_difference(packed, run(true, 1), dt), "") << "packed against misaligned";
    }
  }
}

// LoRA's dropout: the same mask and the same multiply, so the same bits; out of place and in
// place (the backward's use).
TEST_F(EmulatedKernels, DropoutIsBitExact) {
  const size_t n = 100003;
  for (DType dt : kDtypes) {
    check_op(
        name("dropout", dt), {floats(n, dt), floats(n, dt)},
        [&](Kernels& k, Stream& s, void* const* p) {
          k.dropout(s, dt, p[0], p[1], n, 0.1f, 0x5eed5eedull);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_dropout(s, dt, p[0], p[1], n, 0.1f, 0x5eed5eedull);
        },
        {{0, "out"}});
    check_op(
        name("dropout in place", dt), {floats(n, dt)},
        [&](Kernels& k, Stream& s, void* const* p) { k.dropout(s, dt, p[0], p[0], n, 0.35f, 42); },
        [&](cudaStream_t s, void* const* p) {
          return cuda_dropout(s, dt, p[0], p[0], n, 0.35f, 42);
        },
        {{0, "x"}});
  }
}

// A preference batch's row weights on its logits' gradient: the same one multiply, the same
// bits; factors 0 and negative among them, rows not a multiple of a block.
TEST_F(EmulatedKernels, ScaleRowsIsBitExact) {
  const float factors[] = {0.0f, -1.5f, 0.37f, 3.0f, -0.0625f};
  for (DType dt : kDtypes)
    for (size_t row_elems : {size_t{1001}, size_t{70001}}) {
      const int rows = 5;
      Buf scale{std::vector<uint8_t>(sizeof(factors)), DType::kF32};
      std::memcpy(scale.bytes.data(), factors, sizeof(factors));
      check_op(
          name("scale_rows", dt) + " of " + std::to_string(row_elems),
          {floats(size_t(rows) * row_elems, dt, -4, 4), scale},
          [&](Kernels& k, Stream& s, void* const* p) {
            k.scale_rows(s, dt, p[0], static_cast<const float*>(p[1]), rows, row_elems);
          },
          [&](cudaStream_t s, void* const* p) {
            return cuda_scale_rows(s, dt, p[0], static_cast<const float*>(p[1]), rows, row_elems);
          },
          {{0, "x"}});
    }
}

TEST_F(EmulatedKernels, CrossEntropy) {
  const int N = 37, V = 1001;
  // Vp 1024: rows in 16-byte packs, the last pack of the vocabulary part padding; Vp 1001 and
  // `packed` false: one element a thread.
  for (DType dt : kDtypes)
    for (int Vp : {1024, 1001})
      for (bool packed : {true, false}) {
        SCOPED_TRACE("Vp " + std::to_string(Vp) + (packed ? ", packed" : ", one element"));
        // Every third row masked out (target -1, the data's loss mask): loss and gradient 0.
        Buf targets = ints(N, 0, V - 1);
        for (int n = 1; n < N; n += 3) std::memset(&targets.bytes[size_t(n) * 4], 0xff, 4);
        check_op(
            name("crossentropy_forward_backward", dt),
            {floats(N, DType::kF32), floats(size_t(N) * Vp, dt, -4, 4), targets},
            [&](Kernels& k, Stream& s, void* const* p) {
              k.crossentropy_forward_backward(s, dt, static_cast<float*>(p[0]), p[1],
                                              static_cast<int32_t*>(p[2]), 1.0f / N, N, V, Vp);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_crossentropy_forward_backward(s, dt, static_cast<float*>(p[0]), p[1],
                                                        static_cast<int32_t*>(p[2]), 1.0f / N, N, V,
                                                        Vp, packed);
            },
            {{0, "losses", 1e-5}, {1, "dlogits", tol(dt, 1e-5)}});
      }
}

// A row kept in shared memory (cache_rows, where it fits) gives the bits of the row read from
// device memory three times: the same sums in the same order.
TEST_F(EmulatedKernels, CrossEntropyRowsInSharedMemoryKeepTheBits) {
  // Vp 50304 (GPT-2's): 100.6 KB rows of bf16/fp16, past the 48 KB a launch may take without
  // the attribute; fp32's 201 KB stream either way.
  for (DType dt : kDtypes)
    for (int Vp : {1024, 1001, 50304})
      for (bool packed : {true, false}) {
        const int N = Vp > 4096 ? 5 : 37, V = Vp > 4096 ? 50257 : 1001;
        SCOPED_TRACE(name("crossentropy", dt) + " Vp " + std::to_string(Vp) +
                     (packed ? ", packed" : ", one element"));
        Buf logits = floats(size_t(N) * Vp, dt, -4, 4), targets = ints(N, 0, V - 1);
        for (int n = 1; n < N; n += 3) std::memset(&targets.bytes[size_t(n) * 4], 0xff, 4);
        // losses and logits after the op, with or without the rows cached.
        auto run = [&](bool cache_rows) {
          return run_emulated({{std::vector<uint8_t>(size_t(N) * 4), DType::kF32}, logits, targets},
                              [&](cudaStream_t s, void* const* p) {
                                return cuda_crossentropy_forward_backward(
                                    s, dt, static_cast<float*>(p[0]), p[1],
                                    static_cast<int32_t*>(p[2]), 1.0f / N, N, V, Vp, packed,
                                    cache_rows);
                              });
        };
        const std::vector<std::vector<uint8_t>> cached = run(true), uncached = run(false);
        EXPECT_NE(cached[1], logits.bytes) << "the op wrote nothing";
        EXPECT_EQ(first_difference(cached[0], uncached[0], DType::kF32), "") << "losses";
        EXPECT_EQ(first_difference(cached[1], uncached[1], dt), "") << "dlogits";
      }
}

// The squared norm in the host's order: the CPU backend's bits (and grad_stats', its own test),
// whatever order the emulation runs the threads in; an inf makes it inf.
TEST_F(EmulatedKernels, NormSquaredIsTheHostsBitForBit) {
  for (size_t n : {size_t(1), size_t(1001), size_t(65536), size_t(1200007)}) {
    for (bool bad : {false, true}) {
      Buf x = floats(n, DType::kF32, -3, 3);
      if (bad) {
        const float inf = INFINITY;
        std::memcpy(&x.bytes[(n / 2) * 4], &inf, 4);
      }
      check_op(
          "norm_sq_and_nonfinite n=" + std::to_string(n) + (bad ? " with an inf" : ""),
          {{std::vector<uint8_t>(8, 0x55), DType::kF32},  // one double, overwritten
           x,
           {std::vector<uint8_t>(kCudaReduceBlocks * 8), DType::kF32}},
          [&](Kernels& k, Stream& s, void* const* p) {
            k.norm_sq_and_nonfinite(s, static_cast<double*>(p[0]), static_cast<float*>(p[1]), n);
          },
          [&](cudaStream_t s, void* const* p) {
            return cuda_norm_sq_and_nonfinite(s, static_cast<double*>(p[2]),
                                              static_cast<double*>(p[0]), static_cast<float*>(p[1]),
                                              n);
          },
          {{0, "norm_sq", 0.0}});  // bit for bit
    }
  }
}

TEST_F(EmulatedKernels, QuantizeIsBitExact) {
  const size_t n = 1001;
  for (int bits : {8, 4}) {
    for (int block : {64, 100}) {
      for (DType dt : kDtypes) {
        const std::string what = name("quantize", dt) + " " + std::to_string(bits) +
                                 " bits, block " + std::to_string(block);
        Buf x = floats(n, dt, -5, 5);
        if (block == 100) {  // a block with a nan: its scale is nan and its q zero
          const std::vector<uint8_t> nan = to_bytes({NAN}, dt);
          std::memcpy(&x.bytes[150 * dtype_size(dt)], nan.data(), nan.size());
        }
        const size_t nb = quantize_blocks(n, block);
        check_op(
            what,
            {{std::vector<uint8_t>(quantized_bytes(bits, n), 0x5A), DType::kF32},
             floats(nb, DType::kF32),
             x},
            [&](Kernels& k, Stream& s, void* const* p) {
              k.quantize(s, bits, dt, p[0], static_cast<float*>(p[1]), p[2], n, block);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_quantize(s, bits, dt, p[0], static_cast<float*>(p[1]), p[2], n, block);
            },
            {{1, "scales"}});
        // q compared as bytes (Buf's dtype is only for reading values: fp32 words, exact).
        std::vector<uint8_t> q(quantized_bytes(bits, n));
        std::vector<float> scales(nb);
        cpu_->kernels().quantize(cpu_->compute_stream(), bits, dt, q.data(), scales.data(),
                                 x.bytes.data(), n, block);
        ASSERT_TRUE(cpu_->synchronize(cpu_->compute_stream()).is_ok());
        for (bool acc : {false, true}) {
          check_op(
              "de" + what + (acc ? " accumulating" : ""),
              {floats(n, dt), {q, DType::kF32}, {to_bytes(scales, DType::kF32), DType::kF32}},
              [&](Kernels& k, Stream& s, void* const* p) {
                k.dequantize(s, bits, dt, p[0], p[1], static_cast<float*>(p[2]), n, block, acc);
              },
              [&](cudaStream_t s, void* const* p) {
                return cuda_dequantize(s, bits, dt, p[0], p[1], static_cast<float*>(p[2]), n, block,
                                       acc);
              },
              {{0, "x"}});
        }
      }
    }
  }
}

TEST_F(EmulatedKernels, DequantizeNf4IsBitExact) {
  for (size_t n : {size_t(1001), size_t(4096)}) {  // an odd count: a half-used last byte
    std::vector<uint8_t> q((n + 1) / 2);
    std::mt19937 g{uint32_t(n)};
    for (uint8_t& b : q) b = uint8_t(g());  // every code, both nibbles
    const size_t nb = (n + 63) / 64;
    for (DType dt : kDtypes) {
      check_op(
          name("dequantize_nf4", dt) + " n " + std::to_string(n),
          {floats(n, dt), {q, DType::kF32}, floats(nb, DType::kF32, 0.0f, 3.0f)},
          [&](Kernels& k, Stream& s, void* const* p) {
            k.dequantize_nf4(s, dt, p[0], static_cast<const uint8_t*>(p[1]),
                             static_cast<const float*>(p[2]), n);
          },
          [&](cudaStream_t s, void* const* p) {
            return cuda_dequantize_nf4(s, dt, p[0], static_cast<const uint8_t*>(p[1]),
                                       static_cast<const float*>(p[2]), n);
          },
          {{0, "x"}});
    }
  }
}

TEST_F(EmulatedKernels, OptimizerStepIsBitExact) {
  const size_t n = 1001;
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW, OptimizerKind::kAdagrad,
                             OptimizerKind::kLion}) {
    for (DType moments : {DType::kF32, DType::kBF16}) {
      // off 0: the arrays aligned, four elements a thread and one left; off 1: one element a
      // thread (the arrays one element past an aligned address).
      for (size_t off : {0, 1})
        for (DType grad : kDtypes) {
          SCOPED_TRACE(off ? "misaligned" : "aligned");
          OptimizerHyper h;
          h.kind = kind;
          h.lr = 1e-2f;
          h.weight_decay = 0.1f;
          h.step = 3;
          Buf v = floats(n, moments, 0.0f, 0.01f);
          auto at = [&](void* p, DType dt) { return static_cast<char*>(p) + off * dtype_size(dt); };
          auto shard = [&](void* const* p) {
            ShardState s;
            s.n = n - off;
            s.grad = at(p[0], grad);
            s.grad_dtype = grad;
            s.grad_mult = 0.5f;
            s.master = reinterpret_cast<float*>(at(p[1], DType::kF32));
            s.m = at(p[2], moments);
            s.v = at(p[3], moments);
            s.moment_dtype = moments;
            s.lp_out = at(p[4], DType::kBF16);
            s.lp_dtype = DType::kBF16;
            return s;
          };
          check_op(
              std::string(optimizer_kind_name(kind)) + " moments " + dtype_name(moments) +
                  " grad " + dtype_name(grad),
              {floats(n, grad), floats(n, DType::kF32), floats(n, moments, -0.1f, 0.1f), v,
               floats(n, DType::kBF16)},
              [&](Kernels& k, Stream& s, void* const* p) { k.optimizer_step(s, h, shard(p)); },
              [&](cudaStream_t s, void* const* p) { return cuda_optimizer_step(s, h, shard(p)); },
              {{1, "master"}, {2, "m"}, {3, "v"}, {4, "lp"}});
        }
    }
  }
}

}  // namespace
}  // namespace strata
