// The tier manager's state in and out: fresh initialization, checkpoints (whole or one shard
// per rank, and resharding the shards of another world size) and the weights' checksum. All of
// it moves a sub-group at a time: state whose home the host reaches only through staging (NVMe,
// device memory the host cannot address) goes through one host-tier piece of a sub-group,
// never a module or a shard whole, so the host need does not grow with a module's width either
// (the memory model counts the piece: TierNeeds::HostNeed::state_io_staging). The init asks the
// model for a range of a module's weights at a time (Architecture::init_range,
// HfCheckpointReader::read_range); the parameters are always derived from the master weights,
// a sub-group at a time.
#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "src/tiers/tier_manager_impl.h"
#include "strata/checksum.h"

namespace strata {

namespace {

// Elements [off, off + count) of `part` of module m's state (a range within one sub-group) from
// its home into `data`, or with `store` from `data` into its home. NVMe homes go through a
// host-tier piece of the sub-group's extent, read first unless a sub-group's whole master
// weights or whole first moments are stored (the second half of the extent is then not kept:
// a caller storing whole first moments stores the same sub-group's second moments next, as
// the checkpoint files' order has it); device memory the host cannot address is copied.
Status state_range(Homes& H, Module& m, CheckpointPart part, size_t off, size_t count, void* data,
                   bool store) {
  Device& dev = H.device();
  const bool master = part == CheckpointPart::kMaster;
  Home& h = master ? m.master : m.mom;
  const size_t eb = master ? 4 : m.mom_elem() / 2;
  const size_t whole = (part == CheckpointPart::kSecondMoment ? m.sn : 0) + off;  // home layout
  char* bytes = static_cast<char*>(data);
  if (!H.staged(h)) {
    char* p = static_cast<char*>(h.ptr()) + whole * eb;
    std::memcpy(store ? p : bytes, store ? bytes : p, count * eb);
    return Status::ok();
  }
  if (h.tier == Tier::kDevice) {
    char* p = static_cast<char*>(h.dev) + whole * eb;
    if (store) {
      dev.copy_h2d(dev.h2d_stream(), p, bytes, count * eb);
      return dev.synchronize(dev.h2d_stream());
    }
    dev.copy_d2h(dev.d2h_stream(), bytes, p, count * eb);
    return dev.synchronize(dev.d2h_stream());
  }
  const size_t j = off / m.sub_group, len = m.sub_len(j), r = off - m.sub_start(j);
  STRATA_CHECK(r + count <= len, "a state range spans sub-groups");
  // The extent's layout: the sub-group's first moments, then its second.
  const size_t in = (part == CheckpointPart::kSecondMoment ? len : 0) + r;
  STRATA_ASSIGN_OR_RETURN(
      PinnedBuffer b, H.host_buf(piece_bytes(len, master ? 4 : m.mom_elem()), "checkpoint staging"),
      "staging a sub-group");
  IoWorker* io = H.io();
  const SwapExtent& e = h.subs[j];
  if (!store || count < len || part == CheckpointPart::kSecondMoment) {
    STRATA_RETURN_IF_ERROR(io->wait(io->read(e, b.data())), "reading its home");
  }
  if (!store) {
    std::memcpy(bytes, b.as<char>() + in * eb, count * eb);
    return Status::ok();
  }
  std::memcpy(b.as<char>() + in * eb, bytes, count * eb);
  return io->wait(io->write(e, b.data())).with_context("writing its home");
}

// Stores `part` for elements [off, off + count) of the shard, any range: state_range per
// sub-group it touches.
Status store_range(Homes& H, Module& m, CheckpointPart part, size_t off, size_t count,
                   const void* data) {
  const size_t eb = part == CheckpointPart::kMaster ? 4 : m.mom_elem() / 2;
  const char* bytes = static_cast<const char*>(data);
  for (size_t x = off; x < off + count;) {
    const size_t j = x / m.sub_group, e = std::min(off + count, m.sub_start(j) + m.sub_len(j));
    STRATA_RETURN_IF_ERROR(state_range(H, m, part, x, e - x,
                                       const_cast<char*>(bytes + (x - off) * eb), /*store=*/true),
                           fmt::format("sub-group {}", j));
    x = e;
  }
  return Status::ok();
}

// Fresh state is written across the machine's cores, in chunks of this many elements: the init
// functions are position-addressed (the same bits whatever the split, TierManager::InitFn), and
// the first touch of a fresh home (the kernel's page faults, on a virtual machine also the
// hypervisor's) is most of a large model's start-up.
constexpr size_t kInitChunk = size_t{1} << 20;

// init(m, begin, count, out), a chunk per task; the first failure is the result.
Status init_parallel(const TierManager::InitFn& init, int m, size_t begin, size_t count,
                     float* out) {
  if (count <= kInitChunk) return init(m, begin, count, out);
  std::mutex mu;
  Status first;
  tbb::parallel_for(tbb::blocked_range<size_t>(0, count, kInitChunk), [&](const auto& r) {
    Status st = init(m, begin + r.begin(), r.size(), out + r.begin());
    if (st.is_ok()) return;
    std::lock_guard<std::mutex> lock(mu);
    if (first.is_ok()) first = std::move(st);
  });
  return first;
}

// memset(p, 0, bytes) across the cores (a fresh home's first touch).
void zero_parallel(void* p, size_t bytes) {
  auto* b = static_cast<char*>(p);
  tbb::parallel_for(tbb::blocked_range<size_t>(0, bytes, kInitChunk * 4),
                    [&](const auto& r) { std::memset(b + r.begin(), 0, r.size()); });
}

// Home h of module m (elem_bytes per element) all zero: NVMe extents written a sub-group at a
// time from one zeroed host piece, unless `nvme_reads_zero` (nothing has been written to the
// swap files since they were made: SwapSpace makes each a new file, sized by ftruncate and
// posix_fallocate, whose extents read as zeros until written); device memory the host cannot
// address cleared on the compute stream (ordered before any later use of it there).
Status zero_home(Homes& H, Module& m, Home& h, size_t elem_bytes, bool nvme_reads_zero = false) {
  Device& dev = H.device();
  if (h.tier == Tier::kNvme) {
    if (nvme_reads_zero) return Status::ok();
    STRATA_ASSIGN_OR_RETURN(PinnedBuffer zeros,
                            H.host_buf(piece_bytes(m.sub_len(0), elem_bytes), "zeroing state"),
                            "staging zeros");
    std::memset(zeros.data(), 0, zeros.size());
    for (const SwapExtent& e : h.subs) {
      STRATA_RETURN_IF_ERROR(H.io()->wait(H.io()->write(e, zeros.data())), "writing zeros");
    }
  } else if (H.staged(h)) {
    dev.memset_zero(dev.compute_stream(), h.dev, h.bytes);
  } else {
    zero_parallel(h.ptr(), h.bytes);
  }
  return Status::ok();
}

// Sub-group j's master weights in host memory: in their home when the host can address it,
// else read (NVMe) or copied (device memory) into `piece` (a host-tier buffer of one
// sub-group, taken on first use).
Result<const float*> master_sub_group(Homes& H, Module& m, size_t j, PinnedBuffer* piece) {
  const size_t a = m.sub_start(j), len = m.sub_len(j);
  if (!H.staged(m.master)) return static_cast<const float*>(m.master.ptr()) + a;
  if (piece->size() == 0) {
    STRATA_ASSIGN_OR_RETURN(*piece, H.host_buf(piece_bytes(m.sub_len(0), 4), "master staging"),
                            "staging " + m.name + " master weights");
  }
  if (m.master.tier == Tier::kNvme) {
    STRATA_RETURN_IF_ERROR(H.io()->wait(H.io()->read(m.master.subs[j], piece->data())),
                           fmt::format("reading {} master weights (sub-group {})", m.name, j));
  } else {  // device memory the host cannot address
    Device& dev = H.device();
    STRATA_RETURN_IF_ERROR(dev.synchronize(dev.compute_stream()),
                           fmt::format("waiting for {} master weights on the device", m.name));
    dev.copy_d2h(dev.d2h_stream(), piece->data(), static_cast<float*>(m.master.dev) + a, len * 4);
    STRATA_RETURN_IF_ERROR(dev.synchronize(dev.d2h_stream()),
                           "copying " + m.name + " master weights from the device");
  }
  return piece->as<float>();
}

const char* part_name(CheckpointPart p) {
  return p == CheckpointPart::kMaster        ? "master weights"
         : p == CheckpointPart::kFirstMoment ? "first moments"
                                             : "second moments";
}

// A frozen module's parameters (it has no master weights): `init`'s fp32 values a sub-group at a
// time through one host piece, converted into its parameter home. A module stored in another
// form (`fill`, Architecture::stored_fill) is its stored bytes instead, made from `init`'s values.
Status init_frozen(Homes& H, OptimizerPipeline& pipeline, int i, const TierManager::InitFn& init,
                   const Architecture::StoredFillFn& fill, DType dt) {
  Module& m = H.module(i);
  STRATA_ASSIGN_OR_RETURN(PinnedBuffer piece, H.host_buf(piece_bytes(m.sub_len(0), 4), "init"),
                          "staging its parameters");
  float* w = piece.as<float>();
  const size_t es = dtype_size(dt);
  for (size_t j = 0; j < m.sub_groups(); ++j) {
    const size_t a = m.sub_start(j), len = m.sub_len(j);
    if (fill) {
      auto values = [&](size_t b, size_t c, float* out) { return init(i, b, c, out); };
      STRATA_RETURN_IF_ERROR(fill((m.off + a) * es, len * es, piece.as<uint8_t>(), values), "");
      STRATA_RETURN_IF_ERROR(pipeline.write_stored_params(i, j, piece.data()), "");
      continue;
    }
    const size_t real = a < m.valid ? std::min(len, m.valid - a) : 0;
    if (real > 0) STRATA_RETURN_IF_ERROR(init(i, m.off + a, real, w), "");
    std::fill(w + real, w + len, 0.0f);
    STRATA_RETURN_IF_ERROR(pipeline.write_params(i, j, w), "");
  }
  return Status::ok();
}

}  // namespace

Status TierManager::init_state(const InitFn& init) {
  Impl& I = *impl_;
  Homes& H = *I.homes;
  I.pipeline->drop_kept();  // the homes are written here
  // Fresh swap files: each home's extents are its own, so the moments' extents still read as
  // zeros when earlier modules' master weights have been written.
  const bool nvme_fresh = H.io() == nullptr || H.io()->bytes_queued() == 0;
  for (size_t i = 0; i < H.modules().size(); ++i) {
    Module& m = H.module(int(i));
    const std::string what = "initializing " + m.name;
    if (m.frozen()) {  // parameters only: from `init` a sub-group at a time through one piece
      STRATA_RETURN_IF_ERROR(init_frozen(H, *I.pipeline, int(i), init, I.stored_fill[i], I.dt),
                             what);
      continue;
    }
    if (m.master.tier == Tier::kDevice || m.mom.tier == Tier::kDevice) {
      STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.compute_stream()), what);
    }
    // Moments start at zero (NVMe: nothing to write in fresh swap files, else from one zeroed
    // piece, returned before the master weights' piece is taken).
    STRATA_RETURN_IF_ERROR(zero_home(H, m, m.mom, m.mom_elem(), nvme_fresh),
                           what + " (its moments)");
    if (m.gacc.tier == Tier::kDevice && H.staged(m.gacc)) {  // the host cannot address it
      I.dev.memset_zero(I.dev.compute_stream(), m.gacc.dev, m.gacc.bytes);
    } else if (m.gacc.tier != Tier::kNvme) {
      zero_parallel(m.gacc.ptr(), m.gacc.bytes);
    }
    // The master weights: this rank's real elements [m.off, m.off + m.valid) of the module
    // from `init`, the shard's padding zero. A home the host can address is filled in place;
    // else a sub-group at a time through one host piece, each written to its home and its
    // parameters derived before the next.
    if (!H.staged(m.master)) {
      float* master = static_cast<float*>(m.master.ptr());
      if (m.valid > 0) {
        STRATA_RETURN_IF_ERROR(init_parallel(init, int(i), m.off, m.valid, master), what);
      }
      std::fill(master + m.valid, master + m.sn, 0.0f);
      STRATA_RETURN_IF_ERROR(I.pipeline->write_params(int(i), master), what);
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(PinnedBuffer piece, H.host_buf(piece_bytes(m.sub_len(0), 4), "init"),
                            what + " (staging its master weights)");
    float* master = piece.as<float>();
    for (size_t j = 0; j < m.sub_groups(); ++j) {
      const size_t a = m.sub_start(j), len = m.sub_len(j);
      const size_t real = a < m.valid ? std::min(len, m.valid - a) : 0;
      if (real > 0) {
        STRATA_RETURN_IF_ERROR(init_parallel(init, int(i), m.off + a, real, master), what);
      }
      std::fill(master + real, master + len, 0.0f);
      if (m.master.tier == Tier::kNvme) {  // a sub-group's extent, from the whole piece
        STRATA_RETURN_IF_ERROR(H.io()->wait(H.io()->write(m.master.subs[j], master)),
                               what + " (writing its master weights)");
      } else {  // device memory the host cannot address
        I.dev.copy_h2d(I.dev.h2d_stream(), static_cast<float*>(m.master.dev) + a, master, len * 4);
        STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.h2d_stream()), what);
      }
      STRATA_RETURN_IF_ERROR(I.pipeline->write_params(int(i), j, master), what);
    }
  }
  return I.dev.synchronize(I.dev.compute_stream()).with_context("initializing the state");
}

