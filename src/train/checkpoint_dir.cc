#include "src/train/checkpoint_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "src/base/safe_file.h"
#include "src/train/checkpoint.h"
#include "strata/log.h"

namespace strata {
namespace {

// The step of "ckpt-<digits>.bin", or -1.
int64_t step_of(const std::string& name) {
  constexpr std::string_view kPrefix = "ckpt-", kSuffix = ".bin";
  if (name.size() <= kPrefix.size() + kSuffix.size() || name.rfind(kPrefix, 0) != 0 ||
      name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0) {
    return -1;
  }
  const std::string digits =
      name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  if (digits.empty() || digits.size() > 18 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return -1;
  }
  return std::stoll(digits);
}

std::vector<std::string> dir_names(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (const dirent* e = ::readdir(d)) out.emplace_back(e->d_name);
  ::closedir(d);
  return out;
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void remove_entry(const std::string& dir, const std::string& name,
                  std::vector<std::string>* removed) {
  const std::string p = dir + "/" + name;
  if (::unlink(p.c_str()) == 0) {
    removed->push_back(name);
  } else if (errno != ENOENT) {
    log_warn("checkpoint dir: could not remove {}: {}", p, std::strerror(errno));
  }
}

}  // namespace

std::vector<CheckpointEntry> list_checkpoints(const std::string& dir) {
  std::vector<CheckpointEntry> out;
  for (const std::string& name : dir_names(dir)) {
    const int64_t step = step_of(name);
    if (step < 0) continue;
    CheckpointEntry e{name, step, "", false};
    const std::string path = dir + "/" + name;
    auto man = read_shard_manifest(path);
    if (man.is_ok() && man->step >= 0) {
      e.run_id = man->run_id;
      e.readable = true;
    } else if (man.is_ok()) {
      auto meta = read_checkpoint_meta(path);
      if (meta.is_ok()) {
        e.run_id = meta->run_id;
        e.readable = true;
      }
    }
    out.push_back(std::move(e));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) {
    return a.step != b.step ? a.step < b.step : a.name < b.name;
  });
  return out;
}

Status check_checkpoint_dir(const std::string& dir, uint64_t checkpoint_bytes, int count) {
  const std::string key = fmt::format("train.checkpoint_dir '{}'", dir);
  if (dir.empty()) return invalid_argument("train.checkpoint_dir is empty; give a directory");
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT) return errno_status(errno, key + ": cannot stat it");
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      return Status(ec.value() == ENOSPC ? StatusCode::kNoSpace : StatusCode::kInvalidArgument,
                    fmt::format("{}: cannot create it: {} (errno {}); create it yourself or "
                                "point train.checkpoint_dir somewhere writable",
                                key, ec.message(), ec.value()));
    }
    if (::stat(dir.c_str(), &st) != 0) return errno_status(errno, key + ": cannot stat it");
  }
  if (!S_ISDIR(st.st_mode)) {
    return invalid_argument(fmt::format(
        "{} is not a directory; train.checkpoint_dir must name a directory (strata writes "
        "ckpt-*.bin and latest into it): remove or rename the file, or pick another path",
        key));
  }
  const std::string probe = fmt::format("{}/.strata-probe-{}.tmp", dir, ::getpid());
  auto fd = create_temp_file(probe, 0600);
  if (!fd.is_ok()) {
    return Status(fd.status().code() == StatusCode::kNoSpace ? StatusCode::kNoSpace
                                                             : StatusCode::kInvalidArgument,
                  fmt::format("{} is not writable ({}); fix its permissions, remount it "
                              "read-write, or point train.checkpoint_dir elsewhere",
                              key, fd.status().message()));
  }
  ::close(*fd);
  ::unlink(probe.c_str());
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return errno_status(errno, key + ": statvfs");
  const uint64_t avail = uint64_t(vfs.f_bavail) * vfs.f_frsize;
  const uint64_t need_bytes = checkpoint_bytes * uint64_t(std::max(count, 0));
  if (avail < need_bytes) {
    return no_space(fmt::format(
        "{}: {} needs {} bytes ({}), its file system has {} bytes ({}) free; free space there "
        "or point train.checkpoint_dir at a larger file system",
        key,
        count == 1 ? std::string("a checkpoint")
                   : fmt::format("this run writes {} more checkpoints of {} bytes before it "
                                 "prunes (it keeps {} and saves the next before removing the "
                                 "oldest), which",
                                 count, checkpoint_bytes, kKeepCheckpoints),
        need_bytes, format_bytes(double(need_bytes)), avail, format_bytes(double(avail))));
  }
  return Status::ok();
}

