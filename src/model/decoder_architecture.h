// A decoder's runner and architecture over a block definition (see decoder.h for the block
// definition's interface, the modules and the programs): DecoderRunner, one batch shape's
// activation arena (a set per micro-batch of a group) and the compute steps; and
// DecoderArchitecture<Blocks>, the layout, the programs and the FLOPs. Included by the .cc files
// that instantiate them (gpt2.cc, llama.cc, moe.cc).
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "src/model/decoder.h"
#include "src/model/decoder_kv.h"

namespace strata {

// One batch shape's device state and the compute steps of DecoderArchitecture<Blocks>.
template <class Blocks>
class DecoderRunner final : public ModelRunner {
 public:
  // A block's activations (dt unless noted). kKeep: one per layer, and `out` is the next block's
  // input. kRecompute/kOffload: one scratch (out unused: outputs go to inputs/out).
  struct Layer {
    void *ln1 = nullptr, *att_out = nullptr, *res2 = nullptr, *ln2 = nullptr, *mlp_out = nullptr,
         *out = nullptr;
    typename Blocks::NormStats n1, n2;
    typename Blocks::AttentionActs att;
    typename Blocks::MlpActs mlp;
  };
  // Every activation buffer of a micro-batch, carved from one device arena.
  struct Buffers {
    int32_t* tokens = nullptr;
    int32_t* targets = nullptr;
    int32_t* pos = nullptr;  // positions (begin_batch), read when the batch came with them
    float* losses = nullptr;
    float* row_weights = nullptr;  // B: MicroBatch::row_weights' factors
    std::vector<Layer> layers;
    // kRecompute: every block's input (inputs[0] == encoded); kOffload: two slots, block l's
    // input in inputs[l % 2]. out: the last block's output, the head's input (not kKeep).
    std::vector<void*> inputs;
    void* out = nullptr;
    void *encoded = nullptr, *lnf = nullptr, *logits = nullptr;
    typename Blocks::NormStats nf;
    // activation-gradient scratch, reused by every layer. dA: gradient w.r.t. the residual
    // stream at the current layer boundary, carried from one backward step to the next.
    void *dA = nullptr, *dB = nullptr, *dln = nullptr;
    typename Blocks::AttentionScratch datt;
    typename Blocks::MlpScratch dmlp;
    float* discard = nullptr;  // 2 max(C, hs) fp32: a frozen norm's weight gradients (DecoderStep)
    LoraRun lora;              // the adapters' scratch (layout nullptr: none)
    void* block_params = nullptr;  // a quantized base: the block being computed, dequantized
  };

