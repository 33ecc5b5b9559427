// The NCCL communicator: device buffers of a CUDA Device, on the communicator's own stream.
//
// Bootstrap: under mpirun with several ranks, an mpi communicator (mpi_comm.cc) gives rank,
// size and local rank, and rank 0's ncclUniqueId is broadcast over it (with its timeout); alone,
// the id is local and the world is one rank. The GPU is the current CUDA device of the thread
// that creates the communicator (the CUDA Device selected it; the trainer picks the local rank).
//
// Streams: a stream-ordered collective records an event on the caller's stream, makes the
// NCCL stream wait for it, launches, records an event on the NCCL stream and makes the caller's
// stream wait for that: the collective is ordered with the caller's kernels both ways and
// overlaps with work on other streams. Inside group_begin/group_end the launches are one NCCL
// group and the joins back to the callers' streams happen at group_end.
//
// Busy time: a pair of timing events brackets each launch (a whole group: group_begin to
// group_end) on the NCCL stream; busy_seconds() adds up the pairs that have completed.
//
// Timeouts: NCCL kernels spin until their peers arrive, so the waits (synchronize, the blocking
// forms) poll a CUDA event and ncclCommGetAsyncError against the deadline; past it the NCCL
// communicator is aborted (which frees the GPU from the spinning kernels) and the failure
// names the collective. Reductions use NCCL's native bf16/fp16 arithmetic.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "src/comm/comm_internal.h"
#include "strata/log.h"

