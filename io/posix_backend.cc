// posix backend: pread/pwrite on a small pool of threads, buffered (no O_DIRECT), for file
// systems that refuse O_DIRECT. Each op is one pread/pwrite call; its raw result (possibly
// short, possibly -errno) goes back to the engine, which handles retries like any backend's.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "io/backend.h"

namespace strata::io {
namespace {

class PosixBackend final : public Backend {
 public:
  explicit PosixBackend(int threads) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~PosixBackend() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    todo_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  const char* name() const override { return "posix"; }
  bool direct_io() const override { return false; }

  Status submit(std::span<const RawOp> ops) override {
    {
      std::lock_guard lock(mu_);
      todo_.insert(todo_.end(), ops.begin(), ops.end());
    }
    if (ops.size() == 1)
      todo_cv_.notify_one();
    else
      todo_cv_.notify_all();
    return Status::ok();
  }

  Status wait(size_t min, std::vector<RawResult>* out) override {
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return done_.size() >= min; });
    out->insert(out->end(), done_.begin(), done_.end());
    done_.clear();
    return Status::ok();
  }

 private:
  void work() {
    std::unique_lock lock(mu_);
    for (;;) {
      todo_cv_.wait(lock, [&] { return stop_ || !todo_.empty(); });
      if (stop_) return;
      RawOp op = todo_.front();
      todo_.pop_front();
      lock.unlock();
      ssize_t rc = op.write ? ::pwrite(op.fd, op.buffer, op.length, static_cast<off_t>(op.offset))
                            : ::pread(op.fd, op.buffer, op.length, static_cast<off_t>(op.offset));
      const int64_t res = rc < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(rc);
      lock.lock();
      done_.push_back({op.tag, res});
      done_cv_.notify_one();
    }
  }

  std::mutex mu_;
  std::condition_variable todo_cv_, done_cv_;
  std::deque<RawOp> todo_;
  std::vector<RawResult> done_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_posix_backend(int threads) {
  if (threads < 1) threads = 1;
  return std::unique_ptr<Backend>(std::make_unique<PosixBackend>(threads));
}

}  // namespace strata::io
