#include "src/trainer.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "src/checkpoint.h"
#include "src/data.h"
#include "src/model.h"
#include "src/schedule.h"
#include "strata/checksum.h"
#include "strata/device.h"
#include "strata/log.h"
#include "strata/optimizer.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string hms(double s) {
  int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}:{:02}:{:02}", t / 3600, (t / 60) % 60, t % 60);
  return fmt::format("{:02}:{:02}", t / 60, t % 60);
}

size_t host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  size_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

OptimizerKind optimizer_kind(const OptimizerConfig& o) {
  std::string t = o.type;
  for (auto& c : t) c = static_cast<char>(std::tolower(c));
  if (t == "adagrad") return OptimizerKind::kAdagrad;
  if (t == "lion") return OptimizerKind::kLion;
  if (t == "adam" && !o.adam_w_mode) return OptimizerKind::kAdam;
  return OptimizerKind::kAdamW;
}

// Everything one run holds. Device memory: params (dt) + grads (fp32) + activations.
// Host memory: master, moments, a gradient landing buffer and a param staging buffer.
struct Module {
  size_t numel = 0;
  void* params = nullptr;   // device, dt
  float* grads = nullptr;   // device, fp32
  float* master = nullptr;  // host fp32
  void* m = nullptr;        // host moments (moment dtype)
  void* v = nullptr;
  float* grad_host = nullptr;  // host fp32 landing buffer
  void* lp_host = nullptr;     // host staging for new params (dt)
};

class Run {
 public:
  Run(const Config& cfg, const TrainOptions& opts) : cfg_(cfg), opts_(opts) {}
  ~Run() {
    if (!dev_) return;
    dev_->synchronize(dev_->compute_stream()).ignore();
    model_.reset();
    for (Module& m : mods_) {
      dev_->release(m.params);
      dev_->release(m.grads);
      for (void* p :
           {static_cast<void*>(m.master), m.m, m.v, static_cast<void*>(m.grad_host), m.lp_host}) {
        if (p) dev_->release_host(p);
      }
    }
  }

  Status setup();
  Result<TrainResult> loop();

 private:
  Status create_device();
  Status preflight(size_t device_need, size_t host_need);
  Status allocate_state();
  Status init_or_resume();
  Result<double> run_step();
  Result<double> eval_loss();
  Status save_checkpoint(int64_t step, std::string* path_out);
  std::vector<CheckpointBuffers> checkpoint_buffers();
  CheckpointMeta checkpoint_meta(int64_t step) const;
  uint32_t weights_crc() const;

  const Config& cfg_;
  const TrainOptions& opts_;
  ModelLayout layout_;
  DType dt_ = DType::kBF16;
  int B_ = 0, T_ = 0, accum_ = 1;
  std::unique_ptr<Device> dev_;
  std::unique_ptr<GptModel> model_;
  std::optional<Dataset> data_;
  std::vector<Module> mods_;
  LossScaler scaler_;
  int64_t step_ = 0, opt_steps_ = 0;
  OptimizerHyper hyper_;
  std::vector<int32_t> tok_, tgt_;
  std::vector<float> losses_;
  double last_grad_norm_ = 0;
  bool last_skipped_ = false;
};

Status Run::create_device() {
  std::string backend = cfg_.device.backend;
  if (backend == "auto") {
    std::string why;
    backend = cuda_device_available(&why) ? "cuda" : "cpu";
    log_info("device.backend = auto: using {}{}", backend,
             backend == "cpu" ? fmt::format(" ({})", why) : "");
  }
  if (backend == "cuda") {
    CudaDeviceOptions o;
    o.ordinal = cfg_.device.ordinal < 0 ? 0 : cfg_.device.ordinal;
    o.reserve = cfg_.device.reserve;
    o.capacity = cfg_.device.memory_limit;
    STRATA_ASSIGN_OR_RETURN(dev_, create_cuda_device(o), "creating the cuda device");
  } else {
    CpuDeviceOptions o;
    o.capacity = cfg_.device.memory_limit > 0 ? cfg_.device.memory_limit : size_t{1} << 30;
    o.threads = cfg_.device.cpu_threads;
    STRATA_ASSIGN_OR_RETURN(dev_, create_cpu_device(o), "creating the cpu device");
  }
  log_info("device: {}", dev_->name());
  return Status::ok();
}

