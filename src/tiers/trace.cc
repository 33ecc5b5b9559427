#include "src/tiers/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "src/base/json_depth.h"
#include "src/tiers/cache_policy.h"

namespace strata {

using json = nlohmann::json;

Trace::Trace(std::vector<Access> accesses) : acc_(std::move(accesses)) {
  const size_t n = acc_.size();
  int max_obj = -1;
  for (const auto& a : acc_) max_obj = std::max(max_obj, a.object);
  positions_.assign(size_t(max_obj + 1), {});
  for (size_t i = 0; i < n; ++i) positions_[size_t(acc_[i].object)].push_back(i);
  next_.resize(n);
  reuse_.resize(n);
  // prefix sums of bytes over two periods for reuse distances
  std::vector<uint64_t> prefix(2 * n + 1, 0);
  for (size_t i = 0; i < 2 * n; ++i) prefix[i + 1] = prefix[i] + acc_[i % n].bytes;
  for (size_t i = 0; i < n; ++i) {
    const auto& pos = positions_[size_t(acc_[i].object)];
    auto it = std::upper_bound(pos.begin(), pos.end(), i);
    uint64_t nx = it != pos.end() ? *it : pos.front() + n;
    next_[i] = nx;
    // bytes strictly between i and nx, excluding the object itself (it is not in between)
    reuse_[i] = prefix[nx] - prefix[i + 1];
  }
}

uint64_t Trace::next_use_of(int object, uint64_t p) const {
  if (object < 0 || size_t(object) >= positions_.size() || positions_[size_t(object)].empty()) {
    return std::numeric_limits<uint64_t>::max();
  }
  const size_t n = acc_.size();
  const auto& pos = positions_[size_t(object)];
  uint64_t base = p - p % n, off = p % n;
  auto it = std::lower_bound(pos.begin(), pos.end(), off);
  return it != pos.end() ? base + *it : base + n + pos.front();
}

std::string Trace::to_jsonl(const std::vector<std::string>& names) const {
  std::ostringstream o;
  o << nlohmann::json{{"strata_trace", 1}, {"accesses", acc_.size()}, {"objects", names}}.dump()
    << "\n";
  for (const auto& a : acc_) {
    o << nlohmann::json{{"object", a.object}, {"bytes", a.bytes}, {"compute_s", a.compute_s}}.dump()
      << "\n";
  }
  return o.str();
}

Result<Trace> Trace::from_jsonl(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  std::vector<Access> acc;
  int lineno = 0;
  bool header = false;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    if (Status d = check_json_depth(line); !d.is_ok()) {
      return invalid_argument(fmt::format("line {}: {}", lineno, d.message()));
    }
    try {
      auto j = nlohmann::json::parse(line);
      if (!header) {
        if (!j.contains("strata_trace") || j["strata_trace"] != 1) {
          return invalid_argument(fmt::format(
              "line {}: not a strata trace (expected a header with \"strata_trace\": 1); "
              "record one with strata train --set strata.trace_file=PATH",
              lineno));
        }
        header = true;
        continue;
      }
      // Objects are a model's modules; the replay keeps a list per id up to the largest. Bytes
      // are a module's, summed over two steps for reuse distances: 2^48 each leaves room.
      constexpr int64_t kMaxObjects = 1 << 20;
      constexpr uint64_t kMaxBytes = uint64_t{1} << 48;
      const json& object = j.at("object");
      const json& bytes = j.at("bytes");
      const json compute = j.value("compute_s", json(0.0));
      if (!object.is_number_integer() || object.get<int64_t>() < 0 ||
          object.get<int64_t>() >= kMaxObjects) {
        return invalid_argument(fmt::format("line {}: object {} is not a whole number from 0 to {}",
                                            lineno, object.dump(), kMaxObjects - 1));
      }
      if (!bytes.is_number_integer() || (!bytes.is_number_unsigned() && bytes.get<int64_t>() < 0) ||
          bytes.get<uint64_t>() > kMaxBytes) {
        return invalid_argument(fmt::format(
            "line {}: bytes {} is not a whole number from 0 to 2^48", lineno, bytes.dump()));
      }
      if (!compute.is_number() || !(compute.get<double>() >= 0)) {
        return invalid_argument(fmt::format("line {}: compute_s {} is not a time of 0 or more",
                                            lineno, compute.dump()));
      }
      Access a;
      a.object = int(object.get<int64_t>());
      a.bytes = bytes.get<uint64_t>();
      a.compute_s = compute.get<double>();
      acc.push_back(a);
    } catch (const std::exception& e) {
      return invalid_argument(fmt::format("line {}: {}", lineno, e.what()));
    }
  }
  if (acc.empty()) return invalid_argument("trace has no accesses");
  return Trace(std::move(acc));
}

