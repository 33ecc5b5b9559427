// Fault-injecting backend: wraps a real backend and, per FaultPlan, fails, truncates, delays or
// makes transient the pieces the engine issues (see strata/storage_faults.h).
#include <cerrno>
#include <chrono>
#include <random>
#include <thread>

#include "io/backend.h"
#include "strata/storage_faults.h"

namespace strata::io {
namespace {

class FaultBackend final : public Backend {
 public:
  FaultBackend(std::unique_ptr<Backend> inner, std::shared_ptr<FaultPlan> plan)
      : inner_(std::move(inner)), plan_(std::move(plan)), rng_(plan_->seed) {
    name_ = std::string(inner_->name()) + "+faults";
  }

  const char* name() const override { return name_.c_str(); }
  bool direct_io() const override { return inner_->direct_io(); }
  bool fixed_files() const override { return inner_->fixed_files(); }
  bool registered_buffers() const override { return inner_->registered_buffers(); }
  Status add_file(int slot, int fd) override { return inner_->add_file(slot, fd); }
  void remove_file(int slot) override { inner_->remove_file(slot); }
  Status register_buffer(void* base, size_t length) override {
    return inner_->register_buffer(base, length);
  }

  Status submit(std::span<const RawOp> ops) override {
    std::vector<RawOp> pass;
    pass.reserve(ops.size());
    for (RawOp op : ops) {
      FaultPlan& p = *plan_;
      const uint64_t n = ++p.pieces;
      if (p.fail_nth != 0) {
        const bool kind_ok = p.fail_nth_kind == 0 || (p.fail_nth_kind == 1 && !op.write) ||
                             (p.fail_nth_kind == 2 && op.write);
        if (kind_ok && ++nth_counter_ == p.fail_nth) {
          ++p.injected_errors;
          synthetic_.push_back({op.tag, -static_cast<int64_t>(p.fail_nth_errno)});
          continue;
        }
      }
      if (coin(p.p_error)) {
        ++p.injected_errors;
        synthetic_.push_back({op.tag, -static_cast<int64_t>(p.error_errno)});
        continue;
      }
      if (coin(p.p_transient)) {
        ++p.injected_transient;
        synthetic_.push_back({op.tag, (n & 1) ? -int64_t{EINTR} : -int64_t{EAGAIN}});
        continue;
      }
      if (coin(p.p_delay)) {
        ++p.injected_delays;
        std::this_thread::sleep_for(std::chrono::microseconds(p.delay_us));
      }
      const uint32_t unit = inner_->direct_io() ? 4096 : 512;
      if (op.length > unit && coin(p.p_short)) {
        // Keep a random, unit-aligned leading part (at least one unit, never all).
        const uint32_t units = op.length / unit;  // >= 1; op.length may not be a multiple
        std::uniform_int_distribution<uint32_t> keep(1, units == 1 ? 1 : units - 1);
        const uint32_t len = keep(rng_) * unit;
        if (len < op.length) {
          ++p.injected_short;
          op.length = len;
        }
      }
      pass.push_back(op);
    }
    in_inner_ += pass.size();
    if (pass.empty()) return Status::ok();
    Status s = inner_->submit(pass);
    if (!s.is_ok()) in_inner_ -= pass.size();
    return s;
  }

  Status wait(size_t min, std::vector<RawResult>* out) override {
    size_t got = synthetic_.size();
    out->insert(out->end(), synthetic_.begin(), synthetic_.end());
    synthetic_.clear();
    const size_t need = got >= min ? 0 : std::min(min - got, in_inner_);
    const size_t before = out->size();
    Status s = inner_->wait(need, out);
    in_inner_ -= out->size() - before;
    return s;
  }

 private:
  bool coin(double p) {
    if (p <= 0.0) return false;
    return std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < p;
  }

  std::unique_ptr<Backend> inner_;
  std::shared_ptr<FaultPlan> plan_;
  std::mt19937_64 rng_;
  std::string name_;
  std::vector<RawResult> synthetic_;  // results of ops that never reached the inner backend
  size_t in_inner_ = 0;
  uint64_t nth_counter_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_fault_backend(std::unique_ptr<Backend> inner,
                                            std::shared_ptr<FaultPlan> plan) {
  return std::make_unique<FaultBackend>(std::move(inner), std::move(plan));
}

}  // namespace strata::io