  // The one carve of the activation arena: activation_plan() measures it, allocate() allocates
  // what it measured and carves again for real. With `shared` (a forward group's slot after the
  // first) only what a micro-batch keeps from its forward to its backward is carved — its
  // tokens and targets, its blocks' activations (kKeep) or inputs and last output, and the
  // residual stream's gradient dA (carried from one backward step to the next, which a
  // backward group interleaves with the group's other micro-batches') — and the rest, used by
  // one micro-batch at a time (the head's buffers, the losses, the other gradient scratch, a
  // recompute's layer scratch, the adapters' and a quantized base's scratch), is `shared`'s.
  static void carve(Carver& c, const Blocks& blocks, const ModelConfig& sh, const BatchDims& d,
                    ActivationMode mode, const LoraLayout& lora, const BaseQuant* quant, Buffers* m,
                    const Buffers* shared = nullptr) {
    const bool keep = mode == ActivationMode::kKeep;
    const int L = sh.n_layer;
    const size_t N = d.N(), NC = N * size_t(sh.n_embd) * d.es();
    m->inputs.assign(size_t(keep                                 ? 0
                            : mode == ActivationMode::kRecompute ? L
                                                                 : std::min(L, 2)),
                     nullptr);
    m->tokens = static_cast<int32_t*>(c.take(N * 4));
    m->targets = static_cast<int32_t*>(c.take(N * 4));
    m->pos = static_cast<int32_t*>(c.take(N * 4));
    if (shared && !keep) {
      m->layers = shared->layers;
    } else {
      m->layers.resize(size_t(keep ? L : 1));
      for (Layer& y : m->layers) {
        y.ln1 = c.take(NC);
        y.att_out = c.take(NC);
        y.res2 = c.take(NC);
        y.ln2 = c.take(NC);
        y.mlp_out = c.take(NC);
        y.out = keep ? c.take(NC) : nullptr;
        blocks.carve(c, d, &y.n1);
        blocks.carve(c, d, &y.n2);
        blocks.carve(c, d, &y.att);
        blocks.carve(c, d, &y.mlp);
      }
    }
    for (void*& in : m->inputs) in = c.take(NC);
    m->encoded = keep ? c.take(NC) : m->inputs[0];
    m->out = keep ? nullptr : c.take(NC);
    if (shared) {
      m->losses = shared->losses;
      m->row_weights = shared->row_weights;
      m->lnf = shared->lnf;
      m->logits = shared->logits;
      m->nf = shared->nf;
      m->dA = c.take(NC);  // carried from one backward step to the next: a backward group's own
      m->dB = shared->dB;
      m->dln = shared->dln;
      m->datt = shared->datt;
      m->dmlp = shared->dmlp;
      m->discard = shared->discard;
      m->lora = shared->lora;
      m->block_params = shared->block_params;
      return;
    }
    m->losses = c.take_f32(N);
    m->row_weights = c.take_f32(size_t(d.B));
    m->lnf = c.take(NC);
    m->logits = c.take(N * size_t(sh.padded_vocab_size) * d.es());
    blocks.carve(c, d, &m->nf);
    m->dA = c.take(NC);
    m->dB = c.take(NC);
    m->dln = c.take(NC);
    blocks.carve(c, d, &m->datt);
    blocks.carve(c, d, &m->dmlp);
    if (!lora.empty()) {
      m->discard = c.take_f32(2 * std::max<size_t>(size_t(sh.n_embd), size_t(blocks.head_size())));
      m->lora.layout = &lora;
      m->lora.carve(c, N, d.es());
    }
    if (quant) m->block_params = c.take(quant->numel * d.es());
  }

  DecoderRunner(Device& d, const Blocks& blocks, const ModelConfig& sh, const LoraLayout& lora,
                const BaseQuant* quant, const BatchDims& dims, ActivationMode mode,
                ActivationStore* store)
      : blocks_(blocks),
        sh_(sh),
        lora_(lora),
        quant_(quant),
        mods_{sh.n_layer, sh.tied_embeddings, extra_modules_of(blocks), !lora.empty()},
        mode_(mode),
        store_(store) {
    static_cast<BatchDims&>(st_) = dims;
    st_.dev = &d;
    st_.k = &d.kernels();
    st_.s = &d.compute_stream();
  }
  ~DecoderRunner() override {
    st_.dev->synchronize(*st_.s).ignore();
    if (arena_) st_.dev->release(arena_);
    if (host_io_) st_.dev->release_host(host_io_);
  }

  // `slots` activation sets (one per micro-batch of a forward group, see select()), each as
  // one carve measures it, in one device allocation.
  Status allocate(int slots) {
    Carver measure(nullptr);
    Buffers probe, probe_slot;
    carve(measure, blocks_, sh_, st_, mode_, lora_, quant_, &probe);
    const size_t first = measure.used();
    carve(measure, blocks_, sh_, st_, mode_, lora_, quant_, &probe_slot, &probe);
    const size_t bytes = first + (measure.used() - first) * size_t(slots - 1);
    STRATA_ASSIGN_OR_RETURN(arena_, st_.dev->allocate(bytes, "activations"), "device");
    Carver real(static_cast<char*>(arena_));
    slots_.resize(size_t(slots));
    for (size_t i = 0; i < slots_.size(); ++i) {
      carve(real, blocks_, sh_, st_, mode_, lora_, quant_, &slots_[i], i ? &slots_[0] : nullptr);
    }
    restored_.assign(size_t(sh_.n_layer), false);
    const size_t N = st_.N();
    // Per slot: its tokens, targets and positions (N * 12 bytes); then one losses buffer (N * 4)
    // and one of row weights (B * 4) that every slot's head uses in stream order.
    STRATA_ASSIGN_OR_RETURN(
        void* h, st_.dev->allocate_host(N * 12 * size_t(slots) + N * 4 + size_t(st_.B) * 4),
        "host staging");
    host_io_ = static_cast<int32_t*>(h);
    host_losses_ = reinterpret_cast<float*>(host_io_ + 3 * N * size_t(slots));
    host_row_weights_ = host_losses_ + N;
    slot_has_pos_.assign(size_t(slots), false);
    pad_rows_.assign(size_t(slots), {});
    uploaded_.resize(size_t(slots));
    for (int i = 0; i < slots; ++i) states_.push_back(std::make_unique<State>());
    if constexpr (RunnerStateOf<Blocks>::kHas) {
      for (int i = 0; i < slots; ++i) {
        select(i);
        STRATA_RETURN_IF_ERROR(blocks_.prepare(st_, *states_[size_t(i)]),
                               "the block's runner state");
      }
    }
    select(0);
    return Status::ok();
  }

