// io_uring backend (liburing): O_DIRECT files, batched submits, fixed files, one registered
// buffer region when the kernel allows.
#include "io/backend.h"

#ifdef STRATA_HAVE_URING

#include <liburing.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>

#include "strata/log.h"

namespace strata::io {
namespace {

class UringBackend final : public Backend {
 public:
  ~UringBackend() override {
    if (inited_) io_uring_queue_exit(&ring_);
  }

  Status init(int depth) {
    unsigned entries = 1;
    while (entries < static_cast<unsigned>(depth)) entries <<= 1;
    io_uring_params params{};
    params.flags = IORING_SETUP_CQSIZE;
    params.cq_entries = entries * 2;
    int rc = io_uring_queue_init_params(entries, &ring_, &params);
    if (rc < 0) return errno_status(-rc, "io_uring_queue_init");
    inited_ = true;
    rc = io_uring_register_files_sparse(&ring_, kMaxFiles);
    fixed_files_ = rc == 0;
    if (!fixed_files_) log_debug("io_uring: no fixed files ({}); using plain fds", strerror(-rc));
    return Status::ok();
  }

  const char* name() const override { return "io_uring"; }
  bool direct_io() const override { return true; }
  bool fixed_files() const override { return fixed_files_; }
  bool registered_buffers() const override { return buf_base_ != nullptr; }

  Status add_file(int slot, int fd) override {
    if (!fixed_files_) return Status::ok();
    int rc = io_uring_register_files_update(&ring_, slot, &fd, 1);
    if (rc < 0) return errno_status(-rc, "io_uring_register_files_update");
    return Status::ok();
  }
  void remove_file(int slot) override {
    if (!fixed_files_) return;
    int fd = -1;
    io_uring_register_files_update(&ring_, slot, &fd, 1);
  }

  Status register_buffer(void* base, size_t length) override {
    if (buf_base_ != nullptr) {
      io_uring_unregister_buffers(&ring_);
      buf_base_ = nullptr;
    }
    iovec iov{base, length};
    int rc = io_uring_register_buffers(&ring_, &iov, 1);
    if (rc < 0) {
      log_info("io_uring: buffer registration of {} refused ({}); using unregistered buffers",
               format_bytes(static_cast<double>(length)), strerror(-rc));
      return Status::ok();
    }
    buf_base_ = static_cast<char*>(base);
    buf_len_ = length;
    return Status::ok();
  }

  Status submit(std::span<const RawOp> ops) override {
    for (const RawOp& op : ops) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) {  // ring full of unsubmitted sqes: flush and retry once
        int rc = io_uring_submit(&ring_);
        if (rc < 0) return errno_status(-rc, "io_uring_submit");
        sqe = io_uring_get_sqe(&ring_);
        if (sqe == nullptr) return internal_error("io_uring: no free submission entry");
      }
      const int fd = fixed_files_ ? op.slot : op.fd;
      char* b = static_cast<char*>(op.buffer);
      const bool in_reg =
          buf_base_ != nullptr && b >= buf_base_ && b + op.length <= buf_base_ + buf_len_;
      if (in_reg) {
        if (op.write)
          io_uring_prep_write_fixed(sqe, fd, op.buffer, op.length, op.offset, 0);
        else
          io_uring_prep_read_fixed(sqe, fd, op.buffer, op.length, op.offset, 0);
      } else if (op.write) {
        io_uring_prep_write(sqe, fd, op.buffer, op.length, op.offset);
      } else {
        io_uring_prep_read(sqe, fd, op.buffer, op.length, op.offset);
      }
      if (fixed_files_) sqe->flags |= IOSQE_FIXED_FILE;
      io_uring_sqe_set_data64(sqe, op.tag);
      // A large request goes alone (with the small ones before it), unmerged (kUnbatchedBytes).
      if (op.length >= kUnbatchedBytes) STRATA_RETURN_IF_ERROR(flush(), "");
    }
    return flush();  // the rest in one system call
  }

  // Submits every prepared entry; retries if interrupted.
  Status flush() {
    for (;;) {
      if (io_uring_sq_ready(&ring_) == 0) return Status::ok();
      int rc = io_uring_submit(&ring_);
      if (rc >= 0) return Status::ok();
      if (rc != -EINTR && rc != -EAGAIN) return errno_status(-rc, "io_uring_submit");
    }
  }

  Status wait(size_t min, std::vector<RawResult>* out) override {
    size_t got = 0;
    for (;;) {
      io_uring_cqe* cqes[64];
      unsigned n = io_uring_peek_batch_cqe(&ring_, cqes, 64);
      for (unsigned i = 0; i < n; ++i)
        out->push_back({io_uring_cqe_get_data64(cqes[i]), static_cast<int64_t>(cqes[i]->res)});
      io_uring_cq_advance(&ring_, n);
      got += n;
      if (got >= min) return Status::ok();
      io_uring_cqe* cqe = nullptr;
      int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN) return errno_status(-rc, "io_uring_wait_cqe");
    }
  }

 private:
  io_uring ring_{};
  bool inited_ = false;
  bool fixed_files_ = false;
  char* buf_base_ = nullptr;
  size_t buf_len_ = 0;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_uring_backend(int queue_depth) {
  auto b = std::make_unique<UringBackend>();
  Status s = b->init(queue_depth);
  if (!s.is_ok())
    return unavailable(fmt::format("io_uring refused by the kernel: {}", s.message()));
  return std::unique_ptr<Backend>(std::move(b));
}

}  // namespace strata::io

#else  // !STRATA_HAVE_URING

namespace strata::io {
Result<std::unique_ptr<Backend>> make_uring_backend(int) {
  return unavailable(
      "io_uring not built in (liburing missing at build time; install liburing-dev)");
}
}  // namespace strata::io

#endif
