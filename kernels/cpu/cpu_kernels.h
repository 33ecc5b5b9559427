// The CPU backend's kernel table (internal to kernels/cpu and its device).
#pragma once

#include <memory>

#include "strata/kernels.h"

namespace strata {

class Device;

// Kernels that enqueue their work on `device`'s streams through Device::host_fn and run it with
// up to `threads` TBB workers (0 = all cores). `device` must outlive the table.
std::unique_ptr<Kernels> create_cpu_kernels(Device& device, int threads);

}  // namespace strata
