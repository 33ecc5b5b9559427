#include "src/tiers/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

namespace strata {

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
      Access a;
      a.object = j.at("object");
      a.bytes = j.at("bytes");
      a.compute_s = j.value("compute_s", 0.0);
      if (a.object < 0) return invalid_argument(fmt::format("line {}: negative object", lineno));
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

uint64_t prefetch_horizon(const Trace& t, uint64_t pos, uint64_t j) {
  const size_t n = t.size();
  uint64_t h = j;
  for (uint64_t q = pos; q < j; ++q) {
    h = std::max(h, t.next_use_of(t.accesses()[q % n].object, j + 1));
  }
  return h;
}

namespace {

struct Resident {
  uint64_t bytes = 0;
  double ready_at = 0;    // copy completion time
  uint64_t last_use = 0;  // absolute position of last access (LRU)
};

class Sim {
 public:
  Sim(const Trace& t, CachePolicy p, const ReplayOptions& o) : t_(t), p_(p), o_(o) {}

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
        if (p_ == CachePolicy::kStrata) prefetch(pos);
        now_ += a.compute_s;
        r_.compute_s += a.compute_s;
        if (p_ == CachePolicy::kStrata && t_.reuse_distance(i) > o_.max_reuse_distance) {
          used_ -= it->second.bytes;
          res_.erase(it);
        }
      }
    }
    return r_;
  }

 private:
  uint64_t next_use(int obj, uint64_t pos) const { return t_.next_use_of(obj, pos + 1); }

  void fetch(int obj, uint64_t bytes, double issue) {
    double start = std::max(issue, copy_free_);
    double end = start + double(bytes) / o_.bandwidth;
    copy_free_ = end;
    res_[obj] = {bytes, end, 0};
    used_ += bytes;
    r_.bytes_fetched += bytes;
    ++r_.fetches;
  }

  // Frees room for `bytes` at position pos, never evicting `keep` or any object whose next use
  // is at or before `need_before` (prefetch must not evict what is needed sooner).
  bool make_room(uint64_t bytes, uint64_t pos, int keep, uint64_t need_before) {
    while (used_ + bytes > o_.capacity) {
      int victim = -1;
      uint64_t best = 0;
      for (const auto& [obj, r] : res_) {
        if (obj == keep) continue;
        uint64_t key;
        if (p_ == CachePolicy::kLru) {
          key = UINT64_MAX - r.last_use;  // oldest use first
        } else {
          key = next_use(obj, pos);
          if (key <= need_before && need_before != UINT64_MAX) continue;
        }
        if (victim < 0 || key > best) {
          victim = obj;
          best = key;
        }
      }
      if (victim < 0) return false;
      used_ -= res_[victim].bytes;
      res_.erase(victim);
    }
    return true;
  }

  void prefetch(uint64_t pos) {
    const size_t n = t_.size();
    uint64_t in_flight = 0;
    for (const auto& [obj, r] : res_) {
      if (r.ready_at > now_) in_flight += r.bytes;
    }
    for (uint64_t j = pos + 1; j < pos + n; ++j) {
      const Access& a = t_.accesses()[j % n];
      if (res_.count(a.object)) continue;
      if (in_flight + a.bytes > o_.prefetch_bytes) break;
      if (!make_room(a.bytes, pos, t_.accesses()[pos % n].object, prefetch_horizon(t_, pos, j))) {
        break;
      }
      fetch(a.object, a.bytes, now_);
      in_flight += a.bytes;
    }
  }
  const Trace& t_;
  CachePolicy p_;
  ReplayOptions o_;
  std::map<int, Resident> res_;
  uint64_t used_ = 0;
  double now_ = 0, copy_free_ = 0;
  ReplayResult r_;
};

}  // namespace

ReplayResult replay(const Trace& trace, CachePolicy policy, const ReplayOptions& options) {
  if (trace.empty()) return {};
  return Sim(trace, policy, options).run();
}

}  // namespace strata
