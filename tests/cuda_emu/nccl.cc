// The CPU stand-in for NCCL (the emulated GPU is one per process). Each collective runs on the
// caller's stream's worker, in order with its other work, with every buffer checked to be device
// memory, as NCCL's kernels need. One rank: a copy. Several (one process per rank under mpirun,
// the communicator spanning MPI_COMM_WORLD): the stream's worker carries it over MPI on a
// duplicate of MPI_COMM_WORLD; reductions gather every rank's buffer and reduce in rank order
// (fp32 arithmetic for 16-bit floats). Issuing a collective releases the lazy streams
// (control.h), as a GPU runs the NCCL kernel without the host waiting: a peer blocked in it
// must not wait for this host's next synchronization. Test-only.
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if defined(STRATA_HAVE_MPI)
#include <mpi.h>
#endif

#include "tests/cuda_emu/control.h"

struct ncclComm {
  std::mutex mu;
  std::deque<std::pair<const void*, size_t>> sends;  // ncclSend to self awaiting its ncclRecv
  std::string last_error;
  int nranks = 1, rank = 0;
#if defined(STRATA_HAVE_MPI)
  MPI_Comm mpi = MPI_COMM_NULL;
  std::vector<MPI_Request> pending;  // ncclSend to peers not yet complete (the next ncclRecv
  std::vector<std::shared_ptr<std::vector<char>>> buffers;  // waits), and their data
#endif
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

#if defined(STRATA_HAVE_MPI)
float load(ncclDataType_t t, const char* p) {
  switch (t) {
    case ncclFloat32: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case ncclBfloat16: {
      uint32_t bits = uint32_t(uint8_t(p[0]) | (uint8_t(p[1]) << 8)) << 16;
      float v;
      std::memcpy(&v, &bits, 4);
      return v;
    }
    default:
      return float(uint8_t(*p));  // ncclUint8
  }
}
void store(ncclDataType_t t, float v, char* p) {
  switch (t) {
    case ncclFloat32:
      std::memcpy(p, &v, 4);
      return;
    case ncclBfloat16: {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      if (!std::isnan(v)) bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
      const uint16_t h = uint16_t(std::isnan(v) ? 0x7fc0 : bits >> 16);
      std::memcpy(p, &h, 2);
      return;
    }
    default:
      *p = char(uint8_t(v));
  }
}

// Every rank's `bytes` from `src` (a copy first: MPI may read a peer's memory directly, and
// device memory is opened lazily), rank r's at r * bytes.
std::vector<char> gather_all(ncclComm_t comm, const void* src, size_t bytes) {
  std::vector<char> mine(static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
  std::vector<char> all(bytes * size_t(comm->nranks));
  if (MPI_Allgather(mine.data(), int(bytes), MPI_BYTE, all.data(), int(bytes), MPI_BYTE,
                    comm->mpi) != MPI_SUCCESS) {
    throw std::runtime_error("cuda_emu nccl: MPI_Allgather failed");
  }
  return all;
}

// out[i] = op over ranks (in rank order) of element `first + i` of each rank's buffer in `all`.
void reduce(ncclDataType_t t, ncclRedOp_t op, const std::vector<char>& all, int nranks,
            size_t rank_bytes, size_t first, size_t count, void* out) {
  const size_t es = type_size(t);
  for (size_t i = 0; i < count; ++i) {
    float acc = load(t, all.data() + (first + i) * es);
    for (int r = 1; r < nranks; ++r) {
      const float v = load(t, all.data() + size_t(r) * rank_bytes + (first + i) * es);
      acc = op == ncclMax ? std::max(acc, v) : op == ncclMin ? std::min(acc, v) : acc + v;
    }
    if (op == ncclAvg) acc /= float(nranks);
    store(t, acc, static_cast<char*>(out) + i * es);
  }
}

bool reducible(ncclDataType_t t, ncclRedOp_t op) {
  return (t == ncclFloat32 || t == ncclBfloat16 || t == ncclUint8) && op != ncclProd;
}

// A collective of several ranks, run by `stream`'s worker; issuing it releases the streams.
ncclResult_t across(const char* what, const void* send, size_t send_bytes, void* recv,
                    size_t recv_bytes, ncclComm_t comm, cudaStream_t stream,
                    std::function<void()> op) {
  if ((send_bytes && !strata::emu::is_device_memory(send, send_bytes)) ||
      (recv_bytes && !strata::emu::is_device_memory(recv, recv_bytes))) {
    return usage(comm, std::string(what) + ": a buffer is not device memory");
  }
  strata::emu::enqueue(stream, what, std::move(op));
  strata::emu::release();
  return ncclSuccess;
}
#endif

}  // namespace

extern "C" {

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof(*id));
  std::strcpy(id->internal, "cuda_emu");
  return ncclSuccess;
}
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId, int rank) {
  if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  auto c = std::make_unique<ncclComm>();
  c->nranks = nranks;
  c->rank = rank;
  if (nranks > 1) {
#if defined(STRATA_HAVE_MPI)
    int init = 0, size = 0, me = 0;
    MPI_Initialized(&init);
    if (!init) return ncclInvalidUsage;  // see the file comment
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    if (size != nranks || me != rank) return ncclInvalidUsage;
    if (MPI_Comm_dup(MPI_COMM_WORLD, &c->mpi) != MPI_SUCCESS) return ncclSystemError;
#else
    return ncclInvalidUsage;
#endif
  }
  *comm = c.release();
  return ncclSuccess;
}
static void free_comm(ncclComm_t comm) {
#if defined(STRATA_HAVE_MPI)
  if (comm && comm->mpi != MPI_COMM_NULL) MPI_Comm_free(&comm->mpi);
#endif
  delete comm;
}
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  free_comm(comm);
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  free_comm(comm);
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
      return "invalid usage (cuda_emu: several ranks need mpirun, one rank per process, the "
             "communicator spanning MPI_COMM_WORLD)";
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
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  if (!comm || comm->nranks == 1) {
    return copy("ncclAllReduce", send, recv, count * type_size(type), comm, stream);
  }
