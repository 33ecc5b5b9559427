// A CPU emulation of the device side of CUDA that strata's kernels use (kernels/cuda/*.cu and
// flash_attention_kernels.cuh), so that they run, unchanged, in tests on machines without a GPU.
// Test-only. tests/cuda_emu/ builds on it: a translation of each .cu file (its launches
// `k<<<g, b, smem, s>>>(args)` become `k | Launch(g, b, smem, s)(args)`, see translate.cmake) and
// a CPU stand-in for the CUDA runtime, cuBLASLt and NCCL (tests/cuda_emu/runtime.cc), so that the
// real backend (kernels/cuda/cuda_device.cc) runs on it.
//
// What is emulated:
//   - a launch: the blocks of the grid run one after another on the calling host thread (a
//     stream's worker thread), in x, y, z order or, with Order::kReverse, the other way round.
//     The threads of a block (1, 2 or 3-dimensional, at most 1024) are fibers on that thread. A
//     fiber runs until it reaches a barrier (__syncthreads, __syncwarp, a warp collective:
//     __shfl_*_sync, wmma::mma_sync), then the next fiber runs. When every live thread of the
//     block (or of the warp) has arrived, they are released.
//   - shared memory, dynamic (STRATA_DYNAMIC_SMEM) and static (`__shared__` declarations,
//     which the translation turns into block_shared<T>() references), filled with 0xFF bytes
//     (NaN as fp32, bf16 and fp16) before each block, so a read of something never written
//     shows up as NaN in the results. Static shared memory over 48 KiB fails the launch.
//   - warp shuffles (xor, down, up, indexed) of any 4- or 8-byte type; atomicAdd, and atomicMin
//     and atomicMax on int (real atomics: streams run concurrently on several host threads).
//   - WMMA 16x16x16 fragments with bf16/fp16 inputs and fp32 accumulators. The mapping of
//     fragment elements to matrix positions is a fixed pseudo-random permutation, different for
//     matrix_a, matrix_b and accumulator, so a kernel that assumes a particular mapping fails.
//     load/store check the alignment rules (32-byte pointer, 16-byte multiple stride).
//   - bf16/fp16 with round-to-nearest-even conversions (strata/dtype.h); the IEEE-rounded
//     intrinsics (__fdiv_rn, ...) and the math functions are the host's (glibc's expf, not the
//     GPU's): the emulation proves the kernels' logic, not the GPU's last bits.
//
// Races: warps run one at a time, each as far as it can (up to the next __syncthreads), and
// within a warp the lanes run one after another from one barrier to the next; Order::kForward
// goes block 0, warp 0 and lane 0 first, Order::kReverse the other way round. A missing barrier
// between one thread's write and another thread's read of shared memory (within a warp or
// across warps), or one block reading what another block writes, makes the reader see the old
// or the new value in one of the two orders, so running a kernel in both orders and requiring
// the same, correct result finds it. A barrier reached by only some threads (divergence) is
// reported as a deadlock.
//
// Not emulated: timing, the memory model beyond the above (no reordering of one thread's
// stores), register and shared-memory limits other than 48 KiB of static shared memory (ptxas
// and the launch check those on a GPU).
#pragma once

#define STRATA_CUDA_EMULATION 1

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define STRATA_EMU_FAST_SWITCH 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#undef STRATA_EMU_FAST_SWITCH
#endif
#endif

#include <math.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
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
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define STRATA_DYNAMIC_SMEM(name) unsigned char* name = ::strata::emu::dynamic_smem()

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
inline int max(int a, int b) { return a > b ? a : b; }

// The IEEE-rounded intrinsics: the host's float arithmetic is IEEE round-to-nearest-even (the
// emulation is built with -ffp-contract=off, so nothing is fused).
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }

namespace strata::emu {

struct Index {
  unsigned x = 0, y = 0, z = 0;
};

}  // namespace strata::emu

// Per host thread: each stream's worker runs its own launches.
inline thread_local strata::emu::Index threadIdx, blockIdx, blockDim, gridDim;

