// The optimizer step for shards that stay on the GPU (the AdamW of ZeRO's "offload nothing").
//
// cuda_device_optimizer_step() enqueues on `stream` the same update optimizer_step_reference()
// (strata/optimizer.h) defines, element for element: Adam, AdamW, Adagrad and Lion, fp32 master,
// fp32 or bf16 moments, grad in any dtype times grad_mult, optional low-precision copy-out
// (round to nearest even). Every pointer in `shard` must be device memory of `device`.
//
// Returns kInvalidArgument if `device` is not a CUDA device or `stream` is not one of its
// streams, and the launch error otherwise; an error while the kernel runs is reported by the
// next synchronize on `stream`. Asynchronous like every enqueue: `shard`'s buffers must stay
// alive until then, the structs themselves are copied.
//
// The tier manager reaches the same launcher through the Kernels table (Kernels::optimizer_step,
// kernels/cuda/cuda_kernels.cc) to step device-resident optimizer state
// (src/tiers/device_optimizer.h); this entry checks the device and stream and returns the launch
// error directly (tests/cuda_backend_test.cc tests it against the CPU reference).
#pragma once

#include "strata/device.h"
#include "strata/optimizer.h"
#include "strata/status.h"

namespace strata {

Status cuda_device_optimizer_step(Device& device, Stream& stream, const OptimizerHyper& hyper,
                                  const ShardState& shard);

}  // namespace strata
