// The Storage engine: splitting, queue-depth control, retries, short-transfer resubmission,
// error messages and checksums, done once above every backend (io/backend.h).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>

#include "io/backend.h"
#include "strata/checksum.h"
#include "strata/log.h"
#include "strata/storage.h"
#include "strata/storage_faults.h"

namespace strata {

namespace io {
namespace {

constexpr int kMaxTransientRetries = 1000;

const char* op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

struct File {
  int fd = -1;
  std::string path;
  std::map<uint64_t, std::pair<uint64_t, uint32_t>> crcs;  // offset -> (length, crc32c)
};

struct Request {
  IoRequest req;
  uint64_t seq = 0;          // unique id, for run()
  uint64_t next = 0;         // bytes of the request already cut into pieces
  uint32_t outstanding = 0;  // pieces issued and not finished (in flight or awaiting retry)
  uint32_t crc = 0;          // writes with checksum: CRC32C of the data at submit time
  Status status;             // first failure
  bool live = false;
};

struct Piece {
  uint32_t request = 0;  // index into requests_
  uint64_t offset = 0;   // within the request
  uint32_t length = 0;
  uint32_t done = 0;  // bytes already transferred
  int retries = 0;
  bool live = false;
};

struct Ready {
  uint64_t seq;
  IoCompletion completion;
};

class Engine final : public Storage {
 public:
  Engine(std::unique_ptr<Backend> backend, const StorageOptions& options, std::string note)
      : backend_(std::move(backend)), options_(options) {
    caps_.backend = backend_->name();
    caps_.direct_io = backend_->direct_io();
    caps_.fixed_files = backend_->fixed_files();
    caps_.max_queue_depth = options.queue_depth;
    caps_.block_size = options.block_size;
    caps_.note = std::move(note);
    files_.resize(kMaxFiles);
  }

  ~Engine() override {
    // Drain what is in flight so no kernel I/O targets freed buffers after we return.
    std::vector<RawResult> results;
    while (in_flight_ > 0) {
      results.clear();
      if (!backend_->wait(1, &results).is_ok()) break;
      in_flight_ -= std::min(in_flight_, results.size());
    }
    for (int i = 0; i < kMaxFiles; ++i)
      if (files_[i].fd >= 0) close(i);
  }

  const StorageCaps& capabilities() const override { return caps_; }

  Result<FileId> open(const std::string& path, const OpenOptions& o) override {
    int slot = -1;
    for (int i = 0; i < kMaxFiles; ++i)
      if (files_[i].fd < 0) {
        slot = i;
        break;
      }
    if (slot < 0)
      return out_of_memory(
          fmt::format("opening {}: all {} file slots in use; close some first", path, kMaxFiles));
    int flags = O_RDWR | O_NOFOLLOW | O_CLOEXEC;  // never through a link
    if (o.create) flags |= O_CREAT;
    if (o.truncate) flags |= O_TRUNC;
    if (caps_.direct_io) flags |= O_DIRECT;
    int fd = ::open(path.c_str(), flags, 0600);
    if (fd < 0) {
      const int err = errno;
      if (err == EINVAL && caps_.direct_io)
        return unavailable(fmt::format(
            "opening {} with O_DIRECT: the file system refuses direct I/O (tmpfs?); put the path "
            "on a real local file system (ext4, xfs) or set aio.backend to \"posix\"",
            path));
      return errno_status(err, fmt::format("opening {}", path));
    }
    Status s = backend_->add_file(slot, fd);
    if (!s.is_ok()) {
      ::close(fd);
      return s.with_context(fmt::format("opening {}", path));
    }
    files_[slot].fd = fd;
    files_[slot].path = path;
    files_[slot].crcs.clear();
    return FileId{slot};
  }

  void close(FileId file) override {
    if (file < 0 || file >= kMaxFiles || files_[file].fd < 0) return;
    backend_->remove_file(file);
    ::close(files_[file].fd);
    files_[file].fd = -1;
    files_[file].path.clear();
    files_[file].crcs.clear();
  }

  const std::string& path(FileId file) const override {
    static const std::string kEmpty;
    if (file < 0 || file >= kMaxFiles) return kEmpty;
    return files_[file].path;
  }

  Status register_buffer(void* base, size_t length) override {
    Status s = backend_->register_buffer(base, length);
    caps_.registered_buffers = backend_->registered_buffers();
    return s;
  }

  Status submit(std::span<const IoRequest> requests) override {
    for (size_t i = 0; i < requests.size(); ++i) {
      Status s = validate(requests[i]);
      if (!s.is_ok()) return s.with_context(fmt::format("request {} of {}", i, requests.size()));
    }
    for (const IoRequest& r : requests) enqueue(r);
    return pump();
  }