Status Run::preflight(size_t device_need, size_t host_need) {
  const size_t cap = dev_->memory_stats().capacity;
  if (device_need > cap) {
    return out_of_memory(fmt::format(
        "preflight: the device needs {} (params {}, grads {}, activations {}) but has {} "
        "(device.memory_limit); raise device.memory_limit, lower "
        "train_micro_batch_size_per_gpu, or wait for offloading (issue #5)",
        format_bytes(double(device_need)),
        format_bytes(double(layout_.num_params() * dtype_size(dt_))),
        format_bytes(double(layout_.num_params() * 4)),
        format_bytes(double(activation_bytes(layout_, B_, T_, dt_).bytes)),
        format_bytes(double(cap))));
  }
  const size_t avail = host_available_bytes();
  if (avail > 0 && host_need > avail) {
    return out_of_memory(fmt::format(
        "preflight: host memory needs {} (fp32 master, moments, gradient and staging buffers) "
        "but only {} is available (MemAvailable in /proc/meminfo); use a smaller model",
        format_bytes(double(host_need)), format_bytes(double(avail))));
  }
  return Status::ok();
}

Status Run::setup() {
  STRATA_ASSIGN_OR_RETURN(layout_, ModelLayout::from_config(cfg_.model), "model");
  dt_ = cfg_.model.dtype;
  B_ = static_cast<int>(cfg_.train_micro_batch_size_per_gpu);
  accum_ = static_cast<int>(cfg_.gradient_accumulation_steps);
  T_ = cfg_.data.seq_len > 0 ? cfg_.data.seq_len : cfg_.model.context;
  if (B_ < 1 || accum_ < 1) {
    return invalid_argument(
        "train_micro_batch_size_per_gpu and gradient_accumulation_steps "
        "must be >= 1");
  }
  for (const auto& line : cfg_.resolved_auto) log_info("config: {}", line);
  for (const auto& line : cfg_.not_acted_on) log_info("config: {}", line);

  STRATA_ASSIGN_OR_RETURN(Dataset d, Dataset::load(cfg_.data, layout_.V, cfg_.train.seed), "data");
  if (d.train_tokens() < size_t(T_) + 2 || d.eval_tokens() < size_t(T_) + 2) {
    return invalid_argument(fmt::format(
        "data: {} train and {} eval tokens; each split needs at least seq_len+2 = {} (use a "
        "larger corpus or change data.eval_fraction)",
        d.train_tokens(), d.eval_tokens(), T_ + 2));
  }
  data_.emplace(std::move(d));
  log_info("data: {}", data_->description());

  STRATA_RETURN_IF_ERROR(create_device(), "");
  const size_t P = layout_.num_params();
  const size_t mb = dtype_size(cfg_.strata.moment_dtype);
  size_t device_need = activation_bytes(layout_, B_, T_, dt_).bytes;
  size_t host_need = 0;
  for (const auto& m : layout_.modules) {
    device_need += (m.numel * dtype_size(dt_) + 255) / 256 * 256 + (m.numel * 4 + 255) / 256 * 256;
    host_need += m.numel * (4 + 2 * mb + 4 + dtype_size(dt_));
  }
  STRATA_RETURN_IF_ERROR(preflight(device_need, host_need), "");
  log_info(
      "model: GPT {} layers, {} heads, width {}, vocab {} (padded {}), context {}: {:.2f}M "
      "params in {} modules, {}",
      layout_.L, layout_.NH, layout_.C, layout_.V, layout_.Vp, layout_.maxT, double(P) / 1e6,
      layout_.modules.size(), dtype_name(dt_));
  log_info("batch: {} micro x {} accumulation x {} tokens = {} tokens per step", B_, accum_, T_,
           int64_t(B_) * accum_ * T_);
  STRATA_RETURN_IF_ERROR(allocate_state(), "allocating training state");
  STRATA_ASSIGN_OR_RETURN(model_, GptModel::create(*dev_, layout_, B_, T_, dt_), "model");

  hyper_.kind = optimizer_kind(cfg_.optimizer);
  hyper_.beta1 = static_cast<float>(cfg_.optimizer.beta1);
  hyper_.beta2 = static_cast<float>(cfg_.optimizer.beta2);
  hyper_.eps = static_cast<float>(cfg_.optimizer.eps);
  hyper_.weight_decay = static_cast<float>(cfg_.optimizer.weight_decay);
  hyper_.bias_correction = cfg_.optimizer.bias_correction;
  scaler_ = LossScaler::from_config(cfg_);
  tok_.resize(size_t(B_) * T_);
  tgt_.resize(size_t(B_) * T_);
  losses_.resize(size_t(B_) * T_);
  return init_or_resume();
}