int checkpoints_to_come(const std::string& dir, const std::string& resume, int keep) {
  if (resume.empty()) return keep + 1;
  std::string name;
  if (resume == "latest") {
    auto latest = latest_checkpoint(dir);
    if (!latest.is_ok()) return keep + 1;
    name = std::filesystem::path(*latest).filename();
  } else {
    name = std::filesystem::path(resume).filename();
  }
  const std::vector<CheckpointEntry> all = list_checkpoints(dir);
  std::string lineage;
  for (const CheckpointEntry& e : all) {
    if (e.name == name && e.readable) lineage = e.run_id;
  }
  if (lineage.empty()) return keep + 1;
  const int mine = int(std::count_if(
      all.begin(), all.end(), [&](const CheckpointEntry& e) { return e.run_id == lineage; }));
  return keep + 1 - std::min(mine, keep);
}

Status prepare_checkpoint_dir(const std::string& dir, uint64_t checkpoint_bytes, int count,
                              bool remove_temporaries) {
  STRATA_RETURN_IF_ERROR(check_checkpoint_dir(dir, checkpoint_bytes, count), "");
  if (remove_temporaries) {
    for (const std::string& name : remove_stale_temporaries(dir)) {
      log_info("checkpoint dir: removed {}/{}, left by a run that was killed while saving", dir,
               name);
    }
  }
  return Status::ok();
}

std::vector<std::string> remove_stale_temporaries(const std::string& dir) {
  std::vector<std::string> removed;
  for (const std::string& name : dir_names(dir)) {
    if (!ends_with(name, ".tmp")) continue;
    if (name.rfind("ckpt-", 0) != 0 && name != "latest.tmp") continue;
    remove_entry(dir, name, &removed);
  }
  return removed;
}

Status check_no_foreign_overwrite(const std::string& dir, const std::string& run_id,
                                  int64_t first_step, int64_t last_step,
                                  const std::vector<std::string>& passed_over) {
  for (const CheckpointEntry& e : list_checkpoints(dir)) {
    if (e.step <= first_step || e.step > last_step) continue;
    if (!run_id.empty() && e.run_id == run_id) continue;
    const bool damaged = std::any_of(passed_over.begin(), passed_over.end(), [&](auto& p) {
      return std::filesystem::path(p).filename() == e.name;
    });
    if (damaged && !e.readable) continue;
    return invalid_argument(fmt::format(
        "train.checkpoint_dir '{}' holds {} from another run ({}), which this run would "
        "overwrite at step {}: continue that run with --resume, give this run another "
        "train.checkpoint_dir, or move the old checkpoints away",
        dir, e.name,
        e.readable ? (e.run_id.empty() ? std::string("written before lineages were recorded")
                                       : "lineage " + e.run_id)
                   : std::string("unreadable"),
        e.step));
  }
  return Status::ok();
}

std::vector<std::string> prune_checkpoints(const std::string& dir, const std::string& run_id,
                                           const std::string& just_written, int keep) {
  std::vector<std::string> removed;
  const int64_t top = step_of(just_written);
  if (run_id.empty() || top < 0) return removed;
  std::vector<CheckpointEntry> mine;
  for (CheckpointEntry& e : list_checkpoints(dir)) {
    if (e.run_id == run_id && e.step < top && e.name != just_written) mine.push_back(e);
  }
  // mine is by step ascending: keep the keep-1 newest below just_written.
  const size_t keep_old = keep > 1 ? size_t(keep - 1) : 0;
  const std::vector<std::string> names = dir_names(dir);
  for (size_t i = 0; i + keep_old < mine.size(); ++i) {
    // The manifest first: a crash between leaves orphan shard files, never a manifest whose
    // shards are gone.
    remove_entry(dir, mine[i].name, &removed);
    for (const std::string& f : names) {
      if (f.rfind(mine[i].name + ".rank", 0) == 0) remove_entry(dir, f, &removed);
    }
  }
  return removed;
}

