// Communicator: the collectives ZeRO-3 needs (all_gather, reduce_scatter, all_reduce, broadcast,
// barrier) over fp32 / bf16 / fp16 buffers. One interface, three backends:
//   - single: one rank; collectives are copies (or nothing). Always available.
//   - mpi:    Open MPI, HOST buffers (the CPU backend, multi-rank tests under mpirun, host-side
//             reductions such as the grad norm). Built when STRATA_HAVE_MPI.
//   - nccl:   NCCL, DEVICE buffers of a CUDA Device, on the communicator's own CUDA stream; the
//             NCCL unique id is broadcast over MPI. Built when STRATA_HAVE_CUDA (and NCCL).
// buffer_space() says which memory a backend's buffers must live in.
//
// Two forms of every collective:
//   - stream-ordered:  all_reduce(stream, ...) enqueues the collective on `stream` of the Device
//     the communicator was created with, so it runs after the kernels enqueued before it and
//     before those enqueued after it. Host backends run it with device.host_fn(stream, ...)
//     (on the CPU backend's stream thread); nccl joins `stream` to its own stream with events.
//     The call returns at once: buffers must stay valid until the stream has run that far.
//     It returns a failed Status only for what can be seen at once (bad arguments, a
//     communicator already failed); a failure while running (a timeout, a peer error) is kept
//     and returned by synchronize(stream) and by every later call.
//   - blocking:        all_reduce_blocking(...) runs the collective on the calling thread and
//     returns when it is complete on this rank (for host code: loss-scaler flags, grad norms,
//     the probe). On nccl it is enqueued on the communicator's stream and waited for.
//
// Semantics (count is in elements of `dtype`; P = size()):
//   all_gather:     send has count, recv has P*count; recv[r*count..] = send of rank r.
//   all_to_all:     send and recv have P*count; recv[q*count..] of rank r = send_q[r*count..]
//                   (block r of rank q's send). send and recv must not overlap.
//   reduce_scatter: send has P*count, recv has count; recv of rank r =
//                   op over ranks q of send_q[r*count .. (r+1)*count).
//   all_reduce:     send and recv have count; recv = op over ranks of send. send may == recv.
//   broadcast:      buf has count; every rank gets root's buf.
//   barrier:        returns (or lets the stream go on) once every rank has entered it.
// The *_bytes forms (all_gather_bytes, all_to_all_bytes) move opaque bytes (count is in bytes,
// no dtype): the quantized payloads of ZeRO++ (int8/int4 values with their fp32 scales).
//
// In-place: all_reduce and broadcast may alias; all_gather may pass send == recv + rank()*count;
// reduce_scatter may pass recv == send + rank()*count. Other overlaps are undefined.
//
// Reductions: kSum and kMax. The mpi and single backends accumulate in fp32 in rank order
// 0, 1, ..., P-1 and round to bf16/fp16 ONCE, so results are deterministic, bit-identical on
// every rank and equal to a serial fp32 rank-order loop (the tests check exactly that). nccl
// uses NCCL's native bf16/fp16 reductions (its order depends on the topology).
//
// Ordering: every rank must issue the collectives of one communicator in the same order
// (stream-ordered ones in the order they run). Do not run two collectives of one communicator
// concurrently from two threads or two unjoined streams; create a second communicator
// (create_communicator again) for a second independent sequence.
//
// Failure: a collective waits at most `timeout_s` for its peers. Past it the call fails with
// kInternal: "rank R: all_reduce of N bytes (collective #S) timed out after T s waiting for
// rank(s) Q; a rank may have died or hung ...". After any failure the communicator is broken:
// every later call returns the same Status, and (mpi) MPI is not finalised at exit, so the
// caller should report the Status and exit non-zero; mpirun then ends the other ranks. A rank
// that dies outright is also detected by Open MPI itself, which ends the whole job.
//
// Lifetime: stream-ordered collectives refer to the communicator until they have run:
// synchronize() the streams before destroying it; the Device must outlive it.
//
// Sub-groups: split(color, key) makes a communicator of the ranks that pass the same color
// (ordered by key, then rank), for ZeRO++'s groups within and across nodes. node() says which
// host a rank is on: the lowest world rank among this communicator's ranks sharing this one's
// host (MPI's shared-memory split), so the ranks of one node agree on it.
//
// Traffic: bytes_sent() counts the payload bytes this rank has handed to the network for other
// ranks since the communicator was created (mpi: the bytes of every send to a peer; single: 0;
// nccl: what a ring moves per rank, (P-1)/P of the buffer per phase). The trainer reports it per
// step as comm_bytes.
//
// Thread safety: rank()/size()/local_rank()/node()/backend()/buffer_space() are const and safe
// from any thread; so are bytes_sent() and busy_seconds(). Collectives follow the ordering rule
// above.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/status.h"