Status TierManager::save(const std::string& path, const CheckpointMeta& meta) {
  Impl& I = *impl_;
  STRATA_RETURN_IF_ERROR(flush_writes(), "before the checkpoint");
  // Device-resident state may still be stepped by the device's optimizer (compute stream).
  STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.compute_stream()), "before the checkpoint");
  Homes& H = *I.homes;
  // A sub-group at a time, so no module's state is ever staged whole.
  auto range = [&](size_t i) { return H.modules()[i].sub_group; };
  auto read = [&](size_t i, CheckpointPart part, size_t off, size_t count, void* out) -> Status {
    Module& m = H.module(int(i));
    return state_range(H, m, part, off, count, out, /*store=*/false)
        .with_context(fmt::format("saving {} {}", m.name, part_name(part)));
  };
  if (!I.sharded) return write_checkpoint_ranges(path, meta, range, read);
  // A shard file: this rank's real elements of each module (its shard's head; the padding is
  // not saved), with where they start.
  CheckpointMeta shard = meta;
  shard.world_size = opt_.param_comm->size();
  shard.rank = opt_.param_comm->rank();
  for (size_t i = 0; i < H.modules().size(); ++i) {
    const Module& m = H.modules()[i];
    shard.modules[i].numel = m.frozen() ? 0 : m.valid;  // a frozen module saves nothing
    shard.modules[i].offset = m.frozen() ? 0 : m.off;
  }
  return write_checkpoint_ranges(path, shard, range, read);
}

