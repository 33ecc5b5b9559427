// IoWorker: one thread that owns the Storage engine and the swap space, so that the rest of the
// engine can read and write NVMe-resident objects asynchronously from any thread.
//
// read()/write() queue the transfer of a whole swap extent to/from a host buffer and return a
// ticket; wait(ticket) blocks until it is done and returns its Status (an I/O error names the
// path, offset and errno). A read of an extent with a write still in flight is held back until
// that write completes (read-after-write order per extent), so callers may leave writes
// running behind later work. The worker submits everything queued in one batch and reaps
// completions as they come, so many transfers are in flight at once (up to aio.queue_depth
// pieces, see strata/storage.h). Buffers must stay valid until their ticket is waited for.
//
// Thread safety: read/write/wait may be called from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "strata/status.h"
#include "strata/storage.h"
#include "strata/swap_space.h"

namespace strata {

class IoWorker {
 public:
  IoWorker(Storage* storage, SwapSpace* swap);
  ~IoWorker();  // waits for queued work, then stops

  using Ticket = uint64_t;
  // `urgent`: the compute waits for it (a parameter fetch); its pieces go to the disk before
  // those of every transfer queued that is not urgent (IoRequest::urgent).
  Ticket read(const SwapExtent& extent, void* buffer, bool urgent = false);
  // `urgent` as for read(); the caller orders an urgent write after any earlier write of the
  // same extent (the pipeline's state writes follow a read of their extent or its last write).
  Ticket write(const SwapExtent& extent, const void* buffer, bool urgent = false);
  // Blocks until the transfer is done. Each ticket is waited for exactly once.
  Status wait(Ticket t);
  // True once the transfer is done (wait() will not block).
  bool done(Ticket t) const;
  // Seconds callers spent blocked in wait() (the "waiting on I/O" time).
  double wait_seconds() const;
  // Bytes of transfers done (counted as each completes).
  uint64_t bytes_read() const;
  uint64_t bytes_written() const;
  // Bytes of transfers asked for, reads and writes (counted as each is queued): what a caller's
  // span of work asked of the disk, wherever a write behind it lands.
  uint64_t bytes_queued() const;

 private:
  struct Job {
    Ticket ticket;
    IoOp op;
    SwapExtent extent;
    void* buffer;
    bool urgent = false;
  };
  void run();

  Storage* storage_;
  SwapSpace* swap_;
  mutable std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<Job> queue_;
  std::unordered_map<Ticket, Status> done_;
  std::unordered_map<Ticket, size_t> parts_left_;  // requests outstanding per ticket
  std::unordered_map<Ticket, Status> first_error_;
  // Writes in flight per extent (keyed by its first part), and reads held back behind them.
  std::unordered_map<uint64_t, Ticket> writing_;
  std::deque<Job> held_;
  Ticket next_ = 1;
  bool stop_ = false;
  double wait_s_ = 0;
  uint64_t bytes_read_ = 0, bytes_written_ = 0, bytes_queued_ = 0;
  std::thread thread_;
};

}  // namespace strata