namespace strata {

enum class ReduceOp : uint8_t { kSum = 0, kMax = 1 };
const char* reduce_op_name(ReduceOp op);  // "sum", "max"

// Where a backend's collective buffers must live.
enum class BufferSpace : uint8_t { kHost = 0, kDevice = 1 };

struct CommOptions {
  // strata.comm.timeout_s: how long one collective waits for its peers; <= 0 waits forever.
  // The environment variable STRATA_COMM_TIMEOUT_S, when set, overrides it (tests use it).
  double timeout_s = 300.0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual const char* backend() const = 0;  // "single" | "mpi" | "nccl"
  virtual int rank() const = 0;             // 0 .. size()-1
  virtual int size() const = 0;             // number of ranks (world size)
  virtual int local_rank() const = 0;       // rank among the ranks on this host (picks the GPU)
  virtual int node() const = 0;             // names this rank's host (see Sub-groups)
  virtual BufferSpace buffer_space() const = 0;
  double timeout_s() const { return timeout_s_; }

  // --- stream-ordered (asynchronous) --------------------------------------------------------
  Status all_gather(Stream& stream, const void* send, void* recv, size_t count, DType dtype);
  Status all_gather_bytes(Stream& stream, const void* send, void* recv, size_t bytes);
  Status all_to_all_bytes(Stream& stream, const void* send, void* recv, size_t bytes);
  Status reduce_scatter(Stream& stream, const void* send, void* recv, size_t count, DType dtype,
                        ReduceOp op);
  Status all_reduce(Stream& stream, const void* send, void* recv, size_t count, DType dtype,
                    ReduceOp op);
  Status broadcast(Stream& stream, void* buf, size_t count, DType dtype, int root);
  Status barrier(Stream& stream);
  // Waits for everything enqueued on `stream` (Device::synchronize), then returns the first
  // failure of any collective of this communicator, or OK. nccl bounds the wait by timeout_s.
  virtual Status synchronize(Stream& stream) = 0;

  // Bucketing: between group_begin() and group_end() the stream-ordered collectives are one
  // launch (ncclGroupStart/End). Host backends run them one after another; results are the
  // same either way. Groups do not nest.
  virtual void group_begin() {}
  virtual Status group_end() { return Status::ok(); }

  // --- blocking (the calling thread waits) ----------------------------------------------------
  Status all_gather_blocking(const void* send, void* recv, size_t count, DType dtype);
  Status all_gather_bytes_blocking(const void* send, void* recv, size_t bytes);
  Status all_to_all_bytes_blocking(const void* send, void* recv, size_t bytes);
  Status reduce_scatter_blocking(const void* send, void* recv, size_t count, DType dtype,
                                 ReduceOp op);
  Status all_reduce_blocking(const void* send, void* recv, size_t count, DType dtype, ReduceOp op);
  Status broadcast_blocking(void* buf, size_t count, DType dtype, int root);
  Status barrier_blocking();

  // The sticky failure of this communicator, or OK.
  virtual Status health() const = 0;

