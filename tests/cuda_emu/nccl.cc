// The CPU stand-in for NCCL: communicators of one rank (the emulated GPU is one per process).
// Each collective is a copy on the caller's stream's worker, in order with its other work, with
// every buffer checked to be device memory, as NCCL's kernels need. A communicator of more ranks
// is refused with a message saying so (multi-rank NCCL is not emulated). Test-only.
#include <nccl.h>

#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <utility>

#include "tests/cuda_emu/control.h"

struct ncclComm {
  std::mutex mu;
  std::deque<std::pair<const void*, size_t>> sends;  // ncclSend to self awaiting its ncclRecv
  std::string last_error;
};

namespace {

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    default:
      return 8;
  }
}

ncclResult_t usage(ncclComm_t comm, const std::string& what) {
  if (comm) {
    std::lock_guard<std::mutex> lock(comm->mu);
    comm->last_error = "cuda_emu nccl: " + what;
  }
  return ncclInvalidUsage;
}

// A one-rank collective: recv <- send (bytes), both device memory.
ncclResult_t copy(const char* what, const void* send, void* recv, size_t bytes, ncclComm_t comm,
                  cudaStream_t stream) {
  if (!comm) return ncclInvalidArgument;
  if (bytes == 0) return ncclSuccess;
  if (!strata::emu::is_device_memory(send, bytes) || !strata::emu::is_device_memory(recv, bytes)) {
    return usage(comm, std::string(what) + ": a buffer is not device memory");
  }
  strata::emu::enqueue(stream, what, [send, recv, bytes] {
    if (send != recv) std::memmove(recv, send, bytes);
  });
  return ncclSuccess;
}

}  // namespace

extern "C" {

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof(*id));
  std::strcpy(id->internal, "cuda_emu");
  return ncclSuccess;
}
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId, int rank) {
  if (nranks != 1 || rank != 0) return ncclInvalidUsage;  // see the file comment
  *comm = new ncclComm;
  return ncclSuccess;
}
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  if (!comm) return ncclInvalidArgument;
  *async_error = ncclSuccess;
  return ncclSuccess;
}
const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage (cuda_emu: one rank per process only)";
    default:
      return "internal error";
  }
}
const char* ncclGetLastError(ncclComm_t comm) {
  if (!comm) return "";
  std::lock_guard<std::mutex> lock(comm->mu);
  return comm->last_error.c_str();
}

ncclResult_t ncclGroupStart(void) { return ncclSuccess; }
ncclResult_t ncclGroupEnd(void) { return ncclSuccess; }

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t, ncclComm_t comm, cudaStream_t stream) {
  return copy("ncclAllReduce", send, recv, count * type_size(type), comm, stream);
}
ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recv_count, ncclDataType_t type,
                               ncclRedOp_t, ncclComm_t comm, cudaStream_t stream) {
  return copy("ncclReduceScatter", send, recv, recv_count * type_size(type), comm, stream);
}
ncclResult_t ncclAllGather(const void* send, void* recv, size_t send_count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  return copy("ncclAllGather", send, recv, send_count * type_size(type), comm, stream);
}
ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  if (root != 0) return usage(comm, "ncclBroadcast: root out of range");
  return copy("ncclBroadcast", send, recv, count * type_size(type), comm, stream);
}
ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer,
                      ncclComm_t comm, cudaStream_t) {
  if (!comm) return ncclInvalidArgument;
  if (peer != 0) return usage(comm, "ncclSend: peer out of range");
  std::lock_guard<std::mutex> lock(comm->mu);
  comm->sends.emplace_back(send, count * type_size(type));
  return ncclSuccess;
}
ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  if (!comm) return ncclInvalidArgument;
  if (peer != 0) return usage(comm, "ncclRecv: peer out of range");
  std::pair<const void*, size_t> s;
  {
    std::lock_guard<std::mutex> lock(comm->mu);
    if (comm->sends.empty()) return ncclSuccess;  // NCCL would hang; strata pairs them
    s = comm->sends.front();
    comm->sends.pop_front();
  }
  if (s.second != count * type_size(type)) return usage(comm, "ncclRecv: size differs");
  return copy("ncclSend/ncclRecv", s.first, recv, s.second, comm, stream);
}

}  // extern "C"