#if defined(STRATA_HAVE_MPI)
  if (!reducible(type, op)) return usage(comm, "ncclAllReduce: type or op not emulated");
  const size_t bytes = count * type_size(type);
  return across("ncclAllReduce", send, bytes, recv, bytes, comm, stream, [=] {
    reduce(type, op, gather_all(comm, send, bytes), comm->nranks, bytes, 0, count, recv);
  });
#else
  return ncclInvalidUsage;
#endif
}
ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recv_count, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  if (!comm || comm->nranks == 1) {
    return copy("ncclReduceScatter", send, recv, recv_count * type_size(type), comm, stream);
  }
#if defined(STRATA_HAVE_MPI)
  if (!reducible(type, op)) return usage(comm, "ncclReduceScatter: type or op not emulated");
  const size_t bytes = recv_count * type_size(type), all = bytes * size_t(comm->nranks);
  return across("ncclReduceScatter", send, all, recv, bytes, comm, stream, [=] {
    reduce(type, op, gather_all(comm, send, all), comm->nranks, all,
           recv_count * size_t(comm->rank), recv_count, recv);
  });
#else
  return ncclInvalidUsage;
#endif
}
ncclResult_t ncclAllGather(const void* send, void* recv, size_t send_count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  if (!comm || comm->nranks == 1) {
    return copy("ncclAllGather", send, recv, send_count * type_size(type), comm, stream);
  }
#if defined(STRATA_HAVE_MPI)
  const size_t bytes = send_count * type_size(type);
  return across("ncclAllGather", send, bytes, recv, bytes * size_t(comm->nranks), comm, stream,
                [=] {
                  std::vector<char> all = gather_all(comm, send, bytes);
                  std::memcpy(recv, all.data(), all.size());
                });
#else
  return ncclInvalidUsage;
#endif
}
ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  if (comm && (root < 0 || root >= comm->nranks)) {
    return usage(comm, "ncclBroadcast: root out of range");
  }
  if (!comm || comm->nranks == 1) {
    return copy("ncclBroadcast", send, recv, count * type_size(type), comm, stream);
  }
#if defined(STRATA_HAVE_MPI)
  const size_t bytes = count * type_size(type);
  const bool is_root = comm->rank == root;
  return across("ncclBroadcast", is_root ? send : nullptr, is_root ? bytes : 0, recv, bytes, comm,
                stream, [=] {
                  std::vector<char> b(bytes);
                  if (is_root) std::memcpy(b.data(), send, bytes);
                  if (MPI_Bcast(b.data(), int(bytes), MPI_BYTE, root, comm->mpi) != MPI_SUCCESS) {
                    throw std::runtime_error("cuda_emu nccl: MPI_Bcast failed");
                  }
                  std::memcpy(recv, b.data(), bytes);
                });
#else
  return ncclInvalidUsage;
#endif
}
ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  if (!comm) return ncclInvalidArgument;
  if (peer < 0 || peer >= comm->nranks) return usage(comm, "ncclSend: peer out of range");
  if (comm->nranks == 1) {
    std::lock_guard<std::mutex> lock(comm->mu);
    comm->sends.emplace_back(send, count * type_size(type));
    return ncclSuccess;
  }
#if defined(STRATA_HAVE_MPI)
  // Posted when the stream reaches it (from a copy, kept until the send completes); completed
  // by the next ncclRecv, which strata issues in the same group.
  const size_t bytes = count * type_size(type);
  return across("ncclSend", send, bytes, nullptr, 0, comm, stream, [=] {
    auto copy = std::make_shared<std::vector<char>>(static_cast<const char*>(send),
                                                    static_cast<const char*>(send) + bytes);
    MPI_Request req;
    if (MPI_Isend(copy->data(), int(bytes), MPI_BYTE, peer, 0, comm->mpi, &req) != MPI_SUCCESS) {
      throw std::runtime_error("cuda_emu nccl: MPI_Isend failed");
    }
    std::lock_guard<std::mutex> lock(comm->mu);
    comm->pending.push_back(req);
    comm->buffers.push_back(std::move(copy));
  });
#else
  return ncclInvalidUsage;
#endif
}
ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  if (!comm) return ncclInvalidArgument;
  if (peer < 0 || peer >= comm->nranks) return usage(comm, "ncclRecv: peer out of range");
  if (comm->nranks == 1) {
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
#if defined(STRATA_HAVE_MPI)
  const size_t bytes = count * type_size(type);
  return across("ncclRecv", nullptr, 0, recv, bytes, comm, stream, [=] {
    std::vector<char> b(bytes);
    if (MPI_Recv(b.data(), int(bytes), MPI_BYTE, peer, 0, comm->mpi, MPI_STATUS_IGNORE) !=
        MPI_SUCCESS) {
      throw std::runtime_error("cuda_emu nccl: MPI_Recv failed");
    }
    std::memcpy(recv, b.data(), bytes);
    std::lock_guard<std::mutex> lock(comm->mu);
    MPI_Waitall(int(comm->pending.size()), comm->pending.data(), MPI_STATUSES_IGNORE);
    comm->pending.clear();
    comm->buffers.clear();
  });
#else
  return ncclInvalidUsage;
#endif
}

}  // extern "C"
