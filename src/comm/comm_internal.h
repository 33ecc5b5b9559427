// Internal to src/comm: what the backends share.
//
//   HostCommunicator  base of the host-buffer backends (single, mpi): the stream-ordered form
//                     runs the blocking form inside device.host_fn, and the first failure is
//                     kept (sticky) and returned by synchronize() and every later call.
//   reduce_rank_order the reference reduction every host backend uses: fp32 accumulation in
//                     rank order, one rounding to the storage type.
//   create_*          the backend factories; create_communicator (communicator.cc) picks one.
//
// Thread safety: as Communicator (strata/comm.h).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "strata/comm.h"

namespace strata::comm_internal {

// out[i] = op(in[0][i], in[1][i], ..., in[n-1][i]) computed in fp32 left to right and stored
// once in `dtype`. out may alias one of the inputs (elementwise, same index).
void reduce_rank_order(const void* const* inputs, int n, void* out, size_t count, DType dtype,
                       ReduceOp op);

// Bytes of one collective's largest buffer, for messages ("all_reduce of 4.0 MiB").
size_t op_bytes(const Communicator::Op& op, int world_size);

// "all_reduce of 4194304 bytes (bf16 x 2097152, sum)" for error messages.
std::string describe(const Communicator::Op& op, int world_size);

class HostCommunicator : public Communicator {
 public:
  HostCommunicator(Device* device, double timeout_s) : Communicator(timeout_s), device_(device) {}
  BufferSpace buffer_space() const override { return BufferSpace::kHost; }
  Status synchronize(Stream& stream) override;
  Status health() const override;
  double busy_seconds() override;
  uint64_t bytes_sent() const override;

 protected:
  Status enqueue(Stream& stream, const Op& op) override;
  Status run_blocking(const Op& op) final;
  // The collective itself, on the calling thread. Called with run_mu_ held.
  virtual Status run(const Op& op) = 0;
  void fail(const Status& s);
  // Backends count each send to a peer here (bytes_sent()).
  void count_sent(size_t bytes) { bytes_sent_.fetch_add(bytes, std::memory_order_relaxed); }

  Device* device_;

 private:
  std::mutex run_mu_;  // one collective at a time (see the ordering rule)
  mutable std::mutex mu_;
  Status failure_;
  double busy_s_ = 0;  // under mu_
  std::atomic<uint64_t> bytes_sent_{0};
};

Result<std::unique_ptr<Communicator>> create_single(Device* device, double timeout_s);
// kUnavailable when built without MPI.
Result<std::unique_ptr<Communicator>> create_mpi(Device* device, double timeout_s);
// kUnavailable when built without CUDA/NCCL or `device` is not a CUDA device.
Result<std::unique_ptr<Communicator>> create_nccl(Device* device, double timeout_s);

}  // namespace strata::comm_internal