  void select(int slot) override {
    STRATA_CHECK(slot >= 0 && size_t(slot) < slots_.size(),
                 "decoder: activation slot out of range");
    slot_ = slot;
    buf_ = &slots_[size_t(slot)];
    st_.discard = buf_->discard;
    st_.state = states_[size_t(slot)].get();
    st_.pos = slot_has_pos_[size_t(slot)] ? buf_->pos : nullptr;
  }

  void begin_batch(const int32_t* tokens, const int32_t* targets,
                   const int32_t* positions) override {
    const size_t N = st_.N();
    Device& dev = *st_.dev;
    // The slot's staging is reused each step: wait until its last upload was consumed (its
    // copies' event, not the rest of the stream: the last step's optimizer on the device and
    // the other slots' work run on while this step's kernels are launched behind them).
    std::unique_ptr<Event>& uploaded = uploaded_[size_t(slot_)];
    if (uploaded) {
      dev.synchronize(*uploaded).ignore();
    } else {
      uploaded = dev.create_event();
    }
    int32_t* io = host_io_ + 3 * N * size_t(slot_);
    std::memcpy(io, tokens, N * 4);
    std::memcpy(io + N, targets, N * 4);
    dev.copy_h2d(*st_.s, buf_->tokens, io, N * 4);
    dev.copy_h2d(*st_.s, buf_->targets, io + N, N * 4);
    if (positions != nullptr) {
      std::memcpy(io + 2 * N, positions, N * 4);
      dev.copy_h2d(*st_.s, buf_->pos, io + 2 * N, N * 4);
    }
    dev.record(*uploaded, *st_.s);
    slot_has_pos_[size_t(slot_)] = positions != nullptr;
    std::vector<size_t>& pads = pad_rows_[size_t(slot_)];
    pads.clear();
    if (sh_.pad_token_id >= 0) {
      for (size_t n = 0; n < N; ++n) {
        if (tokens[n] == sh_.pad_token_id) pads.push_back(n);
      }
    }
    st_.pos = positions != nullptr ? buf_->pos : nullptr;
  }

  void compute(const ProgramOp& op, const ModuleBindings& b, const MicroBatch& mb) override {
    const int E = mods_.embedding(), F = mods_.final_norm(), H = mods_.head();
    const auto P = [&](int m) { return b.params[size_t(m)]; };
    const auto G = [&](int m) { return b.grads[size_t(m)]; };
    switch (op.fn) {
      case kEmbeddingForward:
        wait_slot(0);  // buf_->encoded is input slot 0 under kOffload
        blocks_.embedding_forward(st_, P(E), buf_->tokens, buf_->encoded);
        break;
      case kBlockForward:
        enter_block(op.layer, b, mb, false);
        forward_block(op.layer, block_params(P(mods_.block(op.layer))));
        break;
      case kHeadForward:
        forward_head(P(F), P(H), mb);
        break;
      case kHeadBackward:
        backward_head(P(F), G(F), P(H), G(H));
        break;
      case kBlockBackward:
        enter_block(op.layer, b, mb, true);
        backward_block(op.layer, block_params(P(mods_.block(op.layer))), G(mods_.block(op.layer)));
        break;
      case kEmbeddingBackward: {
        // model.pad_token_id's rows take no gradient (nn.Embedding's padding_idx): their
        // gradient w.r.t. the embedding's output is zeroed first (the lookup is its last use).
        const size_t row = size_t(sh_.n_embd) * st_.es();
        for (size_t n : pad_rows_[size_t(slot_)]) {
          st_.dev->memset_zero(*st_.s, static_cast<char*>(buf_->dA) + n * row, row);
        }
        blocks_.embedding_backward(st_, G(E), buf_->dA, buf_->tokens);
        break;
      }
      default:
        STRATA_CHECK(false, "decoder: unknown compute step");
    }
  }

