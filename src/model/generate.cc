#include "src/model/generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "src/base/rng.h"

namespace strata {
namespace {

// The model generation runs: `arch` itself, or, for a LoRA architecture, the same model without
// its adapters (the weights it is given have them merged in; its base modules come first).
Result<std::unique_ptr<Architecture>> plain_architecture(const Architecture& arch) {
  if (arch.lora() == nullptr) return std::unique_ptr<Architecture>();
  ModelConfig shape = arch.shape();
  shape.lora = LoraConfig{};
  return create_architecture(shape);
}

class DeviceDecoder final : public Decoder {
 public:
  DeviceDecoder(const Architecture& arch, Device& dev) : arch_(arch), dev_(dev) {}
  ~DeviceDecoder() override {
    dev_.synchronize(dev_.compute_stream()).ignore();
    runner_.reset();
    kv_.reset();
    for (const void* p : params_) dev_.release(const_cast<void*>(p));
    if (logits_) dev_.release_host(logits_);
  }

  // Uploads the weights (each module's host copy freed once it is on the device), then makes
  // the path's state: the cache, or a runner of one window of the context.
  Status init(std::vector<std::vector<float>> weights, DecodePath path) {
    const ModelLayout& layout = arch_.layout();
    if (weights.size() < layout.modules.size()) {
      return invalid_argument(fmt::format("generate: {} modules of weights for a model of {}",
                                          weights.size(), layout.modules.size()));
    }
    Stream& s = dev_.compute_stream();
    for (size_t m = 0; m < layout.modules.size(); ++m) {
      const size_t n = layout.modules[m].numel;
      STRATA_CHECK(weights[m].size() == n, "generate: a module's weights are not its size");
      STRATA_ASSIGN_OR_RETURN(
          void* p, dev_.allocate(n * 4, "generate weights"),
          fmt::format("generate: module {} ({} bytes)", layout.modules[m].name, n * 4));
      params_.push_back(p);
      dev_.copy_h2d(s, p, weights[m].data(), n * 4);
      STRATA_RETURN_IF_ERROR(dev_.synchronize(s), "generate: uploading the weights");
      std::vector<float>().swap(weights[m]);
    }
    grads_.assign(params_.size(), nullptr);
    const int T = arch_.context();
    const size_t Vp = size_t(arch_.shape().padded_vocab_size);
    if (path != DecodePath::kWindow) {
      auto kv = arch_.create_kv_decoder(dev_, DType::kF32);
      if (kv.is_ok()) {
        kv_ = std::move(*kv);
      } else if (path == DecodePath::kCached || kv.status().code() != StatusCode::kUnavailable) {
        return kv.status().with_context("generate: the key/value cache");
      }
    }
    if (!kv_) {
      STRATA_ASSIGN_OR_RETURN(
          runner_, arch_.create_runner(dev_, 1, T, DType::kF32, ActivationMode::kRecompute),
          "generate: the window's runner");
      window_.assign(size_t(T), 0);
      targets_.assign(size_t(T), 0);
      losses_.assign(size_t(T), 0.0f);
    }
    const size_t rows = kv_ ? 1 : size_t(T);
    STRATA_ASSIGN_OR_RETURN(void* h, dev_.allocate_host(rows * Vp * 4), "generate: logits");
    logits_ = static_cast<float*>(h);
    return Status::ok();
  }

  Result<const std::vector<float>*> run(std::span<const int32_t> tokens) override {
    const int T = arch_.context(), V = arch_.vocab_size();
    if (tokens.empty()) return invalid_argument("generate: no tokens to run");
    if (pos_ + int64_t(tokens.size()) > T) {
      return invalid_argument(fmt::format(
          "generate: {} tokens fill the model's context (model.context {}); shorten the prompt "
          "or --max-new-tokens, or raise model.context",
          pos_ + int64_t(tokens.size()), T));
    }
    for (int32_t t : tokens) {
      if (t < 0 || t >= V) {
        return invalid_argument(
            fmt::format("generate: token {} is outside the vocabulary ({})", t, V));
      }
    }
    const float* row = nullptr;
    if (kv_) {
      STRATA_RETURN_IF_ERROR(kv_->forward(tokens, params_, logits_), "generate");
      row = logits_;
    } else {
      STRATA_RETURN_IF_ERROR(run_window(tokens), "generate");
      row =
          logits_ + size_t(pos_ + int(tokens.size()) - 1) * size_t(arch_.shape().padded_vocab_size);
    }
    pos_ += int(tokens.size());
    out_.assign(row, row + V);
    return &out_;
  }

  int position() const override { return pos_; }
  int context() const override { return arch_.context(); }
  int vocab_size() const override { return arch_.vocab_size(); }
  bool cached() const override { return kv_ != nullptr; }

 private:
  // The eval program over the window so far (the positions after it hold token 0: causal
  // attention keeps them from every earlier position), every module bound.
  Status run_window(std::span<const int32_t> tokens) {
    std::copy(tokens.begin(), tokens.end(), window_.begin() + pos_);
    runner_->select(0);
    runner_->begin_batch(window_.data(), targets_.data());
    MicroBatch mb;
    mb.losses_out = losses_.data();
    mb.logits_out = logits_;
    const ModuleBindings bound{params_, grads_};
    for (const ProgramOp& op : arch_.program(Pass::kEval).ops) {
      if (op.kind == ProgramOp::kCompute) runner_->compute(op, bound, mb);
    }
    STRATA_RETURN_IF_ERROR(dev_.synchronize(dev_.compute_stream()), "the window's forward");
    return runner_->status();
  }