Result<std::vector<std::string>> resume_candidates(const std::string& dir) {
  const std::vector<CheckpointEntry> all = list_checkpoints(dir);
  auto latest = latest_checkpoint(dir);
  std::vector<std::string> out;
  if (!latest.is_ok()) {
    if (latest.status().code() != StatusCode::kNotFound || all.empty()) {
      if (all.empty() && latest.status().code() == StatusCode::kNotFound) {
        return not_found(
            fmt::format("no checkpoint to resume from: {} has no latest and no ckpt-*.bin (train "
                        "once with train.checkpoint_dir={} first)",
                        dir, dir));
      }
      return latest.status();
    }
    // `latest` is gone but checkpoints are there: the newest first.
    for (auto it = all.rbegin(); it != all.rend(); ++it) out.push_back(dir + "/" + it->name);
    log_warn("{}/latest is missing; resuming from the newest checkpoint there, {}", dir,
             out.front());
    return out;
  }
  out.push_back(*latest);
  const std::string name = latest->substr(latest->find_last_of('/') + 1);
  const int64_t top = step_of(name);
  std::string lineage;
  bool known = false;
  for (const CheckpointEntry& e : all) {
    if (e.name == name && e.readable) {
      lineage = e.run_id;
      known = true;
    }
  }
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->name == name || (top >= 0 && it->step >= top)) continue;
    if (known && it->run_id != lineage) continue;
    out.push_back(dir + "/" + it->name);
  }
  return out;
}

Result<std::string> resume_first_intact(
    const std::vector<std::string>& candidates,
    const std::function<Status(const std::string& path)>& load,
    const std::function<Result<ResumeOutcome>(ResumeOutcome mine)>& agree) {
  std::string damaged;  // the candidates passed over, for the final message
  for (size_t i = 0; i < candidates.size(); ++i) {
    const std::string& path = candidates[i];
    Status st = load(path);
    ResumeOutcome mine = st.is_ok() ? ResumeOutcome::kLoaded
                         : (st.code() == StatusCode::kCorrupt || st.code() == StatusCode::kNotFound)
                             ? ResumeOutcome::kDamaged
                             : ResumeOutcome::kFailed;
    ResumeOutcome all = mine;
    if (agree) {
      STRATA_ASSIGN_OR_RETURN(all, agree(mine), "agreeing on the checkpoint to resume from");
    }
    if (mine == ResumeOutcome::kFailed) return st;
    if (all == ResumeOutcome::kFailed) {
      return cancelled(
          fmt::format("resuming from {}: another rank failed (see its message)", path));
    }
    if (all == ResumeOutcome::kLoaded) {
      if (i > 0) {
        log_warn("resumed from {}, the newest intact checkpoint (skipped the damaged {})", path,
                 damaged);
      }
      return path;
    }
    damaged += (damaged.empty() ? "" : ", ") + path;
    const std::string why = st.is_ok() ? "another rank's shard is damaged" : st.message();
    if (i + 1 < candidates.size()) {
      log_warn("checkpoint {} is damaged ({}); falling back to the older {}", path, why,
               candidates[i + 1]);
    } else {
      return Status(
          st.is_ok() ? StatusCode::kCorrupt : st.code(),
          fmt::format("{}{}", st.is_ok() ? path + ": " + why : st.message(),
                      candidates.size() > 1
                          ? fmt::format(" (and no older checkpoint is intact: tried {})", damaged)
                          : ""));
    }
  }
  return not_found("no checkpoint to resume from");
}

std::string new_run_id() {
  uint64_t v = 0;
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    if (::read(fd, &v, sizeof(v)) != static_cast<ssize_t>(sizeof(v))) v = 0;
    ::close(fd);
  }
  if (v == 0) {
    v = uint64_t(std::chrono::system_clock::now().time_since_epoch().count()) *
            0x9e3779b97f4a7c15ull ^
        uint64_t(::getpid());
  }
  return fmt::format("{:016x}", v);
}

}  // namespace strata