  size_t reap(std::span<IoCompletion> out, size_t min_complete) override {
    const size_t target = std::min(min_complete, ready_.size() + active_);
    while (ready_.size() < target) {
      Status s = progress();
      STRATA_CHECK(s.is_ok(), s.to_string());
    }
    size_t n = std::min(out.size(), ready_.size());
    for (size_t i = 0; i < n; ++i) {
      out[i] = std::move(ready_.front().completion);
      ready_.pop_front();
    }
    return n;
  }

  size_t pending() const override { return active_ + ready_.size(); }

  Status run(std::span<const IoRequest> requests) override {
    const uint64_t first = next_seq_;
    STRATA_RETURN_IF_ERROR(submit(requests), "run");
    const uint64_t last = next_seq_;  // seqs [first, last) are ours
    Status first_error;
    size_t collected = 0;
    while (collected < requests.size()) {
      for (auto it = ready_.begin(); it != ready_.end();) {
        if (it->seq >= first && it->seq < last) {
          if (first_error.is_ok() && !it->completion.status.is_ok())
            first_error = it->completion.status;
          it = ready_.erase(it);
          ++collected;
        } else {
          ++it;
        }
      }
      if (collected < requests.size()) STRATA_RETURN_IF_ERROR(progress(), "run");
    }
    return first_error;
  }

  StorageStats stats() const override { return stats_; }

 private:
  Status validate(const IoRequest& r) const {
    if (r.file < 0 || r.file >= kMaxFiles || files_[r.file].fd < 0)
      return invalid_argument(fmt::format("{} of unknown file id {}", op_name(r.op), r.file));
    const std::string& p = files_[r.file].path;
    if (r.length == 0 || r.buffer == nullptr)
      return invalid_argument(fmt::format("{} {} at offset {}: zero length or null buffer",
                                          op_name(r.op), p, r.offset));
    if (caps_.direct_io) {
      const uint64_t a = kStorageAlignment;
      if (r.offset % a || r.length % a || reinterpret_cast<uintptr_t>(r.buffer) % a)
        return invalid_argument(fmt::format(
            "{} {} at offset {} length {} buffer {}: O_DIRECT needs offset, length and buffer "
            "aligned to {} bytes (use a BufferPool buffer and round sizes up)",
            op_name(r.op), p, r.offset, r.length, r.buffer, a));
    }
    return Status::ok();
  }

  void enqueue(const IoRequest& r) {
    uint32_t idx;
    if (!free_requests_.empty()) {
      idx = free_requests_.back();
      free_requests_.pop_back();
    } else {
      idx = static_cast<uint32_t>(requests_.size());
      requests_.emplace_back();
    }
    Request& q = requests_[idx];
    q = Request{};
    q.req = r;
    q.seq = next_seq_++;
    q.live = true;
    if (options_.checksum && r.op == IoOp::kWrite) q.crc = crc32c(0, r.buffer, r.length);
    // An urgent request goes after the urgent ones still waiting, before the rest.
    auto at = waiting_.begin();
    if (r.urgent) {
      while (at != waiting_.end() && requests_[*at].req.urgent) ++at;
    } else {
      at = waiting_.end();
    }
    waiting_.insert(at, idx);
    ++active_;
  }

  // Issues pieces (retries first, then new ones) until queue_depth are in flight.
  Status pump() {
    std::vector<RawOp> batch;
    std::vector<uint32_t> batch_pieces;
    const size_t depth = static_cast<size_t>(options_.queue_depth);
    while (in_flight_ + batch.size() < depth) {
      uint32_t pi;
      if (!retry_.empty()) {
        pi = retry_.front();
        retry_.pop_front();
        if (!requests_[pieces_[pi].request].status.is_ok()) {  // request already failed
          finish_piece(pi);
          continue;
        }
      } else if (!waiting_.empty()) {
        const uint32_t ri = waiting_.front();
        Request& q = requests_[ri];
        if (!q.live || !q.status.is_ok() || q.next >= q.req.length) {
          waiting_.pop_front();
          continue;
        }
        pi = new_piece();
        Piece& p = pieces_[pi];
        p.request = ri;
        p.offset = q.next;
        p.length =
            static_cast<uint32_t>(std::min<uint64_t>(options_.block_size, q.req.length - q.next));
        q.next += p.length;
        ++q.outstanding;
        if (q.next >= q.req.length) waiting_.pop_front();
      } else {
        break;
      }
      const Piece& p = pieces_[pi];
      const Request& q = requests_[p.request];
      RawOp op;
      op.write = q.req.op == IoOp::kWrite;
      op.fd = files_[q.req.file].fd;
      op.slot = q.req.file;
      op.offset = q.req.offset + p.offset + p.done;
      op.buffer = static_cast<char*>(q.req.buffer) + p.offset + p.done;
      op.length = p.length - p.done;
      op.tag = pi;
      batch.push_back(op);
      batch_pieces.push_back(pi);
    }
    if (batch.empty()) return Status::ok();
    stats_.pieces += batch.size();
    Status s = backend_->submit(batch);
    if (!s.is_ok()) {
      for (uint32_t pi : batch_pieces) {
        fail(pieces_[pi].request, s.with_context(describe(pieces_[pi])));
        finish_piece(pi);
      }
      return Status::ok();  // the failures surface as completions
    }
    in_flight_ += batch.size();
    return Status::ok();
  }