Status Run::allocate_state() {
  const size_t mb = dtype_size(cfg_.strata.moment_dtype);
  for (size_t i = 0; i < layout_.modules.size(); ++i) {
    const ModuleSpec& spec = layout_.modules[i];
    Module m;
    m.numel = spec.numel;
    STRATA_ASSIGN_OR_RETURN(m.params, dev_->allocate(m.numel * dtype_size(dt_), spec.name),
                            "params of " + spec.name);
    STRATA_ASSIGN_OR_RETURN(void* g, dev_->allocate(m.numel * 4, spec.name + ".grad"),
                            "grads of " + spec.name);
    m.grads = static_cast<float*>(g);
    STRATA_ASSIGN_OR_RETURN(void* master, dev_->allocate_host(m.numel * 4), "master");
    m.master = static_cast<float*>(master);
    STRATA_ASSIGN_OR_RETURN(m.m, dev_->allocate_host(m.numel * mb), "moment m");
    STRATA_ASSIGN_OR_RETURN(m.v, dev_->allocate_host(m.numel * mb), "moment v");
    STRATA_ASSIGN_OR_RETURN(void* gh, dev_->allocate_host(m.numel * 4), "grad landing");
    m.grad_host = static_cast<float*>(gh);
    STRATA_ASSIGN_OR_RETURN(m.lp_host, dev_->allocate_host(m.numel * dtype_size(dt_)), "staging");
    std::memset(m.m, 0, m.numel * mb);
    std::memset(m.v, 0, m.numel * mb);
    mods_.push_back(m);
  }
  return Status::ok();
}

CheckpointMeta Run::checkpoint_meta(int64_t step) const {
  CheckpointMeta meta;
  meta.step = step;
  meta.opt_steps = opt_steps_;
  meta.loss_scale = scaler_.scale;
  meta.scaler_cur_iter = scaler_.cur_iter;
  meta.scaler_last_overflow_iter = scaler_.last_overflow_iter;
  meta.scaler_cur_hysteresis = scaler_.cur_hysteresis;
  meta.model_shape = fmt::format("L={} NH={} C={} V={} Vp={} T={} tied={}", layout_.L, layout_.NH,
                                 layout_.C, layout_.V, layout_.Vp, layout_.maxT, layout_.tied);
  meta.moment_dtype = dtype_name(cfg_.strata.moment_dtype);
  meta.seed = cfg_.train.seed;
  for (size_t i = 0; i < layout_.modules.size(); ++i) {
    meta.modules.push_back({layout_.modules[i].name, layout_.modules[i].numel});
  }
  return meta;
}

std::vector<CheckpointBuffers> Run::checkpoint_buffers() {
  std::vector<CheckpointBuffers> b;
  for (Module& m : mods_) {
    b.push_back({m.master, m.m, m.v, dtype_size(cfg_.strata.moment_dtype)});
  }
  return b;
}

