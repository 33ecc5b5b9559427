// The fused attention's device code (internal to kernels/cuda): flash-attention-2 style causal
// attention with grouped-query heads on tensor cores (WMMA 16x16x16, bf16/fp16 inputs, fp32
// accumulation). The launchers are in flash_attention.cu; the contract (shapes, layout, the
// saved log-sum-exp) is Kernels::fused_attention_* in strata/kernels.h.
//
// This header holds only kernels and the constants their launch needs, so that it compiles in
// two ways: with nvcc for the GPU, and as plain C++ on a CPU emulation of the few CUDA features
// it uses (tests/cuda_emu.h, defining STRATA_CUDA_EMULATION), where
// tests/flash_attention_test.cc runs these same kernels on machines without a GPU.
//
// The algorithm (Dao, "FlashAttention-2", 2023):
//   forward   one block per (query tile of kBr rows, head, batch); 4 warps own 16 rows each.
//             For each key tile of kBc keys up to the diagonal: S = Q K^T on tensor cores,
//             masked (causal, and per sequence with positions: key tiles before every row's
//             sequence are skipped), online softmax (running max m and sum l per row, the output
//             accumulator rescaled by exp(m_old - m_new)), O += P V. O /= l at the end; the row's
//             log-sum-exp is saved, nothing of size T x T.
//   backward  D = rowsum(dO * O) (flash_backward_dot_kernel); then two kernels that recompute
//             P = exp(S - lse) tile by tile:
//             dK, dV: one block per (key tile, key/value head, batch), looping over every query
//               head of the group and every query tile at or below the diagonal;
//               dV += P^T dO, dS = P * (dP - D) with dP = dO V^T, dK += dS^T Q.
//             dQ: one block per (query tile, head, batch), looping over key tiles:
//               dQ += dS K.
//             Each gradient element is summed by one warp in a fixed order: no atomics, the
//             result does not depend on scheduling. The price is recomputing S and dP in the dQ
//             kernel (7 tile GEMMs instead of FA2's 5).
//
// WMMA leaves the mapping of fragment elements to matrix positions unspecified. The kernels
// never assume one: row-wise work (the softmax) goes through shared memory, and the per-row
// rescaling of the output accumulator reads the row of each element from a fragment loaded
// from a matrix of row indices (a fragment of the same type has the same mapping).
#pragma once

#ifndef STRATA_CUDA_EMULATION
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
// cuda_common.cuh's STRATA_DYNAMIC_SMEM (this header stands alone; an identical definition).
#define STRATA_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

#include <cstddef>
#include <cstdint>

