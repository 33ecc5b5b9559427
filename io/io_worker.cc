#include "io/io_worker.h"

#include <pthread.h>

#include <chrono>
#include <vector>

namespace strata {

IoWorker::IoWorker(Storage* storage, SwapSpace* swap) : storage_(storage), swap_(swap) {
  thread_ = std::thread([this] { run(); });
  pthread_setname_np(thread_.native_handle(), "strata-io");  // top -H, perf, gdb
}

IoWorker::~IoWorker() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

IoWorker::Ticket IoWorker::read(const SwapExtent& extent, void* buffer, bool urgent) {
  std::lock_guard<std::mutex> l(mu_);
  Ticket t = next_++;
  queue_.push_back({t, IoOp::kRead, extent, buffer, urgent});
  bytes_queued_ += extent.bytes;
  cv_.notify_all();
  return t;
}

IoWorker::Ticket IoWorker::write(const SwapExtent& extent, const void* buffer, bool urgent) {
  std::lock_guard<std::mutex> l(mu_);
  Ticket t = next_++;
  queue_.push_back({t, IoOp::kWrite, extent, const_cast<void*>(buffer), urgent});
  bytes_queued_ += extent.bytes;
  cv_.notify_all();
  return t;
}

Status IoWorker::wait(Ticket t) {
  auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> l(mu_);
  done_cv_.wait(l, [&] { return done_.count(t) != 0; });
  Status s = std::move(done_[t]);
  done_.erase(t);
  wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

bool IoWorker::done(Ticket t) const {
  std::lock_guard<std::mutex> l(mu_);
  return done_.count(t) != 0;
}

double IoWorker::wait_seconds() const {
  std::lock_guard<std::mutex> l(mu_);
  return wait_s_;
}
uint64_t IoWorker::bytes_read() const {
  std::lock_guard<std::mutex> l(mu_);
  return bytes_read_;
}
uint64_t IoWorker::bytes_written() const {
  std::lock_guard<std::mutex> l(mu_);
  return bytes_written_;
}
uint64_t IoWorker::bytes_queued() const {
  std::lock_guard<std::mutex> l(mu_);
  return bytes_queued_;
}

namespace {
uint64_t extent_key(const SwapExtent& e) {
  return e.parts.empty() ? 0 : (uint64_t(e.parts[0].path) << 56) ^ e.parts[0].offset;
}
}  // namespace

void IoWorker::run() {
  std::vector<IoRequest> reqs;
  std::vector<IoCompletion> comps(256);
  std::unordered_map<Ticket, uint64_t> ticket_bytes;
  std::unordered_map<Ticket, IoOp> ticket_op;
  std::unordered_map<Ticket, uint64_t> ticket_key;  // writes: their extent key
  for (;;) {
    std::deque<Job> jobs;
    {
      std::unique_lock<std::mutex> l(mu_);
      // A held read becomes runnable when the write it waits for completes (reaped below, on
      // this thread): it must wake the loop like new work, or it would sleep until the next
      // request arrived — a deadlock when the caller is waiting for that read.
      auto held_runnable = [&] {
        for (const Job& h : held_) {
          if (writing_.count(extent_key(h.extent)) == 0) return true;
        }
        return false;
      };
      cv_.wait(l, [&] {
        return stop_ || !queue_.empty() || storage_->pending() > 0 || held_runnable();
      });
      if (stop_ && queue_.empty() && storage_->pending() == 0 && held_.empty()) return;
      // Reads held behind a write that has finished go first, in their original order.
      for (auto it = held_.begin(); it != held_.end();) {
        if (writing_.count(extent_key(it->extent)) == 0) {
          jobs.push_back(std::move(*it));
          it = held_.erase(it);
        } else {
          ++it;
        }
      }
      for (Job& j : queue_) {
        const uint64_t key = extent_key(j.extent);
        if (j.op == IoOp::kRead && writing_.count(key) != 0) {
          held_.push_back(std::move(j));
        } else {
          if (j.op == IoOp::kWrite) writing_[key] = j.ticket;
          jobs.push_back(std::move(j));
        }
      }
      queue_.clear();
    }
    for (Job& j : jobs) {
      reqs.clear();
      size_t n = swap_->requests(j.extent, j.op, j.buffer, j.ticket, &reqs);
      for (IoRequest& r : reqs) r.urgent = j.urgent;
      Status s = storage_->submit(reqs);
      std::lock_guard<std::mutex> l(mu_);
      if (!s.is_ok()) {
        done_[j.ticket] = s;
        if (j.op == IoOp::kWrite) writing_.erase(extent_key(j.extent));
        done_cv_.notify_all();
        continue;
      }
      parts_left_[j.ticket] = n;
      ticket_bytes[j.ticket] = j.extent.bytes;
      ticket_op[j.ticket] = j.op;
      if (j.op == IoOp::kWrite) ticket_key[j.ticket] = extent_key(j.extent);
    }
    if (storage_->pending() == 0) continue;
    // Reap at least one completion, then anything else that is ready.
    size_t got = storage_->reap(comps, 1);
    std::lock_guard<std::mutex> l(mu_);
    for (size_t i = 0; i < got; ++i) {
      Ticket t = comps[i].cookie;
      if (!comps[i].status.is_ok() && first_error_.count(t) == 0) {
        first_error_[t] = comps[i].status;
      }
      if (--parts_left_[t] == 0) {
        parts_left_.erase(t);
        auto e = first_error_.find(t);
        if (e != first_error_.end()) {
          done_[t] = e->second;
          first_error_.erase(e);
        } else {
          done_[t] = Status::ok();
          (ticket_op[t] == IoOp::kRead ? bytes_read_ : bytes_written_) += ticket_bytes[t];
        }
        ticket_bytes.erase(t);
        ticket_op.erase(t);
        auto k = ticket_key.find(t);
        if (k != ticket_key.end()) {
          auto w = writing_.find(k->second);
          if (w != writing_.end() && w->second == t) writing_.erase(w);
          ticket_key.erase(k);
        }
      }
    }
    done_cv_.notify_all();
  }
}

}  // namespace strata
