#include "src/plan/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "src/model/gpt2.h"
#include "strata/log.h"

namespace strata {
namespace {

using json = nlohmann::json;

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

struct Preset {
  const char* name;
  int layers, width, heads, vocab, context;
  const char* note;
};

// Shapes from the GPT-2 release, the GPT-3 paper (Table 2.1) and the Llama / Llama 2 papers.
constexpr Preset kPresets[] = {
    {"gpt2-124m", 12, 768, 12, 50257, 1024, ""},
    {"gpt2-350m", 24, 1024, 16, 50257, 1024, ""},
    {"gpt2-774m", 36, 1280, 20, 50257, 1024, ""},
    {"gpt2-1.5b", 48, 1600, 25, 50257, 1024, ""},
    {"gpt3-6.7b", 32, 4096, 32, 50257, 2048, ""},
    {"gpt3-13b", 40, 5140, 40, 50257, 2048, ""},
    {"gpt3-175b", 96, 12288, 96, 50257, 2048, ""},
    {"llama-7b", 32, 4096, 32, 32000, 4096,
     "llama shape (width/layers/heads/vocab) computed with strata's GPT block (4x MLP, "
     "LayerNorm, learned positions, tied embeddings): ~6.5B params, not llama's 6.7B"},
    {"llama-13b", 40, 5120, 40, 32000, 4096,
     "llama shape computed with strata's GPT block: ~12.7B params, not llama's 13.0B"},
    {"llama-70b", 80, 8192, 64, 32000, 4096,
     "llama shape computed with strata's GPT block (no GQA, 4x MLP): ~64.7B params, not "
     "llama's 69B"},
};

// Elements of each module, as ModelLayout::from_config builds them (tied embeddings).
struct ModuleSizes {
  uint64_t emb, block, final_norm;
  int L;
};
ModuleSizes module_sizes(const ModelShape& m) {
  const uint64_t C = uint64_t(m.width), Vp = ceil_div(uint64_t(m.vocab), 64) * 64;
  return {Vp * C + uint64_t(m.context) * C, 12 * C * C + 13 * C, 2 * C, m.layers};
}

std::string gb(double bytes) { return format_bytes(bytes); }

}  // namespace

// strata's GPT architecture at a planner shape (tied embeddings, vocabulary padded to 64).
Result<std::unique_ptr<GptArchitecture>> architecture_of(const ModelShape& m) {
  ModelConfig mc;
  mc.n_layer = m.layers;
  mc.n_head = m.heads;
  mc.n_embd = m.width;
  mc.vocab_size = m.vocab;
  mc.context = m.context;
  return GptArchitecture::create(mc);
}

ActivationSizes activations_of(const ModelShape& m, int B, int T, DType dt, ActivationMode mode) {
  auto arch = architecture_of(m);
  return arch.is_ok() ? (*arch)->activation_plan(B, T, dt, mode) : ActivationSizes{};
}

Result<ModelShape> model_preset(const std::string& name) {
  for (const auto& p : kPresets) {
    if (name == p.name)
      return ModelShape{p.name, p.layers, p.width, p.heads, p.vocab, p.context, p.note};
  }
  std::string known;
  for (const auto& p : kPresets) known += std::string(known.empty() ? "" : ", ") + p.name;
  return not_found(
      fmt::format("--model {}: unknown preset; known: {} (or give --layers "
                  "--width --heads --vocab --context)",
                  name, known));
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> v;
  for (const auto& p : kPresets) v.push_back(p.name);
  return v;
}

uint64_t model_params(const ModelShape& m) {
  const ModuleSizes s = module_sizes(m);
  return s.emb + s.block * uint64_t(s.L) + s.final_norm;
}

// ---- placements -------------------------------------------------------------------------------

const char* plan_tier_name(PlanTier t) {
  return t == PlanTier::kDevice ? "device" : t == PlanTier::kHost ? "host" : "nvme";
}

std::vector<PlacementOption> placement_options() {
  using T = PlanTier;
  return {
      {"all-device", T::kDevice, T::kDevice},       {"opt-host", T::kDevice, T::kHost},
      {"opt-nvme", T::kDevice, T::kNvme},           {"params-host", T::kHost, T::kHost},
      {"params-host+opt-nvme", T::kHost, T::kNvme}, {"params-nvme+opt-host", T::kNvme, T::kHost},
      {"params-nvme+opt-nvme", T::kNvme, T::kNvme}};
}

Result<PlanOption> evaluate_placement(const PlanRequest& r, const PlacementOption& pl) {
  const ModelShape& m = r.model;
  if (m.layers < 1 || m.width < 1 || m.heads < 1 || m.width % m.heads != 0 || m.vocab < 2 ||
      m.context < 1) {
    return invalid_argument(fmt::format(
        "model {}: layers {}, width {}, heads {}, vocab {}, context {}: all must be >= 1 and "
        "width divisible by heads",
        m.name, m.layers, m.width, m.heads, m.vocab, m.context));
  }
  if (r.micro_batch < 1 || r.seq < 1 || r.accumulation < 1 || r.hw.gpus < 1) {
    return invalid_argument("--batch, --seq, accumulation and --gpus must be >= 1");
  }
  if (r.seq > m.context) {
    return invalid_argument(
        fmt::format("--seq {} exceeds the model's context {}", r.seq, m.context));
  }
  PlanOption o;
  o.placement = pl;
  const uint64_t W = uint64_t(r.hw.gpus);
  const uint64_t es = dtype_size(r.dtype), mb = dtype_size(r.moment_dtype);
  const ModuleSizes ms = module_sizes(m);
  // Module list in forward order: embedding, blocks, final_norm (tied head).
  std::vector<uint64_t> full = {ms.emb};
  for (int l = 0; l < ms.L; ++l) full.push_back(ms.block);
  full.push_back(ms.final_norm);
  const PlanTier grads_tier =
      pl.optimizer == PlanTier::kDevice ? PlanTier::kDevice : PlanTier::kHost;

  // Homes (TierManager::create's preflight), per rank: each module's shard is numel/W.
  uint64_t home[3] = {0, 0, 0}, max_p = 0, max_g = 0, max_opt = 0, P_local = 0;
  auto add_home = [&](PlanTier t, uint64_t bytes) {
    home[int(t)] += round_up(bytes, t == PlanTier::kDevice ? 256 : 4096);
  };
  for (uint64_t n_full : full) {
    const uint64_t n = ceil_div(n_full, W);
    P_local += n;
    add_home(pl.params, n * es);
    add_home(pl.optimizer, n * 4);
    add_home(pl.optimizer, n * 2 * mb);
    add_home(grads_tier, n * 4);
    max_p = std::max(max_p, n * es);
    max_g = std::max(max_g, n * 4);
    if (pl.optimizer == PlanTier::kNvme) {
      max_opt = std::max(max_opt, round_up(n * 4, 4096) + round_up(n * 2 * mb, 4096));
    }
  }
  // Device working set: a module's fetched params (full, after the all-gather) + its fp32
  // gradient (plus the tied embedding's gradient while a block runs).
  auto pc = [&](uint64_t n) { return pl.params == PlanTier::kDevice ? 0 : round_up(n * es, 256); };
  auto g = [&](uint64_t n) { return round_up(n * 4, 256); };
  uint64_t ws = pc(ms.final_norm) + g(ms.final_norm);
  ws = std::max(ws, pc(ms.block) + g(ms.block) + g(ms.emb));
  ws = std::max(ws, g(ms.emb) + pc(ms.emb));
  o.device.state = home[0];
  o.device.buffers = ws;
  STRATA_ASSIGN_OR_RETURN(const auto arch, architecture_of(m), "model " + m.name);
  const ActivationSizes acts = arch->activation_plan(r.micro_batch, r.seq, r.dtype, r.activations);
  o.device.activations = acts.bytes;
  o.device.capacity = r.hw.gpu_mem;

  uint64_t staging = 0;
  if (pl.params == PlanTier::kNvme) staging += r.prefetch_bytes + 3 * round_up(max_p, 4096);
  if (max_opt > 0) staging += uint64_t(2 * r.buffer_count + 1) * max_opt;
  staging += 2 * round_up(max_g, 4096) + 2 * round_up(max_p, 4096);
  // The host tier of one node holds every local rank's state and staging.
  o.host.state = home[1] * W;
  o.host.buffers = staging * W;
  o.host.activations = acts.host_bytes * W;
  o.host.capacity = r.hw.host_mem;

  uint64_t objects = 0;
  for (size_t i = 0; i < full.size(); ++i) {
    objects += (pl.params == PlanTier::kNvme) + 2 * (pl.optimizer == PlanTier::kNvme);
  }
  o.nvme.state = home[2] * W;
  if (home[2] > 0) {
    const uint64_t paths = std::max<size_t>(1, r.hw.nvme_paths.size());
    o.nvme.buffers = (objects * (uint64_t{4} << 20) + paths * (uint64_t{16} << 20)) * W;
  }
  o.nvme.capacity = r.hw.nvme_bytes;

  // Fits?
  if (o.device.capacity > 0 && o.device.total() > o.device.capacity) {
    o.why.push_back(fmt::format("device needs {} (activations {}, state {}, working set {}) > {}",
                                gb(double(o.device.total())), gb(double(o.device.activations)),
                                gb(double(o.device.state)), gb(double(o.device.buffers)),
                                gb(double(o.device.capacity))));
  }
  if (o.host.capacity > 0 && o.host.total() > o.host.capacity) {
    o.why.push_back(fmt::format(
        "host needs {} (state {}, staging {}{}) > {}", gb(double(o.host.total())),
        gb(double(o.host.state)), gb(double(o.host.buffers)),
        o.host.activations ? ", offloaded activations " + gb(double(o.host.activations)) : "",
        gb(double(o.host.capacity))));
  }
  if (o.nvme.state > 0 && r.hw.nvme_paths.empty()) {
    o.why.push_back("nvme: state placed on nvme but no --nvme path given");
  } else if (o.nvme.capacity > 0 && o.nvme.total() > o.nvme.capacity) {
    o.why.push_back(fmt::format("nvme needs {} > {} free", gb(double(o.nvme.total())),
                                gb(double(o.nvme.capacity))));
  }
  o.fits = o.why.empty();

  // Expected peaks (what the run reports), beside the reservations above.
  // Device: every module's per-micro-batch gradient buffer (fp32, full module) is alive at the
  // end of backward while the drains run; offloaded params are cached in what is left.
  const uint64_t Pf = model_params(m);
  o.device.peak = o.device.total() + Pf * 4;
  if (pl.params != PlanTier::kDevice) o.device.peak += Pf * es;
  if (o.device.capacity > 0) o.device.peak = std::min(o.device.peak, o.device.capacity);
  uint64_t host_peak = home[1] + 2 * round_up(max_g, 4096) + 2 * round_up(max_p, 4096);
  if (pl.optimizer == PlanTier::kNvme) {
    // The pipeline holds at most 2*buffer_count+1 modules' master+moments, and never more
    // modules than the model has: the largest ones.
    std::vector<uint64_t> opt_bytes;
    for (uint64_t n_full : full) {
      const uint64_t n = ceil_div(n_full, W);
      opt_bytes.push_back(round_up(n * 4, 4096) + round_up(n * 2 * mb, 4096));
    }
    std::sort(opt_bytes.rbegin(), opt_bytes.rend());
    const size_t k = std::min(opt_bytes.size(), size_t(2 * r.buffer_count + 1));
    for (size_t i = 0; i < k; ++i) host_peak += opt_bytes[i];
  }
  if (pl.params == PlanTier::kNvme) host_peak += 2 * round_up(max_p, 4096);  // fetch staging
  // Params homed on the device: the optimizer writes every module's new low-precision params
  // through host staging buffers, all alive until the copies are done.
  if (pl.params == PlanTier::kDevice) host_peak += P_local * es;
  host_peak += acts.host_bytes;  // offloaded block inputs: reserved once, always held
  // The optimizer under backward with clipping or fp16 keeps every stepped module's pre-step
  // master + moments until the step is validated (TierManager::take_undo): NVMe-homed state as
  // its old extents, the step written to fresh ones (nvme.undo: on the swap paths when they
  // have room), other state as host copies (host.undo: taken while the host budget has room
  // beyond the reservation; modules without room are stepped after backward instead).
  uint64_t undo_host = 0, undo_nvme = 0;
  // (On a GPU the optimizer of device-resident state would keep its copies on the device.)
  if (r.overlap_optimizer && r.undo_copies &&
      (pl.optimizer != PlanTier::kDevice || r.profile.cpu_backend)) {
    uint64_t per_rank = 0;
    for (uint64_t n_full : full) {
      const uint64_t n = ceil_div(n_full, W);
      per_rank += round_up(n * 4, 4096) + round_up(n * 2 * mb, 4096);
    }
    (pl.optimizer == PlanTier::kNvme ? undo_nvme : undo_host) = per_rank * W;
  }
  if (undo_nvme > 0) {
    const uint64_t stripes = 2 * full.size() * (uint64_t{4} << 20) * W;  // swap-file slack
    if (o.nvme.capacity == 0 || o.nvme.total() + undo_nvme + stripes <= o.nvme.capacity) {
      o.nvme.undo = undo_nvme;
    } else {
      undo_host = undo_nvme;  // no room on the disks: host copies instead
    }
  }
  const uint64_t undo_want = undo_host;
  o.host.undo = undo_want;
  if (o.host.capacity > 0) {
    const uint64_t room =
        o.host.capacity > o.host.total() ? o.host.capacity - o.host.total() : uint64_t{0};
    o.host.undo = std::min(undo_want, room);
  }
  if (o.host.undo > 0) {
    // With undo copies the peak comes at the end of the speculative pass instead: the homes, the
    // undo copies, and the NVMe optimizer pipeline's buffer_count + 1 modules (read ahead or
    // written behind, one stepped; with NVMe params also their new params' staging) — the
    // gradient landing and write-back staging are free by then. Measured: docs/PLANNER.md.
    uint64_t spec = home[1] + acts.host_bytes + o.host.undo / W;
    if (pl.optimizer == PlanTier::kNvme) {
      std::vector<uint64_t> slot;
      for (uint64_t n_full : full) {
        const uint64_t n = ceil_div(n_full, W);
        slot.push_back(round_up(n * 4, 4096) + round_up(n * 2 * mb, 4096) +
                       (pl.params == PlanTier::kNvme ? round_up(n * es, 4096) : 0));
      }
      std::sort(slot.rbegin(), slot.rend());
      const size_t k = std::min(slot.size(), size_t(r.buffer_count + 1));
      for (size_t i = 0; i < k; ++i) spec += slot[i];
    }
    if (pl.params == PlanTier::kNvme) spec += 2 * round_up(max_p, 4096);  // fetch staging
    host_peak = std::max(host_peak, spec);
  }
  o.host.peak = host_peak * W;
  o.nvme.peak = o.nvme.state + o.nvme.undo;
  if (pl.optimizer == PlanTier::kDevice && !r.profile.cpu_backend) {
    o.runnable = false;  // placement_from_config refuses it on a non-host-addressable device
  }

  // ---- time ----
  const MachineProfile& pf = r.profile;
  const double A = double(r.accumulation), tokens = double(r.micro_batch) * r.seq;
  const FlopsPerToken fpt = arch->flops_per_token(r.seq, r.activations);
  o.flops = uint64_t(fpt.train() * tokens * A);
  TimeTerms& t = o.time;
  t.gemm_flops = gemm_rate_at(pf, m.width, r.micro_batch * r.seq);
  t.compute_s = double(o.flops) / t.gemm_flops;

  const double P = double(P_local), Pfull = double(model_params(m));
  // Params fetched to the device per step: a fwd and a bwd pass per micro-batch, less what the
  // device can keep cached (its free bytes), at least once per step (the optimizer changed
  // them). Params resident on the device are fetched never, but written once after the step.
  double link = 0, fetch = 0;
  if (pl.params != PlanTier::kDevice) {
    const double free_dev =
        o.device.capacity > o.device.total() ? double(o.device.capacity - o.device.total()) : 0.0;
    const double pbytes = Pfull * es;
    const double cached = std::min(1.0, free_dev / pbytes);
    fetch = pbytes * (1.0 + (2.0 * A - 1.0) * (1.0 - cached));
    link += fetch;
  } else if (pl.optimizer != PlanTier::kDevice) {
    link += P * es;  // new low-precision params back to the device
  }
  if (grads_tier != PlanTier::kDevice) link += A * P * 4;  // fp32 grads to the host tier
  // Offloaded block inputs: out after each block's forward, back before its backward.
  link += A * 2.0 * double(acts.stash_layers) * double(acts.stash_bytes);
  o.link_bytes = uint64_t(link);
  t.link_s = link / (pf.link_gbps.value * 1e9);

  double nr = 0, nw = 0;
  if (pl.optimizer == PlanTier::kNvme) {
    nr += P * (4 + 2 * mb);
    nw += P * (4 + 2 * mb);
  }
  double nvme_param_read = 0;
  if (pl.params == PlanTier::kNvme) {
    nvme_param_read = fetch / double(W);  // this rank's shards
    nr += nvme_param_read;
    nw += P * es;
  }
  o.nvme_read_bytes = uint64_t(nr) * W;
  o.nvme_write_bytes = uint64_t(nw) * W;
  // Every local rank shares the node's NVMe bandwidth.
  t.nvme_s =
      double(W) * (nr / (pf.nvme_read_gbps.value * 1e9) + nw / (pf.nvme_write_gbps.value * 1e9));
  t.cpu_optim_s = pl.optimizer == PlanTier::kDevice ? 0.0 : double(W) * P / pf.optimizer_pps.value;
  // The optimizer thread also copies each module's master + moments into its undo copy.
  t.cpu_optim_s += double(o.host.undo) / (pf.host_copy_gbps.value * 1e9);
  if (W > 1) {
    const double frac = double(W - 1) / double(W);
    const double bytes = A * (2.0 * Pfull * es + Pfull * 4) * frac;
    const double bw = pf.collective_gbps.value > 0 ? pf.collective_gbps.value : 25.0;
    t.collectives_s = bytes / (bw * 1e9);
  }
  // Combination (docs/PLANNER.md, "Step time"). Plain schedule: the optimizer pass (CPU Adam
  // pipelined with its NVMe traffic) follows backward. GPU: transfers and collectives overlap
  // compute (prefetch). CPU backend: compute, copies and the optimizer share the same cores, so
  // they add; NVMe transfers run on I/O threads under the optimizer.
  const double plain =
      pf.cpu_backend
          ? t.compute_s + t.link_s + std::max(t.cpu_optim_s, t.nvme_s) + t.collectives_s
          : std::max({t.compute_s, t.link_s, t.collectives_s}) + std::max(t.cpu_optim_s, t.nvme_s);
  t.hidden_share = 0;
  t.step_s = plain;
  if (r.overlap_optimizer) {
    // The optimizer under backward starts with the last micro-batch's backward: each micro-batch
    // is a forward (1) and a backward (2, plus 1 when blocks are recomputed) in compute units.
    const double rc = fpt.recompute / fpt.forward;
    const double start_share = (A * (3.0 + rc) - (2.0 + rc)) / (A * (3.0 + rc));
    // Its NVMe traffic from then on: the optimizer state's reads (less the buffer_count modules
    // read ahead from the step's start, in backward order: final norm, last blocks, ...), its
    // writes, the new params' writes, and the last backward pass's param reads.
    double window = 0;
    if (pl.optimizer == PlanTier::kNvme) {
      const double per_param = double(4 + 2 * mb);
      double ahead = double(ceil_div(ms.final_norm, W));
      const int blocks_ahead = std::min(ms.L, std::max(0, r.buffer_count - 1));
      ahead += double(blocks_ahead) * double(ceil_div(ms.block, W));
      if (r.buffer_count - 1 > ms.L) ahead += double(ceil_div(ms.emb, W));
      window += (P - std::min(P, ahead)) * per_param / (pf.nvme_read_gbps.value * 1e9);
      window += P * per_param / (pf.nvme_write_gbps.value * 1e9);
    }
    if (pl.params == PlanTier::kNvme) window += P * es / (pf.nvme_write_gbps.value * 1e9);
    const double window_opt = window * double(W);  // the optimizer's own traffic
    if (pl.params == PlanTier::kNvme) {
      window += nvme_param_read / (2.0 * A) / (pf.nvme_read_gbps.value * 1e9);
    }
    window *= double(W);  // every local rank shares the node's NVMe bandwidth
    // A step after one that clipped or overflowed only reads ahead under backward (the trainer
    // predicts the next will clip too) and steps after it: the plain schedule less the reads
    // done ahead.
    t.step_after_s =
        r.undo_copies
            ? std::max((pf.cpu_backend ? t.compute_s + t.link_s + t.collectives_s
                                       : std::max({t.compute_s, t.link_s, t.collectives_s})) +
                           std::max(t.cpu_optim_s, window_opt),
                       t.nvme_s)
            : 0.0;
    double overlapped = 0;
    if (pf.cpu_backend) {
      const double start = (t.compute_s + t.link_s) * start_share;
      overlapped = std::max(
          {t.compute_s + t.link_s + t.cpu_optim_s + t.collectives_s, start + window, t.nvme_s});
    } else {
      const double dev = std::max({t.compute_s, t.link_s, t.collectives_s});
      const double start = t.compute_s * start_share;
      overlapped = std::max({dev, start + std::max(t.cpu_optim_s, window), t.nvme_s});
    }
    // Modules without room for their undo copies are stepped after backward.
    t.hidden_share = o.host.undo < undo_want ? double(o.host.undo) / double(undo_want) : 1.0;
    t.step_s = t.hidden_share * overlapped + (1.0 - t.hidden_share) * plain;
    if (!r.undo_copies) t.step_after_s = t.step_s;  // nothing can make it fall back
  } else {
    t.step_after_s = plain;
  }
  const std::pair<const char*, double> terms[] = {{"compute", t.compute_s},
                                                  {"host<->device link", t.link_s},
                                                  {"nvme", t.nvme_s},
                                                  {"cpu optimizer", t.cpu_optim_s},
                                                  {"collectives", t.collectives_s}};
  double best = -1;
  for (const auto& [name, v] : terms) {
    if (v > best) {
      best = v;
      t.bottleneck = name;
    }
  }
  return o;
}

Result<PlanReport> make_plan(const PlanRequest& request) {
  PlanReport rep;
  rep.request = request;
  rep.params = model_params(request.model);
  for (const auto& pl : placement_options()) {
    STRATA_ASSIGN_OR_RETURN(PlanOption o, evaluate_placement(request, pl), "planning");
    rep.options.push_back(std::move(o));
  }
  for (size_t i = 0; i < rep.options.size(); ++i) {
    const auto& o = rep.options[i];
    if (!o.fits || !o.runnable) continue;
    if (rep.best < 0 || o.time.step_s < rep.options[size_t(rep.best)].time.step_s)
      rep.best = int(i);
  }
  return rep;
}

PlacementOption placement_of_config(const Config& cfg) {
  auto tier = [](const std::string& s) {
    return s == "nvme"                   ? PlanTier::kNvme
           : (s == "cpu" || s == "host") ? PlanTier::kHost
                                         : PlanTier::kDevice;
  };
  PlacementOption p;
  p.params = tier(cfg.zero.offload_param.device);
  p.optimizer = tier(cfg.zero.offload_optimizer.device);
  if (!cfg.strata.placement_params.empty()) p.params = tier(cfg.strata.placement_params);
  if (!cfg.strata.placement_master.empty()) p.optimizer = tier(cfg.strata.placement_master);
  for (const auto& o : placement_options()) {
    if (o.params == p.params && o.optimizer == p.optimizer) p.name = o.name;
  }
  return p;
}

PlanRequest request_from_config(const Config& cfg, const Hardware& hw,
                                const MachineProfile& profile) {
  PlanRequest r;
  r.model = {"config",
             cfg.model.n_layer,
             cfg.model.n_embd,
             cfg.model.n_head,
             cfg.model.vocab_size,
             cfg.model.context,
             ""};
  r.micro_batch = int(cfg.train_micro_batch_size_per_gpu);
  r.seq = cfg.data.seq_len > 0 ? cfg.data.seq_len : cfg.model.context;
  r.accumulation = int(cfg.gradient_accumulation_steps);
  r.dtype = cfg.model.dtype;
  r.moment_dtype = cfg.strata.moment_dtype;
  r.buffer_count = std::max(1, cfg.zero.offload_optimizer.buffer_count);
  r.overlap_optimizer = cfg.strata.optimizer_overlap && !cfg.strata.delayed_update;
  r.undo_copies = cfg.gradient_clipping > 0 || cfg.fp16.enabled;
  r.prefetch_bytes = cfg.zero.stage3_prefetch_bucket_size * dtype_size(cfg.model.dtype);
  auto mode = parse_activation_mode(cfg.strata.activations);  // the parser checked the name
  r.activations = mode.is_ok() ? *mode : ActivationMode::kKeep;
  r.hw = hw;
  r.profile = profile;
  // The NVMe rates of the aio case this config runs (aio.backend "auto" is io_uring where it
  // starts, which the probe's case list then has), when the profile measured it.
  const std::string backend = cfg.aio.backend == "auto" ? "io_uring" : cfg.aio.backend;
  for (const auto& c : profile.nvme_cases) {
    if (c.backend == backend && c.block_size == cfg.aio.block_size &&
        c.queue_depth == cfg.aio.queue_depth && c.read_gbps > 0 && c.write_gbps > 0) {
      const std::string src = fmt::format("{} ({} qd {}, the config's aio)",
                                          profile.nvme_read_gbps.source, backend, c.queue_depth);
      r.profile.nvme_read_gbps = {c.read_gbps, src};
      r.profile.nvme_write_gbps = {c.write_gbps, src};
    }
  }
  return r;
}

Result<CapacityResult> max_model(const PlanRequest& request) {
  // Grow the layer count at the request's width: fitting is monotone in layers (every tier's
  // need grows with it), so a doubling search then a bisection finds the boundary.
  auto fits = [&](int layers, PlanReport* out) -> Result<bool> {
    PlanRequest r = request;
    r.model.layers = layers;
    r.model.name = fmt::format("{}-{}L", request.model.name, layers);
    STRATA_ASSIGN_OR_RETURN(PlanReport rep, make_plan(r), "");
    const bool ok = rep.best >= 0;
    if (out) *out = std::move(rep);
    return ok;
  };
  STRATA_ASSIGN_OR_RETURN(bool one, fits(1, nullptr), "capacity search");
  if (!one) {
    return out_of_memory(
        fmt::format("capacity: even 1 layer of width {} does not fit at micro-batch {} x {} tokens",
                    request.model.width, request.micro_batch, request.seq));
  }
  int lo = 1, hi = 2;
  while (hi < (1 << 20)) {
    STRATA_ASSIGN_OR_RETURN(bool f, fits(hi, nullptr), "capacity search");
    if (!f) break;
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    STRATA_ASSIGN_OR_RETURN(bool f, fits(mid, nullptr), "capacity search");
    (f ? lo : hi) = mid;
  }
  CapacityResult c;
  STRATA_ASSIGN_OR_RETURN(bool f, fits(lo, &c.report), "capacity search");
  (void)f;
  c.model = c.report.request.model;
  c.params = c.report.params;
  return c;
}

}  // namespace strata
