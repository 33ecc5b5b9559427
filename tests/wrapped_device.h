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

class WrappedDevice final : public Device {
 public:
  // host_addressable: what this device claims (the inner device's memory is host memory).
  WrappedDevice(std::unique_ptr<Device> inner, bool host_addressable,
                std::shared_ptr<KernelCounts> counts = std::make_shared<KernelCounts>())
      : inner_(std::move(inner)),
        addressable_(host_addressable),
        kernels_(inner_->kernels(), std::move(counts)) {}

  DeviceKind kind() const override { return inner_->kind(); }
  bool host_addressable() const override { return addressable_; }
  // Models on this device use the plain attention (see CountingKernels::fused_attention).
  void disable_fused_attention() { kernels_.fused_attention = false; }
  std::string name() const override {
    return inner_->name() + (addressable_ ? "" : " [not host-addressable]");
  }
  Result<void*> allocate(size_t bytes, std::string_view tag) override {
    return inner_->allocate(bytes, tag);
  }
  void release(void* ptr) override { inner_->release(ptr); }
  DeviceMemoryStats memory_stats() const override { return inner_->memory_stats(); }
  void reset_peak() override { inner_->reset_peak(); }
  Result<void*> allocate_host(size_t bytes) override { return inner_->allocate_host(bytes); }
  void release_host(void* ptr) override { inner_->release_host(ptr); }
  Status register_host(void* ptr, size_t bytes) override {
    return inner_->register_host(ptr, bytes);
  }
  void unregister_host(void* ptr) override { inner_->unregister_host(ptr); }
  Stream& compute_stream() override { return inner_->compute_stream(); }
  Stream& h2d_stream() override { return inner_->h2d_stream(); }
  Stream& d2h_stream() override { return inner_->d2h_stream(); }
  std::unique_ptr<Event> create_event() override { return inner_->create_event(); }
  void record(Event& event, Stream& stream) override { inner_->record(event, stream); }
  void wait(Stream& stream, const Event& event) override { inner_->wait(stream, event); }
  Status synchronize(Event& event) override { return inner_->synchronize(event); }
  Status synchronize(Stream& stream) override { return inner_->synchronize(stream); }
  bool query(Event& event) override { return inner_->query(event); }
  void copy_h2d(Stream& s, void* dst, const void* src, size_t bytes) override {
    inner_->copy_h2d(s, dst, src, bytes);
  }
  void copy_d2h(Stream& s, void* dst, const void* src, size_t bytes) override {
    inner_->copy_d2h(s, dst, src, bytes);
  }
  void copy_d2d(Stream& s, void* dst, const void* src, size_t bytes) override {
    inner_->copy_d2d(s, dst, src, bytes);
  }
  void memset_zero(Stream& s, void* dst, size_t bytes) override {
    inner_->memset_zero(s, dst, bytes);
  }
  void host_fn(Stream& s, std::function<void()> fn) override { inner_->host_fn(s, std::move(fn)); }
  Kernels& kernels() override { return kernels_; }

 private:
  std::unique_ptr<Device> inner_;
  bool addressable_;
  CountingKernels kernels_;
};

}  // namespace strata::test
