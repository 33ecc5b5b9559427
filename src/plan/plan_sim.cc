// The planner's compute on a simulated device (plan_parts.h, simulated_program_time): one
// micro-batch's training program, run through the architecture's own runner over a device that
// holds nothing and whose kernels only add up the times the simulated kernels charge.
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "src/plan/plan_parts.h"
#include "strata/kernels.h"
#include "strata/simulated_device.h"

namespace strata {
namespace {

class TallyStream final : public Stream {};
class TallyEvent final : public Event {};

// Device memory is address space only: reserved, never mapped readable, handed out in order and
// never reused, so that no pointer it gives aliases host memory (a kernel writes nothing; a
// host access to it would fault, as a GPU's would). Host memory is real and zeroed, so the
// host-side parts of a program (a mixture's routing, reading its router's logits back) run on
// zeros. Copies move nothing; each op on a stream adds what the simulated device charges for
// it to the tally (kernels through the tally kernels; zeroing and copies as SimDevice does).
class TallyDevice final : public Device {
 public:
  TallyDevice(const SimulatedDeviceOptions& sim, SimTally* tally)
      : sim_(sim), tally_(tally), kernels_(create_simulated_kernel_tally(sim, tally)) {
    void* p =
        ::mmap(nullptr, kReserve, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    base_ = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
  }
  ~TallyDevice() override {
    if (base_) ::munmap(base_, kReserve);
    for (void* p : host_) std::free(p);
  }

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string name() const override { return "simulated device tally"; }
  Result<void*> allocate(size_t bytes, std::string_view tag) override {
    const size_t n = (bytes + 255) / 256 * 256;
    if (!base_ || kReserve - used_ < n) {
      return out_of_memory(fmt::format(
          "the planner's simulated device: no address space for '{}' ({} bytes)", tag, bytes));
    }
    void* p = base_ + used_;
    used_ += n;
    return p;
  }
  void release(void*) override {}
  DeviceMemoryStats memory_stats() const override { return {kReserve, used_, used_}; }
  void reset_peak() override {}
  Result<void*> allocate_host(size_t bytes) override {
    void* p = std::calloc(1, std::max<size_t>(bytes, 1));
    if (!p) return out_of_memory("the planner's simulated device: host memory");
    host_.push_back(p);
    return p;
  }
  void release_host(void* ptr) override {
    std::erase(host_, ptr);
    std::free(ptr);
  }
  Status register_host(void*, size_t) override { return Status::ok(); }
  void unregister_host(void*) override {}
  Stream& compute_stream() override { return compute_; }
  Stream& h2d_stream() override { return h2d_; }
  Stream& d2h_stream() override { return d2h_; }
  std::unique_ptr<Event> create_event() override { return std::make_unique<TallyEvent>(); }
  void record(Event&, Stream&) override {}
  void wait(Stream&, const Event&) override {}
  Status synchronize(Event&) override { return Status::ok(); }
  Status synchronize(Stream&) override { return Status::ok(); }
  bool query(Event&) override { return true; }
  void copy_h2d(Stream& s, void*, const void*, size_t n) override { copy(s, n, false); }
  void copy_d2h(Stream& s, void*, const void*, size_t n) override { copy(s, n, false); }
  void copy_d2d(Stream& s, void*, const void*, size_t n) override { copy(s, n, true); }
  void memset_zero(Stream& s, void*, size_t n) override {
    if (&s != &compute_) return;
    tally_->seconds += sim_.launch_us * 1e-6 + double(n) / (sim_.hbm_gbps * 1e9);
    ++tally_->kernels;
  }
  void host_fn(Stream&, std::function<void()> fn) override { fn(); }
  Kernels& kernels() override { return *kernels_; }

 private:
  static constexpr size_t kReserve = size_t{1} << 44;  // 16 TiB of address space
  // The compute stream's copies hold it up (SimDevice: bytes over the link's rate, within the
  // device over the HBM's, read and write); the copy streams' run beside it.
  void copy(Stream& s, size_t n, bool within) {
    if (&s != &compute_) return;
    tally_->seconds += double(n) / (within ? sim_.hbm_gbps * 1e9 / 2 : sim_.link_gbps * 1e9);
  }

  const SimulatedDeviceOptions sim_;
  SimTally* tally_;
  std::unique_ptr<Kernels> kernels_;
  char* base_ = nullptr;
  size_t used_ = 0;
  std::vector<void*> host_;
  TallyStream compute_, h2d_, d2h_;
};

}  // namespace

Result<SimTally> simulated_program_time(const Architecture& arch, const SimulatedDeviceOptions& sim,
                                        int B, int T, DType dt, ActivationMode mode) {
  SimTally tally;
  TallyDevice dev(sim, &tally);
  // Offloaded activations run the kept program's kernels (the stash's copies are the link's
  // time, which the planner counts apart); their runner would need the tiers' store.
  const ActivationMode run_mode = mode == ActivationMode::kOffload ? ActivationMode::kKeep : mode;
  STRATA_ASSIGN_OR_RETURN(auto runner, arch.create_runner(dev, B, T, dt, run_mode),
                          "the planner's simulated step");
  const ModelLayout& lay = arch.layout();
  std::vector<const void*> params;
  std::vector<float*> grads;
  for (const ModuleSpec& m : lay.modules) {
    STRATA_ASSIGN_OR_RETURN(void* p, dev.allocate(m.numel * dtype_size(dt), "params"), "");
    params.push_back(p);
    float* g = nullptr;
    if (m.trainable) {
      STRATA_ASSIGN_OR_RETURN(void* gp, dev.allocate(m.numel * 4, "grads"), "");
      g = static_cast<float*>(gp);
    }
    grads.push_back(g);
  }
  const size_t N = size_t(B) * size_t(T);
  std::vector<int32_t> tokens(N, 0), targets(N, 0);
  std::vector<float> losses(N);
  float aux = 0;
  runner->begin_batch(tokens.data(), targets.data());
  tally = SimTally{};  // the program's kernels, not the runner's set-up
  const ModuleBindings bound{params, grads};
  MicroBatch mb;
  mb.dloss = 1.0f / float(N);
  mb.losses_out = losses.data();
  mb.aux_loss_out = &aux;
  for (const ProgramOp& op : arch.program(Pass::kTrain).ops) {
    if (op.kind == ProgramOp::kCompute) runner->compute(op, bound, mb);
  }
  STRATA_RETURN_IF_ERROR(runner->status(), "the planner's simulated step");
  return tally;
}

}  // namespace strata