Status Run::init_or_resume() {
  if (opts_.resume.empty()) {
    for (size_t i = 0; i < mods_.size(); ++i) {
      init_module_params(layout_, static_cast<int>(i), cfg_.train.seed, mods_[i].master);
    }
  } else {
    std::string path = opts_.resume;
    if (path == "latest") {
      STRATA_ASSIGN_OR_RETURN(path, latest_checkpoint(cfg_.train.checkpoint_dir), "--resume");
    }
    STRATA_ASSIGN_OR_RETURN(CheckpointMeta meta, read_checkpoint_meta(path), "--resume");
    CheckpointMeta mine = checkpoint_meta(0);
    if (meta.model_shape != mine.model_shape) {
      return invalid_argument(fmt::format(
          "--resume {}: the checkpoint's model ({}) differs from the config's ({}); resume with "
          "the config it was trained with",
          path, meta.model_shape, mine.model_shape));
    }
    if (meta.moment_dtype != mine.moment_dtype) {
      return invalid_argument(fmt::format(
          "--resume {}: moments are {} in the checkpoint but strata.optimizer.moment_dtype is {}",
          path, meta.moment_dtype, mine.moment_dtype));
    }
    STRATA_RETURN_IF_ERROR(read_checkpoint(path, checkpoint_buffers()), "--resume");
    step_ = meta.step;
    opt_steps_ = meta.opt_steps;
    scaler_.scale = meta.loss_scale;
    scaler_.cur_iter = meta.scaler_cur_iter;
    scaler_.last_overflow_iter = meta.scaler_last_overflow_iter;
    scaler_.cur_hysteresis = meta.scaler_cur_hysteresis;
    log_info("resumed from {} at step {}", path, step_);
  }
  // Device params = low-precision copy of the master weights.
  Stream& s = dev_->compute_stream();
  for (Module& m : mods_) {
    convert(m.master, DType::kF32, m.lp_host, dt_, m.numel);
    dev_->copy_h2d(s, m.params, m.lp_host, m.numel * dtype_size(dt_));
  }
  return dev_->synchronize(s);
}

Result<double> Run::run_step() {
  Stream& s = dev_->compute_stream();
  std::vector<void*> params;
  std::vector<float*> grads;
  for (Module& m : mods_) {
    params.push_back(m.params);
    grads.push_back(m.grads);
    dev_->memset_zero(s, m.grads, m.numel * 4);
  }
  const double scale = scaler_.scale;
  const float dloss = static_cast<float>(scale / (double(B_) * T_ * accum_));
  double loss_sum = 0;
  for (int micro = 0; micro < accum_; ++micro) {
    data_->train_batch(cfg_.train.seed, step_, micro, /*rank=*/0, B_, T_, tok_.data(), tgt_.data());
    model_->forward_backward(tok_.data(), tgt_.data(), params, grads, dloss, losses_.data());
    STRATA_RETURN_IF_ERROR(dev_->synchronize(s), "forward/backward");
    for (float l : losses_) loss_sum += l;
  }
  const double loss = loss_sum / (double(B_) * T_ * accum_);
  for (Module& m : mods_) dev_->copy_d2h(s, m.grad_host, m.grads, m.numel * 4);
  STRATA_RETURN_IF_ERROR(dev_->synchronize(s), "copying gradients to the host");

  GradStats stats;
  for (Module& m : mods_) stats.merge(grad_stats_reference(m.grad_host, DType::kF32, m.numel));
  last_skipped_ = scaler_.update(cfg_, stats.nonfinite);
  last_grad_norm_ = std::sqrt(stats.norm_sq) / scale;
  if (!last_skipped_) {
    double coef = 1.0;
    if (cfg_.gradient_clipping > 0) {
      double c = cfg_.gradient_clipping / (last_grad_norm_ + 1e-6);
      if (c < 1.0) coef = c;
    }
    hyper_.lr = static_cast<float>(learning_rate(cfg_, opt_steps_));
    hyper_.step = opt_steps_ + 1;
    for (Module& m : mods_) {
      ShardState st;
      st.n = m.numel;
      st.grad = m.grad_host;
      st.grad_dtype = DType::kF32;
      st.grad_mult = static_cast<float>(coef / scale);
      st.master = m.master;
      st.m = m.m;
      st.v = m.v;
      st.moment_dtype = cfg_.strata.moment_dtype;
      st.lp_out = m.lp_host;
      st.lp_dtype = dt_;
      optimizer_step_reference(hyper_, st);
      dev_->copy_h2d(s, m.params, m.lp_host, m.numel * dtype_size(dt_));
    }
    ++opt_steps_;
    // The staging buffers are reused next step: the uploads must be done before then.
    STRATA_RETURN_IF_ERROR(dev_->synchronize(s), "uploading parameters");
  }
  ++step_;
  return loss;
}

