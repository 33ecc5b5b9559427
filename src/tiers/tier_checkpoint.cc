// The tier manager's state in and out: fresh initialization, checkpoints (whole or one shard
// per rank) and the weights' checksum. Checkpoints move state a sub-group at a time through the
// host tier (NVMe homes are staged a sub-group extent at a time, never a module whole); the
// init stages one module's master weights (the model initializes a module at once), resharding
// (load_shards) one module's shard; the parameters are always derived from the master weights.
#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "src/tiers/tier_manager_impl.h"
#include "strata/checksum.h"

namespace strata {

Status TierManager::init_state(const InitFn& init) {
  Impl& I = *impl_;
  Homes& H = *I.homes;
  for (size_t i = 0; i < H.modules().size(); ++i) {
    Module& m = H.module(int(i));
    const std::string what = "initializing " + m.name;
    if (m.master.tier == Tier::kDevice || m.mom.tier == Tier::kDevice) {
      STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.compute_stream()), what);
    }
    // Moments start at zero: NVMe extents are written a sub-group at a time from one zeroed
    // piece (returned before the master weights' piece is taken).
    if (m.mom.tier == Tier::kNvme) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer zeros,
                              H.host_buf(piece_bytes(m.sub_len(0), m.mom_elem()), "init"),
                              what + " (staging its moments)");
      std::memset(zeros.data(), 0, zeros.size());
      for (const SwapExtent& e : m.mom.subs) {
        STRATA_RETURN_IF_ERROR(H.io()->wait(H.io()->write(e, zeros.data())),
                               what + " (writing its moments)");
      }
    } else if (H.staged(m.mom)) {
      I.dev.memset_zero(I.dev.compute_stream(), m.mom.dev, m.mom.bytes);
    } else {
      std::memset(m.mom.ptr(), 0, m.mom.bytes);
    }
    if (m.gacc.tier == Tier::kDevice && H.staged(m.gacc)) {  // the host cannot address it
      I.dev.memset_zero(I.dev.compute_stream(), m.gacc.dev, m.gacc.bytes);
    } else if (m.gacc.tier != Tier::kNvme) {
      std::memset(m.gacc.ptr(), 0, m.gacc.bytes);
    }
    // The master weights: this rank's real elements [m.off, m.off + m.valid) of the module
    // from `init`, the shard's padding zero. A home the host can address is filled in place;
    // else a sub-group at a time through one host piece, each written to its home and its
    // parameters derived before the next.
    if (!H.staged(m.master)) {
      float* master = static_cast<float*>(m.master.ptr());
      if (m.valid > 0) STRATA_RETURN_IF_ERROR(init(int(i), m.off, m.valid, master), what);
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
      if (real > 0) STRATA_RETURN_IF_ERROR(init(int(i), m.off + a, real, master), what);
      std::fill(master + real, master + len, 0.0f);
      if (m.master.tier == Tier::kNvme) {  // a sub-group's extent, from the whole piece
        STRATA_RETURN_IF_ERROR(H.io()->wait(H.io()->write(m.master.subs[j], master)),
                               what + " (writing its master weights)");
      } else {  // device memory the host cannot address
        I.dev.copy_h2d(I.dev.h2d_stream(), static_cast<float*>(m.master.dev) + a, master,
                       len * 4);
        STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.h2d_stream()), what);
      }
      STRATA_RETURN_IF_ERROR(I.pipeline->write_params(int(i), j, master), what);
    }
  }
  return I.dev.synchronize(I.dev.compute_stream()).with_context("initializing the state");
}

namespace {

// Elements [off, off + count) of `part` of module m's state (a range within one sub-group) from
// its home into `data`, or with `store` from `data` into its home. NVMe homes go through a
// host-tier piece of the sub-group's extent (read first unless the whole first half of a
// sub-group's moments or its whole master weights are stored); device memory the host cannot
// address is copied.
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
  const size_t j = off / m.sub_group, len = m.sub_len(j);
  STRATA_CHECK(off == m.sub_start(j) && count <= len, "a checkpoint range spans sub-groups");
  const size_t in = part == CheckpointPart::kSecondMoment ? len : 0;  // the extent's layout
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

const char* part_name(CheckpointPart p) {
  return p == CheckpointPart::kMaster        ? "master weights"
         : p == CheckpointPart::kFirstMoment ? "first moments"
                                             : "second moments";
}

}  // namespace

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
    shard.modules[i].numel = H.modules()[i].valid;
    shard.modules[i].offset = H.modules()[i].off;
  }
  return write_checkpoint_ranges(path, shard, range, read);
}