#ifdef STRATA_EMU_FAST_SWITCH
// strata_emu_switch(&save, to): saves the callee-saved registers, MXCSR and the x87 control word
// on the current stack, stores the stack pointer in *save and resumes the stack `to`. A fresh
// stack starts in strata_emu_start, which calls r13(r12). ~10 ns, where swapcontext makes a
// system call (sigprocmask) per switch. Emitted in a COMDAT group: one copy however many
// translation units include this header.
asm(R"(
  .pushsection .text.strata_emu_switch,"axG",@progbits,strata_emu_switch,comdat
  .weak strata_emu_switch
  .type strata_emu_switch,@function
strata_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size strata_emu_switch, .-strata_emu_switch
  .weak strata_emu_start
  .type strata_emu_start,@function
strata_emu_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size strata_emu_start, .-strata_emu_start
  .popsection
)");
extern "C" void strata_emu_switch(void** save, void* to);
extern "C" void strata_emu_start();
#endif

namespace strata::emu {

enum class Order { kForward, kReverse };

// The emulated multiprocessor of one host thread: one launch at a time.
class Runtime {
 public:
  static Runtime& get() {
    static thread_local Runtime r;
    return r;
  }

  // Runs kernel() once per thread of every block of `grid` x `block` with `smem_bytes` of
  // dynamic shared memory. Throws std::runtime_error on a deadlock, a broken WMMA rule or too
  // much static shared memory.
  void launch(Index grid, Index block, size_t smem_bytes, Order order,
              const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = block;
    kernel_ = &kernel;
    const size_t blocks = size_t(grid.x) * grid.y * grid.z;
    for (size_t k = 0; k < blocks; ++k) {
      const size_t b = order == Order::kForward ? k : blocks - 1 - k;
      blockIdx = {unsigned(b % grid.x), unsigned(b / grid.x % grid.y),
                  unsigned(b / (size_t(grid.x) * grid.y))};
      run_block(block, smem_bytes, order);
    }
  }
  // A one-dimensional block of `threads`.
  void launch(Index grid, unsigned threads, size_t smem_bytes, Order order,
              const std::function<void()>& kernel) {
    launch(grid, Index{threads, 1, 1}, smem_bytes, order, kernel);
  }

  unsigned char* smem() { return smem_ + kStaticSmem; }

  // The static shared variable `key` of the running block: the first thread to ask carves it
  // (poisoned) out of the block's static area, every thread of the block gets the same one.
  void* block_shared(unsigned key, size_t bytes, size_t align) {
    for (const Static& s : statics_) {
      if (s.key != key) continue;
      if (s.bytes != bytes) fail("__shared__ variable redeclared with another size");
      return smem_ + s.offset;
    }
    const size_t off = (static_used_ + align - 1) / align * align;
    if (off + bytes > kStaticSmem) {
      fail("more than 48 KiB of static __shared__ memory in one block");
    }
    static_used_ = off + bytes;
    statics_.push_back({key, off, bytes});
    return smem_ + off;
  }

  // Called by the current thread: wait at a barrier of the block or of its warp.
  void sync_block() { wait(Wait::kBlock, "__syncthreads"); }
  void sync_warp(const char* what) { wait(Wait::kWarp, what); }

  struct WarpShared {
    std::array<uint64_t, 32> shfl{};
    std::array<float, 256> a{}, b{}, c{};
  };
  WarpShared& warp_shared() { return warps_[current_ / 32]; }
  unsigned lane() const { return current_ % 32; }
  // Lanes of the current warp (32 except in a partial last warp).
  unsigned warp_size() const { return std::min(32u, threads_ - current_ / 32 * 32); }

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
    to_scheduler(f);
    std::abort();  // never resumed
  }

 private:
  enum class Wait { kNone, kBlock, kWarp, kDone };
  struct Fiber {
#ifdef STRATA_EMU_FAST_SWITCH
    void* sp = nullptr;
#else
    ucontext_t ctx;
#endif
    char* stack = nullptr;  // kStack bytes above a guard page
    Wait wait = Wait::kNone;
    const char* what = "";
  };
  struct Static {
    unsigned key;
    size_t offset, bytes;
  };
  static constexpr size_t kStack = 128 << 10, kGuard = 4096;
  static constexpr size_t kStaticSmem = 48 << 10;

  Runtime() {
    for (int k = 0; k < 3; ++k) {
      std::mt19937 rng(1234 + k);
      perm_[k].resize(256);
      for (int i = 0; i < 256; ++i) perm_[k][i] = i;
      std::shuffle(perm_[k].begin(), perm_[k].end(), rng);
    }
  }
  ~Runtime() {
    for (Fiber& f : fibers_) {
      if (f.stack) munmap(f.stack - kGuard, kStack + kGuard);
    }
    std::free(smem_);
  }