namespace strata::flash {

namespace wmma = nvcuda::wmma;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBr = 16 * kWarps;  // query rows per tile: 16 per warp
constexpr int kBc = 64;           // keys per tile
static_assert(kBr == kBc, "the backward starts a key tile's query loop at the same index");
constexpr int kDotRowsPerBlock = 8;  // flash_backward_dot_kernel: one warp per row
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Shared-memory row strides, padded by 16 bytes against bank conflicts. WMMA needs fragment
// pointers 32-byte aligned and strides a multiple of 16 bytes: every fragment starts at a row
// that is a multiple of 16 and a column that is a multiple of 16, so both hold.
template <int HS>
constexpr int kLdTile = HS + 8;  // a [rows][HS] tile of 16-bit elements
constexpr int kLdS = kBc + 4;    // a warp's [16][kBc] fp32 scores
constexpr int kLdP = kBc + 8;    // a warp's [16][kBc] 16-bit probabilities

constexpr size_t align128(size_t x) { return (x + 127) / 128 * 128; }

// Byte offsets into the dynamic shared memory of each kernel.
template <int HS>
struct ForwardSmem {
  static constexpr size_t kTile = align128(size_t(kBr) * kLdTile<HS> * 2);
  static constexpr size_t kQ = 0, kK = kQ + kTile, kV = kK + kTile;
  static constexpr size_t kS = kV + kTile;  // per warp: [16][kLdS] fp32
  static constexpr size_t kP = kS + align128(size_t(kWarps) * 16 * kLdS * 4);
  static constexpr size_t kRowIds = kP + align128(size_t(kWarps) * 16 * kLdP * 2);
  static constexpr size_t kStats = kRowIds + align128(16 * 16 * 4);  // per warp: 16 fp32
  static constexpr size_t kBytes = kStats + align128(size_t(kWarps) * 16 * 4);
};
template <int HS>
struct BackwardSmem {
  static constexpr size_t kTile = align128(size_t(kBr) * kLdTile<HS> * 2);
  static constexpr size_t kK = 0, kV = kTile, kQ = 2 * kTile, kDO = 3 * kTile;
  static constexpr size_t kLse = 4 * kTile;               // kBr fp32, log2 units
  static constexpr size_t kD = kLse + align128(kBr * 4);  // kBr fp32
  static constexpr size_t kS = kD + align128(kBr * 4);    // per warp: [16][kLdS] fp32
  static constexpr size_t kDP = kS + align128(size_t(kWarps) * 16 * kLdS * 4);
  static constexpr size_t kP = kDP + align128(size_t(kWarps) * 16 * kLdS * 4);  // [16][kLdP]
  static constexpr size_t kDS = kP + align128(size_t(kWarps) * 16 * kLdP * 2);
  static constexpr size_t kLo = kDS + align128(size_t(kWarps) * 16 * kLdP * 2);  // kBr int32
  static constexpr size_t kBytes = kLo + align128(kBr * 4);
};

// --- element helpers ----------------------------------------------------------------------------

// The first key query row t of batch row b sees (attention masked per sequence, Kernels::
// attention_gqa_forward): t - pos[b,t] clamped to [0, t]; 0 without positions or past T_.
__device__ __forceinline__ int key_start(const int32_t* pos, int b, int t, int T_) {
  if (pos == nullptr || t >= T_) return 0;
  const int p = pos[size_t(b) * T_ + t];
  return p <= 0 ? t : (p >= t ? 0 : t - p);
}

// The smallest key_start of the query rows t0 .. t0+kBr-1: key tiles that end before it are
// masked for every row of the tile and skipped. Every thread computes the same value.
__device__ __forceinline__ int tile_key_start(const int32_t* pos, int b, int t0, int T_) {
  if (pos == nullptr) return 0;
  int lo = T_;
  for (int t = t0; t < min(T_, t0 + kBr); ++t) lo = min(lo, key_start(pos, b, t, T_));
  return lo;
}

__device__ __forceinline__ float f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float f32(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) {
  return __float2half_rn(x);
}

template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// dst[r][0..HS) = row (row0 + r) of a strided global matrix for r < kRows; rows at or past
// `rows` are zero. 16-byte copies: `src` rows and the start are 16-byte aligned (checked by the
// launcher). Called by the whole block.
template <typename T, int HS, int kRows>
__device__ __forceinline__ void load_tile(T* dst, const T* src, size_t stride, int row0, int rows) {
  constexpr int kChunks = HS / 8;  // 8 elements = 16 bytes
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks, col = (i % kChunks) * 8;
    uint4* d = reinterpret_cast<uint4*>(dst + r * kLdTile<HS> + col);
    if (row0 + r < rows) {
      *d = *reinterpret_cast<const uint4*>(src + size_t(row0 + r) * stride + col);
    } else {
      *d = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// dst[row0 + 16*warp + r][16*n + c] += acc[n](r, c) for rows below `rows`, rounded to T. Uses the
// warp's fp32 staging area `stage` ([16][kLdS]). Called by the whole warp.
template <typename T, int NF>
__device__ __forceinline__ void add_to_global(T* dst, size_t stride, int row0, int rows,
                                              FragAcc (&acc)[NF], float* stage) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int n = 0; n < NF; ++n) {
    __syncwarp();  // earlier reads of `stage` by other lanes are done
    wmma::store_matrix_sync(stage, acc[n], kLdS, wmma::mem_row_major);
    __syncwarp();
    for (int e = lane; e < 256; e += 32) {
      const int r = e / 16, c = e % 16, row = row0 + warp * 16 + r;
      if (row < rows) {
        T* p = dst + size_t(row) * stride + n * 16 + c;
        *p = from_f32<T>(f32(*p) + stage[r * kLdS + c]);
      }
    }
  }
}

// stage[r][16*n + c] = (rows of this warp's A) . (rows n*16.. of B): a [16][kBc] tile of
// A B^T, where `a` holds the warp's 16 rows of A as NF fragments and B is a [kBc][HS] tile.
template <typename T, int HS>
__device__ __forceinline__ void tile_abt(float* stage, const FragA<T> (&a)[HS / 16], const T* b) {
  constexpr int LD = kLdTile<HS>;
  for (int n = 0; n < kBc / 16; ++n) {
    FragAcc s;
    wmma::fill_fragment(s, 0.0f);
    for (int k = 0; k < HS / 16; ++k) {
      FragBCol<T> bf;
      wmma::load_matrix_sync(bf, b + n * 16 * LD + k * 16, LD);
      wmma::mma_sync(s, a[k], bf, s);
    }
    wmma::store_matrix_sync(stage + n * 16, s, kLdS, wmma::mem_row_major);
  }
}

// --- forward ------------------------------------------------------------------------------------

// grid (ceil(T / kBr), NH, B), kThreads threads, ForwardSmem<HS>::kBytes of shared memory.
template <typename T, int HS>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(T* __restrict__ out, float* __restrict__ lse, const T* __restrict__ qkv,
                         const int32_t* __restrict__ pos, int T_, int NH, int NKV) {
  STRATA_DYNAMIC_SMEM(smem);
  using L = ForwardSmem<HS>;
  constexpr int LD = kLdTile<HS>, NF = HS / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  T* Qs = reinterpret_cast<T*>(smem + L::kQ);
  T* Ks = reinterpret_cast<T*>(smem + L::kK);
  T* Vs = reinterpret_cast<T*>(smem + L::kV);
  float* Sw = reinterpret_cast<float*>(smem + L::kS) + warp * 16 * kLdS;
  T* Pw = reinterpret_cast<T*>(smem + L::kP) + warp * 16 * kLdP;
  float* row_ids = reinterpret_cast<float*>(smem + L::kRowIds);
  float* stat = reinterpret_cast<float*>(smem + L::kStats) + warp * 16;

  const int q0 = blockIdx.x * kBr, h = blockIdx.y, b = blockIdx.z;
  const int g = h / (NH / NKV);
  const size_t W = size_t(NH + 2 * NKV) * HS;
  const T* base = qkv + size_t(b) * T_ * W;
  load_tile<T, HS, kBr>(Qs, base + size_t(h) * HS, W, q0, T_);
  for (int i = threadIdx.x; i < 256; i += kThreads) row_ids[i] = float(i / 16);
  __syncthreads();

  FragA<T> qf[NF];
  for (int k = 0; k < NF; ++k) wmma::load_matrix_sync(qf[k], Qs + warp * 16 * LD + k * 16, LD);
  FragAcc rows, o[NF];
  wmma::load_matrix_sync(rows, row_ids, 16, wmma::mem_row_major);
  for (int n = 0; n < NF; ++n) wmma::fill_fragment(o[n], 0.0f);

  // Lanes 2r and 2r+1 own row r of the warp's 16: columns [0, kBc/2) and [kBc/2, kBc) of each
  // score tile. Scores are kept in log2 units: x = q.k * log2(e) / sqrt(hs).
  const float scale_log2 = kLog2e / sqrtf(float(HS));
  const int r = lane / 2, c0 = (lane % 2) * (kBc / 2);
  const int t = q0 + warp * 16 + r;
  const int lo = key_start(pos, b, t, T_);
  float m = -INFINITY, l = 0.0f;
  const int kv_end = min(T_, q0 + kBr);
  for (int j0 = tile_key_start(pos, b, q0, T_) / kBc * kBc; j0 < kv_end; j0 += kBc) {
    __syncthreads();  // every warp is done with the previous K and V tiles
    load_tile<T, HS, kBc>(Ks, base + size_t(NH + g) * HS, W, j0, T_);
    load_tile<T, HS, kBc>(Vs, base + size_t(NH + NKV + g) * HS, W, j0, T_);
    __syncthreads();
    tile_abt<T, HS>(Sw, qf, Ks);
    __syncwarp();

    float* srow = Sw + r * kLdS;
    float mx = -INFINITY;
    for (int c = c0; c < c0 + kBc / 2; ++c) {
      const int j = j0 + c;
      const float x = (j <= t && j < T_ && j >= lo) ? srow[c] * scale_log2 : -INFINITY;
      srow[c] = x;
      mx = fmaxf(mx, x);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_new = fmaxf(m, mx);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing unmasked yet
    T* prow = Pw + r * kLdP;
    float sum = 0.0f;
    for (int c = c0; c < c0 + kBc / 2; ++c) {
      const float p = exp2f(srow[c] - m_use);
      sum += p;
      prow[c] = from_f32<T>(p);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    const float alpha = exp2f(m - m_use);
    l = l * alpha + sum;
    m = m_new;
    if (lane % 2 == 0) stat[r] = alpha;
    __syncwarp();

    for (int n = 0; n < NF; ++n) {
      for (int i = 0; i < o[n].num_elements; ++i) o[n].x[i] *= stat[int(rows.x[i])];
    }
    for (int k = 0; k < kBc / 16; ++k) {
      FragA<T> pf;
      wmma::load_matrix_sync(pf, Pw + k * 16, kLdP);
      for (int n = 0; n < NF; ++n) {
        FragBRow<T> vf;
        wmma::load_matrix_sync(vf, Vs + k * 16 * LD + n * 16, LD);
        wmma::mma_sync(o[n], pf, vf, o[n]);
      }
    }
    __syncwarp();  // `stat` and the warp's P are rewritten by the next tile
  }

  if (lane % 2 == 0) stat[r] = l > 0.0f ? 1.0f / l : 0.0f;
  __syncwarp();
  for (int n = 0; n < NF; ++n) {
    for (int i = 0; i < o[n].num_elements; ++i) o[n].x[i] *= stat[int(rows.x[i])];
  }
  if (lane % 2 == 0 && t < T_) lse[(size_t(b) * NH + h) * T_ + t] = (m + log2f(l)) * kLn2;
  const size_t C = size_t(NH) * HS;
  T* obase = out + size_t(b) * T_ * C + size_t(h) * HS;
  for (int n = 0; n < NF; ++n) {
    __syncwarp();
    wmma::store_matrix_sync(Sw, o[n], kLdS, wmma::mem_row_major);
    __syncwarp();
    for (int e = lane; e < 256; e += 32) {
      const int rr = e / 16, cc = e % 16, tt = q0 + warp * 16 + rr;
      if (tt < T_) obase[size_t(tt) * C + n * 16 + cc] = from_f32<T>(Sw[rr * kLdS + cc]);
    }
  }
}

// --- backward -----------------------------------------------------------------------------------

// D[(b*NH + h)*T + t] = dot(dout[b,t,h,:], out[b,t,h,:]). One warp per row; grid
// ceil(B*NH*T / kDotRowsPerBlock), 32 * kDotRowsPerBlock threads.
template <typename T>
__global__ void flash_backward_dot_kernel(float* __restrict__ D, const T* __restrict__ dout,
                                          const T* __restrict__ out, int B, int T_, int NH,
                                          int hs) {
  const size_t row = size_t(blockIdx.x) * kDotRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= size_t(B) * NH * T_) return;
  const int t = int(row % T_), h = int((row / T_) % NH), b = int(row / (size_t(T_) * NH));
  const size_t p = (size_t(b) * T_ + t) * NH * hs + size_t(h) * hs;
  float sum = 0.0f;
  for (int i = lane; i < hs; i += 32) sum += f32(dout[p + i]) * f32(out[p + i]);
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) D[row] = sum;
}

// Loads a query tile's Q and dO rows, and its rows' log-sum-exp (in log2 units), D and first
// key (key_start of batch row b).
template <typename T, int HS>
__device__ __forceinline__ void load_query_tile(unsigned char* smem, const T* qbase,
                                                const T* dobase, size_t W, size_t C,
                                                const float* lse_row, const float* d_row,
                                                const int32_t* pos, int b, int i0, int T_) {
  using L = BackwardSmem<HS>;
  load_tile<T, HS, kBr>(reinterpret_cast<T*>(smem + L::kQ), qbase, W, i0, T_);
  load_tile<T, HS, kBr>(reinterpret_cast<T*>(smem + L::kDO), dobase, C, i0, T_);
  float* lse2 = reinterpret_cast<float*>(smem + L::kLse);
  float* Ds = reinterpret_cast<float*>(smem + L::kD);
  int* los = reinterpret_cast<int*>(smem + L::kLo);
  for (int i = threadIdx.x; i < kBr; i += kThreads) {
    const bool in = i0 + i < T_;
    lse2[i] = in ? lse_row[i0 + i] * kLog2e : 0.0f;
    Ds[i] = in ? d_row[i0 + i] : 0.0f;
    los[i] = key_start(pos, b, i0 + i, T_);
  }
}

// dK and dV of one key tile. grid (ceil(T / kBc), NKV, B), kThreads threads,
// BackwardSmem<HS>::kBytes of shared memory. Warp w owns keys j0 + 16w .. j0 + 16w + 15.
template <typename T, int HS>
__global__ void __launch_bounds__(kThreads)
    flash_backward_dkdv_kernel(T* __restrict__ dqkv, const T* __restrict__ qkv,
                               const T* __restrict__ dout, const float* __restrict__ lse,
                               const float* __restrict__ D, const int32_t* __restrict__ pos, int T_,
                               int NH, int NKV) {
  STRATA_DYNAMIC_SMEM(smem);
  using L = BackwardSmem<HS>;
  constexpr int LD = kLdTile<HS>, NF = HS / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  T* Ks = reinterpret_cast<T*>(smem + L::kK);
  T* Vs = reinterpret_cast<T*>(smem + L::kV);
  const T* Qs = reinterpret_cast<const T*>(smem + L::kQ);
  const T* dOs = reinterpret_cast<const T*>(smem + L::kDO);
  const float* lse2 = reinterpret_cast<const float*>(smem + L::kLse);
  const float* Ds = reinterpret_cast<const float*>(smem + L::kD);
  const int* los = reinterpret_cast<const int*>(smem + L::kLo);
  float* Sw = reinterpret_cast<float*>(smem + L::kS) + warp * 16 * kLdS;
  float* dPw = reinterpret_cast<float*>(smem + L::kDP) + warp * 16 * kLdS;
  T* Pw = reinterpret_cast<T*>(smem + L::kP) + warp * 16 * kLdP;
  T* dSw = reinterpret_cast<T*>(smem + L::kDS) + warp * 16 * kLdP;

  const int j0 = blockIdx.x * kBc, g = blockIdx.y, b = blockIdx.z;
  const int group = NH / NKV;
  const size_t W = size_t(NH + 2 * NKV) * HS, C = size_t(NH) * HS;
  const T* base = qkv + size_t(b) * T_ * W;
  const T* dbase = dout + size_t(b) * T_ * C;
  load_tile<T, HS, kBc>(Ks, base + size_t(NH + g) * HS, W, j0, T_);
  load_tile<T, HS, kBc>(Vs, base + size_t(NH + NKV + g) * HS, W, j0, T_);

  FragAcc dk[NF], dv[NF];
  for (int n = 0; n < NF; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  const float scale = 1.0f / sqrtf(float(HS));
  const float scale_log2 = scale * kLog2e;
  // Lanes 2r and 2r+1 own key row r of the warp's 16: query columns [0, 32) and [32, 64).
  const int r = lane / 2, c0 = (lane % 2) * (kBr / 2);
  const int j = j0 + warp * 16 + r;
  for (int h = g * group; h < (g + 1) * group; ++h) {
    const size_t row0 = (size_t(b) * NH + h) * T_;
    for (int i0 = j0; i0 < T_; i0 += kBr) {  // query tiles at or below the diagonal
      // A tile whose every row starts its sequence after this key tile sees none of its keys.
      if (pos != nullptr && tile_key_start(pos, b, i0, T_) >= j0 + kBc) continue;
      __syncthreads();  // every warp is done with the previous query tile
      load_query_tile<T, HS>(smem, base + size_t(h) * HS, dbase + size_t(h) * HS, W, C, lse + row0,
                             D + row0, pos, b, i0, T_);
      __syncthreads();
      // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys and the tile's kBr queries.
      for (int n = 0; n < kBr / 16; ++n) {
        FragAcc s, dp;
        wmma::fill_fragment(s, 0.0f);
        wmma::fill_fragment(dp, 0.0f);
        for (int k = 0; k < NF; ++k) {
          FragA<T> a;
          FragBCol<T> bf;
          wmma::load_matrix_sync(a, Ks + warp * 16 * LD + k * 16, LD);
          wmma::load_matrix_sync(bf, Qs + n * 16 * LD + k * 16, LD);
          wmma::mma_sync(s, a, bf, s);
          wmma::load_matrix_sync(a, Vs + warp * 16 * LD + k * 16, LD);
          wmma::load_matrix_sync(bf, dOs + n * 16 * LD + k * 16, LD);
          wmma::mma_sync(dp, a, bf, dp);
        }
        wmma::store_matrix_sync(Sw + n * 16, s, kLdS, wmma::mem_row_major);
        wmma::store_matrix_sync(dPw + n * 16, dp, kLdS, wmma::mem_row_major);
      }
      __syncwarp();
      for (int c = c0; c < c0 + kBr / 2; ++c) {
        const int t = i0 + c;
        const bool valid = t >= j && t < T_ && j < T_ && j >= los[c];
        const float p = valid ? exp2f(Sw[r * kLdS + c] * scale_log2 - lse2[c]) : 0.0f;
        Pw[r * kLdP + c] = from_f32<T>(p);
        dSw[r * kLdP + c] = from_f32<T>(p * (dPw[r * kLdS + c] - Ds[c]));
      }
      __syncwarp();
      // dV += P^T dO, dK += dS^T Q (the softmax scale is applied to dK at the end).
      for (int k = 0; k < kBr / 16; ++k) {
        FragA<T> pa, da;
        wmma::load_matrix_sync(pa, Pw + k * 16, kLdP);
        wmma::load_matrix_sync(da, dSw + k * 16, kLdP);
        for (int n = 0; n < NF; ++n) {
          FragBRow<T> bf;
          wmma::load_matrix_sync(bf, dOs + k * 16 * LD + n * 16, LD);
          wmma::mma_sync(dv[n], pa, bf, dv[n]);
          wmma::load_matrix_sync(bf, Qs + k * 16 * LD + n * 16, LD);
          wmma::mma_sync(dk[n], da, bf, dk[n]);
        }
      }
      __syncwarp();  // the warp's P and dS are rewritten by the next tile
    }
  }
  for (int n = 0; n < NF; ++n) {
    for (int i = 0; i < dk[n].num_elements; ++i) dk[n].x[i] *= scale;
  }
  T* dbase_out = dqkv + size_t(b) * T_ * W;
  add_to_global<T, NF>(dbase_out + size_t(NH + g) * HS, W, j0, T_, dk, Sw);
  add_to_global<T, NF>(dbase_out + size_t(NH + NKV + g) * HS, W, j0, T_, dv, Sw);
}

// dQ of one query tile. grid (ceil(T / kBr), NH, B), kThreads threads,
// BackwardSmem<HS>::kBytes of shared memory. Warp w owns queries i0 + 16w .. i0 + 16w + 15.
template <typename T, int HS>
__global__ void __launch_bounds__(kThreads)
    flash_backward_dq_kernel(T* __restrict__ dqkv, const T* __restrict__ qkv,
                             const T* __restrict__ dout, const float* __restrict__ lse,
                             const float* __restrict__ D, const int32_t* __restrict__ pos, int T_,
                             int NH, int NKV) {
  STRATA_DYNAMIC_SMEM(smem);
  using L = BackwardSmem<HS>;
  constexpr int LD = kLdTile<HS>, NF = HS / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  T* Ks = reinterpret_cast<T*>(smem + L::kK);
  T* Vs = reinterpret_cast<T*>(smem + L::kV);
  const T* Qs = reinterpret_cast<const T*>(smem + L::kQ);
  const T* dOs = reinterpret_cast<const T*>(smem + L::kDO);
  const float* lse2 = reinterpret_cast<const float*>(smem + L::kLse);
  const float* Ds = reinterpret_cast<const float*>(smem + L::kD);
  float* Sw = reinterpret_cast<float*>(smem + L::kS) + warp * 16 * kLdS;
  float* dPw = reinterpret_cast<float*>(smem + L::kDP) + warp * 16 * kLdS;
  T* dSw = reinterpret_cast<T*>(smem + L::kDS) + warp * 16 * kLdP;

  const int i0 = blockIdx.x * kBr, h = blockIdx.y, b = blockIdx.z;
  const int g = h / (NH / NKV);
  const size_t W = size_t(NH + 2 * NKV) * HS, C = size_t(NH) * HS;
  const T* base = qkv + size_t(b) * T_ * W;
  const size_t row0 = (size_t(b) * NH + h) * T_;
  load_query_tile<T, HS>(smem, base + size_t(h) * HS, dout + size_t(b) * T_ * C + size_t(h) * HS, W,
                         C, lse + row0, D + row0, pos, b, i0, T_);
  __syncthreads();
  FragA<T> qf[NF], dof[NF];
  for (int k = 0; k < NF; ++k) {
    wmma::load_matrix_sync(qf[k], Qs + warp * 16 * LD + k * 16, LD);
    wmma::load_matrix_sync(dof[k], dOs + warp * 16 * LD + k * 16, LD);
  }
  FragAcc dq[NF];
  for (int n = 0; n < NF; ++n) wmma::fill_fragment(dq[n], 0.0f);

  const float scale = 1.0f / sqrtf(float(HS));
  const float scale_log2 = scale * kLog2e;
  const int r = lane / 2, c0 = (lane % 2) * (kBc / 2);
  const int t = i0 + warp * 16 + r;
  const float lse_t = lse2[warp * 16 + r], d_t = Ds[warp * 16 + r];
  const int lo = key_start(pos, b, t, T_);
  const int kv_end = min(T_, i0 + kBr);
  for (int j0 = tile_key_start(pos, b, i0, T_) / kBc * kBc; j0 < kv_end; j0 += kBc) {
    __syncthreads();  // every warp is done with the previous K and V tiles
    load_tile<T, HS, kBc>(Ks, base + size_t(NH + g) * HS, W, j0, T_);
    load_tile<T, HS, kBc>(Vs, base + size_t(NH + NKV + g) * HS, W, j0, T_);
    __syncthreads();
    tile_abt<T, HS>(Sw, qf, Ks);
    tile_abt<T, HS>(dPw, dof, Vs);
    __syncwarp();
    for (int c = c0; c < c0 + kBc / 2; ++c) {
      const int jj = j0 + c;
      const bool valid = jj <= t && jj < T_ && t < T_ && jj >= lo;
      const float p = valid ? exp2f(Sw[r * kLdS + c] * scale_log2 - lse_t) : 0.0f;
      dSw[r * kLdP + c] = from_f32<T>(p * (dPw[r * kLdS + c] - d_t));
    }
    __syncwarp();
    for (int k = 0; k < kBc / 16; ++k) {
      FragA<T> a;
      wmma::load_matrix_sync(a, dSw + k * 16, kLdP);
      for (int n = 0; n < NF; ++n) {
        FragBRow<T> bf;
        wmma::load_matrix_sync(bf, Ks + k * 16 * LD + n * 16, LD);
        wmma::mma_sync(dq[n], a, bf, dq[n]);
      }
    }
    __syncwarp();  // the warp's dS is rewritten by the next tile
  }
  for (int n = 0; n < NF; ++n) {
    for (int i = 0; i < dq[n].num_elements; ++i) dq[n].x[i] *= scale;
  }
  add_to_global<T, NF>(dqkv + size_t(b) * T_ * W + size_t(h) * HS, W, i0, T_, dq, Sw);
}

}  // namespace strata::flash
