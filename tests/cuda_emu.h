// A CPU emulation of the small part of CUDA that kernels/cuda/flash_attention_kernels.cuh uses,
// so that its kernels run, unchanged, in tests on machines without a GPU. Test-only.
//
// What is emulated:
//   - a launch: blocks run one after another; the threads of a block are fibers (ucontext) on
//     the calling thread. A fiber runs until it reaches a barrier (__syncthreads, __syncwarp,
//     or a warp collective: __shfl_xor_sync, wmma::mma_sync), then the next fiber runs. When
//     every live thread of the block (or of the warp) has arrived, they are released.
//   - dynamic shared memory, filled with 0xFF bytes (NaN as fp32, bf16 and fp16) before each
//     block, so a read of something never written shows up as NaN in the results.
//   - WMMA 16x16x16 fragments with bf16/fp16 inputs and fp32 accumulators. The mapping of
//     fragment elements to matrix positions is a fixed pseudo-random permutation, different for
//     matrix_a, matrix_b and accumulator, so a kernel that assumes a particular mapping fails.
//     load/store check the alignment rules (32-byte pointer, 16-byte multiple stride).
//   - bf16/fp16 with round-to-nearest-even conversions (strata/dtype.h).
//
// Races: warps run one at a time, each as far as it can (up to the next __syncthreads), and
// within a warp the lanes run one after another from one barrier to the next; Order::kForward
// goes warp 0 first and lane 0 first, Order::kReverse the other way round. A missing barrier
// between one thread's write and another thread's read of shared memory (within a warp or
// across warps) makes the reader see the old or the new value in one of the two orders, so
// running a kernel in both orders and requiring the same, correct result finds it. A barrier
// reached by only some threads (divergence) is reported as a deadlock.
//
// Not emulated: timing, the memory model beyond the above, register and shared-memory limits
// (ptxas and the launch check those), atomics, multi-dimensional blocks.
#pragma once

#define STRATA_CUDA_EMULATION 1

#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "strata/dtype.h"

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define STRATA_FA_DYNAMIC_SMEM(name) unsigned char* name = ::strata::emu::dynamic_smem()

struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};
inline __nv_bfloat16 __float2bfloat16_rn(float x) { return {strata::f32_to_bf16(x)}; }
inline float __bfloat162float(__nv_bfloat16 x) { return strata::bf16_to_f32(x.bits); }
inline __half __float2half_rn(float x) { return {strata::f32_to_f16(x)}; }
inline float __half2float(__half x) { return strata::f16_to_f32(x.bits); }
inline float emu_to_float(float x) { return x; }
inline float emu_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
inline float emu_to_float(__half x) { return __half2float(x); }

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline int min(int a, int b) { return a < b ? a : b; }

namespace strata::emu {

struct Index {
  unsigned x = 0, y = 0, z = 0;
};

}  // namespace strata::emu

inline strata::emu::Index threadIdx, blockIdx, blockDim, gridDim;

namespace strata::emu {

enum class Order { kForward, kReverse };

// The emulated device: one launch at a time, on one host thread.
class Runtime {
 public:
  static Runtime& get() {
    static Runtime r;
    return r;
  }

