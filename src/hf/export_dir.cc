#include "src/hf/export_dir.h"

#include <dirent.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>
#include <vector>

#include "src/base/json_depth.h"
#include "src/base/safe_file.h"
#include "strata/log.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A file that makes a directory a model: its config, its weights and their index, its
// generation defaults.
bool is_model_file(const std::string& name) {
  return name == "config.json" || name == "generation_config.json" ||
         name == "adapter_config.json" || name == "adapter_model.bin" ||
         ends_with(name, ".safetensors") || ends_with(name, ".index.json") ||
         (name.rfind("pytorch_model", 0) == 0 && ends_with(name, ".bin"));
}

// The model files in `dir` (regular files or links), by name, with their inode.
std::map<std::string, std::pair<dev_t, ino_t>> model_files(const std::string& dir) {
  std::map<std::string, std::pair<dev_t, ino_t>> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    struct stat st {};
    if (!is_model_file(name) || ::lstat((dir + "/" + name).c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) continue;
    out[name] = {st.st_dev, st.st_ino};
  }
  ::closedir(d);
  return out;
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) return json();
  std::stringstream ss;
  ss << in.rdbuf();
  if (!check_json_depth(ss.str()).is_ok()) return json();
  return json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
}

}  // namespace

Status check_export_dir(const ExportTarget& t) {
  const std::string what = fmt::format("{} '{}'", t.key, t.dir);
  if (t.dir.empty()) return invalid_argument(t.key + " is empty; give a directory");
  std::error_code ec;
  if (!t.from_pretrained.empty() && fs::equivalent(t.dir, t.from_pretrained, ec)) {
    return invalid_argument(fmt::format(
        "{} is model.from_pretrained's directory: the export would overwrite the base model "
        "this run starts from; give {} another directory",
        what, t.key));
  }
  // The directory, or the nearest ancestor that exists: a directory strata may write in.
  fs::path p = fs::absolute(t.dir, ec);
  if (ec) p = t.dir;
  while (true) {
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode)) {
        return invalid_argument(fmt::format(
            "{}: '{}' is not a directory; {} must name a directory (strata writes config.json "
            "and model.safetensors into it): pick another path",
            what, p.string(), t.key));
      }
      // A probe file, as the checkpoint directory's preflight makes: what access(2) says is
      // not what a read-only or special file system does.
      const std::string probe = fmt::format("{}/.strata-probe-{}.tmp", p.string(), ::getpid());
      auto fd = create_temp_file(probe, 0600);
      if (!fd.is_ok()) {
        return invalid_argument(
            fmt::format("{} is not writable ({}); fix its permissions, remount it read-write, or "
                        "give {} another directory",
                        what, fd.status().message(), t.key));
      }
      ::close(*fd);
      ::unlink(probe.c_str());
      return Status::ok();
    }
    if ((errno != ENOENT && errno != ENOTDIR) || !p.has_parent_path() || p.parent_path() == p) {
      return errno_status(errno, fmt::format("{}: cannot stat '{}'", what, p.string()));
    }
    p = p.parent_path();
  }
}

Status check_export_owner(const ExportTarget& t) {
  STRATA_RETURN_IF_ERROR(check_export_dir(t), "");
  const auto files = model_files(t.dir);
  if (files.empty()) return Status::ok();
  const json marker = read_json(t.dir + "/" + kExportMarker);
  const std::string owner =
      marker.is_object() && marker.contains("run_id") && marker["run_id"].is_string()
          ? marker["run_id"].get<std::string>()
          : "";
  // A merged model and an adapter do not share a directory: replacing one with the other
  // would remove the other's files, even when both are this lineage's.
  const bool other_kind = std::any_of(files.begin(), files.end(), [&](const auto& f) {
    return (f.first.rfind("adapter_", 0) == 0) != t.adapter;
  });
  if (!owner.empty() && owner == t.run_id && !other_kind) return Status::ok();  // this lineage's
  std::string names;
  int listed = 0;
  for (const auto& [name, id] : files) {
    if (listed++ < 4) names += (names.empty() ? "" : ", ") + name;
  }
  if (files.size() > 4) names += fmt::format(" and {} more", files.size() - 4);
  std::string what;
  if (!owner.empty() && owner == t.run_id) {
    what = t.adapter ? "this run's merged export" : "this run's adapter";
  } else if (!owner.empty()) {
    what =
        fmt::format("the export of another run (lineage {}{})", owner,
                    marker.contains("step") ? fmt::format(", step {}", marker["step"].dump()) : "");
  } else if (files.count("adapter_config.json")) {
    const json adapter = read_json(t.dir + "/adapter_config.json");
    const json base =
        adapter.is_object() ? adapter.value("base_model_name_or_path", json()) : json();
    what = fmt::format(
        "a PEFT adapter (of {}{})",
        base.is_string() && !base.get<std::string>().empty() ? base.dump() : "an unnamed base",
        adapter.is_object() && adapter.contains("r") ? fmt::format(", r {}", adapter["r"].dump())
                                                     : "");
  } else {
    const json config = read_json(t.dir + "/config.json");
    const bool arch = config.is_object() && config.contains("architectures") &&
                      config["architectures"].is_array() && !config["architectures"].empty();
    what = arch ? fmt::format("a model ({})", config["architectures"][0].dump())
                : std::string("a model");
  }
  if (t.force) {
    log_warn("{} '{}' holds {} ({}): replacing it (--force)", t.key, t.dir, what, names);
    return Status::ok();
  }
  return invalid_argument(fmt::format(
      "{} '{}' holds {} ({}); an export there would mix its files with this model's: give {} "
      "a new directory or move that one away{}",
      t.key, t.dir, what, names, t.key, t.force_hint));
}

Status export_as_owner(const ExportTarget& t, const std::function<Status()>& write) {
  STRATA_RETURN_IF_ERROR(check_export_owner(t), "");
  // The directories the export creates, deepest first (removed again on failure).
  std::vector<fs::path> created;
  std::error_code ec;
  for (fs::path p = fs::absolute(t.dir, ec);
       !ec && !fs::exists(p, ec) && p.has_parent_path() && p.parent_path() != p;
       p = p.parent_path()) {
    created.push_back(p);
  }
  const auto before = model_files(t.dir);
  if (Status st = write(); !st.is_ok()) {
    for (const fs::path& p : created) ::rmdir(p.c_str());  // only when empty
    return st;
  }
  json marker = {{"run_id", t.run_id}, {"step", t.step}};
  STRATA_RETURN_IF_ERROR(
      write_file_atomically(t.dir + "/" + kExportMarker, marker.dump() + "\n", 0644),
      fmt::format("{}: recording the export's lineage", t.key));
  // What the export did not rewrite (the same inode as before) is the earlier model's.
  const auto after = model_files(t.dir);
  for (const auto& [name, id] : before) {
    auto it = after.find(name);
    if (it == after.end() || it->second != id) continue;
    const std::string path = t.dir + "/" + name;
    if (::unlink(path.c_str()) == 0) {
      log_info("{}: removed {}, left by the model that was there before", t.key, path);
    } else {
      log_warn("{}: could not remove {}, left by the model that was there before: {}", t.key, path,
               std::strerror(errno));
    }
  }
  return fsync_directory(t.dir);
}

}  // namespace strata
