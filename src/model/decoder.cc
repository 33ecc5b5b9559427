#include "src/model/decoder.h"

#include <fmt/format.h>

#include "src/config/model_shape.h"

namespace strata {

void decoder_programs(const DecoderModules& s, Program* train, Program* eval) {
  const int E = s.embedding(), F = s.final_norm(), H = s.head();
  const bool frozen = s.lora;  // the base trains no parameter of its own
  using K = ProgramOp;
  auto state = [](Program& p, ProgramOp::Kind k, int m) {
    if (m >= 0) p.ops.push_back({k, m, -1, -1});
  };
  auto run = [](Program& p, int fn, int layer = -1) {
    p.ops.push_back({ProgramOp::kCompute, -1, fn, layer});
  };
  // Block l and its extra modules, every one of them (each rank runs the same collectives,
  // whatever its tokens were routed to).
  auto block_state = [&](Program& p, ProgramOp::Kind k, int l) {
    state(p, k, s.block(l));
    for (int j = 0; j < s.X; ++j) state(p, k, s.extra(l, j));
  };
  for (Program* p : {train, eval}) {
    state(*p, K::kAcquireParams, E);
    run(*p, kEmbeddingForward);
    state(*p, K::kReleaseParams, E);
    for (int l = 0; l < s.L; ++l) {
      block_state(*p, K::kAcquireParams, l);
      state(*p, K::kAcquireParams, s.adapter(l));
      run(*p, kBlockForward, l);
      block_state(*p, K::kReleaseParams, l);
      state(*p, K::kReleaseParams, s.adapter(l));
    }
    p->forward_end = p->ops.size();
    // The head keeps the final norm and the (tied) embedding acquired through its backward.
    state(*p, K::kAcquireParams, F);
    state(*p, K::kAcquireParams, H);
    run(*p, kHeadForward);
  }
  state(*eval, K::kReleaseParams, F);
  state(*eval, K::kReleaseParams, H);

  // Backward: each module's gradients leave the device as soon as its backward is done. A tied
  // embedding's gradient buffer collects the head's and the embedding's parts.
  Program& p = *train;
  if (!frozen) {
    state(p, K::kAcquireGrads, F);
    state(p, K::kAcquireGrads, H);
  }
  run(p, kHeadBackward);
  state(p, K::kReleaseParams, F);
  state(p, K::kReleaseParams, H);
  if (!frozen) {
    state(p, K::kDrainGrads, F);
    if (H != E) state(p, K::kDrainGrads, H);
  }
  for (int l = s.L - 1; l >= 0; --l) {
    block_state(p, K::kAcquireParams, l);
    state(p, K::kAcquireParams, s.adapter(l));
    if (!frozen) block_state(p, K::kAcquireGrads, l);
    state(p, K::kAcquireGrads, s.adapter(l));
    run(p, kBlockBackward, l);
    block_state(p, K::kReleaseParams, l);
    state(p, K::kReleaseParams, s.adapter(l));
    if (!frozen) block_state(p, K::kDrainGrads, l);
    state(p, K::kDrainGrads, s.adapter(l));
  }
  if (frozen) return;
  if (H != E) state(p, K::kAcquireGrads, E);
  run(p, kEmbeddingBackward);
  state(p, K::kDrainGrads, E);
}

Result<ModelConfig> decoder_shape(const ModelConfig& config) {
  ModelConfig s = config;
  if (s.padded_vocab_size <= 0) s.padded_vocab_size = (s.vocab_size + 63) / 64 * 64;
  if (s.num_key_value_heads <= 0) s.num_key_value_heads = s.n_head;
  STRATA_RETURN_IF_ERROR(check_model_shape(s), "");  // the config's own checks
  return s;
}

ModelLayout decoder_layout(const ModelConfig& s, const std::function<void(ModuleSpec&)>& embedding,
                           const std::function<void(ModuleSpec&)>& block,
                           const std::function<void(ModuleSpec&)>& final_norm, int X,
                           const std::function<std::string(int, int)>& extra_name,
                           const std::function<void(int, ModuleSpec&)>& extra,
                           const LoraLayout& lora) {
  ModelLayout layout;
  ModuleSpec emb{"embedding", {}, 0};
  embedding(emb);
  layout.modules.push_back(std::move(emb));
  for (int i = 0; i < s.n_layer; ++i) {
    ModuleSpec b{fmt::format("block.{}", i), {}, 0};
    block(b);
    layout.modules.push_back(std::move(b));
    for (int j = 0; j < X; ++j) {
      ModuleSpec e{extra_name(i, j), {}, 0};
      extra(j, e);
      layout.modules.push_back(std::move(e));
    }
  }
  ModuleSpec fn{"final_norm", {}, 0};
  final_norm(fn);
  layout.modules.push_back(std::move(fn));
  if (!s.tied_embeddings) {
    ModuleSpec h{"head", {}, 0};
    add_tensor(h, "lm_head", size_t(s.padded_vocab_size) * size_t(s.n_embd), 0);
    layout.modules.push_back(std::move(h));
  }
  if (lora.empty()) return layout;
  for (ModuleSpec& m : layout.modules) m.trainable = false;
  for (int i = 0; i < s.n_layer; ++i) {
    ModuleSpec a{fmt::format("lora.{}", i), {}, 0};
    lora_tensors(lora, a);
    layout.modules.push_back(std::move(a));
  }
  return layout;
}

void decoder_init_range(const ModelConfig& s, const ModuleSpec& m, uint64_t stream, uint64_t seed,
                        size_t begin, size_t count, float* out) {
  // Padding rows of the vocabulary (V..Vp-1) start at zero: they never receive gradient.
  const bool vocab = m.name == "embedding" || m.name == "head";
  const size_t C = size_t(s.n_embd);
  init_module_range(m, seed, stream, vocab ? size_t(s.vocab_size) * C : 0,
                    vocab ? size_t(s.padded_vocab_size) * C : 0, begin, count, out);
}

Status check_decoder_runner(const ModelConfig& s, int T, ActivationMode mode,
                            const ActivationStore* store, int slots) {
  if (T > s.context) {
    return invalid_argument(fmt::format("data.seq_len: {} exceeds model.context {}", T, s.context));
  }
  if (mode == ActivationMode::kOffload && store == nullptr) {
    return invalid_argument(
        "strata.activations: offload needs an activation store (the tier manager's host tier)");
  }
  if (slots < 1 || (slots > 1 && mode == ActivationMode::kOffload)) {
    return invalid_argument(fmt::format(
        "strata.grouped_forwards: {} activation sets under strata.activations = {}; offload keeps "
        "one set of block inputs (set strata.grouped_forwards to 1, or activations to keep or "
        "recompute)",
        slots, activation_mode_name(mode)));
  }
  return Status::ok();
}

size_t tensor_offset(const ModuleSpec& m, const std::string& name) {
  for (const TensorSpec& t : m.tensors) {
    if (t.name == name) return t.offset;
  }
  STRATA_CHECK(false, "a decoder block without the tensor its part reads");
  return 0;
}

}  // namespace strata