Status TierManager::load(const std::string& path) {
  Impl& I = *impl_;
  STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.compute_stream()), "before loading");
  STRATA_RETURN_IF_ERROR(flush_writes(), "before loading a checkpoint");
  I.pipeline->drop_kept();  // the homes are written here
  Homes& H = *I.homes;
  // A sub-group at a time into the homes; each sub-group's parameters are derived from its
  // master weights as they arrive.
  auto range = [&](size_t i) { return H.modules()[i].sub_group; };
  auto write = [&](size_t i, CheckpointPart part, size_t off, size_t count, void* in) -> Status {
    Module& m = H.module(int(i));
    const std::string what = fmt::format("loading {} {}", m.name, part_name(part));
    STRATA_RETURN_IF_ERROR(state_range(H, m, part, off, count, in, /*store=*/true), what);
    if (part != CheckpointPart::kMaster) return Status::ok();
    STRATA_CHECK(off % m.sub_group == 0 && count == m.sub_len(off / m.sub_group),
                 "an unsharded checkpoint range is one whole sub-group");
    return I.pipeline->write_params(int(i), off / m.sub_group, static_cast<const float*>(in))
        .with_context(what);
  };
  return read_checkpoint_ranges(path, range, write);
}

Status TierManager::load_shards(const std::vector<std::string>& paths) {
  Impl& I = *impl_;
  Homes& H = *I.homes;
  std::vector<Module>& mods = H.modules();
  const size_t M = mods.size();
  std::vector<size_t> covered(M, 0);
  STRATA_RETURN_IF_ERROR(flush_writes(), "before loading a checkpoint");
  I.pipeline->drop_kept();  // the homes are written here
  // Device-resident state may still be stepped by the device's optimizer (compute stream).
  STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.compute_stream()), "before loading");
  // Padding and anything not covered start at zero.
  for (Module& m : mods) {
    if (m.frozen()) continue;
    STRATA_RETURN_IF_ERROR(zero_home(H, m, m.master, 4), "clearing " + m.name + " master weights");
    STRATA_RETURN_IF_ERROR(zero_home(H, m, m.mom, m.mom_elem()), "clearing " + m.name + " moments");
  }
  // Device memory is cleared on the compute stream; the loads below copy on the h2d stream.
  STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.compute_stream()), "clearing the state");
  for (const auto& path : paths) {
    STRATA_ASSIGN_OR_RETURN(CheckpointMeta meta, read_checkpoint_meta(path), "loading shards");
    if (meta.modules.size() != M) {
      return invalid_argument(
          fmt::format("{}: {} modules, the model has {}", path, meta.modules.size(), M));
    }
    for (size_t i = 0; i < M; ++i) {
      const size_t n = meta.modules[i].numel;
      // n == 0: a shard that is all padding (its offset may lie past the end).
      if (meta.modules[i].name != mods[i].name ||
          (n > 0 && meta.modules[i].offset + n > mods[i].numel)) {
        return invalid_argument(fmt::format(
            "{}: module {} '{}' elements [{}, {}) do not fit this model's '{}' ({} elements)", path,
            i, meta.modules[i].name, meta.modules[i].offset, meta.modules[i].offset + n,
            mods[i].name, mods[i].numel));
      }
    }
    // Each range of the old shard (a sub-group's worth of elements at a time) goes to the
    // part of it this rank owns: the overlap of [o_lo, o_hi) with [m.off, m.off + m.valid).
    auto range = [&](size_t i) { return mods[i].sub_group; };
    auto write = [&](size_t i, CheckpointPart part, size_t off, size_t count, void* in) -> Status {
      Module& m = mods[i];
      const size_t eb = part == CheckpointPart::kMaster ? 4 : m.mom_elem() / 2;
      const size_t o_lo = meta.modules[i].offset + off;  // module elements [o_lo, o_lo + count)
      const size_t lo = std::max(o_lo, m.off), hi = std::min(o_lo + count, m.off + m.valid);
      if (lo >= hi) return Status::ok();
      if (part == CheckpointPart::kMaster) covered[i] += hi - lo;
      return store_range(H, m, part, lo - m.off, hi - lo,
                         static_cast<const char*>(in) + (lo - o_lo) * eb)
          .with_context(fmt::format("loading {} {}", m.name, part_name(part)));
    };
    STRATA_RETURN_IF_ERROR(read_checkpoint_ranges(path, range, write), "");  // names the path
  }
  for (size_t i = 0; i < M; ++i) {
    Module& m = mods[i];
    if (m.frozen()) continue;  // its parameters are the base's, from init_state
    if (covered[i] != m.valid) {
      return invalid_argument(fmt::format(
          "checkpoint files {} hold {} of the {} elements of {} this rank owns; a shard file "
          "is missing or duplicated (resume from the manifest strata train wrote)",
          paths.front(), covered[i], m.valid, m.name));
    }
    // The parameters, derived a sub-group at a time from the loaded master weights.
    PinnedBuffer piece;
    for (size_t j = 0; j < m.sub_groups(); ++j) {
      STRATA_ASSIGN_OR_RETURN(const float* master, master_sub_group(H, m, j, &piece),
                              "reading " + m.name);
      STRATA_RETURN_IF_ERROR(I.pipeline->write_params(int(i), j, master),
                             "deriving " + m.name + " parameters");
    }
  }
  return Status::ok();
}

uint32_t TierManager::weights_crc() {
  Impl& I = *impl_;
  if (!flush_writes().is_ok()) return 0;
  uint32_t crc = 0;  // CRC32C chains: the real elements in order, whatever the pieces
  for (size_t i = 0; i < I.homes->modules().size(); ++i) {
    Module& m = I.homes->module(int(i));
    if (m.frozen()) continue;  // never changes
    if (m.master.tier == Tier::kDevice && !I.dev.synchronize(I.dev.compute_stream()).is_ok()) {
      return 0;  // the device's optimizer step must have run
    }
    if (!I.homes->staged(m.master)) {
      crc = crc32c(crc, m.master.ptr(), m.valid * 4);
      continue;
    }
    PinnedBuffer piece;  // a sub-group at a time
    for (size_t j = 0; j < m.sub_groups() && m.sub_start(j) < m.valid; ++j) {
      auto master = master_sub_group(*I.homes, m, j, &piece);
      if (!master.is_ok()) return 0;
      crc = crc32c(crc, *master, std::min(m.sub_len(j), m.valid - m.sub_start(j)) * 4);
    }
  }
  return crc;
}

}  // namespace strata