  // Seconds this communicator's collectives have taken since it was created, summed over
  // collectives (stream-ordered and blocking, failed ones included): from the moment a
  // collective starts on this rank to its end, so the wait for the slowest peer counts. Host
  // backends time run() on the thread that runs it; nccl times the collectives on its stream
  // with CUDA events and counts only those that have completed when asked. Stream-ordered
  // collectives overlap other streams' work: this is time spent communicating, not time lost.
  // Safe from any thread (the trainer reads it between steps for the JSONL's comm_s).
  virtual double busy_seconds() = 0;
  // Payload bytes sent to other ranks since creation (see Traffic).
  virtual uint64_t bytes_sent() const = 0;

  // The ranks of this communicator that pass the same `color` (>= 0), ordered by (key, rank),
  // as a new communicator on the same device and with the same timeout. A collective call of
  // this communicator: every rank must call it, in the same order as its other collectives.
  // kUnavailable on a backend that cannot split (nccl, for now).
  virtual Result<std::unique_ptr<Communicator>> split(int color, int key) = 0;

  // What the backends implement. `op` describes one collective; the checks of the public
  // wrappers (count, root, dtype) have already passed.
  enum class Kind : uint8_t {
    kAllGather,
    kReduceScatter,
    kAllReduce,
    kBroadcast,
    kBarrier,
    kAllToAll
  };
  struct Op {
    Kind kind = Kind::kBarrier;
    const void* send = nullptr;
    void* recv = nullptr;  // broadcast: the buffer
    size_t count = 0;
    DType dtype = DType::kF32;
    ReduceOp reduce = ReduceOp::kSum;
    int root = 0;
    bool raw = false;  // count is in bytes and dtype is ignored (the *_bytes forms)
    size_t elem_size() const { return raw ? 1 : dtype_size(dtype); }
  };
  static const char* kind_name(Kind kind);  // "all_gather", ...

 protected:
  explicit Communicator(double timeout_s) : timeout_s_(timeout_s) {}
  virtual Status enqueue(Stream& stream, const Op& op) = 0;
  virtual Status run_blocking(const Op& op) = 0;

 private:
  // The sticky failure as it is (it names the rank), else the argument checks' failure with
  // "rank R: " in front, else OK.
  Status check(const Op& op) const;
  Status check_args(const Op& op) const;
  double timeout_s_;
};

// Creates a communicator. backend: "auto" | "mpi" | "nccl" | "single".
//   auto: nccl when `device` is a CUDA device and NCCL is built in; else mpi when launched by
//         mpirun/srun with more than one rank (OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX/SLURM env,
//         or MPI already initialised with size > 1); else single.
// `device` is where stream-ordered collectives run; it must outlive the communicator and may
// be null only for the blocking forms of host backends. mpi initialises MPI (thread level
// MULTIPLE; SERIALIZED is accepted and MPI calls are then serialised) once per process and
// finalises it at exit. Fails with kUnavailable naming what is missing (a backend not built,
// nccl without a CUDA device) and with kInvalidArgument for an unknown name.
Result<std::unique_ptr<Communicator>> create_communicator(const std::string& backend,
                                                          Device* device,
                                                          const CommOptions& options = {});

// True when the environment says this process is one of several MPI ranks.
bool launched_with_multiple_ranks();

// --- ZeRO-3 partitioning --------------------------------------------------------------------
// A flat group of `numel` elements split over `world_size` ranks. Every shard has the same
// size, a multiple of `alignment` bytes (e.g. 4096 for O_DIRECT), so the padded group is
// world_size * shard_numel elements, the smallest multiple of world_size * alignment/elsize
// that holds numel. Rank r owns elements [offset(r), offset(r) + shard_numel) of the padded
// group, of which valid(r) are real (the rest is padding, kept zero by the caller).
struct ShardLayout {
  size_t numel = 0;  // real elements in the group
  int world_size = 1;
  size_t shard_numel = 0;   // elements per shard, padding included
  size_t padded_numel = 0;  // world_size * shard_numel

