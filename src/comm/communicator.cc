// The Communicator's public wrappers (argument checks), the host-backend base, the shared
// rank-order reduction, ShardLayout and the backend factory.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "src/comm/comm_internal.h"
#include "strata/log.h"

namespace strata {

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "max"; }

const char* Communicator::kind_name(Kind kind) {
  switch (kind) {
    case Kind::kAllGather:
      return "all_gather";
    case Kind::kReduceScatter:
      return "reduce_scatter";
    case Kind::kAllReduce:
      return "all_reduce";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kAllToAll:
      return "all_to_all";
    default:
      return "barrier";
  }
}

// A failed check names this rank once: the sticky failure already does (the backends write
// "rank R: ..."), and the argument errors get it here. Wrapping the sticky failure again printed
// "rank 0: rank 0: ..." on every call after a timeout.
Status Communicator::check(const Op& op) const {
  if (Status h = health(); !h.is_ok()) return h;
  if (op.kind == Kind::kBarrier) return Status::ok();
  Status s = check_args(op);
  return s.is_ok() ? s : s.with_context(fmt::format("rank {}", rank()));
}

Status Communicator::check_args(const Op& op) const {
  const char* name = kind_name(op.kind);
  if (!op.raw && op.dtype != DType::kF32 && op.dtype != DType::kBF16 && op.dtype != DType::kF16) {
    return invalid_argument(fmt::format("{}: unknown dtype {}", name, int(op.dtype)));
  }
  if (op.count > 0 && op.recv == nullptr) {
    return invalid_argument(fmt::format("{} of {} elements: null buffer", name, op.count));
  }
  if (op.count > 0 && op.kind != Kind::kBroadcast && op.send == nullptr) {
    return invalid_argument(fmt::format("{} of {} elements: null send buffer", name, op.count));
  }
  if (op.kind == Kind::kBroadcast && (op.root < 0 || op.root >= size())) {
    return invalid_argument(fmt::format(
        "broadcast: root {} is not a rank of this {}-rank communicator", op.root, size()));
  }
  return Status::ok();
}

Status Communicator::all_gather(Stream& s, const void* send, void* recv, size_t count, DType t) {
  Op op{Kind::kAllGather, send, recv, count, t};
  if (Status c = check(op); !c.is_ok()) return c;
  return enqueue(s, op);
}
Status Communicator::all_gather_bytes(Stream& s, const void* send, void* recv, size_t bytes) {
  Op op{Kind::kAllGather, send, recv, bytes};
  op.raw = true;
  if (Status c = check(op); !c.is_ok()) return c;
  return enqueue(s, op);
}
Status Communicator::all_to_all_bytes(Stream& s, const void* send, void* recv, size_t bytes) {
  Op op{Kind::kAllToAll, send, recv, bytes};
  op.raw = true;
  if (Status c = check(op); !c.is_ok()) return c;
  return enqueue(s, op);
}
Status Communicator::reduce_scatter(Stream& s, const void* send, void* recv, size_t count, DType t,
                                    ReduceOp r) {
  Op op{Kind::kReduceScatter, send, recv, count, t, r};
  if (Status c = check(op); !c.is_ok()) return c;
  return enqueue(s, op);
}
Status Communicator::all_reduce(Stream& s, const void* send, void* recv, size_t count, DType t,
                                ReduceOp r) {
  Op op{Kind::kAllReduce, send, recv, count, t, r};
  if (Status c = check(op); !c.is_ok()) return c;
  return enqueue(s, op);
}
Status Communicator::broadcast(Stream& s, void* buf, size_t count, DType t, int root) {
  Op op{Kind::kBroadcast, nullptr, buf, count, t, ReduceOp::kSum, root};
  if (Status c = check(op); !c.is_ok()) return c;
  return enqueue(s, op);
}
Status Communicator::barrier(Stream& s) {
  Op op{Kind::kBarrier};
  if (Status c = check(op); !c.is_ok()) return c;
  return enqueue(s, op);
}

