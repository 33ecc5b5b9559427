// A decoder's generation forward with a key/value cache (KvDecoder, architecture.h), over a
// block definition (decoder.h): DecoderKv<Blocks>, created by DecoderArchitecture<Blocks>::
// create_kv_decoder beside the training runner (DecoderRunner), never instead of it: it carves
// its own arena, and the training program never reaches it.
//
// A call of n tokens at positions [pos, pos + n) runs the skeleton's forward over them alone:
// the embedding (the positions in DecoderStep::pos), each block's norm, its attention against
// the layer's cache (Blocks::attention_decode: the projections, the rotary positions, then
// Kernels::attention_decode, which appends the new keys and values and attends over every
// cached position), the MLP (a mixture routes the n tokens), and the head on the last token
// only. One sequence; every buffer sized for model.context tokens.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <vector>

#include "src/model/decoder.h"

namespace strata {

template <class Blocks>
class DecoderKv final : public KvDecoder {
 public:
  // The arena: token ids and positions, the residual stream twice, one block's activations and
  // the head's, for maxT = model.context tokens; then each layer's keys and values.
  struct Buffers {
    int32_t *tokens = nullptr, *pos = nullptr;
    void *x = nullptr, *ln1 = nullptr, *att_out = nullptr, *res2 = nullptr, *ln2 = nullptr,
         *mlp_out = nullptr, *lnf = nullptr, *logits = nullptr;
    typename Blocks::NormStats n1, n2, nf;
    typename Blocks::AttentionActs att;
    typename Blocks::MlpActs mlp;
    std::vector<void*> k, v;  // per layer [maxT, KVH * hs]
  };
  static void carve(Carver& c, const Blocks& blocks, const ModelConfig& sh, DType dt, Buffers* m) {
    // The fused attention's sizes: a layer keeps no [T, T] probabilities here.
    const BatchDims d{1, sh.context, dt, true};
    const size_t N = d.N(), NC = N * size_t(sh.n_embd) * d.es();
    m->tokens = static_cast<int32_t*>(c.take(N * 4));
    m->pos = static_cast<int32_t*>(c.take(N * 4));
    for (void** p : {&m->x, &m->ln1, &m->att_out, &m->res2, &m->ln2, &m->mlp_out}) *p = c.take(NC);
    m->lnf = c.take(size_t(sh.n_embd) * d.es());
    m->logits = c.take(size_t(sh.padded_vocab_size) * d.es());
    blocks.carve(c, d, &m->n1);
    blocks.carve(c, d, &m->n2);
    blocks.carve(c, d, &m->nf);
    blocks.carve(c, d, &m->att);
    blocks.carve(c, d, &m->mlp);
    const size_t kv = N * size_t(sh.num_key_value_heads) * size_t(blocks.head_size()) * d.es();
    m->k.resize(size_t(sh.n_layer));
    m->v.resize(size_t(sh.n_layer));
    for (int l = 0; l < sh.n_layer; ++l) {
      m->k[size_t(l)] = c.take(kv);
      m->v[size_t(l)] = c.take(kv);
    }
  }
  static size_t bytes(const Blocks& blocks, const ModelConfig& sh, DType dt) {
    Carver measure(nullptr);
    Buffers b;
    carve(measure, blocks, sh, dt, &b);
    return measure.used();
  }

  DecoderKv(Device& d, const Blocks& blocks, const ModelConfig& sh, DType dt)
      : blocks_(blocks), sh_(sh), mods_{sh.n_layer, sh.tied_embeddings, extra_modules_of(blocks)} {
    static_cast<BatchDims&>(st_) = BatchDims{1, sh.context, dt, true};
    st_.dev = &d;
    st_.k = &d.kernels();
    st_.s = &d.compute_stream();
  }
  ~DecoderKv() override {
    st_.dev->synchronize(*st_.s).ignore();
    if (arena_) st_.dev->release(arena_);
    if (host_) st_.dev->release_host(host_);
  }

