// A test double of the Device interface: forwards everything to a real device, but can claim
// that the host cannot address its memory (as a CUDA device), so that the code paths a GPU
// takes — copies instead of host pointers, the device's optimizer, gradient statistics on the
// device — run on the CPU backend in CI; and counts the optimizer steps its kernels enqueue.
//
// Memory is still host memory underneath: a host access to device memory on such a path is not
// caught here (only on a GPU), but any missing copy or ordering shows up as different numbers.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "strata/device.h"
#include "strata/device_wrapper.h"
#include "strata/kernels.h"
#include "strata/kernels_wrapper.h"

namespace strata::test {

// What CountingKernels counts; shared, so that it outlives the device.
struct KernelCounts {
  std::atomic<long> optimizer_steps{0};
  std::atomic<long> optimizer_elements{0};
};

// Forwards every op to `inner` (KernelsWrapper), counting optimizer_step calls and their
// elements. With fused_attention false it reports the fused attention unsupported, so that
// models take the plain attention (the reference the fused one is compared with).
class CountingKernels final : public KernelsWrapper {
 public:
  bool fused_attention = true;

  CountingKernels(Kernels& inner, std::shared_ptr<KernelCounts> counts)
      : KernelsWrapper(&inner), counts_(std::move(counts)) {}

  KernelSupport supports(KernelOp op, const OpShape& shape) const override {
    if (op == KernelOp::kFusedAttention && !fused_attention) {
      return {false, "fused attention turned off by the test device"};
    }
    return KernelsWrapper::supports(op, shape);
  }
  void optimizer_step(Stream& s, const OptimizerHyper& hyper, const ShardState& shard) override {
    counts_->optimizer_steps.fetch_add(1);
    counts_->optimizer_elements.fetch_add(long(shard.n));
    KernelsWrapper::optimizer_step(s, hyper, shard);
  }

 private:
  std::shared_ptr<KernelCounts> counts_;
};

class WrappedDevice final : public DeviceWrapper {
 public:
  // host_addressable: what this device claims (the inner device's memory is host memory).
  WrappedDevice(std::unique_ptr<Device> inner, bool host_addressable,
                std::shared_ptr<KernelCounts> counts = std::make_shared<KernelCounts>())
      : DeviceWrapper(std::move(inner)),
        addressable_(host_addressable),
        kernels_(wrapped().kernels(), std::move(counts)) {}

  bool host_addressable() const override { return addressable_; }
  // Models on this device use the plain attention (see CountingKernels::fused_attention).
  void disable_fused_attention() { kernels_.fused_attention = false; }
  std::string name() const override {
    return wrapped().name() + (addressable_ ? "" : " [not host-addressable]");
  }
  Kernels& kernels() override { return kernels_; }

 private:
  bool addressable_;
  CountingKernels kernels_;
};

}  // namespace strata::test
