// Checkpoints: the full training state in one self-checking file.
//
// Layout (little-endian):
//   0   char[8]  magic "STRATACK"
//   8   u32      format version (kCheckpointVersion)
//   12  u32      metadata length J (bytes of JSON)
//   16  u32      CRC32C of the metadata
//   20  u32      CRC32C of the payload
//   24  u64      payload length P
//   32  J bytes  metadata JSON: step counters, loss-scaler state, model shape, dtypes, which
//                optimizer's state the moments are, and each module's name and element count
//                (its stable id)
//   32+J P bytes payload: per module in order, fp32 master weights, then the first and second
//                moments in the moment dtype
// The payload CRC is computed while streaming and the header is written last (at offset 0).
// A file is written as <name>.tmp (created with O_EXCL | O_NOFOLLOW after removing whatever
// sat at that name, so a planted link is never followed), fsynced, renamed over <name>, and the
// directory fsynced: a crash mid-write never leaves a file that looks valid. Before writing,
// the file system must have room for the whole file (a no-space error gives both byte counts).
// Truncated files, a wrong magic or version, a checksum mismatch, and metadata whose values
// have the wrong type or range (negative step, opt_steps above step, sizes that overflow, an
// optimizer state no optimizer keeps) are refused with a message naming the file and the offset.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "strata/status.h"