Result<double> Run::eval_loss() {
  std::vector<void*> params;
  for (Module& m : mods_) params.push_back(m.params);
  double sum = 0;
  const int n = std::max(1, cfg_.data.eval_batches);
  for (int i = 0; i < n; ++i) {
    data_->eval_batch(i, B_, T_, tok_.data(), tgt_.data());
    model_->forward_loss(tok_.data(), tgt_.data(), params, losses_.data());
    STRATA_RETURN_IF_ERROR(dev_->synchronize(dev_->compute_stream()), "eval forward");
    for (float l : losses_) sum += l;
  }
  return sum / (double(n) * B_ * T_);
}

uint32_t Run::weights_crc() const {
  uint32_t c = 0;
  for (const Module& m : mods_) c = crc32c(c, m.master, m.numel * 4);
  return c;
}

Status Run::save_checkpoint(int64_t step, std::string* path_out) {
  const std::string& dir = cfg_.train.checkpoint_dir;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return io_error(fmt::format("train.checkpoint_dir: cannot create '{}': {}", dir, ec.message()));
  }
  const std::string name = fmt::format("ckpt-{:08}.bin", step);
  const std::string path = dir + "/" + name;
  STRATA_RETURN_IF_ERROR(write_checkpoint(path, checkpoint_meta(step), checkpoint_buffers()),
                         "saving step " + std::to_string(step));
  STRATA_RETURN_IF_ERROR(set_latest_checkpoint(dir, name), "saving step " + std::to_string(step));
  // Keep the two newest checkpoints.
  std::vector<std::string> old;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    std::string f = e.path().filename().string();
    if (f.rfind("ckpt-", 0) == 0 && f.size() > 4 && f.substr(f.size() - 4) == ".bin") {
      old.push_back(f);
    }
  }
  std::sort(old.begin(), old.end());
  for (size_t i = 0; i + 2 < old.size(); ++i) std::filesystem::remove(dir + "/" + old[i], ec);
  *path_out = path;
  return Status::ok();
}