  // Runs kernel() once per thread of every block of `grid` x `threads` with `smem_bytes` of
  // dynamic shared memory. Throws std::runtime_error on a deadlock or a broken WMMA rule.
  void launch(Index grid, unsigned threads, size_t smem_bytes, Order order,
              const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = {threads, 1, 1};
    kernel_ = &kernel;
    for (unsigned z = 0; z < grid.z; ++z) {
      for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x) {
          blockIdx = {x, y, z};
          run_block(threads, smem_bytes, order);
        }
      }
    }
  }

  unsigned char* smem() { return smem_.get(); }

  // Called by the current thread: wait at a barrier of the block or of its warp.
  void sync_block() { wait(Wait::kBlock, "__syncthreads"); }
  void sync_warp(const char* what) { wait(Wait::kWarp, what); }

  struct WarpShared {
    std::array<float, 32> shfl{};
    std::array<float, 256> a{}, b{}, c{};
  };
  WarpShared& warp_shared() { return warps_[current_ / 32]; }
  unsigned lane() const { return current_ % 32; }

  // Position in the 16x16 matrix (row * 16 + col) of element i of `lane`'s fragment of kind k.
  enum Kind { kA = 0, kB = 1, kAcc = 2 };
  int position(Kind k, unsigned lane, int i) const { return perm_[k][lane * 8 + i]; }

  // Reports a broken rule. Inside a kernel the thread stops and launch() throws once the
  // scheduler has control (an exception must not cross a fiber's stack).
  [[noreturn]] void fail(const std::string& what) {
    if (!in_fiber_) throw std::runtime_error("cuda_emu: " + what);
    if (error_.empty()) error_ = what;
    Fiber& f = fibers_[current_];
    f.wait = Wait::kDone;
    swapcontext(&f.ctx, &sched_);
    std::abort();  // never resumed
  }

 private:
  enum class Wait { kNone, kBlock, kWarp, kDone };
  struct Fiber {
    ucontext_t ctx;
    std::unique_ptr<char[]> stack;
    Wait wait = Wait::kNone;
    const char* what = "";
  };
  static constexpr size_t kStack = 256 << 10;

  Runtime() {
    for (int k = 0; k < 3; ++k) {
      std::mt19937 rng(1234 + k);
      perm_[k].resize(256);
      for (int i = 0; i < 256; ++i) perm_[k][i] = i;
      std::shuffle(perm_[k].begin(), perm_[k].end(), rng);
    }
  }

  static void fiber_main() {
    Runtime& r = get();
    (*r.kernel_)();
    r.fibers_[r.current_].wait = Wait::kDone;
    swapcontext(&r.fibers_[r.current_].ctx, &r.sched_);
  }

  void wait(Wait w, const char* what) {
    Fiber& f = fibers_[current_];
    f.wait = w;
    f.what = what;
    swapcontext(&f.ctx, &sched_);
  }

  void run_block(unsigned n, size_t smem_bytes, Order order) {
    const size_t bytes = (smem_bytes + 127) / 128 * 128 + 128;
    smem_.reset(static_cast<unsigned char*>(std::aligned_alloc(128, bytes)));
    std::memset(smem_.get(), 0xFF, bytes);
    fibers_.resize(n);
    warps_.assign((n + 31) / 32, WarpShared{});
    for (unsigned t = 0; t < n; ++t) {
      Fiber& f = fibers_[t];
      if (!f.stack) f.stack.reset(new char[kStack]);
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.get();
      f.ctx.uc_stack.ss_size = kStack;
      f.ctx.uc_link = nullptr;
      makecontext(&f.ctx, &Runtime::fiber_main, 0);
      f.wait = Wait::kNone;
    }
    const unsigned warps = (n + 31) / 32;
    for (;;) {
      // Each warp in turn runs as far as it can: its lanes run until they block, its warp
      // barriers are released as soon as all its lanes reach them, until every lane waits at a
      // block barrier (or has exited). So one warp runs ahead of the others up to the next
      // __syncthreads, which a missing block barrier cannot survive in both orders.
      bool ran = false;
      for (unsigned k = 0; k < warps; ++k) {
        const unsigned w = order == Order::kForward ? k : warps - 1 - k;
        const unsigned lo = w * 32, hi = std::min(n, lo + 32);
        for (;;) {
          for (unsigned i = lo; i < hi; ++i) {
            const unsigned t = order == Order::kForward ? i : hi - 1 - (i - lo);
            if (fibers_[t].wait != Wait::kNone) continue;
            resume(t);
            ran = true;
          }
          if (!release_warp(lo, hi)) break;
        }
      }
      bool all_done = true, all_block = true;
      for (const Fiber& f : fibers_) {
        if (f.wait != Wait::kDone) all_done = false;
        if (f.wait != Wait::kDone && f.wait != Wait::kBlock) all_block = false;
      }
      if (all_done) return;
      if (all_block) {
        for (Fiber& f : fibers_) {
          if (f.wait == Wait::kBlock) f.wait = Wait::kNone;
        }
        continue;
      }
      if (!ran) {
        std::string s;
        for (unsigned t = 0; t < n; ++t) {
          s += " " + std::to_string(t) + ":" +
               (fibers_[t].wait == Wait::kDone ? "exited" : fibers_[t].what);
          if (s.size() > 400) break;
        }
        fail("deadlock in block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) +
             "," + std::to_string(blockIdx.z) + "): threads wait at different barriers:" + s);
      }
    }
  }

  // Runs thread t until it blocks or exits.
  void resume(unsigned t) {
    current_ = t;
    threadIdx = {t, 0, 0};
    in_fiber_ = true;
    swapcontext(&sched_, &fibers_[t].ctx);
    in_fiber_ = false;
    if (!error_.empty()) {
      const std::string e = "thread " + std::to_string(t) + " of block (" +
                            std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," +
                            std::to_string(blockIdx.z) + "): " + error_;
      error_.clear();
      fail(e);
    }
  }

  // Releases threads lo..hi-1 (one warp) if every live one waits at the same warp barrier.
  bool release_warp(unsigned lo, unsigned hi) {
    const char* what = nullptr;
    for (unsigned t = lo; t < hi; ++t) {
      const Fiber& f = fibers_[t];
      if (f.wait == Wait::kDone) continue;
      if (f.wait != Wait::kWarp) return false;
      if (what != nullptr && std::strcmp(what, f.what) != 0) {
        fail("warp " + std::to_string(lo / 32) + ": lanes wait at different collectives: " + what +
             " and " + f.what);
      }
      what = f.what;
    }
    if (what == nullptr) return false;
    for (unsigned t = lo; t < hi; ++t) {
      if (fibers_[t].wait == Wait::kWarp) fibers_[t].wait = Wait::kNone;
    }
    return true;
  }

  struct FreeDeleter {
    void operator()(unsigned char* p) const { std::free(p); }
  };
  std::unique_ptr<unsigned char, FreeDeleter> smem_;
  std::vector<Fiber> fibers_;
  std::vector<WarpShared> warps_;
  std::vector<int> perm_[3];
  ucontext_t sched_;
  unsigned current_ = 0;
  bool in_fiber_ = false;
  std::string error_;
  const std::function<void()>* kernel_ = nullptr;
};

