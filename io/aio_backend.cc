// libaio backend: Linux native AIO (io_submit/io_getevents) on O_DIRECT files.
#include "io/backend.h"

#ifdef STRATA_HAVE_AIO

#include <fmt/format.h>
#include <libaio.h>

#include <cerrno>
#include <cstring>

namespace strata::io {
namespace {

class AioBackend final : public Backend {
 public:
  ~AioBackend() override {
    if (ctx_ != nullptr) io_destroy(ctx_);
  }

  Status init(int depth) {
    depth_ = depth;
    int rc = io_setup(depth, &ctx_);
    if (rc < 0) {
      ctx_ = nullptr;
      return errno_status(-rc, fmt::format("io_setup({})", depth));
    }
    iocbs_.resize(depth);
    free_.reserve(depth);
    for (int i = depth - 1; i >= 0; --i) free_.push_back(&iocbs_[i]);
    return Status::ok();
  }

  const char* name() const override { return "libaio"; }
  bool direct_io() const override { return true; }

  Status submit(std::span<const RawOp> ops) override {
    if (ops.size() > free_.size()) return internal_error("libaio: more ops than queue depth");
    std::vector<iocb*> batch;
    batch.reserve(ops.size());
    for (const RawOp& op : ops) {
      iocb* cb = free_.back();
      free_.pop_back();
      if (op.write)
        io_prep_pwrite(cb, op.fd, op.buffer, op.length, static_cast<long long>(op.offset));
      else
        io_prep_pread(cb, op.fd, op.buffer, op.length, static_cast<long long>(op.offset));
      cb->data = reinterpret_cast<void*>(op.tag);
      batch.push_back(cb);
    }
    // Runs of small requests in one system call; a large one alone, unmerged (kUnbatchedBytes).
    size_t done = 0;
    while (done < batch.size()) {
      size_t end = done;
      while (end < batch.size() && ops[end].length < kUnbatchedBytes) ++end;
      if (end == done) ++end;  // a large request
      int rc = io_submit(ctx_, static_cast<long>(end - done), batch.data() + done);
      if (rc > 0) {
        done += rc;
      } else if (rc != -EINTR && rc != -EAGAIN) {
        // Give back the iocbs that did not start.
        for (size_t i = done; i < batch.size(); ++i) free_.push_back(batch[i]);
        return errno_status(-rc, "io_submit");
      }
    }
    return Status::ok();
  }

  Status wait(size_t min, std::vector<RawResult>* out) override {
    io_event events[64];
    size_t got = 0;
    do {
      long want_min = static_cast<long>(std::min<size_t>(min - std::min(min, got), 64));
      int rc = io_getevents(ctx_, want_min, 64, events, nullptr);
      if (rc < 0) {
        if (rc == -EINTR) continue;
        return errno_status(-rc, "io_getevents");
      }
      for (int i = 0; i < rc; ++i) {
        iocb* cb = events[i].obj;
        // res is unsigned long: a negative errno arrives as a huge value.
        const int64_t res = static_cast<int64_t>(static_cast<long>(events[i].res));
        out->push_back({reinterpret_cast<uint64_t>(cb->data), res});
        free_.push_back(cb);
      }
      got += rc;
      if (min == 0) break;
    } while (got < min);
    return Status::ok();
  }

 private:
  io_context_t ctx_ = nullptr;
  int depth_ = 0;
  std::vector<iocb> iocbs_;
  std::vector<iocb*> free_;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_aio_backend(int queue_depth) {
  auto b = std::make_unique<AioBackend>();
  Status s = b->init(queue_depth);
  if (!s.is_ok())
    return unavailable(
        fmt::format("libaio refused: {} (raise /proc/sys/fs/aio-max-nr or lower aio.queue_depth)",
                    s.message()));
  return std::unique_ptr<Backend>(std::move(b));
}

}  // namespace strata::io

#else  // !STRATA_HAVE_AIO

namespace strata::io {
Result<std::unique_ptr<Backend>> make_aio_backend(int) {
  return unavailable("libaio not built in (libaio missing at build time; install libaio-dev)");
}
}  // namespace strata::io

#endif
