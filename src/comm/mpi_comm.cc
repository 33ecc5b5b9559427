// The MPI communicator: host buffers, Open MPI point-to-point messages.
//
// Every collective is built from nonblocking sends and receives between pairs of ranks, waited
// for by polling MPI_Testsome against a deadline, so that
//   - a peer that never arrives makes the call fail after timeout_s naming that peer, instead of
//     blocking forever inside MPI_Allreduce;
//   - reductions are computed by strata itself, in fp32, in rank order 0..P-1, with one
//     rounding to bf16/fp16: deterministic and bit-identical on every rank, whatever algorithm
//     an MPI library would have chosen.
// Algorithms (P ranks, each moves (P-1)/P of the data per phase, like a ring):
//   all_gather:     every rank sends its block to every other rank.
//   reduce_scatter: every rank sends block q of its input to rank q, which reduces the P blocks.
//   all_reduce:     reduce_scatter on P near-equal parts, then all_gather of the parts; below
//                   64 KiB of traffic, one phase (everyone sends everything, everyone reduces).
//   all_to_all:     every rank sends block q of its input to rank q.
//   broadcast:      the root sends to every other rank.
//   barrier:        zero-byte messages between every pair.
// Messages longer than 1 GiB are split (MPI counts are int). Each exchange has its own tag, so a
// rank that issues collectives in a different order times out instead of mixing data.
//
// MPI is initialised once per process (MPI_THREAD_MULTIPLE; with SERIALIZED every MPI call is
// made under one lock) and finalised at exit, unless a collective failed: MPI_Finalize may then
// wait for the dead peer, so the process exits without it and mpirun ends the job.
#include <fmt/ranges.h>
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "src/comm/comm_internal.h"
#include "strata/log.h"

namespace strata::comm_internal {
namespace {

constexpr size_t kMaxMessage = size_t{1} << 30;
constexpr size_t kOnePhaseAllReduceBytes = size_t{64} << 10;

std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(text, static_cast<size_t>(len));
}

// Process-wide MPI state. Never destroyed: the atexit handler uses it.
struct MpiRuntime {
  std::mutex init_mu;
  bool initialized = false;  // by us or by someone else, successfully
  bool we_initialized = false;
  bool serialized = false;  // thread level SERIALIZED: hold `mu` around each MPI call
  std::mutex mu;
  std::atomic<bool> broken{false};  // a collective failed: do not finalise
};

MpiRuntime& runtime() {
  static MpiRuntime* rt = new MpiRuntime;
  return *rt;
}

void finalize_at_exit() {
  MpiRuntime& rt = runtime();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (rt.broken.load()) {
    log_error("MPI not finalised: a collective failed, so a peer may be gone; mpirun ends the job");
    return;
  }
  MPI_Finalize();
}

Status init_mpi() {
  MpiRuntime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.init_mu);
  if (rt.initialized) return Status::ok();
  int flag = 0, provided = 0;
  MPI_Initialized(&flag);
  if (!flag) {
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) {
      return unavailable(
          fmt::format("MPI_Init_thread failed: {}; run under mpirun, or set "
                      "strata.comm.backend to single",
                      mpi_error_text(rc)));
    }
    rt.we_initialized = true;
    std::atexit(finalize_at_exit);
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    return unavailable(fmt::format(
        "MPI provides thread level {}, but strata runs collectives on stream threads and needs "
        "MPI_THREAD_SERIALIZED ({}) or MPI_THREAD_MULTIPLE; initialise MPI with "
        "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or let strata initialise it",
        provided, int(MPI_THREAD_SERIALIZED)));
  }
  rt.serialized = provided < MPI_THREAD_MULTIPLE;
  rt.initialized = true;
  return Status::ok();
}