inline unsigned char* dynamic_smem() { return Runtime::get().smem(); }

}  // namespace strata::emu

inline void __syncthreads() { strata::emu::Runtime::get().sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) strata::emu::Runtime::get().fail("__syncwarp with a partial mask");
  strata::emu::Runtime::get().sync_warp("__syncwarp");
}
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
  auto& rt = strata::emu::Runtime::get();
  if (mask != 0xffffffffu) rt.fail("__shfl_xor_sync with a partial mask");
  auto& w = rt.warp_shared();
  const unsigned lane = rt.lane();
  w.shfl[lane] = v;
  rt.sync_warp("__shfl_xor_sync");
  const float r = w.shfl[lane ^ unsigned(lane_mask)];
  rt.sync_warp("__shfl_xor_sync (read)");
  return r;
}

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "cuda_emu: only 16x16x16 fragments");
  static constexpr int num_elements = 8;  // 256 elements over 32 lanes
  T x[num_elements];
};

namespace detail {
using strata::emu::Runtime;
template <typename Use>
constexpr Runtime::Kind kind() {
  if constexpr (std::is_same_v<Use, matrix_a>) return Runtime::kA;
  if constexpr (std::is_same_v<Use, matrix_b>) return Runtime::kB;
  return Runtime::kAcc;
}
inline void check(const void* p, unsigned ldm, size_t elem) {
  auto& rt = Runtime::get();
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) rt.fail("WMMA pointer not 32-byte aligned");
  if ((ldm * elem) % 16 != 0) rt.fail("WMMA stride not a multiple of 16 bytes");
}
// Offset in memory of matrix position (r, c) for a row-major or column-major layout.
inline size_t at(int r, int c, unsigned ldm, bool col) {
  return col ? size_t(c) * ldm + r : size_t(r) * ldm + c;
}
}  // namespace detail

template <typename Use, typename T, typename Layout>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, float v) {
  for (auto& e : f.x) {
    if constexpr (std::is_same_v<T, float>) {
      e = v;
    } else {
      e = T{};
      static_cast<void>(v);
      detail::Runtime::get().fail("fill_fragment is only emulated for accumulators");
    }
  }
}

// matrix_a / matrix_b: the layout is the fragment's.
template <typename Use, typename T, typename Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  detail::check(p, ldm, sizeof(T));
  auto& rt = detail::Runtime::get();
  constexpr bool col = std::is_same_v<Layout, col_major>;
  for (int i = 0; i < f.num_elements; ++i) {
    const int pos = rt.position(detail::kind<Use>(), rt.lane(), i);
    f.x[i] = p[detail::at(pos / 16, pos % 16, ldm, col)];
  }
}
// accumulator: the layout is given.
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout) {
  detail::check(p, ldm, 4);
  auto& rt = detail::Runtime::get();
  for (int i = 0; i < f.num_elements; ++i) {
    const int pos = rt.position(detail::Runtime::kAcc, rt.lane(), i);
    f.x[i] = p[detail::at(pos / 16, pos % 16, ldm, layout == mem_col_major)];
  }
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
  detail::check(p, ldm, 4);
  auto& rt = detail::Runtime::get();
  for (int i = 0; i < f.num_elements; ++i) {
    const int pos = rt.position(detail::Runtime::kAcc, rt.lane(), i);
    p[detail::at(pos / 16, pos % 16, ldm, layout == mem_col_major)] = f.x[i];
  }
}

// d = a b + c: every lane publishes its elements, then computes its own elements of d.
template <typename T, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, T, row_major>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  auto& rt = detail::Runtime::get();
  auto& w = rt.warp_shared();
  const unsigned lane = rt.lane();
  for (int i = 0; i < 8; ++i) {
    w.a[rt.position(detail::Runtime::kA, lane, i)] = emu_to_float(a.x[i]);
    w.b[rt.position(detail::Runtime::kB, lane, i)] = emu_to_float(b.x[i]);
    w.c[rt.position(detail::Runtime::kAcc, lane, i)] = c.x[i];
  }
  rt.sync_warp("wmma::mma_sync");
  float out[8];
  for (int i = 0; i < 8; ++i) {
    const int pos = rt.position(detail::Runtime::kAcc, lane, i), r = pos / 16, col = pos % 16;
    float acc = w.c[pos];
    for (int k = 0; k < 16; ++k) acc += w.a[r * 16 + k] * w.b[k * 16 + col];
    out[i] = acc;
  }
  rt.sync_warp("wmma::mma_sync (read)");
  for (int i = 0; i < 8; ++i) d.x[i] = out[i];
}

}  // namespace nvcuda::wmma