  // Waits for at least one piece, handles the results, refills the queue.
  Status progress() {
    STRATA_RETURN_IF_ERROR(pump(), "issuing I/O");
    if (in_flight_ == 0) {
      // Nothing in flight yet requests still active: they must be failed ones waiting to be
      // completed (handled in finish_piece) or a bug.
      STRATA_CHECK(active_ == 0, "storage engine stalled: requests active, nothing in flight");
      return Status::ok();
    }
    results_.clear();
    STRATA_RETURN_IF_ERROR(backend_->wait(1, &results_), fmt::format("{} wait", caps_.backend));
    in_flight_ -= results_.size();
    for (const RawResult& r : results_) handle(r);
    return pump();
  }

  void handle(const RawResult& r) {
    const uint32_t pi = static_cast<uint32_t>(r.tag);
    Piece& p = pieces_[pi];
    Request& q = requests_[p.request];
    if (r.result < 0) {
      const int err = static_cast<int>(-r.result);
      if ((err == EINTR || err == EAGAIN) && p.retries < kMaxTransientRetries) {
        ++p.retries;
        ++stats_.retries;
        retry_.push_back(pi);
        return;
      }
      fail(p.request, errno_status(err, describe(p)));
      finish_piece(pi);
      return;
    }
    if (r.result == 0) {
      fail(p.request,
           io_error(fmt::format("{}: {} returned 0 bytes at offset {} ({}; the file is shorter "
                                "than the request, or the disk is full)",
                                describe(p), op_name(q.req.op), q.req.offset + p.offset + p.done,
                                q.req.op == IoOp::kRead ? "end of file" : "nothing written")));
      finish_piece(pi);
      return;
    }
    p.done += static_cast<uint32_t>(r.result);
    if (p.done < p.length) {
      ++stats_.short_resubmits;
      retry_.push_back(pi);
      return;
    }
    finish_piece(pi);
  }

  std::string describe(const Piece& p) const {
    const Request& q = requests_[p.request];
    return fmt::format("{} {} offset {} length {} (piece at offset {} length {})",
                       op_name(q.req.op), files_[q.req.file].path, q.req.offset, q.req.length,
                       q.req.offset + p.offset, p.length);
  }

  void fail(uint32_t ri, Status s) {
    Request& q = requests_[ri];
    if (q.status.is_ok()) q.status = std::move(s);
  }

  uint32_t new_piece() {
    if (!free_pieces_.empty()) {
      uint32_t i = free_pieces_.back();
      free_pieces_.pop_back();
      pieces_[i] = Piece{};
      pieces_[i].live = true;
      return i;
    }
    pieces_.emplace_back();
    pieces_.back().live = true;
    return static_cast<uint32_t>(pieces_.size() - 1);
  }

  void finish_piece(uint32_t pi) {
    const uint32_t ri = pieces_[pi].request;
    pieces_[pi].live = false;
    free_pieces_.push_back(pi);
    Request& q = requests_[ri];
    --q.outstanding;
    const bool all_cut = q.next >= q.req.length || !q.status.is_ok();
    if (q.outstanding == 0 && all_cut) complete(ri);
  }

