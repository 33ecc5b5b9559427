// `strata probe comm`: nccl-tests style bus bandwidth of each collective (see strata/comm.h).
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "src/comm/comm_internal.h"
#include "src/comm/zeropp.h"
#include "strata/config.h"
#include "strata/log.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

// ZeRO++'s quantized collectives (src/comm/zeropp.h), timed from the model-dtype buffer to the
// model-dtype result, kernels included: all_gather_q8 (qwZ: quantize, all-gather the int8
// chunks, dequantize) and reduce_scatter_q4 (qgZ's hierarchical int4 reduce-scatter, fp32).
// Their size and bandwidth are those of the plain collective they replace.
bool quantized_op(const std::string& op) {
  return op == "all_gather_q8" || op == "reduce_scatter_q4";
}
bool per_rank_op(const std::string& op) {
  return op == "all_gather" || op == "reduce_scatter" || quantized_op(op);
}

double bus_factor(const std::string& op, int p) {
  if (op == "all_reduce") return 2.0 * (p - 1) / p;
  if (per_rank_op(op)) return double(p - 1) / p;
  return 1.0;  // broadcast
}

// Collective buffers in host or device memory; released on destruction.
class ProbeBuffers {
 public:
  ~ProbeBuffers() {
    for (void* p : ptrs_) {
      if (device_) {
        device_->release(p);
      } else {
        std::free(p);
      }
    }
  }
  Result<void*> make(Device* device, BufferSpace space, size_t bytes, DType dtype) {
    const size_t n = std::max<size_t>(bytes, 4096);
    if (space == BufferSpace::kDevice) {
      device_ = device;
      STRATA_ASSIGN_OR_RETURN(void* p, device->allocate(n, "comm probe"), "comm probe buffers");
      ptrs_.push_back(p);
      device->memset_zero(device->compute_stream(), p, n);
      STRATA_RETURN_IF_ERROR(device->synchronize(device->compute_stream()), "comm probe");
      return p;
    }
    void* p = std::aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (p == nullptr) {
      return out_of_memory(
          fmt::format("comm probe: cannot allocate {} of host memory; lower "
                      "--max-bytes",
                      format_bytes(double(n))));
    }
    ptrs_.push_back(p);
    // Small finite values: sums stay finite and the reduction runs at its normal speed.
    for (size_t i = 0; i < n / dtype_size(dtype); ++i) {
      store_f32(p, dtype, i, 0.25f * float(i % 7));
    }
    return p;
  }

 private:
  Device* device_ = nullptr;
  std::vector<void*> ptrs_;
};

// What the quantized collectives need besides the communicator.
struct QuantizedCtx {
  Device* device = nullptr;
  ZeroPP* zeropp = nullptr;  // reduce_scatter_q4's groups
  void* scratch = nullptr;   // device memory for the packed chunks
};

Status run_quantized(Communicator& comm, const QuantizedCtx& q, const std::string& op,
                     const void* send, void* recv, size_t count, DType dtype) {
  Device& dev = *q.device;
  Stream& s = dev.compute_stream();
  if (op == "all_gather_q8") {
    const size_t unit = packed_bytes(8, count, kWeightBlock), es = dtype_size(dtype);
    char* units = static_cast<char*>(q.scratch);
    char* mine = units + size_t(comm.rank()) * unit;
    quantize_packed(dev, s, 8, dtype, mine, send, count, kWeightBlock);
    STRATA_RETURN_IF_ERROR(comm.all_gather_bytes(s, mine, units, unit), "qwZ all_gather probe");
    for (int r = 0; r < comm.size(); ++r) {
      dequantize_packed(dev, s, 8, dtype, static_cast<char*>(recv) + size_t(r) * count * es,
                        units + size_t(r) * unit, count, kWeightBlock, false);
    }
  } else {
    // The send buffer is sent again: the partial sums go to the scratch.
    STRATA_RETURN_IF_ERROR(
        q.zeropp->reduce_scatter(dev, s, static_cast<float*>(const_cast<void*>(send)),
                                 static_cast<float*>(recv), count, q.scratch, /*reuse_buf=*/false),
        "qgZ reduce_scatter probe");
  }
  STRATA_RETURN_IF_ERROR(comm.synchronize(s), "probe " + op);
  return q.zeropp ? q.zeropp->health() : Status::ok();
}