  Status status() const override {
    if constexpr (RunnerStateOf<Blocks>::kHas) {
      if (error_.is_ok()) {
        for (const auto& st : states_) {
          if (!st->error.is_ok()) return st->error;
        }
      }
    }
    return error_;
  }

 private:
  // The step's view of block l: its index, its extra modules' buffers, the loss scale, and its
  // adapters when the model has them.
  void enter_block(int l, const ModuleBindings& b, const MicroBatch& mb, bool backward) {
    st_.layer = l;
    st_.dloss = mb.dloss;
    st_.dropout_key = mb.dropout_key;
    const size_t first = size_t(mods_.extra(l, 0)), X = size_t(mods_.X);
    st_.extra_params = X ? b.params.subspan(first, X) : std::span<const void* const>();
    st_.extra_grads = X && backward ? b.grads.subspan(first, X) : std::span<float* const>();
    if (!lora_.empty()) {
      const int a = mods_.adapter(l);
      buf_->lora.p = b.params[size_t(a)];
      buf_->lora.g = b.grads[size_t(a)];
      st_.lora = &buf_->lora;
    }
  }
  // A block's parameters as its compute reads them: a quantized base's stored module is first
  // dequantized into the one scratch buffer (enqueued ahead of the block's compute; the next
  // block's dequantization follows it on the same stream).
  const void* block_params(const void* p) {
    if (!quant_) return p;
    base_quant_dequantize(*quant_, *st_.k, *st_.s, st_.dt, p, buf_->block_params);
    return buf_->block_params;
  }
  size_t residual_bytes() const { return st_.N() * size_t(sh_.n_embd) * st_.es(); }
  // Block l's input, its output (the next block's input or the head's), its intermediates.
  void* input(int l) const {
    switch (mode_) {
      case ActivationMode::kKeep:
        return l == 0 ? buf_->encoded : buf_->layers[size_t(l) - 1].out;
      case ActivationMode::kRecompute:
        return buf_->inputs[size_t(l)];
      case ActivationMode::kOffload:
        return buf_->inputs[size_t(l % 2)];
    }
    return nullptr;
  }
  void* output(int l) const {
    if (mode_ == ActivationMode::kKeep) return buf_->layers[size_t(l)].out;
    return l + 1 < sh_.n_layer ? input(l + 1) : buf_->out;
  }
  Layer& acts(int l) {
    return mode_ == ActivationMode::kKeep ? buf_->layers[size_t(l)] : buf_->layers[0];
  }
  // kOffload: the compute stream waits for the stash still reading input slot `slot`, if any.
  void wait_slot(int slot) {
    if (mode_ != ActivationMode::kOffload || slot < 0 || slot_stash_[slot] < 0) return;
    store_->compute_waits_activation(slot_stash_[slot]);
    slot_stash_[slot] = -1;
  }
  void note(const Status& s) {
    if (!s.is_ok() && error_.is_ok()) error_ = s;
  }

  // Enqueues block l's forward from `in` into `y`; writes the residual output to `out` unless
  // it is nullptr (a recompute, whose output is not needed). With kOffload, the compute stream
  // first waits for any stash still reading input slot `wait_slot_before_out` (-1: none).
  void block_forward(const void* p, const void* in, Layer& y, void* out, int wait_slot_before_out) {
    Kernels& k = *st_.k;
    blocks_.norm_forward(st_, NormSite::kBlockIn, p, in, y.ln1, y.n1);
    blocks_.attention_forward(st_, p, y.ln1, y.att, y.att_out);
    blocks_.residual_norm_forward(st_, NormSite::kBlockMid, p, in, y.att_out, y.res2, y.ln2, y.n2);
    blocks_.mlp_forward(st_, p, y.ln2, y.mlp, y.mlp_out);
    if (out == nullptr) return;  // a recompute: backward needs no block output
    wait_slot(wait_slot_before_out);
    k.residual_forward(*st_.s, st_.dt, out, y.res2, y.mlp_out, st_.N() * size_t(sh_.n_embd));
  }