Result<TrainResult> Run::loop() {
  TrainResult r;
  r.start_step = step_;
  const int64_t total = cfg_.train.steps;
  const int64_t print_every = std::max<int64_t>(1, cfg_.steps_per_print);
  std::string log_path = cfg_.train.log_file.empty() ? cfg_.train.checkpoint_dir + "/metrics.jsonl"
                                                     : cfg_.train.log_file;
  std::error_code ec;
  auto parent = std::filesystem::path(log_path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  std::ofstream jsonl(log_path, step_ > 0 ? std::ios::app : std::ios::trunc);
  if (!jsonl) return io_error(fmt::format("train.log_file: cannot open '{}'", log_path));

  auto do_eval = [&](int64_t step) -> Status {
    STRATA_ASSIGN_OR_RETURN(double el, eval_loss(), "eval");
    r.eval_losses.emplace_back(step, el);
    if (opts_.progress)
      std::printf("step %5lld/%lld | eval loss %.4f\n", (long long)step, (long long)total, el);
    jsonl << nlohmann::json{{"step", step}, {"eval_loss", el}}.dump() << "\n";
    jsonl.flush();
    return Status::ok();
  };
  if (step_ == 0 && cfg_.train.eval_interval > 0) STRATA_RETURN_IF_ERROR(do_eval(0), "");

  const auto t0 = Clock::now();
  const int64_t tokens_per_step = int64_t(B_) * T_ * accum_;
  auto window_t = Clock::now();
  int64_t window_steps = 0;
  while (step_ < total) {
    STRATA_ASSIGN_OR_RETURN(double loss, run_step(), fmt::format("step {}", step_ + 1));
    r.losses.push_back(loss);
    if (last_skipped_) ++r.skipped_steps;
    ++window_steps;
    if (!std::isfinite(loss) && !cfg_.fp16.enabled) {
      return internal_error(
          fmt::format("step {}: loss is {} — training diverged; lower optimizer.lr or enable "
                      "gradient_clipping",
                      step_, loss));
    }
    const bool last = step_ == total;
    if (step_ % print_every == 0 || last || step_ == r.start_step + 1) {
      const double win = seconds_since(window_t);
      const double tps = double(tokens_per_step * window_steps) / std::max(win, 1e-9);
      const double elapsed = seconds_since(t0);
      const double per_step = elapsed / double(step_ - r.start_step);
      const double eta = per_step * double(total - step_);
      const double lr = learning_rate(cfg_, std::max<int64_t>(opt_steps_ - 1, 0));
      if (opts_.progress) {
        std::printf(
            "step %5lld/%lld | loss %.4f | lr %.3e | norm %.3f | %s%.0f tok/s | %s "
            "elapsed, ETA %s%s\n",
            (long long)step_, (long long)total, loss, lr, last_grad_norm_,
            cfg_.fp16.enabled ? fmt::format("scale {:g} | ", scaler_.scale).c_str() : "", tps,
            hms(elapsed).c_str(), hms(eta).c_str(),
            last_skipped_ ? " | overflow: step skipped" : "");
        std::fflush(stdout);
      }
      jsonl << nlohmann::json{{"step", step_},
                              {"loss", loss},
                              {"lr", lr},
                              {"grad_norm", last_grad_norm_},
                              {"loss_scale", scaler_.scale},
                              {"skipped", last_skipped_},
                              {"tokens_per_s", tps},
                              {"elapsed_s", elapsed}}
                   .dump()
            << "\n";
      jsonl.flush();
      window_t = Clock::now();
      window_steps = 0;
    }
    if (cfg_.train.eval_interval > 0 && (step_ % cfg_.train.eval_interval == 0 || last)) {
      STRATA_RETURN_IF_ERROR(do_eval(step_), "");
    }
    const bool stop = (opts_.stop_signal && opts_.stop_signal->load() != 0) ||
                      (opts_.stop_at_step >= 0 && step_ >= opts_.stop_at_step);
    if (stop && !last) {
      r.stopped_early = true;
      STRATA_RETURN_IF_ERROR(save_checkpoint(step_, &r.last_checkpoint), "stopping");
      log_info("stopped at step {}: checkpoint {} written; continue with --resume", step_,
               r.last_checkpoint);
      break;
    }
    if (cfg_.train.checkpoint_interval > 0 && step_ % cfg_.train.checkpoint_interval == 0 &&
        !last) {
      STRATA_RETURN_IF_ERROR(save_checkpoint(step_, &r.last_checkpoint), "");
    }
  }
  if (!r.stopped_early) {
    STRATA_RETURN_IF_ERROR(save_checkpoint(step_, &r.last_checkpoint), "final checkpoint");
  }
  r.end_step = step_;
  r.weights_crc = weights_crc();
  const double secs = seconds_since(t0);
  r.tokens_per_s = double(tokens_per_step * (step_ - r.start_step)) / std::max(secs, 1e-9);
  return r;
}

}  // namespace

Result<TrainResult> train(const Config& cfg, const TrainOptions& opts) {
  Run run(cfg, opts);
  STRATA_RETURN_IF_ERROR(run.setup(), "");
  return run.loop();
}

}  // namespace strata
