// The CPU stand-in for the CUDA runtime (tests/cuda_emu/control.h says what it promises).
// Test-only. One emulated GPU (ordinal 0) per process.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tests/cuda_emu/control.h"
#include "tests/cuda_emu/device_memory.h"

// An event: records are numbered when issued; a record completes when its stream reaches it.
// The state is shared with the records and waits still queued: CUDA lets an event be destroyed
// while streams still hold them.
struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0, completed = 0;
  unsigned polls = 0;  // cudaEventQuery calls that found the latest record not done
  bool timing = true;
  std::chrono::steady_clock::time_point when;
};
struct CUevent_st {
  std::shared_ptr<EventState> state = std::make_shared<EventState>();
};

// A stream: a worker thread running its operations in order, each once the scheduler lets it
// (tests/cuda_emu/control.h). Guarded by the scheduler's mutex.
struct CUstream_st {
  struct Op {
    const char* what;
    std::function<void()> fn;
    uint64_t seq = 0;                  // issue number, over all streams
    uint64_t round = 0;                // the release that let it run (0: not yet released)
    std::shared_ptr<EventState> wait;  // cudaStreamWaitEvent: runnable once record `target` is
    uint64_t target = 0;               // done
  };
  uint64_t id = 0;  // creation number
  std::deque<Op> queue;
  uint64_t enqueued = 0, completed = 0;
  bool stop = false;
  std::thread worker;
};