const char* cache_policy_name(CachePolicy p) {
  switch (p) {
    case CachePolicy::kLru:
      return "lru";
    case CachePolicy::kBelady:
      return "belady";
    case CachePolicy::kStrata:
      return "strata";
  }
  return "?";
}

namespace {

struct Resident {
  uint64_t bytes = 0;
  double ready_at = 0;    // copy completion time
  uint64_t last_use = 0;  // absolute position of last access (LRU)
};

CachePolicyOptions sim_policy(CachePolicy p, const ReplayOptions& o) {
  CachePolicyOptions c;
  c.belady = p != CachePolicy::kLru;
  c.prefetch = p == CachePolicy::kStrata;
  c.prefetch_bytes = o.prefetch_bytes;
  c.max_reuse_distance = o.max_reuse_distance;
  return c;
}

// A device cache on a modelled timeline: one copy engine, compute times per access. What to
// evict, prefetch and drop is DeviceCachePolicy's decision, as in the tier manager.
class Sim final : public CacheState {
 public:
  Sim(const Trace& t, CachePolicy p, const ReplayOptions& o)
      : t_(t), o_(o), policy_(sim_policy(p, o)) {
    policy_.set_trace(&t_);
    for (const auto& a : t_.accesses()) objects_ = std::max(objects_, a.object + 1);
  }

  ReplayResult run() {
    const size_t n = t_.size();
    for (int s = 0; s < o_.steps; ++s) {
      for (size_t i = 0; i < n; ++i) {
        const uint64_t pos = uint64_t(s) * n + i;
        const Access& a = t_.accesses()[i];
        if (a.bytes > o_.capacity) {
          r_.fits = false;
          return r_;
        }
        auto it = res_.find(a.object);
        if (it == res_.end()) {
          if (!make_room(a.bytes, pos, a.object, /*need_before=*/UINT64_MAX)) {
            r_.fits = false;
            return r_;
          }
          fetch(a.object, a.bytes, now_);
          it = res_.find(a.object);
        }
        if (it->second.ready_at > now_) {
          r_.stall_s += it->second.ready_at - now_;
          now_ = it->second.ready_at;
        }
        it->second.last_use = pos;
        pos_ = pos;
        policy_.prefetch(*this, pos, in_flight());
        now_ += a.compute_s;
        r_.compute_s += a.compute_s;
        if (policy_.drop_after_use(i)) {
          used_ -= it->second.bytes;
          res_.erase(it);
        }
      }
    }
    return r_;
  }

  // CacheState
  int object_count() const override { return objects_; }
  bool evictable(int obj) const override { return res_.count(obj) > 0; }
  uint64_t last_access(int obj) const override { return res_.at(obj).last_use; }
  bool fetchable(int obj) const override { return res_.count(obj) == 0; }
  bool prefetch(int obj, uint64_t bytes, uint64_t horizon) override {
    if (!make_room(bytes, pos_, t_.accesses()[pos_ % t_.size()].object, horizon)) return false;
    fetch(obj, bytes, now_);
    return true;
  }

 private:
  uint64_t in_flight() const {
    uint64_t b = 0;
    for (const auto& [obj, r] : res_) {
      if (r.ready_at > now_) b += r.bytes;
    }
    return b;
  }

  void fetch(int obj, uint64_t bytes, double issue) {
    double start = std::max(issue, copy_free_);
    double end = start + double(bytes) / o_.bandwidth;
    copy_free_ = end;
    res_[obj] = {bytes, end, 0};
    used_ += bytes;
    r_.bytes_fetched += bytes;
    ++r_.fetches;
  }

  // Frees room for `bytes` at position pos, evicting the policy's victims: never `keep`, and
  // for a prefetch none used at or before `need_before`.
  bool make_room(uint64_t bytes, uint64_t pos, int keep, uint64_t need_before) {
    while (used_ + bytes > o_.capacity) {
      const int victim = policy_.victim(*this, pos + 1, keep, need_before);
      if (victim < 0) return false;
      used_ -= res_[victim].bytes;
      res_.erase(victim);
    }
    return true;
  }

  const Trace& t_;
  ReplayOptions o_;
  DeviceCachePolicy policy_;
  int objects_ = 0;
  std::map<int, Resident> res_;
  uint64_t used_ = 0;
  uint64_t pos_ = 0;  // the access under way
  double now_ = 0, copy_free_ = 0;
  ReplayResult r_;
};

}  // namespace

ReplayResult replay(const Trace& trace, CachePolicy policy, const ReplayOptions& options) {
  if (trace.empty()) return {};
  return Sim(trace, policy, options).run();
}

}  // namespace strata