  void forward_block(int l, const void* p) {
    const int L = sh_.n_layer;
    const void* in = input(l);
    int out_slot = -1;
    if (mode_ == ActivationMode::kOffload) {
      // Block l's input leaves as soon as it is complete (it overlaps this block's forward); the
      // last block's input stays for the backward that follows the head.
      if (l + 1 < L) {
        note(store_->stash_activation(l, in, residual_bytes()));
        slot_stash_[l % 2] = l;
        restored_[size_t(l)] = false;
      }
      if (l + 1 < L) out_slot = (l + 1) % 2;  // still being stashed from block l-1
    }
    block_forward(p, in, acts(l), output(l), out_slot);
  }

  void forward_head(const void* pf, const void* ph, const MicroBatch& mb) {
    Kernels& k = *st_.k;
    Stream& s = *st_.s;
    const int N = int(st_.N()), C = sh_.n_embd, Vp = sh_.padded_vocab_size;
    blocks_.norm_forward(st_, NormSite::kFinal, pf, output(sh_.n_layer - 1), buf_->lnf, buf_->nf);
    k.matmul_forward(s, st_.dt, buf_->logits, buf_->lnf, ph, nullptr, N, C, Vp);
    if (mb.logits_out) st_.dev->copy_d2h(s, mb.logits_out, buf_->logits, size_t(N) * Vp * st_.es());
    k.crossentropy_forward_backward(s, st_.dt, buf_->losses, buf_->logits, buf_->targets,
                                    mb.row_weights ? 1.0f : mb.dloss, N, sh_.vocab_size, Vp);
    const float* pinned_losses = mb.losses_out;
    if (mb.losses_out_pinned) {
      st_.dev->copy_d2h(s, mb.losses_out, buf_->losses, size_t(N) * 4);
    } else {
      st_.dev->copy_d2h(s, host_losses_, buf_->losses, size_t(N) * 4);
      float* src = host_losses_;
      float* dst = mb.losses_out;
      st_.dev->host_fn(s, [src, dst, N] { std::memcpy(dst, src, size_t(N) * 4); });
      pinned_losses = host_losses_;
    }
    if (mb.row_weights) {
      // The rows' factors from their losses on the host, back before the head's backward.
      const RowWeights* w = mb.row_weights;
      float* weights = host_row_weights_;
      const int B = st_.B, T = st_.T;
      st_.dev->host_fn(
          s, [w, pinned_losses, weights, B, T] { w->weigh(pinned_losses, B, T, weights); });
      st_.dev->copy_h2d(s, buf_->row_weights, weights, size_t(B) * 4);
      k.scale_rows(s, st_.dt, buf_->logits, buf_->row_weights, B, size_t(T) * size_t(Vp));
    }
    if constexpr (RunnerStateOf<Blocks>::kHas) blocks_.end_forward(st_, mb);
  }

  void backward_head(const void* pf, float* gf, const void* ph, float* gh) {
    const int N = int(st_.N()), C = sh_.n_embd;
    // logits now hold dlogits.
    // gh == nullptr: a frozen head (no weight gradient).
    st_.k->matmul_backward(*st_.s, st_.dt, buf_->dln, gh, nullptr, buf_->logits, buf_->lnf, ph, N,
                           C, sh_.padded_vocab_size, /*accumulate=*/false);
    blocks_.norm_backward(st_, NormSite::kFinal, pf, gf, buf_->dA, /*dres=*/nullptr, buf_->dln,
                          output(sh_.n_layer - 1), buf_->nf);
  }