namespace strata::emu {
namespace {

constexpr size_t kPage = 4096;
constexpr unsigned kPollsBeforeProgress = 64;

struct HostRange {
  size_t bytes;
  bool pinned;  // cudaHostAlloc (else cudaHostRegister)
};

struct State {
  std::mutex mu;  // host_, attrs_, total, failure
  std::map<uintptr_t, HostRange> host;
  std::unordered_map<const void*, int> max_dynamic_smem;
  size_t allocated = 0;
  std::string failure;  // stays valid while set: cudaGetErrorString returns its c_str
  std::atomic<bool> failed{false};
  // The scheduler (control.h): the streams in creation order, operations issued and released
  // (by issue number), release rounds, and whether a lazy-mode operation is running.
  std::mutex sched_mu;
  std::condition_variable sched_cv;
  std::vector<cudaStream_t> streams;
  uint64_t issued = 0, released = 0, rounds = 0, stream_ids = 0, ran = 0;
  bool running = false;
  cudaStream_t legacy = nullptr;
  std::atomic<int> order{int(Order::kForward)};
  std::atomic<unsigned> delay_us{50}, delay_percent{20};
  std::atomic<bool> lazy{true};
  uint64_t seed = 0;
};
State& state() {
  static State* s = [] {
    auto* st = new State;  // never destroyed: streams may outlive static destruction
    const char* us = std::getenv("STRATA_EMU_DELAY_US");
    const char* pc = std::getenv("STRATA_EMU_DELAY_PERCENT");
    const char* seed = std::getenv("STRATA_EMU_SEED");
    const char* streams = std::getenv("STRATA_EMU_STREAMS");
    if (streams && std::strcmp(streams, "concurrent") == 0) st->lazy = false;
    if (us) st->delay_us = unsigned(std::strtoul(us, nullptr, 10));
    if (pc) st->delay_percent = unsigned(std::strtoul(pc, nullptr, 10));
    st->seed = seed ? std::strtoull(seed, nullptr, 10) : 1;
    return st;
  }();
  return *s;
}

thread_local cudaError_t t_last_error = cudaSuccess;
thread_local int t_device = 0;

// A failed call's error, returned and kept as the thread's last error as the runtime does
// (cudaErrorNotReady is a state, not an error: it is never kept).
cudaError_t fail(cudaError_t e) {
  t_last_error = e;
  return e;
}

// GPUs visible: STRATA_EMU_GPU_COUNT (default 1). This process emulates one of them, whichever
// ordinal it binds (under mpirun each rank binds its local rank's).
int gpu_count() {
  const char* env = std::getenv("STRATA_EMU_GPU_COUNT");
  return env ? std::max(1, std::atoi(env)) : 1;
}

size_t total_memory() {
  const char* env = std::getenv("STRATA_EMU_GPU_MEMORY_MIB");
  return (env ? std::strtoull(env, nullptr, 10) : 8192) << 20;
}

// --- streams ----------------------------------------------------------------------------------

void sleep_maybe(std::mt19937_64& rng) {
  State& st = state();
  const unsigned us = st.delay_us, pc = st.delay_percent;
  if (us == 0 || pc == 0) return;
  if (rng() % 100 >= pc) return;
  std::this_thread::sleep_for(std::chrono::microseconds(rng() % (us + 1)));
}

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Whether `s`'s next operation may run: released, and a wait's record done. Under sched_mu.
bool runnable(cudaStream_t s) {
  if (s->queue.empty() || s->queue.front().round == 0) return false;
  const CUstream_st::Op& op = s->queue.front();
  if (!op.wait) return true;
  std::lock_guard<std::mutex> lock(op.wait->mu);
  return op.wait->completed >= op.target;
}

// Lazy: the one stream whose next operation runs now. Work of an earlier release first; among
// the streams with work of the same release, one drawn from the seed and the number of
// operations run so far. Under sched_mu.
cudaStream_t pick() {
  State& st = state();
  cudaStream_t best = nullptr;
  uint64_t best_round = 0, best_key = 0;
  for (cudaStream_t s : st.streams) {
    if (!runnable(s)) continue;
    const uint64_t round = s->queue.front().round;
    const uint64_t key = mix(st.seed ^ mix(st.ran) ^ mix(s->id + 0x51ed));
    if (!best || round < best_round || (round == best_round && key < best_key)) {
      best = s;
      best_round = round;
      best_key = key;
    }
  }
  return best;
}

void worker(cudaStream_t s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  State& st = state();
  std::unique_lock<std::mutex> lock(st.sched_mu);
  for (;;) {
    st.sched_cv.wait(lock, [&] {
      if (s->stop && s->queue.empty()) return true;
      return st.lazy ? !st.running && pick() == s : runnable(s);
    });
    if (s->queue.empty()) return;
    CUstream_st::Op op = std::move(s->queue.front());
    s->queue.pop_front();
    const bool lazy = st.lazy;
    if (lazy) {
      st.running = true;
      ++st.ran;
    }
    lock.unlock();
    if (!lazy) sleep_maybe(rng);
    if (op.fn) {
      try {
        op.fn();
      } catch (const std::exception& e) {
        fail_context(std::string(op.what) + ": " + e.what());
      }
    }
    lock.lock();
    ++s->completed;
    if (lazy) st.running = false;
    st.sched_cv.notify_all();
  }
}

cudaStream_t new_stream() {
  State& st = state();
  auto* s = new CUstream_st;
  std::lock_guard<std::mutex> lock(st.sched_mu);
  s->id = st.stream_ids++;
  s->worker = std::thread(worker, s, st.seed * 1000003 + s->id);
  st.streams.push_back(s);
  return s;
}

cudaStream_t resolve(cudaStream_t s) {
  if (s) return s;
  State& st = state();
  static std::once_flag once;
  std::call_once(once, [&] { st.legacy = new_stream(); });
  return st.legacy;
}

// Releases every operation issued so far, as round `rounds + 1`. Under sched_mu.
void release_all_locked() {
  State& st = state();
  if (st.released == st.issued) return;
  st.released = st.issued;
  ++st.rounds;
  for (cudaStream_t s : st.streams) {
    for (CUstream_st::Op& op : s->queue) {
      if (op.round == 0) op.round = st.rounds;
    }
  }
  st.sched_cv.notify_all();
}
void release_all() {
  std::lock_guard<std::mutex> lock(state().sched_mu);
  release_all_locked();
}

void drain(cudaStream_t s) {
  State& st = state();
  std::unique_lock<std::mutex> lock(st.sched_mu);
  const uint64_t target = s->enqueued;
  release_all_locked();
  st.sched_cv.wait(lock, [&] { return s->completed >= target; });
}

void drain_all() {
  State& st = state();
  std::unique_lock<std::mutex> lock(st.sched_mu);
  release_all_locked();
  st.sched_cv.wait(lock, [&] {
    return std::all_of(st.streams.begin(), st.streams.end(),
                       [](cudaStream_t s) { return s->completed >= s->enqueued; });
  });
}

// Puts `op` on `s`'s queue (released at once unless lazy).
void push(cudaStream_t s, CUstream_st::Op op) {
  State& st = state();
  {
    std::lock_guard<std::mutex> lock(st.sched_mu);
    op.seq = ++st.issued;
    s->queue.push_back(std::move(op));
    ++s->enqueued;
    if (!st.lazy) {
      st.released = st.issued;
      s->queue.back().round = ++st.rounds;
    }
  }
  st.sched_cv.notify_all();
}

cudaError_t sticky() { return state().failed ? cudaErrorLaunchFailure : cudaSuccess; }

bool is_host_registered(const void* p, size_t bytes) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.host.upper_bound(uintptr_t(p));
  if (it == st.host.begin()) return false;
  --it;
  return uintptr_t(p) + bytes <= it->first + it->second.bytes;
}

}  // namespace