  Status allocate() {
    const size_t total = bytes(blocks_, sh_, st_.dt);
    STRATA_ASSIGN_OR_RETURN(arena_, st_.dev->allocate(total, "generation cache"), "device");
    Carver real(static_cast<char*>(arena_));
    carve(real, blocks_, sh_, st_.dt, &buf_);
    STRATA_ASSIGN_OR_RETURN(void* h, st_.dev->allocate_host(size_t(sh_.context) * 8),
                            "host staging");
    host_ = static_cast<int32_t*>(h);
    if constexpr (RunnerStateOf<Blocks>::kHas) {
      st_.state = &state_;
      STRATA_RETURN_IF_ERROR(blocks_.prepare(st_, state_), "the block's runner state");
    }
    return Status::ok();
  }

  Status forward(std::span<const int32_t> tokens, std::span<const void* const> params,
                 void* logits_out) override {
    const int n = int(tokens.size()), C = sh_.n_embd;
    if (n < 1 || pos_ + int64_t(n) > sh_.context) {
      return invalid_argument(
          fmt::format("the cache holds model.context {} positions: {} already run, {} more asked",
                      sh_.context, pos_, n));
    }
    Device& dev = *st_.dev;
    Kernels& k = *st_.k;
    Stream& s = *st_.s;
    // The staging is reused each call: the last call's uploads are done (it synchronized).
    std::memcpy(host_, tokens.data(), size_t(n) * 4);
    std::iota(host_ + sh_.context, host_ + sh_.context + n, pos_);
    dev.copy_h2d(s, buf_.tokens, host_, size_t(n) * 4);
    dev.copy_h2d(s, buf_.pos, host_ + sh_.context, size_t(n) * 4);
    st_.T = n;
    st_.pos = buf_.pos;
    const auto P = [&](int m) { return params[size_t(m)]; };
    blocks_.embedding_forward(st_, P(mods_.embedding()), buf_.tokens, buf_.x);
    const size_t NC = size_t(n) * C, X = size_t(mods_.X);
    for (int l = 0; l < sh_.n_layer; ++l) {
      const void* p = P(mods_.block(l));
      st_.layer = l;
      st_.extra_params =
          X ? params.subspan(size_t(mods_.extra(l, 0)), X) : std::span<const void* const>();
      blocks_.norm_forward(st_, NormSite::kBlockIn, p, buf_.x, buf_.ln1, buf_.n1);
      const KvLayer kv{buf_.k[size_t(l)], buf_.v[size_t(l)], pos_, sh_.context};
      blocks_.attention_decode(st_, p, buf_.ln1, buf_.att, kv, buf_.att_out);
      blocks_.residual_norm_forward(st_, NormSite::kBlockMid, p, buf_.x, buf_.att_out, buf_.res2,
                                    buf_.ln2, buf_.n2);
      blocks_.mlp_forward(st_, p, buf_.ln2, buf_.mlp, buf_.mlp_out);
      k.residual_forward(s, st_.dt, buf_.x, buf_.res2, buf_.mlp_out, NC);
    }
    // The head on the last token alone.
    st_.layer = -1;
    st_.T = 1;
    const char* last = static_cast<const char*>(buf_.x) + (NC - size_t(C)) * st_.es();
    blocks_.norm_forward(st_, NormSite::kFinal, P(mods_.final_norm()), last, buf_.lnf, buf_.nf);
    k.matmul_forward(s, st_.dt, buf_.logits, buf_.lnf, P(mods_.head()), nullptr, 1, C,
                     sh_.padded_vocab_size);
    dev.copy_d2h(s, logits_out, buf_.logits, size_t(sh_.padded_vocab_size) * st_.es());
    st_.pos = nullptr;
    STRATA_RETURN_IF_ERROR(dev.synchronize(s), fmt::format("positions {}..{}", pos_, pos_ + n - 1));
    if constexpr (RunnerStateOf<Blocks>::kHas) {
      STRATA_RETURN_IF_ERROR(state_.error, "");
    }
    pos_ += n;
    return Status::ok();
  }
  int position() const override { return pos_; }

 private:
  const Blocks& blocks_;
  const ModelConfig& sh_;
  DecoderModules mods_;
  DecoderStep st_;
  typename RunnerStateOf<Blocks>::type state_;
  void* arena_ = nullptr;
  int32_t* host_ = nullptr;  // host staging: token ids [context], then positions [context]
  Buffers buf_;
  int pos_ = 0;
};

}  // namespace strata