Status run_one(Communicator& comm, const QuantizedCtx& q, const std::string& op, const void* send,
               void* recv, size_t count, DType dtype) {
  if (quantized_op(op)) return run_quantized(comm, q, op, send, recv, count, dtype);
  if (op == "all_reduce") return comm.all_reduce_blocking(send, recv, count, dtype, ReduceOp::kSum);
  if (op == "all_gather") return comm.all_gather_blocking(send, recv, count, dtype);
  if (op == "reduce_scatter") {
    return comm.reduce_scatter_blocking(send, recv, count, dtype, ReduceOp::kSum);
  }
  if (op == "broadcast") return comm.broadcast_blocking(recv, count, dtype, 0);
  return invalid_argument(fmt::format(
      "probe comm: unknown collective '{}'; use all_reduce, all_gather, reduce_scatter, "
      "broadcast, all_gather_q8 or reduce_scatter_q4",
      op));
}

// Seconds per collective over `iters` back-to-back calls, the slowest rank's.
Result<double> time_iters(Communicator& comm, const QuantizedCtx& q, const std::string& op,
                          const void* send, void* recv, size_t count, DType dtype, int iters) {
  STRATA_RETURN_IF_ERROR(comm.barrier_blocking(), "probe comm: barrier");
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    STRATA_RETURN_IF_ERROR(run_one(comm, q, op, send, recv, count, dtype),
                           fmt::format("probe comm: {} of {} elements", op, count));
  }
  float t = float(std::chrono::duration<double>(Clock::now() - t0).count() / iters);
  STRATA_RETURN_IF_ERROR(comm.all_reduce_blocking(&t, &t, 1, DType::kF32, ReduceOp::kMax),
                         "probe comm: gathering the slowest rank's time");
  return double(t);
}

void print_header(std::FILE* out, const CommProbeReport& r) {
  std::fprintf(out, "# strata probe comm: backend %s, %d ranks, %s\n", r.backend.c_str(),
               r.world_size, dtype_name(r.dtype));
  std::fprintf(out, "# %12s %12s %6s %6s %15s %9s %11s %11s %11s %11s\n", "size(B)", "count",
               "type", "redop", "op", "iters", "time(us)", "min(us)", "algbw(GB/s)", "busbw(GB/s)");
}

void print_case(std::FILE* out, const CommProbeCase& c, DType dtype) {
  const bool reduces =
      c.op == "all_reduce" || c.op == "reduce_scatter" || c.op == "reduce_scatter_q4";
  std::fprintf(out, "  %12zu %12zu %6s %6s %15s %9d %11.2f %11.2f %11.3f %11.3f\n", c.bytes,
               c.count, dtype_name(dtype), reduces ? "sum" : "none", c.op.c_str(), c.iters,
               c.median_us, c.min_us, c.algbw, c.busbw);
  std::fflush(out);
}

}  // namespace

