// Offloaded activations (strata.activations = offload): block inputs stashed in host-tier
// buffers reserved at creation (TierOptions::stash_*) and restored before their backward.
//
// A stash is a device-to-host copy on the d2h stream after the compute stream's work so far; a
// restore a host-to-device copy on the h2d stream after the compute stream's work so far and
// after every stash; compute_waits() makes the compute stream wait for the latest of either.
// The bytes count in the host tier's bytes_in/out and the device tier's bytes_out/in. A bad
// layer or size is an error naming strata.activations, also kept for end_backward.
//
// Thread safety: the host thread calls everything.
#pragma once

#include <memory>
#include <vector>

#include "src/tiers/counters.h"
#include "src/tiers/device_cache.h"
#include "src/tiers/homes.h"

namespace strata {

class ActivationStash {
 public:
  ActivationStash(Homes& homes, DeviceCache& cache, TierCounters& counters, AsyncError& errors);
  // Reserves `layers` host-tier buffers of `bytes` each.
  Status reserve(int layers, size_t bytes);
  // Frees the buffers; call after the streams have been synchronized.
  void release_all();

  Status stash(int layer, const void* dev, size_t bytes);
  Status restore(int layer, void* dev);
  void compute_waits(int layer);

 private:
  Homes& homes_;
  Device& dev_;
  DeviceCache& cache_;
  TierCounters& counters_;
  AsyncError& errors_;
  size_t reserved_bytes_ = 0;
  std::vector<PinnedBuffer> host_;          // one per stashed layer, from the pool
  std::vector<size_t> len_;                 // bytes stashed (0: never)
  std::vector<std::shared_ptr<Event>> ev_;  // latest stash or restore of each layer
  std::shared_ptr<Event> last_stash_;       // the latest stash (the d2h stream is FIFO)
};

}  // namespace strata
