// The run's device (the CPU or CUDA backend, or the simulated fast device) and its
// communicators (ZeRO-3's collectives, ZeRO++'s compression): Run::create_device and
// Run::create_comms.
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <utility>

#include "src/comm/zeropp.h"
#include "src/train/run.h"
#include "strata/comm.h"
#include "strata/device.h"
#include "strata/log.h"
#include "strata/simulated_device.h"

namespace strata::run_detail {

Status Run::create_device() {
  std::string backend = cfg_.device.backend;
  if (!cfg_.device.simulate.empty()) {
    if (backend == "cuda") {
      return invalid_argument(
          "device.simulate runs on the CPU backend: set device.backend to cpu or auto, or "
          "device.simulate to \"\" to train on the GPU");
    }
    const DeviceConfig& d = cfg_.device;
    STRATA_ASSIGN_OR_RETURN(SimulatedDeviceOptions sim, simulated_device_options(d), "");
    CpuDeviceOptions o;
    o.capacity = sim.memory;
    o.threads = d.cpu_threads;
    STRATA_ASSIGN_OR_RETURN(dev_, create_simulated_device(o, sim), "creating the simulated device");
    if (opts_.wrap_device) dev_ = opts_.wrap_device(std::move(dev_));
    STRATA_RETURN_IF_ERROR(wrap_profiler(sim), "flops_profiler");
    log_info(
        "device: {}; losses are not real (device.simulate), times and bytes are; gradient "
        "norm {} (device.simulate_grad_norm)",
        dev_->name(), d.simulate_grad_norm);
    return Status::ok();
  }
  if (backend == "auto") {
    std::string why;
    backend = cuda_device_available(&why) ? "cuda" : "cpu";
    log_info("device.backend = auto: using {}{}", backend,
             backend == "cpu" ? fmt::format(" ({})", why) : "");
  }
  if (backend == "cuda") {
    CudaDeviceOptions o;
    o.ordinal = cfg_.device.ordinal < 0 ? 0 : cfg_.device.ordinal;
    if (cfg_.device.ordinal < 0) {
      // Several ranks per host: the launcher's local rank picks the GPU.
      for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
        if (const char* v = std::getenv(var)) {
          o.ordinal = std::atoi(v);
          break;
        }
      }
    }
    o.reserve = cfg_.device.reserve;
    o.capacity = cfg_.device.memory_limit;
    o.deterministic = cfg_.device.deterministic;
    STRATA_ASSIGN_OR_RETURN(dev_, create_cuda_device(o), "creating the cuda device");
  } else {
    CpuDeviceOptions o;
    o.capacity = cfg_.device.memory_limit > 0 ? cfg_.device.memory_limit : size_t{1} << 30;
    o.threads = cfg_.device.cpu_threads;
    STRATA_ASSIGN_OR_RETURN(dev_, create_cpu_device(o), "creating the cpu device");
  }
  if (opts_.wrap_device) dev_ = opts_.wrap_device(std::move(dev_));
  // A GPU the simulated device has a preset for: the op profile sets each op beside the
  // preset's time for it.
  std::optional<SimulatedDeviceOptions> model;
  if (dev_->kind() == DeviceKind::kCuda) {
    for (const char* gpu : {"H200", "H100", "A100"}) {
      if (dev_->name().find(gpu) != std::string::npos) {
        std::string preset(gpu);
        std::transform(preset.begin(), preset.end(), preset.begin(), ::tolower);
        model = simulated_device_preset(preset).value();
        break;
      }
    }
  }
  STRATA_RETURN_IF_ERROR(wrap_profiler(model), "flops_profiler");
  log_info("device: {}", dev_->name());
  return Status::ok();
}