Status Communicator::all_gather_blocking(const void* send, void* recv, size_t count, DType t) {
  Op op{Kind::kAllGather, send, recv, count, t};
  if (Status c = check(op); !c.is_ok()) return c;
  return run_blocking(op);
}
Status Communicator::all_gather_bytes_blocking(const void* send, void* recv, size_t bytes) {
  Op op{Kind::kAllGather, send, recv, bytes};
  op.raw = true;
  if (Status c = check(op); !c.is_ok()) return c;
  return run_blocking(op);
}
Status Communicator::all_to_all_bytes_blocking(const void* send, void* recv, size_t bytes) {
  Op op{Kind::kAllToAll, send, recv, bytes};
  op.raw = true;
  if (Status c = check(op); !c.is_ok()) return c;
  return run_blocking(op);
}
Status Communicator::reduce_scatter_blocking(const void* send, void* recv, size_t count, DType t,
                                             ReduceOp r) {
  Op op{Kind::kReduceScatter, send, recv, count, t, r};
  if (Status c = check(op); !c.is_ok()) return c;
  return run_blocking(op);
}
Status Communicator::all_reduce_blocking(const void* send, void* recv, size_t count, DType t,
                                         ReduceOp r) {
  Op op{Kind::kAllReduce, send, recv, count, t, r};
  if (Status c = check(op); !c.is_ok()) return c;
  return run_blocking(op);
}
Status Communicator::broadcast_blocking(void* buf, size_t count, DType t, int root) {
  Op op{Kind::kBroadcast, nullptr, buf, count, t, ReduceOp::kSum, root};
  if (Status c = check(op); !c.is_ok()) return c;
  return run_blocking(op);
}
Status Communicator::barrier_blocking() {
  Op op{Kind::kBarrier};
  if (Status c = check(op); !c.is_ok()) return c;
  return run_blocking(op);
}

Result<ShardLayout> ShardLayout::make(size_t numel, int world_size, size_t alignment, DType dtype) {
  const size_t es = dtype_size(dtype);
  if (world_size < 1) {
    return invalid_argument(fmt::format("shard layout: world size {} must be >= 1", world_size));
  }
  if (alignment == 0 || alignment % es != 0) {
    return invalid_argument(
        fmt::format("shard layout: alignment {} bytes is not a positive multiple of the {} "
                    "element size ({} bytes)",
                    alignment, dtype_name(dtype), es));
  }
  const size_t align_elems = alignment / es;
  const size_t ws = static_cast<size_t>(world_size);
  ShardLayout l;
  l.numel = numel;
  l.world_size = world_size;
  const size_t per_rank = (numel + ws - 1) / ws;
  l.shard_numel = (per_rank + align_elems - 1) / align_elems * align_elems;
  l.padded_numel = l.shard_numel * ws;
  return l;
}

namespace comm_internal {

namespace {
inline float reduce2(float a, float b, ReduceOp op) {
  if (op == ReduceOp::kSum) return a + b;
  return (b > a || std::isnan(b)) ? b : a;  // max, NaN propagates
}
}  // namespace

void reduce_rank_order(const void* const* inputs, int n, void* out, size_t count, DType dtype,
                       ReduceOp op) {
  if (dtype == DType::kF32) {
    const float* const* in = reinterpret_cast<const float* const*>(inputs);
    float* o = static_cast<float*>(out);
    constexpr size_t kBlock = 4096;
    float acc[kBlock];
    for (size_t b = 0; b < count; b += kBlock) {
      const size_t m = std::min(kBlock, count - b);
      std::memcpy(acc, in[0] + b, m * sizeof(float));
      for (int q = 1; q < n; ++q) {
        const float* x = in[q] + b;
        if (op == ReduceOp::kSum) {
          for (size_t i = 0; i < m; ++i) acc[i] += x[i];
        } else {
          for (size_t i = 0; i < m; ++i) acc[i] = reduce2(acc[i], x[i], op);
        }
      }
      std::memcpy(o + b, acc, m * sizeof(float));
    }
    return;
  }
  constexpr size_t kBlock = 2048;
  float acc[kBlock], x[kBlock];
  const size_t es = dtype_size(dtype);
  for (size_t b = 0; b < count; b += kBlock) {
    const size_t m = std::min(kBlock, count - b);
    convert(static_cast<const char*>(inputs[0]) + b * es, dtype, acc, DType::kF32, m);
    for (int q = 1; q < n; ++q) {
      convert(static_cast<const char*>(inputs[q]) + b * es, dtype, x, DType::kF32, m);
      if (op == ReduceOp::kSum) {
        for (size_t i = 0; i < m; ++i) acc[i] += x[i];
      } else {
        for (size_t i = 0; i < m; ++i) acc[i] = reduce2(acc[i], x[i], op);
      }
    }
    convert(acc, DType::kF32, static_cast<char*>(out) + b * es, dtype, m);
  }
}

size_t op_bytes(const Communicator::Op& op, int world_size) {
  const size_t b = op.count * op.elem_size();
  using K = Communicator::Kind;
  if (op.kind == K::kAllGather || op.kind == K::kReduceScatter || op.kind == K::kAllToAll) {
    return b * static_cast<size_t>(world_size);
  }
  return op.kind == K::kBarrier ? 0 : b;
}

std::string describe(const Communicator::Op& op, int world_size) {
  using K = Communicator::Kind;
  const char* name = Communicator::kind_name(op.kind);
  if (op.kind == K::kBarrier) return name;
  std::string s = fmt::format("{} of {} bytes ({} x {}", name, op_bytes(op, world_size),
                              op.raw ? "bytes" : dtype_name(op.dtype), op.count);
  if (op.kind == K::kReduceScatter || op.kind == K::kAllReduce) {
    s += fmt::format(", {}", reduce_op_name(op.reduce));
  }
  if (op.kind == K::kBroadcast) s += fmt::format(", root {}", op.root);
  return s + ")";
}

Status HostCommunicator::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void HostCommunicator::fail(const Status& s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_.is_ok()) failure_ = s;
}