namespace strata {

inline constexpr uint32_t kCheckpointVersion = 1;

// In a rank's shard file (ZeRO-3, world_size > 1) `numel` is the number of the module's real
// elements this file holds and `offset` where they start in the module; a whole-model file has
// offset 0 and the module's full numel.
struct CheckpointModule {
  std::string name;
  size_t numel = 0;
  size_t offset = 0;
};

struct CheckpointMeta {
  int64_t step = 0;       // training steps completed
  int64_t opt_steps = 0;  // optimizer steps taken (steps minus skipped overflow steps)
  double loss_scale = 1.0;
  int64_t scaler_cur_iter = 0;
  int64_t scaler_last_overflow_iter = -1;
  int scaler_cur_hysteresis = 1;
  std::string model_shape;  // "L=4 NH=4 C=128 V=256 Vp=256 T=64 tied=1"
  std::string moment_dtype;
  // What the moments hold: the name of an OptimizerState (include/strata/optimizer.h), "adam",
  // "adagrad" or "lion"; a resume refuses a config whose optimizer keeps another state. ""
  // (not written) in files written before it was recorded.
  std::string optimizer_state;
  uint64_t seed = 0;
  // The batch it was trained with: sequences per micro-batch per rank
  // (train_micro_batch_size_per_gpu) and gradient_accumulation_steps. 0 in files written before
  // they were recorded. A step's samples are picked by micro-batch index and by position across
  // the ranks' micro-batches, so a resume that changes either steps through other samples.
  int64_t micro_batch = 0;
  int64_t accumulation = 0;
  // The steps the learning-rate schedule decays over (scheduler.params.total_num_steps, which
  // "auto" makes train.steps), where it decays over them (WarmupDecayLR, WarmupCosineLR); 0
  // for a schedule that does not, and in files written before it was recorded.
  int64_t schedule_steps = 0;
  // model.pad_token_id of the run (-1: none); -2 in files written before it was recorded.
  int64_t pad_token_id = -2;
  // Sharded checkpoints: one file per rank, "<name>.rank<R>-of-<N>", each holding that rank's
  // shard of every module; "<name>" is then a manifest (JSON: magic "strata-shards", world_size,
  // step, and the shard file names) that `latest` points at. Whole-model files: 1 and 0.
  int world_size = 1;
  int rank = 0;
  std::vector<CheckpointModule> modules;
  // The lineage: a fresh run draws a new id, a resumed run keeps its checkpoint's. Pruning
  // removes only checkpoints of the writer's lineage (src/train/checkpoint_dir.h). "" in files
  // written before lineages existed: never pruned.
  std::string run_id;
};

// A shard manifest (or, for a whole-model checkpoint, just its path in `files`).
struct ShardManifest {
  int world_size = 1;
  int64_t step = -1;   // -1: not a manifest
  std::string run_id;  // the lineage, as in CheckpointMeta
  std::vector<std::string> files;
};

// The shard file of `rank` for checkpoint `path` of a `world_size`-rank run.
std::string shard_file_path(const std::string& path, int rank, int world_size);
// Writes the manifest at `path` (atomically) naming the shard files of a `world_size` run.
Status write_shard_manifest(const std::string& path, int64_t step, int world_size,
                            const std::string& run_id);
// If `path` is a manifest, its fields and the shard files it names (in rank order, with their
// directory; only the names strata writes, "<name>.rank<R>-of-<N>", are accepted); if it is a
// whole-model checkpoint, {path}. Fails naming the path if it is neither.
Result<ShardManifest> read_shard_manifest(const std::string& path);
// read_shard_manifest(path).files.
Result<std::vector<std::string>> checkpoint_files(const std::string& path);
// The size of the checkpoint file write_checkpoint writes for `meta` (header, metadata,
// payload): what the preflight checks the checkpoint directory for.
uint64_t checkpoint_file_bytes(const CheckpointMeta& meta);

// One module's state in memory: where the writer reads it from, or the reader puts it.
struct CheckpointBuffers {
  float* master;        // numel fp32
  void* m;              // numel x moment bytes (null: written as zeros / skipped on read)
  void* v;              // likewise
  size_t moment_bytes;  // bytes per moment element (4 fp32, 2 bf16)
};

// Streaming access, so offloaded state never has to be in memory all at once:
// the writer asks `source(i, &b)` for module i's buffers just before writing them (they must
// stay valid until the next call); the reader asks `staging(i, &b)` for buffers to read module
// i into, then hands them to `sink(i, b)` to store wherever the module's state lives.
using CheckpointSource = std::function<Status(size_t module, CheckpointBuffers* out)>;
using CheckpointSink = std::function<Status(size_t module, const CheckpointBuffers& in)>;

// Writes atomically to `path` (see above), one module at a time.
Status write_checkpoint(const std::string& path, const CheckpointMeta& meta,
                        const CheckpointSource& source);
// Convenience: all modules' buffers at hand. `buffers[i]` belongs to meta.modules[i].
Status write_checkpoint(const std::string& path, const CheckpointMeta& meta,
                        const std::vector<CheckpointBuffers>& buffers);

// Ranged streaming, so no module has to be in memory whole either: module i's state is three
// arrays in file order (fp32 master weights, first moments, second moments, `numel` elements
// each), moved in ranges [offset, offset + count) of at most range(i) elements. The writer asks
// `read` to fill `data` with each range; the reader verifies the whole checksum first (as
// read_checkpoint), then hands each range to `write`. Same file format.
enum class CheckpointPart { kMaster, kFirstMoment, kSecondMoment };
using CheckpointRangeFn = std::function<Status(size_t module, CheckpointPart part, size_t offset,
                                               size_t count, void* data)>;
Status write_checkpoint_ranges(const std::string& path, const CheckpointMeta& meta,
                               const std::function<size_t(size_t)>& range,
                               const CheckpointRangeFn& read);
Status read_checkpoint_ranges(const std::string& path, const std::function<size_t(size_t)>& range,
                              const CheckpointRangeFn& write);

// Reads and verifies the metadata only (cheap; checks magic, version, sizes, metadata CRC).
Result<CheckpointMeta> read_checkpoint_meta(const std::string& path);

// Verifies the whole payload checksum first (streaming, in small chunks), and only then reads
// module by module into staging buffers and hands each to the sink: a damaged file never
// changes any state. The caller has checked (read_checkpoint_meta) that the modules match.
Status read_checkpoint(const std::string& path, const CheckpointSource& staging,
                       const CheckpointSink& sink);
// Convenience: reads straight into `buffers`.
Status read_checkpoint(const std::string& path, const std::vector<CheckpointBuffers>& buffers);

// The checkpoint `dir`/latest names, or kNotFound (see resolve_latest in
// src/train/checkpoint_dir.h for the fallbacks when it is missing or damaged).
Result<std::string> latest_checkpoint(const std::string& dir);
// A checkpoint file or a sharded checkpoint's manifest as given; a run directory: the
// checkpoint its `latest` names.
Result<std::string> resolve_checkpoint(const std::string& path);
// Atomically points `dir`/latest at `file_name` (latest.tmp, never through a link).
Status set_latest_checkpoint(const std::string& dir, const std::string& file_name);

}  // namespace strata