Status Run::wrap_profiler(std::optional<SimulatedDeviceOptions> model) {
  if (!cfg_.flops_profiler.enabled) return Status::ok();
  // The table goes to a new file or over an earlier profile, never over anything else.
  const std::string& path = cfg_.flops_profiler.output_file;
  struct stat st;
  if (!path.empty() && ::lstat(path.c_str(), &st) == 0) {
    std::string head(32, '\0');
    std::ifstream in(path, std::ios::binary);
    in.read(head.data(), std::streamsize(head.size()));
    head.resize(size_t(in.gcount()));
    if (!S_ISREG(st.st_mode) || head.rfind(kOpProfileTitle, 0) != 0) {
      return invalid_argument(fmt::format(
          "flops_profiler.output_file {} exists and is not an op profile (or is a link): strata "
          "does not write over it; name a new file",
          path));
    }
  }
  auto profiled = std::make_unique<ProfiledDevice>(std::move(dev_), std::move(model));
  profiler_ = profiled.get();
  dev_ = std::move(profiled);
  log_info("flops_profiler: the ops of step {} will be timed on the device (the op profile)",
           cfg_.flops_profiler.profile_step + 1);
  return Status::ok();
}

Status Run::create_comms() {
  CommOptions co;
  co.timeout_s = cfg_.strata.comm_timeout_s;
  const std::string& b = cfg_.strata.comm_backend;
  STRATA_ASSIGN_OR_RETURN(comm_, create_communicator(b, dev_.get(), co), "strata.comm.backend");
  world_ = comm_->size();
  rank_ = comm_->rank();
  if (world_ > 1 && !cfg_.device.simulate.empty()) {
    // The simulated device holds its memory apart from the host's, as a GPU does, and the host
    // communicators move host buffers (a GPU's ranks talk over NCCL, which it does not model).
    return invalid_argument(fmt::format(
        "device.simulate runs one rank ({} here): run it without mpirun, or set device.simulate "
        "to \"\" to train the {} ranks on the CPU backend",
        world_, world_));
  }
  if (world_ > 1) {
    set_log_rank(rank_);
    STRATA_ASSIGN_OR_RETURN(param_comm_, create_communicator(comm_->backend(), dev_.get(), co),
                            "strata.comm.backend (parameter gathers)");
    STRATA_ASSIGN_OR_RETURN(grad_comm_, create_communicator(comm_->backend(), dev_.get(), co),
                            "strata.comm.backend (gradient reduce-scatters)");
    ZeroPPOptions zo;
    zo.quantized_weights = cfg_.zero.zero_quantized_weights;
    zo.hpz_partition_size = cfg_.zero.zero_hpz_partition_size;
    zo.quantized_gradients = cfg_.zero.zero_quantized_gradients;
    zo.ranks_per_node = cfg_.strata.comm_ranks_per_node;
    if (zo.any()) {
      STRATA_ASSIGN_OR_RETURN(zeropp_, ZeroPP::create(zo, *param_comm_, *grad_comm_), "");
    }
  }
  if (world_ == 1) {
    // ZeRO++ compresses what ranks send each other: on one rank there is nothing to compress.
    std::string keys;
    for (const auto& [on, key] :
         {std::pair{cfg_.zero.zero_quantized_weights, "zero_quantized_weights"},
          {cfg_.zero.zero_hpz_partition_size > 1, "zero_hpz_partition_size"},
          {cfg_.zero.zero_quantized_gradients, "zero_quantized_gradients"}}) {
      if (on) keys += fmt::format("{}zero_optimization.{}", keys.empty() ? "" : ", ", key);
    }
    if (!keys.empty()) {
      log_warn(
          "{}: ZeRO++ compresses the collectives between ranks, and this run has one rank, "
          "so it does nothing here; launch with mpirun -np N (N > 1) for it to act, or "
          "remove the key(s)",
          keys);
    }
  }
  log_info("comm: {} backend, rank {} of {}, timeout {:g} s", comm_->backend(), rank_, world_,
           comm_->timeout_s());
  return Status::ok();
}

}  // namespace strata::run_detail