Result<CommProbeReport> run_comm_probe(const CommProbeOptions& o, Communicator& comm,
                                       Device* device, std::FILE* out) {
  if (o.min_bytes == 0 || o.max_bytes < o.min_bytes || o.repeats < 1 || o.warmup < 0) {
    return invalid_argument(fmt::format(
        "probe comm: need 0 < min_bytes ({}) <= max_bytes ({}), repeats ({}) >= 1, warmup ({}) "
        ">= 0",
        o.min_bytes, o.max_bytes, o.repeats, o.warmup));
  }
  if (comm.buffer_space() == BufferSpace::kDevice && device == nullptr) {
    return invalid_argument("probe comm: the nccl backend needs a device for its buffers");
  }
  const int p = comm.size();
  CommProbeReport report;
  report.backend = comm.backend();
  report.world_size = p;
  report.dtype = o.dtype;
  ProbeBuffers buffers;
  STRATA_ASSIGN_OR_RETURN(void* send,
                          buffers.make(device, comm.buffer_space(), o.max_bytes, o.dtype),
                          "probe comm: send buffer");
  STRATA_ASSIGN_OR_RETURN(void* recv,
                          buffers.make(device, comm.buffer_space(), o.max_bytes, o.dtype),
                          "probe comm: receive buffer");
  // The quantized collectives: a device for their kernels, the packed chunks' scratch (at most
  // twice the largest buffer), and qgZ's groups.
  QuantizedCtx q;
  std::unique_ptr<ZeroPP> zeropp;
  if (std::any_of(o.ops.begin(), o.ops.end(), quantized_op)) {
    if (device == nullptr) {
      return invalid_argument("probe comm: all_gather_q8 and reduce_scatter_q4 need a device");
    }
    q.device = device;
    STRATA_ASSIGN_OR_RETURN(
        q.scratch, buffers.make(device, comm.buffer_space(), 2 * o.max_bytes + 65536, DType::kF32),
        "probe comm: quantized scratch");
    if (std::find(o.ops.begin(), o.ops.end(), "reduce_scatter_q4") != o.ops.end()) {
      ZeroPPOptions zo;
      zo.quantized_gradients = true;
      zo.ranks_per_node = o.ranks_per_node;
      STRATA_ASSIGN_OR_RETURN(zeropp, ZeroPP::create(zo, comm, comm), "probe comm");
      q.zeropp = zeropp.get();
    }
  }
  const bool print = out != nullptr && comm.rank() == 0;
  if (print) print_header(out, report);
  for (const std::string& op : o.ops) {
    for (size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) {
      const bool per_rank = per_rank_op(op);
      // reduce_scatter_q4 reduces fp32 gradients whatever --dtype says.
      const DType dt = op == "reduce_scatter_q4" ? DType::kF32 : o.dtype;
      const size_t es = dtype_size(dt);
      const size_t count = per_rank ? bytes / es / p : bytes / es;
      if (count == 0) continue;
      CommProbeCase c;
      c.op = op;
      c.count = count;
      c.bytes = count * es * (per_rank ? p : 1);
      // One untimed call sizes the repeats: iters ~ target / time, the same on every rank.
      STRATA_ASSIGN_OR_RETURN(double first, time_iters(comm, q, op, send, recv, count, dt, 1),
                              "probe comm: sizing");
      c.iters = static_cast<int>(std::clamp(o.target_seconds / std::max(first, 1e-7), 1.0, 100.0));
      for (int w = 0; w < o.warmup; ++w) {
        STRATA_ASSIGN_OR_RETURN(double t, time_iters(comm, q, op, send, recv, count, dt, c.iters),
                                "probe comm: warm-up");
        (void)t;
      }
      for (int r = 0; r < o.repeats; ++r) {
        STRATA_ASSIGN_OR_RETURN(double t, time_iters(comm, q, op, send, recv, count, dt, c.iters),
                                "probe comm");
        c.time_us.push_back(t * 1e6);
      }
      std::vector<double> sorted = c.time_us;
      std::sort(sorted.begin(), sorted.end());
      const size_t n = sorted.size();
      c.median_us = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
      c.min_us = sorted.front();
      c.max_us = sorted.back();
      c.algbw = c.median_us > 0 ? double(c.bytes) / (c.median_us * 1e-6) / 1e9 : 0.0;
      c.busbw = c.algbw * bus_factor(op, p);
      if (print) print_case(out, c, dt);
      report.cases.push_back(std::move(c));
      if (bytes > o.max_bytes / 2) break;  // no overflow past max
    }
  }
  return report;
}

std::string comm_probe_json(const CommProbeReport& r) {
  nlohmann::json j;
  j["magic"] = "strata-comm-probe";
  j["version"] = kCommProbeFormatVersion;
  j["backend"] = r.backend;
  j["world_size"] = r.world_size;
  j["dtype"] = dtype_name(r.dtype);
  j["cases"] = nlohmann::json::array();
  for (const CommProbeCase& c : r.cases) {
    const bool reduces =
        c.op == "all_reduce" || c.op == "reduce_scatter" || c.op == "reduce_scatter_q4";
    j["cases"].push_back({{"op", c.op},
                          {"bytes", c.bytes},
                          {"count", c.count},
                          {"dtype", dtype_name(r.dtype)},
                          {"reduce", reduces ? "sum" : "none"},
                          {"iters", c.iters},
                          {"time_us_median", c.median_us},
                          {"time_us_min", c.min_us},
                          {"time_us_max", c.max_us},
                          {"algbw_gbps", c.algbw},
                          {"busbw_gbps", c.busbw},
                          {"time_us", c.time_us}});
  }
  return j.dump(2) + "\n";
}