namespace strata::comm_internal {
namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    default:
      return ncclFloat16;
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Device* device, double timeout_s) : Communicator(timeout_s), device_(device) {}
  ~NcclCommunicator() override {
    if (comm_ != nullptr) {
      if (health().is_ok() && cudaStreamSynchronize(stream_) == cudaSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    if (barrier_buf_ != nullptr) device_->release(barrier_buf_);
    if (ev_in_ != nullptr) cudaEventDestroy(ev_in_);
    if (ev_out_ != nullptr) cudaEventDestroy(ev_out_);
    if (ev_wait_ != nullptr) cudaEventDestroy(ev_wait_);
    for (auto& [a, b] : timed_) {
      cudaEventDestroy(a);
      cudaEventDestroy(b);
    }
    for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Status init() {
    if (launched_with_multiple_ranks()) {
      STRATA_ASSIGN_OR_RETURN(bootstrap_, create_mpi(nullptr, timeout_s()),
                              "nccl: bootstrapping over MPI");
      rank_ = bootstrap_->rank();
      size_ = bootstrap_->size();
      local_rank_ = bootstrap_->local_rank();
    }
    STRATA_RETURN_IF_ERROR(cuda(cudaGetDevice(&ordinal_), "cudaGetDevice"), "nccl");
    STRATA_RETURN_IF_ERROR(
        cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating its stream"),
        "nccl");
    for (cudaEvent_t* e : {&ev_in_, &ev_out_, &ev_wait_}) {
      STRATA_RETURN_IF_ERROR(
          cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "creating an event"), "nccl");
    }
    STRATA_ASSIGN_OR_RETURN(barrier_buf_, device_->allocate(sizeof(float), "nccl barrier"), "nccl");
    ncclUniqueId id;
    if (rank_ == 0) {
      STRATA_RETURN_IF_ERROR(nccl(ncclGetUniqueId(&id), "ncclGetUniqueId"), "nccl");
    }
    if (bootstrap_) {
      static_assert(sizeof(ncclUniqueId) % 2 == 0);
      STRATA_RETURN_IF_ERROR(
          bootstrap_->broadcast_blocking(&id, sizeof(id) / 2, DType::kF16, 0),
          fmt::format("rank {}: nccl: broadcasting the NCCL unique id over MPI", rank_));
    }
    STRATA_RETURN_IF_ERROR(nccl(ncclCommInitRank(&comm_, size_, id, rank_), "ncclCommInitRank"),
                           fmt::format("rank {} of {}: nccl: creating the communicator on GPU {}",
                                       rank_, size_, ordinal_));
    return Status::ok();
  }

  const char* backend() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int node() const override { return bootstrap_ ? bootstrap_->node() : 0; }
  BufferSpace buffer_space() const override { return BufferSpace::kDevice; }
  uint64_t bytes_sent() const override { return bytes_sent_.load(); }
  Result<std::unique_ptr<Communicator>> split(int /*color*/, int /*key*/) override {
    return unavailable(
        "nccl: sub-communicators (ZeRO++ zero_hpz_partition_size > 1 and "
        "zero_quantized_gradients) are not implemented on nccl yet; use the mpi backend or "
        "leave those keys off");
  }

  Status health() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  }

  void group_begin() override {
    if (group_depth_++ == 0) {
      group_timer_ = timer_start();
      note(nccl(ncclGroupStart(), "ncclGroupStart"));
      group_streams_.clear();
    }
  }

  double busy_seconds() override {
    std::lock_guard<std::mutex> lock(mu_);
    reap_timers_locked();
    return busy_s_;
  }

  Status group_end() override {
    if (group_depth_ == 0) return invalid_argument("nccl: group_end without group_begin");
    if (--group_depth_ > 0) return health();
    note(nccl(ncclGroupEnd(), "ncclGroupEnd"));
    timer_end(group_timer_);
    for (cudaStream_t s : group_streams_) join_back(s);
    group_streams_.clear();
    return health();
  }

  Status synchronize(Stream& stream) override {
    const cudaStream_t s = cuda_stream(stream).handle;
    STRATA_RETURN_IF_ERROR(health(), "");
    Status st = cuda(cudaEventRecord(ev_wait_, s), "recording the wait event");
    if (st.is_ok()) st = wait_event(ev_wait_, "synchronize");
    if (!st.is_ok()) fail(st);
    return st;
  }

 protected:
  Status enqueue(Stream& stream, const Op& op) override {
    const cudaStream_t s = cuda_stream(stream).handle;
    Status st = cuda(cudaEventRecord(ev_in_, s), "recording the caller's stream");
    if (st.is_ok()) st = cuda(cudaStreamWaitEvent(stream_, ev_in_, 0), "joining the streams");
    if (st.is_ok()) st = timed_launch(op);
    if (!st.is_ok()) {
      fail(st);
      return st;
    }
    if (group_depth_ > 0) {
      if (std::find(group_streams_.begin(), group_streams_.end(), s) == group_streams_.end()) {
        group_streams_.push_back(s);
      }
    } else {
      join_back(s);
    }
    return health();
  }

  // The blocking forms take host buffers (the trainer's scalars): NCCL reads and writes only
  // device memory, so they go through a device buffer on the NCCL stream, in and out.
  Status run_blocking(const Op& op) override {
    if (group_depth_ > 0) {
      return invalid_argument(
          fmt::format("rank {}: nccl: {}_blocking inside a group", rank_, kind_name(op.kind)));
    }
    const size_t b = op.count * op.elem_size(), all = op_bytes(op, size_);
    if (op.kind == Kind::kBarrier || all == 0) return finish_blocking(op, op);
    const size_t send_b = op.kind == Kind::kBroadcast ? 0 : op.kind == Kind::kAllGather ? b : all;
    const size_t recv_b = op.kind == Kind::kReduceScatter ? b : all;
    STRATA_ASSIGN_OR_RETURN(void* buf, device_->allocate(send_b + recv_b, "nccl staging"),
                            fmt::format("rank {}: nccl: staging {}", rank_, describe(op, size_)));
    Op staged = op;
    staged.send = send_b ? buf : nullptr;
    staged.recv = static_cast<char*>(buf) + send_b;
    const void* in = op.kind == Kind::kBroadcast ? op.recv : op.send;
    void* in_dst = op.kind == Kind::kBroadcast ? staged.recv : buf;
    Status st = cuda(cudaMemcpyAsync(in_dst, in, op.kind == Kind::kBroadcast ? recv_b : send_b,
                                     cudaMemcpyDefault, stream_),
                     "staging the input");
    if (st.is_ok()) st = finish_blocking(op, staged);
    if (st.is_ok()) {
      st = cuda(cudaMemcpyAsync(op.recv, staged.recv, recv_b, cudaMemcpyDefault, stream_),
                "copying the result out");
    }
    if (st.is_ok()) st = cuda(cudaStreamSynchronize(stream_), "copying the result out");
    device_->release(buf);
    if (!st.is_ok()) fail(st);
    return st;
  }

 private:
  // Launches `staged` (op with device buffers) and waits for it.
  Status finish_blocking(const Op& op, const Op& staged) {
    Status st = timed_launch(staged);
    if (st.is_ok()) st = cuda(cudaEventRecord(ev_wait_, stream_), "recording the done event");
    if (st.is_ok()) st = wait_event(ev_wait_, describe(op, size_));
    if (!st.is_ok()) fail(st);
    return st;
  }

  Status cuda(cudaError_t err, const char* what) const {
    if (err == cudaSuccess) return Status::ok();
    return internal_error(fmt::format("rank {}: nccl: {}: {}: {}", rank_, what,
                                      cudaGetErrorName(err), cudaGetErrorString(err)));
  }
  Status nccl(ncclResult_t r, const char* what) const {
    if (r == ncclSuccess) return Status::ok();
    const char* last = comm_ != nullptr ? ncclGetLastError(comm_) : ncclGetLastError(nullptr);
    return internal_error(fmt::format("rank {}: {} failed: {} ({})", rank_, what,
                                      ncclGetErrorString(r), last ? last : ""));
  }
  void note(const Status& s) {
    if (!s.is_ok()) fail(s);
  }
  void fail(const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.is_ok()) failure_ = s;
  }

  void join_back(cudaStream_t s) {
    note(cuda(cudaEventRecord(ev_out_, stream_), "recording the collective's end"));
    note(cuda(cudaStreamWaitEvent(s, ev_out_, 0), "joining back to the caller's stream"));
  }

  // --- busy time: timing events around launches on stream_ -----------------------------------
  // Returns a started event (recorded on stream_), or nullptr if events cannot be had (the time
  // is then not counted; a collective never fails for want of a timer).
  cudaEvent_t timer_start() {
    cudaEvent_t e = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!spare_events_.empty()) {
        e = spare_events_.back();
        spare_events_.pop_back();
      }
    }
    if (e == nullptr && cudaEventCreate(&e) != cudaSuccess) return nullptr;
    if (cudaEventRecord(e, stream_) != cudaSuccess) {
      cudaEventDestroy(e);
      return nullptr;
    }
    return e;
  }
  void timer_end(cudaEvent_t start) {
    if (start == nullptr) return;
    cudaEvent_t e = timer_start();
    std::lock_guard<std::mutex> lock(mu_);
    if (e == nullptr) {
      spare_events_.push_back(start);
      return;
    }
    timed_.emplace_back(start, e);
    if (timed_.size() > 4096) reap_timers_locked();
  }
  // Adds the completed pairs (in launch order) to busy_s_ and recycles their events.
  void reap_timers_locked() {
    while (!timed_.empty() && cudaEventQuery(timed_.front().second) == cudaSuccess) {
      float ms = 0;
      if (cudaEventElapsedTime(&ms, timed_.front().first, timed_.front().second) == cudaSuccess) {
        busy_s_ += double(ms) / 1e3;
      }
      spare_events_.push_back(timed_.front().first);
      spare_events_.push_back(timed_.front().second);
      timed_.pop_front();
    }
  }
  // A launch timed on its own; inside a group the group's pair times it.
  Status timed_launch(const Op& op) {
    if (group_depth_ > 0) return launch(op);
    cudaEvent_t t = timer_start();
    Status st = launch(op);
    timer_end(t);
    return st;
  }

  Status launch(const Op& op) {
    const ncclDataType_t t = op.raw ? ncclUint8 : nccl_type(op.dtype);
    const ncclRedOp_t r = op.reduce == ReduceOp::kSum ? ncclSum : ncclMax;
    ncclResult_t res = ncclSuccess;
    // What a ring moves per rank: (P-1)/P of the buffer per phase (bytes_sent()).
    const uint64_t b = op.count * op.elem_size(), p = uint64_t(size_);
    switch (op.kind) {
      case Kind::kAllGather:
      case Kind::kReduceScatter:
      case Kind::kAllToAll:
        bytes_sent_ += (p - 1) * b;
        break;
      case Kind::kAllReduce:
        bytes_sent_ += 2 * (p - 1) * b / p;
        break;
      case Kind::kBroadcast:
        bytes_sent_ += b;
        break;
      default:
        break;
    }
    switch (op.kind) {
      case Kind::kAllToAll: {
        const char* send = static_cast<const char*>(op.send);
        char* recv = static_cast<char*>(op.recv);
        res = ncclGroupStart();
        for (int q = 0; q < size_ && res == ncclSuccess; ++q) {
          res = ncclSend(send + q * b, op.count, t, q, comm_, stream_);
          if (res == ncclSuccess) res = ncclRecv(recv + q * b, op.count, t, q, comm_, stream_);
        }
        const ncclResult_t end = ncclGroupEnd();
        if (res == ncclSuccess) res = end;
        break;
      }
      case Kind::kAllGather:
        res = ncclAllGather(op.send, op.recv, op.count, t, comm_, stream_);
        break;
      case Kind::kReduceScatter:
        res = ncclReduceScatter(op.send, op.recv, op.count, t, r, comm_, stream_);
        break;
      case Kind::kAllReduce:
        res = ncclAllReduce(op.send, op.recv, op.count, t, r, comm_, stream_);
        break;
      case Kind::kBroadcast:
        res = ncclBroadcast(op.recv, op.recv, op.count, t, op.root, comm_, stream_);
        break;
      case Kind::kBarrier:
        res = ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat32, ncclSum, comm_, stream_);
        break;
    }
    return nccl(res, describe(op, size_).c_str());
  }

  // Polls `ev` and NCCL's asynchronous error until the event completes or the deadline passes.
  Status wait_event(cudaEvent_t ev, const std::string& what) {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    int idle = 0;
    for (;;) {
      const cudaError_t q = cudaEventQuery(ev);
      if (q == cudaSuccess) return Status::ok();
      if (q != cudaErrorNotReady) return cuda(q, fmt::format("waiting for {}", what).c_str());
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        return internal_error(fmt::format("rank {}: nccl: {} failed: {}; a peer may have died",
                                          rank_, what, ncclGetErrorString(async)));
      }
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (timeout_s() > 0 && waited > timeout_s()) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        return internal_error(fmt::format(
            "rank {}: nccl: {} timed out after {:.1f} s waiting for peers; a rank may have died "
            "or hung (see its output). If the peers are only slow, raise strata.comm.timeout_s "
            "(now {} s)",
            rank_, what, waited, timeout_s()));
      }
      if (++idle < 256) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  Device* device_;
  std::unique_ptr<Communicator> bootstrap_;
  int rank_ = 0, size_ = 1, local_rank_ = 0, ordinal_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ev_in_ = nullptr, ev_out_ = nullptr, ev_wait_ = nullptr;
  void* barrier_buf_ = nullptr;
  int group_depth_ = 0;
  std::vector<cudaStream_t> group_streams_;
  cudaEvent_t group_timer_ = nullptr;
  mutable std::mutex mu_;
  Status failure_;
  // Timing event pairs not yet added to busy_s_, and events to reuse; under mu_.
  std::deque<std::pair<cudaEvent_t, cudaEvent_t>> timed_;
  std::vector<cudaEvent_t> spare_events_;
  double busy_s_ = 0;
  std::atomic<uint64_t> bytes_sent_{0};
};

}  // namespace

Result<std::unique_ptr<Communicator>> create_nccl(Device* device, double timeout_s) {
  if (device == nullptr || device->kind() != DeviceKind::kCuda) {
    return unavailable(
        "strata.comm.backend nccl needs a CUDA device (device.backend cuda); on the CPU "
        "backend use mpi or single");
  }
  auto comm = std::make_unique<NcclCommunicator>(device, timeout_s);
  STRATA_RETURN_IF_ERROR(comm->init(), "creating the nccl communicator");
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace strata::comm_internal