Status TierManager::load(const std::string& path) {
  Impl& I = *impl_;
  STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.compute_stream()), "before loading");
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
  std::vector<Module>& mods = I.homes->modules();
  const size_t M = mods.size(), mb = dtype_size(I.mdt);
  std::vector<size_t> covered(M, 0);
  // This rank's master and moments of module i in host memory (NVMe homes are read into
  // staging and written back: read-modify-write per old file).
  auto with_state = [&](size_t i, bool read, bool write,
                        const std::function<void(float*, char*)>& fn) -> Status {
    HostState hs;
    STRATA_RETURN_IF_ERROR(I.homes->host_state(i, read, "checkpoint staging", &hs),
                           read ? "reading the shard" : "staging the shard");
    fn(hs.master, hs.moments);
    if (write) STRATA_RETURN_IF_ERROR(I.homes->write_back(i, hs), "writing the shard back");
    return Status::ok();
  };
  STRATA_RETURN_IF_ERROR(flush_writes(), "before loading a checkpoint");
  for (size_t i = 0; i < M; ++i) {  // padding and anything not covered start at zero
    STRATA_RETURN_IF_ERROR(with_state(i, false, true,
                                      [&](float* master, char* moments) {
                                        std::memset(master, 0, mods[i].master.bytes);
                                        std::memset(moments, 0, mods[i].mom.bytes);
                                      }),
                           "clearing " + mods[i].name);
  }
  for (const auto& path : paths) {
    STRATA_ASSIGN_OR_RETURN(CheckpointMeta meta, read_checkpoint_meta(path), "loading shards");
    if (meta.modules.size() != M) {
      return invalid_argument(
          fmt::format("{}: {} modules, the model has {}", path, meta.modules.size(), M));
    }
    std::vector<float> st_master;
    std::vector<char> st_m, st_v;
    auto staging = [&](size_t i, CheckpointBuffers* out) -> Status {
      const size_t n = meta.modules[i].numel;
      // n == 0: a shard that is all padding (its offset may lie past the end).
      if (meta.modules[i].name != mods[i].name ||
          (n > 0 && meta.modules[i].offset + n > mods[i].numel)) {
        return invalid_argument(fmt::format(
            "{}: module {} '{}' elements [{}, {}) do not fit this model's '{}' ({} elements)", path,
            i, meta.modules[i].name, meta.modules[i].offset, meta.modules[i].offset + n,
            mods[i].name, mods[i].numel));
      }
      st_master.resize(n);
      st_m.resize(n * mb);
      st_v.resize(n * mb);
      *out = {st_master.data(), st_m.data(), st_v.data(), mb};
      return Status::ok();
    };
    auto sink = [&](size_t i, const CheckpointBuffers& b) -> Status {
      Module& m = mods[i];
      const size_t o_lo = meta.modules[i].offset, o_hi = o_lo + meta.modules[i].numel;
      const size_t lo = std::max(o_lo, m.off), hi = std::min(o_hi, m.off + m.valid);
      if (lo >= hi) return Status::ok();
      covered[i] += hi - lo;
      return with_state(
                 i, true, true,
                 [&](float* master, char* moments) {
                   std::memcpy(master + (lo - m.off), b.master + (lo - o_lo), (hi - lo) * 4);
                   std::memcpy(moments + (lo - m.off) * mb,
                               static_cast<const char*>(b.m) + (lo - o_lo) * mb, (hi - lo) * mb);
                   std::memcpy(moments + (m.sn + lo - m.off) * mb,
                               static_cast<const char*>(b.v) + (lo - o_lo) * mb, (hi - lo) * mb);
                 })
          .with_context("loading " + m.name);
    };
    STRATA_RETURN_IF_ERROR(read_checkpoint(path, staging, sink), "");  // names the path
  }
  for (size_t i = 0; i < M; ++i) {
    if (covered[i] != mods[i].valid) {
      return invalid_argument(fmt::format(
          "checkpoint files {} hold {} of the {} elements of {} this rank owns; a shard file "
          "is missing or duplicated (resume from the manifest strata train wrote)",
          paths.front(), covered[i], mods[i].valid, mods[i].name));
    }
    Status ws;
    STRATA_RETURN_IF_ERROR(
        with_state(i, true, false,
                   [&](float* master, char*) { ws = I.pipeline->write_params(int(i), master); }),
        "reading " + mods[i].name);
    STRATA_RETURN_IF_ERROR(ws, "deriving " + mods[i].name + " parameters");
  }
  return Status::ok();
}

uint32_t TierManager::weights_crc() {
  Impl& I = *impl_;
  if (!flush_writes().is_ok()) return 0;
  uint32_t crc = 0;  // CRC32C chains: the real elements in order, whatever the pieces
  for (size_t i = 0; i < I.homes->modules().size(); ++i) {
    Module& m = I.homes->module(int(i));
    if (m.master.tier == Tier::kDevice && !I.dev.synchronize(I.dev.compute_stream()).is_ok()) {
      return 0;  // the device's optimizer step must have run
    }
    if (!I.homes->staged(m.master)) {
      crc = crc32c(crc, m.master.ptr(), m.valid * 4);
      continue;
    }
    // A sub-group at a time through one host piece.
    auto b = I.homes->host_buf(piece_bytes(m.sub_len(0), 4), "crc");
    if (!b.is_ok()) return 0;
    for (size_t j = 0; j < m.sub_groups() && m.sub_start(j) < m.valid; ++j) {
      const size_t a = m.sub_start(j), len = m.sub_len(j);
      if (m.master.tier == Tier::kNvme) {
        if (!I.homes->io()->wait(I.homes->io()->read(m.master.subs[j], b->data())).is_ok()) {
          return 0;
        }
      } else {  // device memory the host cannot address
        I.dev.copy_d2h(I.dev.d2h_stream(), b->data(), static_cast<float*>(m.master.dev) + a,
                       len * 4);
        if (!I.dev.synchronize(I.dev.d2h_stream()).is_ok()) return 0;
      }
      crc = crc32c(crc, b->data(), std::min(len, m.valid - a) * 4);
    }
  }
  return crc;
}

}  // namespace strata