void set_order(Order o) { state().order = int(o); }
Order order() { return Order(state().order.load()); }
void set_lazy(bool lazy) {
  drain_all();
  state().lazy = lazy;
}
bool lazy() { return state().lazy; }
void release() { release_all(); }
void set_delay(unsigned max_us, unsigned percent) {
  state().delay_us = max_us;
  state().delay_percent = percent;
}

std::string failure() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return st.failed ? st.failure : std::string();
}
void clear_failure() {
  drain_all();
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.failed = false;
}

void fail_context(const std::string& report) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.failed) return;
  st.failure = "unspecified launch failure (cuda_emu: " + report +
               "; STRATA_EMU_SEED=" + std::to_string(st.seed) + ")";
  st.failed = true;
  std::fprintf(stderr, "%s\n", st.failure.c_str());
}

bool is_device_memory(const void* p, size_t bytes) { return find_region(p, bytes) != nullptr; }

void enqueue(cudaStream_t stream, const char* what, std::function<void()> op) {
  CUstream_st::Op o;
  o.what = what;
  o.fn = std::move(op);
  push(resolve(stream), std::move(o));
}

void enqueue_kernel(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const void* kernel,
                    std::function<void()> body, std::string bad_argument) {
  const size_t threads = size_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    t_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  int max_smem = 48 << 10;
  {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.max_dynamic_smem.find(kernel);
    if (it != st.max_dynamic_smem.end()) max_smem = std::max(max_smem, it->second);
  }
  if (smem > size_t(max_smem)) {
    t_last_error = cudaErrorInvalidValue;  // cudaFuncSetAttribute was not called for this much
    return;
  }
  const Order o = order();
  enqueue(stream, "kernel", [=, body = std::move(body)] {
    if (state().failed) return;
    if (!bad_argument.empty()) throw std::runtime_error("kernel launched with " + bad_argument);
    Runtime::get().launch({grid.x, grid.y, grid.z}, Index{block.x, block.y, block.z}, smem, o,
                          body);
    std::string bad = check_all_slack();
    if (!bad.empty()) throw std::runtime_error("after a kernel: " + bad);
  });
}

}  // namespace strata::emu

using namespace strata::emu;  // NOLINT: the C API below is global

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  *count = gpu_count();
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= gpu_count()) return fail(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = t_device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= gpu_count()) return fail(cudaErrorInvalidDevice);
  *prop = {};
  std::snprintf(prop->name, sizeof(prop->name), "cuda_emu (CPU emulation of an sm_90 GPU)");
  prop->totalGlobalMem = total_memory();
  prop->sharedMemPerBlock = 48 << 10;
  prop->sharedMemPerBlockOptin = 227 << 10;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 4;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  drain_all();
  return sticky();
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  *total = total_memory();
  *free_bytes = *total > st.allocated ? *total - st.allocated : 0;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  State& st = state();
  const size_t pages = region_bytes(size);
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (st.allocated + pages > total_memory()) return fail(cudaErrorMemoryAllocation);
    st.allocated += pages;
  }
  Region* r = new_region(size);
  if (r == nullptr) {
    std::lock_guard<std::mutex> lock(st.mu);
    st.allocated -= pages;
    return fail(cudaErrorMemoryAllocation);
  }
  *ptr = r->ptr;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (!ptr) return cudaSuccess;
  drain_all();  // cudaFree synchronizes the device
  State& st = state();
  Region* r = region_at(ptr);
  if (!r) return fail(cudaErrorInvalidValue);
  std::string bad = check_slack(*r);
  if (!bad.empty()) fail_context("at cudaFree: " + bad);
  const size_t pages = r->body;
  free_region(r);
  {
    std::lock_guard<std::mutex> lock(st.mu);
    st.allocated -= pages;
  }
  return sticky();
}

cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int) {
  const size_t n = (std::max<size_t>(size, 1) + kPage - 1) / kPage * kPage;
  void* p = std::aligned_alloc(kPage, n);
  if (!p) return fail(cudaErrorMemoryAllocation);
  std::memset(p, 0xFF, n);  // uninitialized, as cudaHostAlloc's memory is
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.host[uintptr_t(p)] = {n, true};
  *ptr = p;
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** ptr, size_t size) { return cudaHostAlloc(ptr, size, 0); }
cudaError_t cudaFreeHost(void* ptr) {
  State& st = state();
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.host.find(uintptr_t(ptr));
    if (it == st.host.end() || !it->second.pinned) return fail(cudaErrorInvalidValue);
    st.host.erase(it);
  }
  std::free(ptr);
  return cudaSuccess;
}
cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int) {
  if (!ptr || size == 0 || is_device_memory(ptr, 1)) return fail(cudaErrorInvalidValue);
  if (is_host_registered(ptr, 1)) return fail(cudaErrorHostMemoryAlreadyRegistered);
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.host[uintptr_t(ptr)] = {size, false};
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void* ptr) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.host.find(uintptr_t(ptr));
  if (it == st.host.end() || it->second.pinned) return fail(cudaErrorHostMemoryNotRegistered);
  st.host.erase(it);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  *stream = new_stream();
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  return cudaStreamCreate(stream);
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  drain(s);
  State& st = state();
  {
    std::lock_guard<std::mutex> lock(st.sched_mu);
    s->stop = true;
  }
  st.sched_cv.notify_all();
  s->worker.join();
  {
    std::lock_guard<std::mutex> lock(st.sched_mu);
    st.streams.erase(std::remove(st.streams.begin(), st.streams.end(), s), st.streams.end());
  }
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  drain(resolve(s));
  return sticky();
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t event, unsigned int) {
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  std::shared_ptr<EventState> e = event->state;
  CUstream_st::Op op;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    op.target = e->recorded;
  }
  if (op.target == 0) return cudaSuccess;  // never recorded: nothing to wait for
  // The stream's next operations run once the record is done (the scheduler sees to it).
  op.what = "cudaStreamWaitEvent";
  op.wait = std::move(e);
  push(resolve(s), std::move(op));
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  *event = new CUevent_st;
  (*event)->state->timing = (flags & cudaEventDisableTiming) == 0;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  delete event;  // queued records and waits keep the state alive
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t s) {
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  std::shared_ptr<EventState> e = event->state;
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    gen = ++e->recorded;
    e->polls = 0;
  }
  enqueue(s, "cudaEventRecord", [e, gen] {
    {
      std::lock_guard<std::mutex> lock(e->mu);
      e->completed = std::max(e->completed, gen);
      e->when = std::chrono::steady_clock::now();
    }
    e->cv.notify_all();
  });
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  if (state().failed) return fail(cudaErrorLaunchFailure);
  EventState& e = *event->state;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    if (e.completed >= e.recorded) return cudaSuccess;
    // A query only looks: the work stays late. A host that keeps polling is waiting for it,
    // and a GPU gets there in the end: everything is released after kPollsBeforeProgress.
    if (++e.polls < kPollsBeforeProgress) return cudaErrorNotReady;
  }
  release_all();
  return cudaErrorNotReady;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  EventState& e = *event->state;
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    target = e.recorded;
  }
  release_all();
  {
    std::unique_lock<std::mutex> lock(e.mu);
    e.cv.wait(lock, [&] { return e.completed >= target; });
  }
  return sticky();
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start_event, cudaEvent_t end_event) {
  if (!start_event || !end_event) return fail(cudaErrorInvalidResourceHandle);
  EventState &start = *start_event->state, &end = *end_event->state;
  if (!start.timing || !end.timing) return fail(cudaErrorInvalidResourceHandle);
  // One event as both ends (CUDA gives 0 ms) takes its lock once.
  std::unique_lock<std::mutex> lock_start(start.mu, std::defer_lock), lock_end;
  if (&end == &start) {
    lock_start.lock();
  } else {
    lock_end = std::unique_lock<std::mutex>(end.mu, std::defer_lock);
    std::lock(lock_start, lock_end);
  }
  if (start.completed < start.recorded || end.completed < end.recorded) return cudaErrorNotReady;
  if (start.recorded == 0 || end.recorded == 0) return fail(cudaErrorInvalidResourceHandle);
  *ms = std::chrono::duration<float, std::milli>(end.when - start.when).count();
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const bool dst_dev = is_device_memory(dst, count), src_dev = is_device_memory(src, count);
  if (kind == cudaMemcpyDefault) {
    kind = dst_dev ? (src_dev ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                   : (src_dev ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  }
  // Each side must be what `kind` says: a host pointer given as device memory faults on a GPU.
  const bool want_dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool want_src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (want_dst_dev != dst_dev || want_src_dev != src_dev) return fail(cudaErrorInvalidValue);
  if (sticky() != cudaSuccess) return sticky();
  // Pageable host memory, as the CUDA documentation describes it: host to device waits for
  // the stream's earlier work, copies the source to staging memory and returns, the transfer
  // to the device still to come on the stream; device to host returns once the copy is done.
  // Pinned or registered memory: truly asynchronous.
  const void* host = kind == cudaMemcpyHostToDevice ? src : dst;
  const bool pageable = (kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToHost) &&
                        !is_host_registered(host, count);
  if (kind == cudaMemcpyHostToHost || (pageable && kind == cudaMemcpyDeviceToHost)) {
    drain(resolve(stream));
    std::memcpy(dst, src, count);
    return cudaSuccess;
  }
  if (pageable) {
    drain(resolve(stream));
    auto staging = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                       static_cast<const char*>(src) + count);
    enqueue(stream, "cudaMemcpyAsync (staged)", [dst, staging] {
      if (!state().failed) std::memcpy(dst, staging->data(), staging->size());
    });
    return cudaSuccess;
  }
  enqueue(stream, "cudaMemcpyAsync", [dst, src, count] {
    if (!state().failed) std::memcpy(dst, src, count);
  });
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  cudaError_t err = cudaMemcpyAsync(dst, src, count, kind, nullptr);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(nullptr);
}
cudaError_t cudaMemsetAsync(void* dst, int value, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (!is_device_memory(dst, count)) return fail(cudaErrorInvalidValue);
  enqueue(stream, "cudaMemsetAsync", [dst, value, count] {
    if (!state().failed) std::memset(dst, value, count);
  });
  return cudaSuccess;
}
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) {
  if (!fn) return fail(cudaErrorInvalidValue);
  enqueue(stream, "cudaLaunchHostFunc", [fn, user_data] { fn(user_data); });
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || value > (227 << 10)) {
    return fail(cudaErrorInvalidValue);
  }
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.max_dynamic_smem[func] = value;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) {
  if (sticky() != cudaSuccess) return sticky();
  return std::exchange(t_last_error, cudaSuccess);
}
cudaError_t cudaPeekAtLastError(void) {
  if (sticky() != cudaSuccess) return sticky();
  return t_last_error;
}
const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInsufficientDriver:
      return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorHostMemoryAlreadyRegistered:
      return "cudaErrorHostMemoryAlreadyRegistered";
    case cudaErrorHostMemoryNotRegistered:
      return "cudaErrorHostMemoryNotRegistered";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t error) {
  if (error == cudaErrorLaunchFailure) {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    if (st.failed) return st.failure.c_str();
    return "unspecified launch failure";
  }
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorNotReady:
      return "device not ready";
    default:
      return cudaGetErrorName(error);
  }
}

}  // extern "C"