Result<CommProbeReport> parse_comm_probe_json(const std::string& text, const std::string& origin) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return corrupt(fmt::format("{}: not a JSON object; rerun `strata probe comm`", origin));
  }
  if (j.value("magic", std::string()) != "strata-comm-probe") {
    return corrupt(
        fmt::format("{}: magic is not \"strata-comm-probe\": not a comm probe profile", origin));
  }
  if (j.value("version", 0) != kCommProbeFormatVersion) {
    return corrupt(
        fmt::format("{}: format version {} (this strata reads {}); rerun `strata probe "
                    "comm`",
                    origin, j.value("version", 0), kCommProbeFormatVersion));
  }
  try {
    CommProbeReport r;
    r.backend = j.at("backend").get<std::string>();
    r.world_size = j.at("world_size").get<int>();
    if (!parse_dtype(j.at("dtype").get<std::string>(), &r.dtype)) {
      return corrupt(fmt::format("{}: unknown dtype {}", origin, j.at("dtype").dump()));
    }
    for (const auto& jc : j.at("cases")) {
      CommProbeCase c;
      c.op = jc.at("op").get<std::string>();
      c.bytes = jc.at("bytes").get<size_t>();
      c.count = jc.at("count").get<size_t>();
      c.iters = jc.value("iters", 0);
      c.median_us = jc.at("time_us_median").get<double>();
      c.min_us = jc.at("time_us_min").get<double>();
      c.max_us = jc.at("time_us_max").get<double>();
      c.algbw = jc.at("algbw_gbps").get<double>();
      c.busbw = jc.at("busbw_gbps").get<double>();
      c.time_us = jc.at("time_us").get<std::vector<double>>();
      r.cases.push_back(std::move(c));
    }
    return r;
  } catch (const nlohmann::json::exception& e) {
    return corrupt(fmt::format("{}: {}; rerun `strata probe comm`", origin, e.what()));
  }
}

Status run_comm_probe_command(const CommProbeOptions& o) {
  std::unique_ptr<Device> device;
  std::string why;
  const bool want_cuda =
      o.backend == "nccl" || (o.backend == "auto" && cuda_device_available(&why));
  if (want_cuda) {
    CudaDeviceOptions d;
    for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
      if (const char* v = std::getenv(var)) {
        d.ordinal = std::atoi(v);
        break;
      }
    }
    STRATA_ASSIGN_OR_RETURN(device, create_cuda_device(d), "probe comm: opening the GPU");
  } else if (std::any_of(o.ops.begin(), o.ops.end(), quantized_op)) {
    // The quantized collectives' kernels run on the CPU backend (a few threads: the host
    // collectives' ranks share the cores).
    CpuDeviceOptions d;
    d.capacity = 8 * o.max_bytes + (size_t{64} << 20);
    d.threads = 1;
    STRATA_ASSIGN_OR_RETURN(device, create_cpu_device(d), "probe comm: the kernels' device");
  }
  CommOptions co;
  co.timeout_s = o.timeout_s;
  STRATA_ASSIGN_OR_RETURN(auto comm, create_communicator(o.backend, device.get(), co),
                          "probe comm");
  STRATA_ASSIGN_OR_RETURN(CommProbeReport report, run_comm_probe(o, *comm, device.get(), stdout),
                          "probe comm");
  if (comm->rank() == 0 && !o.json_path.empty()) {
    const std::string tmp = o.json_path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      f << comm_probe_json(report);
      if (!f.good()) {
        return io_error(
            fmt::format("probe comm: cannot write {}; check the directory exists and "
                        "is writable",
                        tmp));
      }
    }
    if (std::rename(tmp.c_str(), o.json_path.c_str()) != 0) {
      return errno_status(errno, fmt::format("probe comm: renaming {} to {}", tmp, o.json_path));
    }
    std::printf("# profile written to %s\n", o.json_path.c_str());
  }
  return Status::ok();
}

}  // namespace strata