  void backward_block(int l, const void* p, float* g) {
    const int L = sh_.n_layer;
    const void* residual = input(l);
    if (mode_ == ActivationMode::kOffload) {
      // Block l's input comes back into its slot (prefetched by backward_block(l + 1)); block
      // l-1's is fetched into the other slot now, behind backward l+1 (its slot's last user),
      // so the copy overlaps this block's recompute and backward.
      if (l + 1 < L && !restored_[size_t(l)]) {
        note(store_->restore_activation(l, input(l)));
        restored_[size_t(l)] = true;
      }
      if (l >= 1 && !restored_[size_t(l) - 1]) {
        note(store_->restore_activation(l - 1, input(l - 1)));
        restored_[size_t(l) - 1] = true;
        slot_stash_[(l - 1) % 2] = l - 1;  // forward waits for this copy before reusing the slot
      }
      if (l + 1 < L) {
        store_->compute_waits_activation(l);
        restored_[size_t(l)] = false;
        if (slot_stash_[l % 2] == l) slot_stash_[l % 2] = -1;
      }
    }
    if (mode_ != ActivationMode::kKeep) block_forward(p, residual, acts(l), nullptr, -1);
    Layer& y = acts(l);
    // out = res2 + mlp_out: dmlp_out = dA; dres2 = dA + the norm2 path, into dB.
    blocks_.mlp_backward(st_, p, g, buf_->dA, y.ln2, y.mlp, buf_->dmlp, buf_->dln);
    blocks_.norm_backward(st_, NormSite::kBlockMid, p, g, buf_->dB, buf_->dA, buf_->dln, y.res2,
                          y.n2);
    // res2 = residual + att_out: datt_out = dB; dresidual = dB + the norm1 path, into dA.
    blocks_.attention_backward(st_, p, g, buf_->dB, y.ln1, y.att, buf_->datt, buf_->dln);
    blocks_.norm_backward(st_, NormSite::kBlockIn, p, g, buf_->dA, buf_->dB, buf_->dln, residual,
                          y.n1);
  }

  const Blocks& blocks_;
  const ModelConfig& sh_;
  const LoraLayout& lora_;
  const BaseQuant* quant_;  // nullptr: the base is stored in the model dtype
  DecoderModules mods_;
  DecoderStep st_;
  ActivationMode mode_;
  ActivationStore* store_;
  Status error_;
  void* arena_ = nullptr;  // one device allocation for every slot's buffers
  // One activation set per micro-batch of a forward group; buf_ is the selected one.
  std::vector<Buffers> slots_;
  Buffers* buf_ = nullptr;
  int slot_ = 0;
  // kOffload: the layer whose stash last read each slot (-1: none pending), and whether a
  // layer's restore has been enqueued and not yet consumed by its backward.
  int slot_stash_[2] = {-1, -1};
  std::vector<bool> restored_;
  // The block definition's runner state, one per slot (a mixture's routing of each layer is
  // kept from a micro-batch's forward to its backward).
  using State = typename RunnerStateOf<Blocks>::type;
  std::vector<std::unique_ptr<State>> states_;
  std::vector<std::unique_ptr<Event>> uploaded_;  // per slot: after its last batch's uploads
  // host staging for tokens/targets/losses (the copy engines need stable host memory)
  int32_t* host_io_ = nullptr;
  float* host_losses_ = nullptr;
  float* host_row_weights_ = nullptr;
  std::vector<bool> slot_has_pos_;             // per slot: its batch came with positions
  std::vector<std::vector<size_t>> pad_rows_;  // per slot: its rows of model.pad_token_id
};

// A decoder model: the skeleton above with the block definition `Blocks`.
template <class Blocks>
class DecoderArchitecture final : public Architecture {
 public:
  // Checks the shape (errors name the model.* key) and builds the layout and programs.
  static Result<std::unique_ptr<Architecture>> create(const ModelConfig& config) {
    STRATA_ASSIGN_OR_RETURN(ModelConfig shape, decoder_shape(config), "");
    STRATA_RETURN_IF_ERROR(Blocks::check(shape), "");
    const Blocks blocks(shape);
    std::vector<std::string> prefixes;
    for (int l = 0; l < shape.n_layer; ++l) prefixes.push_back(blocks.hf_block_prefix(l));
    STRATA_ASSIGN_OR_RETURN(
        LoraLayout lora, lora_layout(shape.lora, Blocks::kType, blocks.lora_sites(), prefixes), "");
    STRATA_ASSIGN_OR_RETURN(
        BaseQuantKind quant,
        lora_base_quant_kind(shape.lora, Blocks::kType, lora, Blocks(shape).lora_sites()), "");
    return std::unique_ptr<Architecture>(new DecoderArchitecture(shape, std::move(lora), quant));
  }

  const std::string& name() const override { return name_; }
  const ModelLayout& layout() const override { return layout_; }
  const ModelConfig& shape() const override { return shape_; }
  std::string describe() const override {
    return blocks_.describe(layout_) + lora_describe(lora_, shape_.n_layer) +
           base_quant_describe(quant_.get(), shape_.n_layer);
  }
  std::string shape_string() const override {
    return blocks_.shape_string() + lora_shape_string(lora_) +
           (quant_ ? fmt::format(" base_quantization={}", base_quant_name(quant_->kind)) : "");
  }
  int vocab_size() const override { return shape_.vocab_size; }
  int context() const override { return shape_.context; }
  const Program& program(Pass pass) const override { return pass == Pass::kTrain ? train_ : eval_; }
  bool fused_attention(const Kernels& kernels, DType dt) const override {
    return kernels.supports(KernelOp::kFusedAttention, OpShape{.dt = dt, .hs = blocks_.head_size()})
        .supported;
  }