// Holds the runtime lock only when MPI is SERIALIZED.
class MpiLock {
 public:
  MpiLock() {
    if (runtime().serialized) lock_ = std::unique_lock<std::mutex>(runtime().mu);
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

// Requests of one exchange, with the peer of each for diagnostics.
struct Pending {
  std::vector<MPI_Request> reqs;
  std::vector<int> peers;
  std::vector<char> is_recv;
};

class MpiCommunicator final : public HostCommunicator {
 public:
  MpiCommunicator(Device* device, double timeout_s) : HostCommunicator(device, timeout_s) {}
  ~MpiCommunicator() override {
    if (!health().is_ok()) {
      runtime().broken = true;
      scratch_.release();  // messages may still land in it; the process is about to exit
      return;
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_NULL) {
      MpiLock lock;
      MPI_Comm_free(&comm_);
    }
  }

  Status init() {
    STRATA_RETURN_IF_ERROR(init_mpi(), "starting the mpi communicator");
    MpiLock lock;
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    if (rc != MPI_SUCCESS) return internal_error("MPI_Comm_dup: " + mpi_error_text(rc));
    return describe_comm();
  }

  // The sub-communicator of `parent`'s ranks with this color (MPI_Comm_split).
  Status init_split(MPI_Comm parent, int color, int key) {
    MpiLock lock;
    int rc = MPI_Comm_split(parent, color, key, &comm_);
    if (rc != MPI_SUCCESS) return internal_error("MPI_Comm_split: " + mpi_error_text(rc));
    return describe_comm();
  }

  Result<std::unique_ptr<Communicator>> split(int color, int key) override {
    if (color < 0) {
      return invalid_argument(fmt::format("rank {}: split: color {} must be >= 0", rank_, color));
    }
    auto sub = std::make_unique<MpiCommunicator>(device_, timeout_s());
    STRATA_RETURN_IF_ERROR(sub->init_split(comm_, color, key),
                           fmt::format("rank {}: splitting the mpi communicator", rank_));
    return std::unique_ptr<Communicator>(std::move(sub));
  }

  const char* backend() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int node() const override { return node_; }

 protected:
  Status run(const Op& op) override {
    ++collective_;
    Status s;
    switch (op.kind) {
      case Kind::kAllGather:
        s = all_gather(op);
        break;
      case Kind::kReduceScatter:
        s = reduce_scatter(op);
        break;
      case Kind::kAllReduce:
        s = all_reduce(op);
        break;
      case Kind::kBroadcast:
        s = broadcast(op);
        break;
      case Kind::kBarrier:
        s = barrier(op);
        break;
      case Kind::kAllToAll:
        s = all_to_all(op);
        break;
    }
    if (!s.is_ok()) runtime().broken = true;
    return s;
  }

 private:
  // rank, size, local rank and node of comm_ (called with the MPI lock held). The node is the
  // lowest world rank among comm_'s ranks on this host: for a sub-group, its own members'.
  Status describe_comm() {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm local;
    int rc = MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local);
    if (rc != MPI_SUCCESS) return internal_error("MPI_Comm_split_type: " + mpi_error_text(rc));
    MPI_Comm_rank(local, &local_rank_);
    int world_rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    rc = MPI_Allreduce(&world_rank, &node_, 1, MPI_INT, MPI_MIN, local);
    MPI_Comm_free(&local);
    if (rc != MPI_SUCCESS) return internal_error("MPI_Allreduce (node id): " + mpi_error_text(rc));
    return Status::ok();
  }

  int next_tag() { return static_cast<int>(tag_seq_++ % 30000) + 1; }

  char* scratch(size_t bytes) {
    if (scratch_bytes_ < bytes) {
      scratch_.reset(new char[bytes]);
      scratch_bytes_ = bytes;
    }
    return scratch_.get();
  }

  Status post(Pending& p, bool recv, void* buf, size_t bytes, int peer, int tag, const Op& op) {
    size_t off = 0;
    do {
      const size_t n = std::min(kMaxMessage, bytes - off);
      MPI_Request req;
      int rc;
      {
        MpiLock lock;
        char* b = static_cast<char*>(buf) + off;
        rc = recv ? MPI_Irecv(b, static_cast<int>(n), MPI_BYTE, peer, tag, comm_, &req)
                  : MPI_Isend(b, static_cast<int>(n), MPI_BYTE, peer, tag, comm_, &req);
      }
      if (rc == MPI_SUCCESS && !recv) count_sent(n);
      if (rc != MPI_SUCCESS) {
        return internal_error(fmt::format(
            "rank {}: {}: {} of {} bytes {} rank {} failed: {}", rank_, describe(op, size_),
            recv ? "MPI_Irecv" : "MPI_Isend", n, recv ? "from" : "to", peer, mpi_error_text(rc)));
      }
      p.reqs.push_back(req);
      p.peers.push_back(peer);
      p.is_recv.push_back(recv);
      off += n;
    } while (off < bytes);
    return Status::ok();
  }
  Status post_send(Pending& p, const void* buf, size_t bytes, int peer, int tag, const Op& op) {
    return post(p, false, const_cast<void*>(buf), bytes, peer, tag, op);
  }
  Status post_recv(Pending& p, void* buf, size_t bytes, int peer, int tag, const Op& op) {
    return post(p, true, buf, bytes, peer, tag, op);
  }

  // Polls until every request of `p` completed or the deadline passed.
  Status wait(Pending& p, const Op& op) {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const double limit = timeout_s();
    const int n = static_cast<int>(p.reqs.size());
    std::vector<int> done(static_cast<size_t>(std::max(n, 1)));
    int remaining = n, idle = 0;
    while (remaining > 0) {
      int outcount = 0, rc;
      {
        MpiLock lock;
        rc = MPI_Testsome(n, p.reqs.data(), &outcount, done.data(), MPI_STATUSES_IGNORE);
      }
      if (rc != MPI_SUCCESS) {
        return internal_error(fmt::format("rank {}: {} (collective #{}): MPI_Testsome failed: {}",
                                          rank_, describe(op, size_), collective_,
                                          mpi_error_text(rc)));
      }
      if (outcount == MPI_UNDEFINED) break;
      if (outcount > 0) {
        remaining -= outcount;
        idle = 0;
        continue;
      }
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (limit > 0 && waited > limit) return timed_out(p, op, waited);
      // Yield first (small messages complete within microseconds), then sleep briefly so that
      // oversubscribed ranks leave the cores to the peers they wait for.
      if (++idle < 256) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(std::min(idle - 255, 50) * 10));
      }
    }
    return Status::ok();
  }

  Status timed_out(const Pending& p, const Op& op, double waited) {
    std::set<int> recv_peers, send_peers;
    for (size_t i = 0; i < p.reqs.size(); ++i) {
      if (p.reqs[i] == MPI_REQUEST_NULL) continue;
      (p.is_recv[i] ? recv_peers : send_peers).insert(p.peers[i]);
    }
    const std::set<int>& peers = recv_peers.empty() ? send_peers : recv_peers;
    return internal_error(fmt::format(
        "rank {}: {} (collective #{}) timed out after {:.1f} s waiting for rank(s) {}; a rank "
        "may have died or hung (see its output), or the ranks issued collectives in different "
        "orders. If the peers are only slow, raise strata.comm.timeout_s (now {} s)",
        rank_, describe(op, size_), collective_, waited, fmt::join(peers, ", "), timeout_s()));
  }

  Status all_gather(const Op& op) {
    const size_t cb = op.count * op.elem_size();
    char* recv = static_cast<char*>(op.recv);
    if (cb == 0) return Status::ok();
    if (op.send != recv + rank_ * cb) std::memmove(recv + rank_ * cb, op.send, cb);
    Pending p;
    const int tag = next_tag();
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      STRATA_RETURN_IF_ERROR(post_recv(p, recv + q * cb, cb, q, tag, op), "all_gather");
    }
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      STRATA_RETURN_IF_ERROR(post_send(p, recv + rank_ * cb, cb, q, tag, op), "all_gather");
    }
    return wait(p, op);
  }

  Status all_to_all(const Op& op) {
    const size_t cb = op.count * op.elem_size();
    if (cb == 0) return Status::ok();
    const char* send = static_cast<const char*>(op.send);
    char* recv = static_cast<char*>(op.recv);
    std::memcpy(recv + rank_ * cb, send + rank_ * cb, cb);
    Pending p;
    const int tag = next_tag();
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      STRATA_RETURN_IF_ERROR(post_recv(p, recv + q * cb, cb, q, tag, op), "all_to_all");
    }
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      STRATA_RETURN_IF_ERROR(post_send(p, send + q * cb, cb, q, tag, op), "all_to_all");
    }
    return wait(p, op);
  }

  Status reduce_scatter(const Op& op) {
    const size_t cb = op.count * op.elem_size();
    if (cb == 0) return Status::ok();
    const char* send = static_cast<const char*>(op.send);
    char* stage = scratch(cb * size_);
    Pending p;
    const int tag = next_tag();
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      STRATA_RETURN_IF_ERROR(post_recv(p, stage + q * cb, cb, q, tag, op), "reduce_scatter");
    }
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      STRATA_RETURN_IF_ERROR(post_send(p, send + q * cb, cb, q, tag, op), "reduce_scatter");
    }
    STRATA_RETURN_IF_ERROR(wait(p, op), "");
    std::vector<const void*> in(static_cast<size_t>(size_));
    for (int q = 0; q < size_; ++q) in[q] = q == rank_ ? send + rank_ * cb : stage + q * cb;
    reduce_rank_order(in.data(), size_, op.recv, op.count, op.dtype, op.reduce);
    return Status::ok();
  }

  Status all_reduce(const Op& op) {
    const size_t es = dtype_size(op.dtype);
    const size_t bytes = op.count * es;
    if (bytes == 0) return Status::ok();
    const char* send = static_cast<const char*>(op.send);
    char* recv = static_cast<char*>(op.recv);
    std::vector<const void*> in(static_cast<size_t>(size_));
    if (bytes * size_ <= kOnePhaseAllReduceBytes) {
      // One phase: everyone sends everything; everyone reduces all P buffers in rank order.
      char* stage = scratch(bytes * size_);
      Pending p;
      const int tag = next_tag();
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        STRATA_RETURN_IF_ERROR(post_recv(p, stage + q * bytes, bytes, q, tag, op), "all_reduce");
        STRATA_RETURN_IF_ERROR(post_send(p, send, bytes, q, tag, op), "all_reduce");
      }
      STRATA_RETURN_IF_ERROR(wait(p, op), "");
      for (int q = 0; q < size_; ++q) in[q] = q == rank_ ? send : stage + q * bytes;
      reduce_rank_order(in.data(), size_, recv, op.count, op.dtype, op.reduce);
      return Status::ok();
    }
    // Two phases over P near-equal parts: [lo(q), lo(q+1)).
    auto lo = [&](int q) { return op.count * static_cast<size_t>(q) / size_; };
    const size_t my_lo = lo(rank_), my_len = lo(rank_ + 1) - my_lo;
    char* stage = scratch(my_len * es * size_);
    {
      Pending p;
      const int tag = next_tag();
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        const size_t qlen = lo(q + 1) - lo(q);
        if (my_len > 0) {
          STRATA_RETURN_IF_ERROR(post_recv(p, stage + q * my_len * es, my_len * es, q, tag, op),
                                 "all_reduce (reduce phase)");
        }
        if (qlen > 0) {
          STRATA_RETURN_IF_ERROR(post_send(p, send + lo(q) * es, qlen * es, q, tag, op),
                                 "all_reduce (reduce phase)");
        }
      }
      STRATA_RETURN_IF_ERROR(wait(p, op), "");
    }
    for (int q = 0; q < size_; ++q) {
      in[q] = q == rank_ ? send + my_lo * es : stage + q * my_len * es;
    }
    reduce_rank_order(in.data(), size_, recv + my_lo * es, my_len, op.dtype, op.reduce);
    Pending p;
    const int tag = next_tag();
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      const size_t qlen = lo(q + 1) - lo(q);
      if (qlen > 0) {
        STRATA_RETURN_IF_ERROR(post_recv(p, recv + lo(q) * es, qlen * es, q, tag, op),
                               "all_reduce (gather phase)");
      }
      if (my_len > 0) {
        STRATA_RETURN_IF_ERROR(post_send(p, recv + my_lo * es, my_len * es, q, tag, op),
                               "all_reduce (gather phase)");
      }
    }
    return wait(p, op);
  }

  Status broadcast(const Op& op) {
    const size_t bytes = op.count * op.elem_size();
    if (bytes == 0) return Status::ok();
    Pending p;
    const int tag = next_tag();
    if (rank_ == op.root) {
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        STRATA_RETURN_IF_ERROR(post_send(p, op.recv, bytes, q, tag, op), "broadcast");
      }
    } else {
      STRATA_RETURN_IF_ERROR(post_recv(p, op.recv, bytes, op.root, tag, op), "broadcast");
    }
    return wait(p, op);
  }

  Status barrier(const Op& op) {
    Pending p;
    const int tag = next_tag();
    char dummy_in = 0, dummy_out = 0;
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      STRATA_RETURN_IF_ERROR(post_recv(p, &dummy_in, 0, q, tag, op), "barrier");
      STRATA_RETURN_IF_ERROR(post_send(p, &dummy_out, 0, q, tag, op), "barrier");
    }
    return wait(p, op);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, local_rank_ = 0, node_ = 0;
  uint64_t tag_seq_ = 0;     // one per exchange, identical on every rank
  uint64_t collective_ = 0;  // one per collective, for messages
  std::unique_ptr<char[]> scratch_;
  size_t scratch_bytes_ = 0;
};

}  // namespace

Result<std::unique_ptr<Communicator>> create_mpi(Device* device, double timeout_s) {
  auto comm = std::make_unique<MpiCommunicator>(device, timeout_s);
  STRATA_RETURN_IF_ERROR(comm->init(), "creating the mpi communicator");
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace strata::comm_internal