  size_t offset(int r) const { return static_cast<size_t>(r) * shard_numel; }
  size_t valid(int r) const {
    size_t off = offset(r);
    return off >= numel ? 0 : (numel - off < shard_numel ? numel - off : shard_numel);
  }
  size_t shard_bytes(DType t) const { return shard_numel * dtype_size(t); }

  // kInvalidArgument if world_size < 1, alignment is 0 or not a multiple of the element size.
  static Result<ShardLayout> make(size_t numel, int world_size, size_t alignment, DType dtype);
};

// --- `strata probe comm` ----------------------------------------------------------------------
// Bus bandwidth of each collective over a range of sizes, reported as nccl-tests does (ops
// all_reduce, all_gather, reduce_scatter, broadcast, and ZeRO++'s all_gather_q8 and
// reduce_scatter_q4, timed with their quantize/dequantize kernels and sized as the plain
// all_gather / fp32 reduce_scatter they replace; see src/comm/zeropp.h):
//   size  = bytes of the largest buffer (all_gather: recv, reduce_scatter: send, others: buf)
//   algbw = size / time;  busbw = algbw * factor, factor = 2(P-1)/P for all_reduce,
//   (P-1)/P for all_gather and reduce_scatter, 1 for broadcast.
// Each case runs `warmup` timed-and-discarded repeats, then `repeats` repeats of `iters`
// back-to-back collectives; a repeat's time is the slowest rank's (all_reduce max), the case
// reports the median, min and max over repeats, in microseconds per collective.
//
// Profile JSON (format version 1), written by rank 0:
//   {"magic": "strata-comm-probe", "version": 1, "backend", "world_size", "dtype",
//    "cases": [{"op", "bytes", "count", "dtype", "reduce", "time_us_median", "time_us_min",
//               "time_us_max", "algbw_gbps", "busbw_gbps", "time_us": [per repeat]}...]}
inline constexpr int kCommProbeFormatVersion = 1;

struct CommProbeOptions {
  std::string backend = "auto";
  size_t min_bytes = size_t{1} << 10;
  size_t max_bytes = size_t{256} << 20;  // sizes double from min to max
  DType dtype = DType::kF32;
  std::vector<std::string> ops = {"all_reduce", "all_gather", "reduce_scatter", "broadcast"};
  int warmup = 1;
  int repeats = 5;
  double target_seconds = 0.05;  // iters per repeat ~ target / (estimated time), 1..100
  std::string json_path;         // "" = no file
  double timeout_s = 300.0;
  int ranks_per_node = 0;  // reduce_scatter_q4's nodes (strata.comm.ranks_per_node); 0: hosts
};

struct CommProbeCase {
  std::string op;
  size_t bytes = 0, count = 0;
  int iters = 0;
  std::vector<double> time_us;  // per timed repeat
  double median_us = 0, min_us = 0, max_us = 0;
  double algbw = 0, busbw = 0;  // GB/s (1e9), from the median
};

struct CommProbeReport {
  std::string backend;
  int world_size = 1;
  DType dtype = DType::kF32;
  std::vector<CommProbeCase> cases;
};

// Runs the sweep on `comm` (buffers in comm.buffer_space(), allocated on `device` for kDevice).
// Every rank must call it with the same options. Rank 0 prints the table to `out` (may be
// null) as cases finish.
Result<CommProbeReport> run_comm_probe(const CommProbeOptions& options, Communicator& comm,
                                       Device* device, std::FILE* out);
std::string comm_probe_json(const CommProbeReport& report);
Result<CommProbeReport> parse_comm_probe_json(const std::string& text, const std::string& origin);

// `strata probe comm [options]` (argv[0] is "comm"): parses the flags into CommProbeOptions and
// runs run_comm_probe_command; returns the exit code (0, 1 on a failed Status, 2 on bad usage).
int comm_probe_main(int argc, char** argv);

// The whole command: creates the device (cpu, or cuda for nccl) and communicator from
// `options`, runs the sweep, prints on rank 0 and writes options.json_path from rank 0.
Status run_comm_probe_command(const CommProbeOptions& options);

}  // namespace strata