  void complete(uint32_t ri) {
    Request& q = requests_[ri];
    File& f = files_[q.req.file];
    Status s = q.status;
    const uint64_t end = q.req.offset + q.req.length;
    if (q.req.op == IoOp::kWrite && options_.checksum) {
      // Forget recorded extents this write overlaps; remember this one if it landed.
      auto it = f.crcs.lower_bound(q.req.offset);
      if (it != f.crcs.begin()) {
        auto prev = std::prev(it);
        if (prev->first + prev->second.first > q.req.offset) it = prev;
      }
      while (it != f.crcs.end() && it->first < end) it = f.crcs.erase(it);
      if (s.is_ok()) f.crcs[q.req.offset] = {q.req.length, q.crc};
    }
    if (q.req.op == IoOp::kRead && options_.checksum && s.is_ok()) {
      auto it = f.crcs.find(q.req.offset);
      if (it != f.crcs.end() && it->second.first == q.req.length) {
        const uint32_t got = crc32c(0, q.req.buffer, q.req.length);
        ++stats_.checksums_verified;
        if (got != it->second.second)
          s = corrupt(fmt::format(
              "read {} offset {} length {}: CRC32C mismatch (stored {:08x}, read {:08x}); the "
              "data on disk changed behind strata's back or the device is failing",
              f.path, q.req.offset, q.req.length, it->second.second, got));
      } else {
        ++stats_.checksums_skipped;
      }
    }
    if (s.is_ok()) {
      (q.req.op == IoOp::kRead ? stats_.bytes_read : stats_.bytes_written) += q.req.length;
    }
    ++stats_.requests;
    ready_.push_back({q.seq, IoCompletion{q.req.cookie, std::move(s)}});
    q.live = false;
    free_requests_.push_back(ri);
    --active_;
  }

  std::unique_ptr<Backend> backend_;
  StorageOptions options_;
  StorageCaps caps_;
  std::vector<File> files_;
  std::vector<Request> requests_;
  std::vector<uint32_t> free_requests_;
  std::vector<Piece> pieces_;
  std::vector<uint32_t> free_pieces_;
  std::deque<uint32_t> waiting_;  // requests with bytes not yet cut into pieces
  std::deque<uint32_t> retry_;    // pieces to resubmit (short or transient)
  std::deque<Ready> ready_;       // completions not yet reaped
  std::vector<RawResult> results_;
  size_t in_flight_ = 0;  // pieces in the backend
  size_t active_ = 0;     // requests submitted and not complete
  uint64_t next_seq_ = 0;
  StorageStats stats_;
};

Result<std::unique_ptr<Backend>> make_backend(const std::string& name, const StorageOptions& o) {
  if (name == "io_uring") return make_uring_backend(o.queue_depth);
  if (name == "libaio") return make_aio_backend(o.queue_depth);
  if (name == "posix") return make_posix_backend(o.posix_threads);
  return invalid_argument(
      fmt::format("aio.backend \"{}\" is not one of auto, io_uring, libaio, posix", name));
}

}  // namespace
}  // namespace io

bool storage_backend_available(const std::string& backend, std::string* why) {
  StorageOptions o;
  o.queue_depth = 4;
  o.posix_threads = 1;
  auto b = io::make_backend(backend, o);
  if (!b.is_ok() && why != nullptr) *why = b.status().message();
  return b.is_ok();
}

Result<std::unique_ptr<Storage>> open_storage(const StorageOptions& options) {
  if (options.block_size == 0 || options.block_size % kStorageAlignment != 0 ||
      options.block_size > (size_t{1} << 30))
    return invalid_argument(
        fmt::format("aio.block_size {} must be a multiple of {} between {} and 1 GiB",
                    options.block_size, kStorageAlignment, kStorageAlignment));
  if (options.queue_depth < 1 || options.queue_depth > 4096)
    return invalid_argument(
        fmt::format("aio.queue_depth {} must be between 1 and 4096", options.queue_depth));
  std::unique_ptr<io::Backend> backend;
  std::string note;
  if (options.backend == "auto") {
    for (const char* name : {"io_uring", "libaio", "posix"}) {
      auto b = io::make_backend(name, options);
      if (b.is_ok()) {
        backend = std::move(b).value();
        break;
      }
      note += fmt::format("{}{} refused: {}", note.empty() ? "" : "; ", name, b.status().message());
    }
    if (!backend) return unavailable("aio.backend auto: no backend could start: " + note);
    log_info("storage: aio.backend auto chose {}{}{}", backend->name(), note.empty() ? "" : " (",
             note.empty() ? "" : note + ")");
  } else {
    STRATA_ASSIGN_OR_RETURN(backend, io::make_backend(options.backend, options),
                            fmt::format("aio.backend \"{}\"", options.backend));
  }
  if (options.faults) backend = io::make_fault_backend(std::move(backend), options.faults);
  return std::unique_ptr<Storage>(
      std::make_unique<io::Engine>(std::move(backend), options, std::move(note)));
}

}  // namespace strata