  static void fiber_main() {
    Runtime& r = get();
    (*r.kernel_)();
    Fiber& f = r.fibers_[r.current_];
    f.wait = Wait::kDone;
    r.to_scheduler(f);
  }
#ifdef STRATA_EMU_FAST_SWITCH
  static void fiber_entry(void*) { fiber_main(); }
  void to_scheduler(Fiber& f) { strata_emu_switch(&f.sp, sched_sp_); }
#else
  void to_scheduler(Fiber& f) { swapcontext(&f.ctx, &sched_); }
#endif

  void wait(Wait w, const char* what) {
    Fiber& f = fibers_[current_];
    f.wait = w;
    f.what = what;
    to_scheduler(f);
  }

  // A fiber's stack, with an inaccessible page below it: an overflow faults instead of
  // overwriting the next stack.
  static char* new_stack() {
    void* p = mmap(nullptr, kStack + kGuard, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("cuda_emu: cannot map a fiber stack");
    mprotect(p, kGuard, PROT_NONE);
    return static_cast<char*>(p) + kGuard;
  }

  void start_fiber(Fiber& f) {
    if (!f.stack) f.stack = new_stack();
#ifdef STRATA_EMU_FAST_SWITCH
    // The frame strata_emu_switch pops: MXCSR and x87 control word (IEEE defaults), r15, r14,
    // r13 (the entry), r12 (its argument), rbx, rbp, the return address (strata_emu_start).
    auto* top = reinterpret_cast<uint64_t*>(f.stack + kStack);
    uint64_t* sp = top - 8;
    sp[0] = uint64_t(0x1F80) | (uint64_t(0x037F) << 32);
    sp[1] = 0;
    sp[2] = 0;
    sp[3] = reinterpret_cast<uint64_t>(&Runtime::fiber_entry);
    sp[4] = 0;
    sp[5] = 0;
    sp[6] = 0;
    sp[7] = reinterpret_cast<uint64_t>(&strata_emu_start);
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, &Runtime::fiber_main, 0);
#endif
    f.wait = Wait::kNone;
  }

