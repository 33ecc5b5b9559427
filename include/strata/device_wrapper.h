// DeviceWrapper: a Device that forwards every call to another one it owns (LevelDB's
// EnvWrapper; KernelsWrapper for the kernel table).
//
// A layer that changes a few calls derives from it and overrides only those: the simulated fast
// device (device.simulate: its copies, zeroing, kernels and host_addressable, kernels/cpu/
// sim_device.cc), a test double that claims the host cannot address its memory
// (tests/wrapped_device.h). A new Device call is added here once, and every wrapper forwards it.
//
// Ownership: the wrapper owns the wrapped device (destroyed with it). Thread safety: that of the
// wrapped device (the wrapper adds no state).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "strata/device.h"

namespace strata {

class DeviceWrapper : public Device {
 public:
  explicit DeviceWrapper(std::unique_ptr<Device> wrapped) : d_(std::move(wrapped)) {}

  // The device every call is forwarded to.
  Device& wrapped() const { return *d_; }

  DeviceKind kind() const override { return d_->kind(); }
  bool host_addressable() const override { return d_->host_addressable(); }
  std::string name() const override { return d_->name(); }

  Result<void*> allocate(size_t bytes, std::string_view tag) override {
    return d_->allocate(bytes, tag);
  }
  void release(void* ptr) override { d_->release(ptr); }
  DeviceMemoryStats memory_stats() const override { return d_->memory_stats(); }
  void reset_peak() override { d_->reset_peak(); }

  Result<void*> allocate_host(size_t bytes) override { return d_->allocate_host(bytes); }
  void release_host(void* ptr) override { d_->release_host(ptr); }
  Status register_host(void* ptr, size_t bytes) override { return d_->register_host(ptr, bytes); }
  void unregister_host(void* ptr) override { d_->unregister_host(ptr); }

  Stream& compute_stream() override { return d_->compute_stream(); }
  Stream& h2d_stream() override { return d_->h2d_stream(); }
  Stream& d2h_stream() override { return d_->d2h_stream(); }
  std::unique_ptr<Event> create_event() override { return d_->create_event(); }
  void record(Event& event, Stream& stream) override { d_->record(event, stream); }
  void wait(Stream& stream, const Event& event) override { d_->wait(stream, event); }
  Status synchronize(Event& event) override { return d_->synchronize(event); }
  Status synchronize(Stream& stream) override { return d_->synchronize(stream); }
  bool query(Event& event) override { return d_->query(event); }
  std::unique_ptr<Event> create_timed_event() override { return d_->create_timed_event(); }
  Result<double> elapsed_ms(Event& from, Event& to) override { return d_->elapsed_ms(from, to); }

  void copy_h2d(Stream& s, void* dst, const void* src, size_t bytes) override {
    d_->copy_h2d(s, dst, src, bytes);
  }
  void copy_d2h(Stream& s, void* dst, const void* src, size_t bytes) override {
    d_->copy_d2h(s, dst, src, bytes);
  }
  void copy_d2d(Stream& s, void* dst, const void* src, size_t bytes) override {
    d_->copy_d2d(s, dst, src, bytes);
  }
  void memset_zero(Stream& s, void* dst, size_t bytes) override { d_->memset_zero(s, dst, bytes); }
  void host_fn(Stream& s, std::function<void()> fn) override { d_->host_fn(s, std::move(fn)); }

  Kernels& kernels() override { return d_->kernels(); }

 private:
  std::unique_ptr<Device> d_;
};

}  // namespace strata