  ActivationSizes activation_plan(int B, int T, DType dt, ActivationMode mode,
                                  bool fused_attention = true) const override {
    Carver measure(nullptr);
    typename DecoderRunner<Blocks>::Buffers b;
    DecoderRunner<Blocks>::carve(measure, blocks_, shape_, BatchDims{B, T, dt, fused_attention},
                                 mode, lora_, quant_.get(), &b);
    ActivationSizes s;
    s.bytes = measure.used();
    typename DecoderRunner<Blocks>::Buffers slot;
    DecoderRunner<Blocks>::carve(measure, blocks_, shape_, BatchDims{B, T, dt, fused_attention},
                                 mode, lora_, quant_.get(), &slot, &b);
    s.slot_bytes = measure.used() - s.bytes;
    if (mode == ActivationMode::kOffload) {
      s.stash_layers = shape_.n_layer - 1;
      s.stash_bytes = size_t(B) * T * shape_.n_embd * dtype_size(dt);
      s.host_bytes = size_t(s.stash_layers) * ((s.stash_bytes + 4095) / 4096 * 4096);
    }
    return s;
  }

  FlopsPerToken flops_per_token(int T, ActivationMode mode) const override {
    // The blocks' GEMMs and attention, plus 2 FLOPs per weight of the Vp x C head; the
    // recompute re-runs the blocks only.
    const double blocks = blocks_.blocks_flops(T);
    FlopsPerToken f;
    const double head = 2.0 * double(shape_.padded_vocab_size) * double(shape_.n_embd);
    f.forward = blocks + head;
    f.recompute = mode == ActivationMode::kKeep ? 0.0 : blocks;
    if (!lora_.empty()) {
      // The frozen base: every weight GEMM (the blocks' at T = 0 leave attention's T x T
      // products out) and the head get no weight gradient. The adapters: u = x A^T and
      // u B^T per site and token, 2 r (in + out), trained as any weight (x 3).
      f.frozen = blocks_.blocks_flops(0) + head;
      double adapters = 0;
      for (const LoraLayout::Target& t : lora_.targets) {
        adapters += 2.0 * lora_.r * double(t.site.in + t.site.out);
      }
      for (const LoraLayout::Target& t : lora_.experts) {  // on each of a token's K experts
        adapters += 2.0 * lora_.r * double(t.site.in + t.site.out) * shape_.num_experts_per_tok;
      }
      f.forward += adapters * shape_.n_layer;
      if (mode != ActivationMode::kKeep) f.recompute += adapters * shape_.n_layer;
    }
    return f;
  }

  void init_range(int m, uint64_t seed, size_t begin, size_t count, float* out) const override {
    decoder_init_range(shape_, layout_.modules[size_t(m)], Blocks::kInitStream + uint64_t(m), seed,
                       begin, count, out);
  }

  std::vector<HfTensor> hf_tensors(int m) const override {
    if (!layout_.modules[size_t(m)].trainable || lora_.empty() || m < mods().base_modules()) {
      return blocks_.hf_tensors(layout_.modules[size_t(m)]);
    }
    return {};  // an adapter: not in the base's checkpoint (hf_adapter_tensors)
  }
  std::vector<HfTensor> hf_adapter_tensors(int m) const override {
    const DecoderModules d = mods();
    if (lora_.empty() || m < d.base_modules()) return {};
    return lora_hf_tensors(lora_, blocks_.hf_block_prefix(m - d.base_modules()));
  }
  const LoraLayout* lora() const override { return lora_.empty() ? nullptr : &lora_; }
  std::shared_ptr<const BaseQuant> base_quant(int m) const override {
    const DecoderModules d = mods();
    for (int l = 0; quant_ && l < shape_.n_layer; ++l) {
      if (m == d.block(l)) return quant_;
    }
    return nullptr;
  }
  StoredFillFn stored_fill(int m) const override {
    std::shared_ptr<const BaseQuant> q = base_quant(m);
    if (!q) return nullptr;
    return [q](size_t begin, size_t count, uint8_t* out, const StoredValuesFn& values) {
      return base_quant_fill(*q, begin, count, out, values)
          .with_context(fmt::format("quantizing its {} bytes", base_quant_name(q->kind)));
    };
  }
  bool hf_ignorable(const std::string& name) const override {
    return blocks_.hf_ignorable(name) || (shape_.tied_embeddings && name == "lm_head.weight");
  }