  void run_block(Index block, size_t smem_bytes, Order order) {
    const unsigned n = block.x * block.y * block.z;
    threads_ = n;
    const size_t bytes = kStaticSmem + (smem_bytes + 127) / 128 * 128 + 128;
    if (bytes > smem_capacity_) {
      std::free(smem_);
      smem_ = static_cast<unsigned char*>(std::aligned_alloc(128, bytes));
      smem_capacity_ = bytes;
    }
    std::memset(smem_, 0xFF, bytes);
    statics_.clear();
    static_used_ = 0;
    if (fibers_.size() < n) fibers_.resize(n);
    warps_.assign((n + 31) / 32, WarpShared{});
    for (unsigned t = 0; t < n; ++t) start_fiber(fibers_[t]);
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
            resume(t, block);
            ran = true;
          }
          if (!release_warp(lo, hi)) break;
        }
      }
      bool all_done = true, all_block = true;
      for (unsigned t = 0; t < n; ++t) {
        const Fiber& f = fibers_[t];
        if (f.wait != Wait::kDone) all_done = false;
        if (f.wait != Wait::kDone && f.wait != Wait::kBlock) all_block = false;
      }
      if (all_done) return;
      if (all_block) {
        for (unsigned t = 0; t < n; ++t) {
          if (fibers_[t].wait == Wait::kBlock) fibers_[t].wait = Wait::kNone;
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
        fail("deadlock in block " + block_name() + ": threads wait at different barriers:" + s);
      }
    }
  }

  static std::string block_name() {
    return "(" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," +
           std::to_string(blockIdx.z) + ")";
  }

  // Runs thread t until it blocks or exits.
  void resume(unsigned t, Index block) {
    current_ = t;
    threadIdx = {t % block.x, t / block.x % block.y, t / (block.x * block.y)};
    in_fiber_ = true;
#ifdef STRATA_EMU_FAST_SWITCH
    strata_emu_switch(&sched_sp_, fibers_[t].sp);
#else
    swapcontext(&sched_, &fibers_[t].ctx);
#endif
    in_fiber_ = false;
    if (!error_.empty()) {
      const std::string e =
          "thread " + std::to_string(t) + " of block " + block_name() + ": " + error_;
      error_.clear();
      // The other fibers of the block are abandoned mid-kernel; the next block restarts them.
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

  unsigned char* smem_ = nullptr;  // [static area: kStaticSmem][dynamic]
  size_t smem_capacity_ = 0, static_used_ = 0;
  std::vector<Static> statics_;
  std::vector<Fiber> fibers_;
  std::vector<WarpShared> warps_;
  std::vector<int> perm_[3];
#ifdef STRATA_EMU_FAST_SWITCH
  void* sched_sp_ = nullptr;
#else
  ucontext_t sched_;
#endif
  unsigned current_ = 0, threads_ = 0;
  bool in_fiber_ = false;
  std::string error_;
  const std::function<void()>* kernel_ = nullptr;
};

inline unsigned char* dynamic_smem() { return Runtime::get().smem(); }

// A `__shared__ T name;` declaration, as the translation rewrites it.
template <typename T>
T& block_shared(unsigned key) {
  return *static_cast<T*>(Runtime::get().block_shared(key, sizeof(T), alignof(T)));
}

// A warp collective: every lane publishes `v`, then reads lane `src(lane)`'s (its own value where
// the source lane is outside the warp, as CUDA's shuffles do).
template <typename T, typename Src>
T shuffle(unsigned mask, T v, const char* what, Src src) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "cuda_emu: shuffle type");
  auto& rt = Runtime::get();
  if (mask != 0xffffffffu) rt.fail(std::string(what) + " with a partial mask");
  auto& w = rt.warp_shared();
  const unsigned lane = rt.lane();
  std::memcpy(&w.shfl[lane], &v, sizeof(T));
  rt.sync_warp(what);
  const int from = src(int(lane));
  T r = v;
  if (from >= 0 && from < int(rt.warp_size())) std::memcpy(&r, &w.shfl[from], sizeof(T));
  rt.sync_warp(what);  // nobody overwrites w.shfl before every lane has read it
  return r;
}

}  // namespace strata::emu

// A 16-byte vector access (kernels/cuda/cuda_common.cuh's packs) of an address that is not
// 16-byte aligned faults on a GPU (misaligned address); here it fails the launch.
#define STRATA_PACK_CHECK(p)                                                                   \
  (reinterpret_cast<uintptr_t>(p) % 16 == 0                                                    \
       ? void()                                                                                \
       : ::strata::emu::Runtime::get().fail("a 16-byte pack access at an address that is not " \
                                            "16-byte aligned"))

inline void __syncthreads() { strata::emu::Runtime::get().sync_block(); }
// A fence orders the calling host thread's accesses (another stream's kernels run on another
// host thread; within a launch the threads run one at a time).
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) strata::emu::Runtime::get().fail("__syncwarp with a partial mask");
  strata::emu::Runtime::get().sync_warp("__syncwarp");
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return strata::emu::shuffle(mask, v, "__shfl_xor_sync", [&](int l) {
    return width == 32 ? (l ^ lane_mask) : (l / width * width + ((l % width) ^ lane_mask));
  });
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return strata::emu::shuffle(mask, v, "__shfl_down_sync", [&](int l) {
    const int j = l % width + int(delta);
    return j < width ? l + int(delta) : l;
  });
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return strata::emu::shuffle(mask, v, "__shfl_up_sync",
                              [&](int l) { return l % width >= int(delta) ? l - int(delta) : l; });
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return strata::emu::shuffle(mask, v, "__shfl_sync",
                              [&](int l) { return l / width * width + src % width; });
}

// Real atomics: kernels on different streams run at the same time on different host threads.
template <typename T>
T atomicAdd(T* p, T v) {
  static_assert(std::is_arithmetic_v<T>, "cuda_emu: atomicAdd type");
  return std::atomic_ref<T>(*p).fetch_add(v);
}
template <typename T>
T atomicExch(T* p, T v) {
  return std::atomic_ref<T>(*p).exchange(v);
}
inline int atomicMin(int* p, int v) {
  std::atomic_ref<int> a(*p);
  int old = a.load();
  while (old > v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
inline int atomicMax(int* p, int v) {
  std::atomic_ref<int> a(*p);
  int old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
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