Status HostCommunicator::run_blocking(const Op& op) {
  std::lock_guard<std::mutex> lock(run_mu_);
  if (Status h = health(); !h.is_ok()) return h;
  const auto t0 = std::chrono::steady_clock::now();
  Status s = run(op);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard<std::mutex> l(mu_);
    busy_s_ += secs;
  }
  if (!s.is_ok()) fail(s);
  return s;
}

double HostCommunicator::busy_seconds() {
  std::lock_guard<std::mutex> lock(mu_);
  return busy_s_;
}

uint64_t HostCommunicator::bytes_sent() const { return bytes_sent_.load(); }

Status HostCommunicator::enqueue(Stream& stream, const Op& op) {
  if (device_ == nullptr) {
    return invalid_argument(fmt::format(
        "rank {}: stream-ordered {} on a communicator created without a device; pass the "
        "Device to create_communicator or use {}_blocking",
        rank(), kind_name(op.kind), kind_name(op.kind)));
  }
  // The failure is kept by run_blocking; synchronize() returns it.
  device_->host_fn(stream, [this, op] { run_blocking(op).ignore(); });
  return Status::ok();
}

Status HostCommunicator::synchronize(Stream& stream) {
  if (device_ != nullptr) {
    STRATA_RETURN_IF_ERROR(device_->synchronize(stream),
                           fmt::format("rank {}: synchronizing a communicator's stream", rank()));
  }
  return health();
}

}  // namespace comm_internal

bool launched_with_multiple_ranks() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS",
                          "SLURM_NTASKS", "MV2_COMM_WORLD_SIZE"}) {
    if (const char* v = std::getenv(var)) {
      if (std::atoi(v) > 1) return true;
    }
  }
  return false;
}

Result<std::unique_ptr<Communicator>> create_communicator(const std::string& backend,
                                                          Device* device,
                                                          const CommOptions& options) {
  double timeout = options.timeout_s;
  if (const char* env = std::getenv("STRATA_COMM_TIMEOUT_S")) {
    char* end = nullptr;
    double v = std::strtod(env, &end);
    if (end == env || *end != '\0') {
      return invalid_argument(fmt::format(
          "STRATA_COMM_TIMEOUT_S='{}' is not a number of seconds; unset it or set e.g. 300", env));
    }
    timeout = v;
  }
  std::string name = backend;
  if (name == "auto") {
    if (device != nullptr && device->kind() == DeviceKind::kCuda) {
      name = "nccl";
    } else if (launched_with_multiple_ranks()) {
      name = "mpi";
    } else {
      name = "single";
    }
    log_debug("strata.comm.backend auto: {}", name);
  }
  if (name == "single") return comm_internal::create_single(device, timeout);
  if (name == "mpi") return comm_internal::create_mpi(device, timeout);
  if (name == "nccl") return comm_internal::create_nccl(device, timeout);
  return invalid_argument(fmt::format(
      "strata.comm.backend: unknown backend '{}'; use auto, mpi, nccl or single", backend));
}

}  // namespace strata