  const Architecture& arch_;
  Device& dev_;
  std::vector<const void*> params_;      // every module's fp32 weights on the device
  std::vector<float*> grads_;            // none: the eval program binds no gradients
  std::unique_ptr<KvDecoder> kv_;        // the cached path, or
  std::unique_ptr<ModelRunner> runner_;  // the window's
  std::vector<int32_t> window_, targets_;
  std::vector<float> losses_;
  float* logits_ = nullptr;  // host: the cached path's one row, or the window's rows
  int pos_ = 0;
  std::vector<float> out_;
};

// A decoder that owns the model it runs (a LoRA architecture's plain twin).
class OwningDecoder final : public Decoder {
 public:
  OwningDecoder(std::unique_ptr<Architecture> arch, std::unique_ptr<Decoder> d)
      : arch_(std::move(arch)), d_(std::move(d)) {}
  Result<const std::vector<float>*> run(std::span<const int32_t> tokens) override {
    return d_->run(tokens);
  }
  int position() const override { return d_->position(); }
  int context() const override { return d_->context(); }
  int vocab_size() const override { return d_->vocab_size(); }
  bool cached() const override { return d_->cached(); }

 private:
  std::unique_ptr<Architecture> arch_;  // declared first: destroyed after the decoder
  std::unique_ptr<Decoder> d_;
};

}  // namespace

DecoderBytes decoder_bytes(const Architecture& arch, DecodePath path) {
  // Each device allocation counted rounded up to 4 KiB (an allocator's alignment), and 64 KiB
  // for the few small ones (staging, the cache's token and position buffers).
  const auto round = [](uint64_t n) { return (n + 4095) / 4096 * 4096; };
  DecoderBytes b;
  b.host = arch.layout().num_params() * 4ull;
  for (const ModuleSpec& m : arch.layout().modules) b.device += round(m.numel * 4ull);
  const uint64_t cached = arch.kv_decoder_bytes(DType::kF32);
  const uint64_t state =
      path != DecodePath::kWindow && cached > 0
          ? cached
          : arch.activation_plan(1, arch.context(), DType::kF32, ActivationMode::kRecompute).bytes;
  b.device += round(state) + (64 << 10);
  return b;
}

Result<std::unique_ptr<Decoder>> Decoder::create(const Architecture& arch, Device& device,
                                                 std::vector<std::vector<float>> weights,
                                                 DecodePath path) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Architecture> plain, plain_architecture(arch),
                          "generate: the model without its adapters");
  const Architecture& run = plain ? *plain : arch;
  auto d = std::make_unique<DeviceDecoder>(run, device);
  STRATA_RETURN_IF_ERROR(d->init(std::move(weights), path), "");
  if (!plain) return std::unique_ptr<Decoder>(std::move(d));
  return std::unique_ptr<Decoder>(new OwningDecoder(std::move(plain), std::move(d)));
}

int32_t pick_token(const std::vector<float>& logits, double temperature, double top_p,
                   double uniform) {
  const size_t V = logits.size();
  if (temperature <= 0) {
    return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  std::vector<int32_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return logits[size_t(a)] > logits[size_t(b)]; });
  std::vector<double> p(V);
  const double mx = double(logits[size_t(order[0])]);
  double sum = 0;
  for (size_t i = 0; i < V; ++i) {
    sum += (p[i] = std::exp((double(logits[size_t(order[i])]) - mx) / temperature));
  }
  // The nucleus: the most likely tokens until their mass reaches top_p (at least one).
  size_t keep = 0;
  double mass = 0;
  while (keep < V && (keep == 0 || mass < top_p * sum)) mass += p[keep++];
  double r = uniform * mass;
  for (size_t i = 0; i < keep; ++i) {
    if ((r -= p[i]) < 0) return order[i];
  }
  return order[keep - 1];
}

Result<std::vector<int32_t>> generate(Decoder& decoder, const std::vector<int32_t>& prompt,
                                      const SampleOptions& options) {
  if (prompt.empty()) return invalid_argument("generate: the prompt has no tokens");
  const std::vector<float>* logits = nullptr;
  STRATA_ASSIGN_OR_RETURN(logits, decoder.run(prompt), "the prompt");
  std::vector<int32_t> out;
  Rng rng(options.seed, 0x6e6e);  // the same seed draws the same tokens
  while (int(out.size()) < options.max_new_tokens) {
    const int32_t tok = pick_token(*logits, options.temperature, options.top_p, rng.uniform());
    out.push_back(tok);
    if (std::find(options.stop.begin(), options.stop.end(), tok) != options.stop.end()) break;
    if (int(out.size()) == options.max_new_tokens || decoder.position() >= decoder.context()) {
      break;
    }
    STRATA_ASSIGN_OR_RETURN(logits, decoder.step(tok), "generating");
  }
  return out;
}

}  // namespace strata