namespace strata {
namespace {

void probe_usage(std::FILE* out) {
  const CommProbeOptions d;
  std::fprintf(
      out,
      "usage: [mpirun -np N] strata probe comm [options]\n\n"
      "Measures each collective at sizes doubling from --min-bytes to --max-bytes, as nccl-tests\n"
      "does: time per collective (slowest rank, median of repeats after warm-up), algorithm\n"
      "bandwidth size/time and bus bandwidth (algbw x 2(P-1)/P for all_reduce, x (P-1)/P for\n"
      "all_gather and reduce_scatter). Rank 0 prints the table and writes the JSON profile.\n\n"
      "options:\n"
      "  --backend NAME       auto|mpi|nccl|single (default %s)\n"
      "  --min-bytes BYTES    smallest size (default %s)\n"
      "  --max-bytes BYTES    largest size (default %s)\n"
      "  --dtype T            fp32|bf16|fp16 (default %s)\n"
      "  --ops LIST           all_reduce,all_gather,reduce_scatter,broadcast (default), and\n"
      "                       ZeRO++'s all_gather_q8 (int8 qwZ) and reduce_scatter_q4 (int4\n"
      "                       hierarchical qgZ, fp32), timed with their kernels\n"
      "  --ranks-per-node L   reduce_scatter_q4's nodes: ranks [n*L, (n+1)*L) (default: hosts)\n"
      "  --repeats N          timed repeats per case, 1-1000 (default %d)\n"
      "  --warmup N           discarded repeats per case, 0-1000 (default %d)\n"
      "  --timeout S          collective timeout in seconds (default %.0f)\n"
      "  --json FILE          write the profile here (default: none)\n",
      d.backend.c_str(), format_bytes(double(d.min_bytes)).c_str(),
      format_bytes(double(d.max_bytes)).c_str(), dtype_name(d.dtype), d.repeats, d.warmup,
      d.timeout_s);
}

}  // namespace

int comm_probe_main(int argc, char** argv) {
  CommProbeOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      probe_usage(stdout);
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "strata probe comm: %s needs a value\n\n", a.c_str());
      probe_usage(stderr);
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--backend") {
      o.backend = v;
    } else if (a == "--min-bytes" || a == "--max-bytes") {
      auto s = parse_size(v);
      if (!s.is_ok()) {
        std::fprintf(stderr, "strata probe comm: %s: %s\n", a.c_str(),
                     s.status().to_string().c_str());
        return 2;
      }
      (a == "--min-bytes" ? o.min_bytes : o.max_bytes) = *s;
    } else if (a == "--dtype") {
      if (!parse_dtype(v, &o.dtype)) {
        std::fprintf(stderr, "strata probe comm: --dtype takes fp32, bf16 or fp16, not '%s'\n",
                     v.c_str());
        return 2;
      }
    } else if (a == "--ops") {
      o.ops.clear();
      size_t start = 0;
      while (start <= v.size()) {
        size_t comma = v.find(',', start);
        if (comma == std::string::npos) comma = v.size();
        if (comma > start) o.ops.push_back(v.substr(start, comma - start));
        start = comma + 1;
      }
    } else if (a == "--repeats" || a == "--warmup" || a == "--ranks-per-node") {
      // Passes, as strata probe's (each repeats every case); a node's ranks, 0: from the hosts.
      const long long lo = a == "--repeats" ? 1 : 0, hi = a == "--ranks-per-node" ? 1 << 20 : 1000;
      long long n = 0;
      if (!parse_int_in(v, lo, hi, &n)) {
        std::fprintf(stderr,
                     "strata probe comm: %s '%s': expected a whole number from %lld to %lld\n",
                     a.c_str(), v.c_str(), lo, hi);
        return 2;
      }
      (a == "--repeats" ? o.repeats : a == "--warmup" ? o.warmup : o.ranks_per_node) = int(n);
    } else if (a == "--timeout") {
      if (!parse_number_in(v, 1e-3, 1e6, &o.timeout_s)) {
        std::fprintf(stderr, "strata probe comm: --timeout '%s': expected seconds above 0\n",
                     v.c_str());
        return 2;
      }
    } else if (a == "--json") {
      o.json_path = v;
    } else {
      std::fprintf(stderr, "strata probe comm: unknown option '%s'\n\n", a.c_str());
      probe_usage(stderr);
      return 2;
    }
  }
  Status s = run_comm_probe_command(o);
  if (!s.is_ok()) {
    std::fprintf(stderr, "strata probe comm: %s\n", s.to_string().c_str());
    return 1;
  }
  return 0;
}

}  // namespace strata