  Result<std::unique_ptr<ModelRunner>> create_runner(Device& device, int B, int T, DType dt,
                                                     ActivationMode mode, ActivationStore* store,
                                                     int slots) const override {
    STRATA_RETURN_IF_ERROR(check_decoder_runner(shape_, T, mode, store, slots), "");
    STRATA_RETURN_IF_ERROR(lora_check_backend(lora_, device.kernels()), "");
    auto r = std::make_unique<DecoderRunner<Blocks>>(
        device, blocks_, shape_, lora_, quant_.get(),
        BatchDims{B, T, dt, fused_attention(device.kernels(), dt)}, mode, store);
    STRATA_RETURN_IF_ERROR(r->allocate(slots),
                           fmt::format("allocating activations ({}) for batch {}x{}",
                                       activation_mode_name(mode), B, T));
    return std::unique_ptr<ModelRunner>(std::move(r));
  }
  Result<std::unique_ptr<KvDecoder>> create_kv_decoder(Device& device, DType dt) const override {
    if (!lora_.empty()) {
      return unavailable(
          "a model with LoRA adapters has no key/value cache: generation runs the "
          "merged weights on the model without them");
    }
    const KernelSupport ks = device.kernels().supports(
        KernelOp::kAttentionDecode, OpShape{.dt = dt, .hs = blocks_.head_size()});
    if (!ks) return unavailable("the kernels have no cached attention: " + ks.path);
    auto d = std::make_unique<DecoderKv<Blocks>>(device, blocks_, shape_, dt);
    STRATA_RETURN_IF_ERROR(d->allocate(), fmt::format("allocating the key/value cache for {} "
                                                      "positions",
                                                      shape_.context));
    return std::unique_ptr<KvDecoder>(std::move(d));
  }
  size_t kv_decoder_bytes(DType dt) const override {
    return DecoderKv<Blocks>::bytes(blocks_, shape_, dt);
  }

 private:
  DecoderModules mods() const {
    return DecoderModules{shape_.n_layer, shape_.tied_embeddings, extra_modules_of(blocks_),
                          !lora_.empty()};
  }
  DecoderArchitecture(const ModelConfig& shape, LoraLayout lora, BaseQuantKind quant)
      : name_(Blocks::kType), shape_(shape), blocks_(shape_), lora_(std::move(lora)) {
    const int X = extra_modules_of(blocks_);
    std::function<std::string(int, int)> extra_name;
    std::function<void(int, ModuleSpec&)> extra;
    if constexpr (requires { blocks_.extra_modules(); }) {
      extra_name = [this](int l, int j) { return blocks_.extra_name(l, j); };
      extra = [this](int j, ModuleSpec& m) { blocks_.extra_tensors(j, m); };
    }
    layout_ = decoder_layout(
        shape_, [this](ModuleSpec& m) { blocks_.embedding_tensors(m); },
        [this](ModuleSpec& m) { blocks_.block_tensors(m); },
        [this](ModuleSpec& m) { blocks_.final_norm_tensors(m); }, X, extra_name, extra, lora_);
    decoder_programs(mods(), &train_, &eval_);
    if (quant != BaseQuantKind::kNone) {  // every block has the same layout: one description
      quant_ = std::make_shared<const BaseQuant>(
          lora_base_quant(quant, layout_.modules[size_t(mods().block(0))], blocks_.lora_sites()));
      for (int l = 0; l < shape_.n_layer; ++l) {
        layout_.modules[size_t(mods().block(l))].stored_bytes = quant_->bytes;
      }
    }
  }
  std::string name_;
  ModelConfig shape_;
  Blocks blocks_;
  LoraLayout lora_;
  std::shared_ptr<const BaseQuant> quant_;  // the blocks' stored format; nullptr: not quantized
  ModelLayout layout_;
  Program train_, eval_;
};

}  // namespace strata
