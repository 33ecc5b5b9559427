#include "src/plan/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "src/base/json_depth.h"
#include "src/model/model.h"
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

ActivationSizes activations_of(const ModelShape& m, int B, int T, DType dt, ActivationMode mode) {
  ModelLayout l;  // activation_bytes reads only the shape fields
  l.L = m.layers;
  l.NH = m.heads;
  l.C = m.width;
  l.V = m.vocab;
  l.Vp = int(ceil_div(uint64_t(m.vocab), 64) * 64);
  l.maxT = m.context;
  return activation_bytes(l, B, T, dt, mode);
}

std::string gb(double bytes) { return format_bytes(bytes); }

}  // namespace

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

// ---- profiles ---------------------------------------------------------------------------------

MachineProfile default_profile(bool cpu_backend) {
  MachineProfile p;
  p.cpu_backend = cpu_backend;
  if (cpu_backend) {
    // Measured on the 2-core development host (docs/PLANNER.md); run `strata probe` for yours.
    p.gemm_flops = {6.0e10, "default (2-core dev host)"};
    p.link_gbps = {8.0, "default (host memcpy)"};
    p.host_copy_gbps = {8.0, "default"};
    p.optimizer_pps = {1.5e8, "default"};
    p.nvme_read_gbps = {1.5, "default"};
    p.nvme_write_gbps = {1.0, "default"};
  } else {
    // H100 SXM-class: bf16 dense GEMM at ~60% of 989 TFLOP/s peak, PCIe Gen5 pinned copies,
    // DeepSpeed-class CPU Adam on a 2-socket host, NVLink bus bandwidth (docs/PLANNER.md).
    p.gemm_flops = {6.0e14, "default (H100, 60% of bf16 peak)"};
    p.link_gbps = {25.0, "default (PCIe Gen5 x16, pinned)"};
    p.host_copy_gbps = {50.0, "default"};
    p.optimizer_pps = {1.0e9, "default (per node)"};
    p.nvme_read_gbps = {3.0, "default (one NVMe)"};
    p.nvme_write_gbps = {2.0, "default (one NVMe)"};
    p.collective_gbps = {200.0, "default (NVLink busbw)"};
  }
  return p;
}

namespace {
Result<MachineProfile> parse_profile_fields(const std::string& text, const std::string& origin,
                                            bool fastest) {
  const std::string regen =
      fmt::format("; regenerate it with `strata probe --path <nvme dir> --json {}`", origin);
  json j;
  try {
    Status depth = check_json_depth(text);
    if (!depth.is_ok()) throw std::runtime_error(depth.message());
    j = json::parse(text);
  } catch (const std::exception& e) {
    return invalid_argument(fmt::format("{}: not a JSON profile ({}){}", origin, e.what(), regen));
  }
  if (!j.is_object() || !j.contains("magic") || j["magic"] != "strata-machine-profile") {
    return invalid_argument(fmt::format(
        "{}: magic is {}, expected \"strata-machine-profile\" (a `strata probe io` profile "
        "alone is not a machine profile){}",
        origin, j.is_object() && j.contains("magic") ? j["magic"].dump() : "missing", regen));
  }
  if (!j.contains("version") || !j["version"].is_number_integer() ||
      j["version"].get<int>() != kMachineProfileVersion) {
    return invalid_argument(
        fmt::format("{}: profile version {} is not the version {} this strata "
                    "reads{}",
                    origin, j.contains("version") ? j["version"].dump() : "missing",
                    kMachineProfileVersion, regen));
  }
  MachineProfile p;
  const std::string src = "probe " + origin + (fastest ? " (fastest pass)" : "");
  // With `fastest`, a rate's fastest pass replaces its median where the profile has it.
  auto best_of = [&](const json& spread, double median) {
    return fastest && spread.is_object() && spread.contains("max") && spread["max"].is_number()
               ? spread["max"].get<double>()
               : median;
  };
  auto num = [&](const char* a, const char* b, double* out) -> Status {
    if (!j.contains(a) || !j[a].is_object() || !j[a].contains(b) || !j[a][b].is_number()) {
      return invalid_argument(
          fmt::format("{}: field {}.{} is missing or not a number{}", origin, a, b, regen));
    }
    *out = j[a][b].get<double>();
    return Status::ok();
  };
  double v = 0;
  if (!j.contains("device") || !j["device"].contains("backend") ||
      !j["device"]["backend"].is_string()) {
    return invalid_argument(fmt::format("{}: field device.backend is missing{}", origin, regen));
  }
  p.cpu_backend = j["device"]["backend"] == "cpu";
  STRATA_RETURN_IF_ERROR(num("device", "gemm_flops", &v), "");
  p.gemm_flops = {best_of(j["device"].value("gemm_flops_spread", json()), v), src};
  if (j["device"].contains("gemm_by_width") && j["device"]["gemm_by_width"].is_array()) {
    for (const auto& e : j["device"]["gemm_by_width"]) {
      if (!e.contains("C") || !e.contains("gemm_flops") || !e["gemm_flops"].is_number()) {
        return invalid_argument(fmt::format(
            "{}: device.gemm_by_width entry {} lacks C or gemm_flops{}", origin, e.dump(), regen));
      }
      const double med = e["gemm_flops"].get<double>();
      MachineProfile::GemmPoint g;
      g.width = e["C"].get<int>();
      g.tokens = e.value("B", 4) * e.value("T", 128);  // version-1 profiles: 4 x 128
      g.flops = fastest ? e.value("gemm_flops_max", med) : med;
      p.gemm_by_width.push_back(g);
    }
    std::sort(p.gemm_by_width.begin(), p.gemm_by_width.end(), [](const auto& a, const auto& b) {
      return std::tie(a.tokens, a.width) < std::tie(b.tokens, b.width);
    });
  }
  STRATA_RETURN_IF_ERROR(num("host", "copy_gbps", &v), "");
  v = best_of(j["host"].value("copy_spread", json()), v);
  p.host_copy_gbps = {v, src};
  if (p.cpu_backend) {
    p.link_gbps = {v, src + " (host copy: the CPU backend's link)"};
  } else {
    STRATA_RETURN_IF_ERROR(num("link", "h2d_pinned_gbps", &v), "");
    p.link_gbps = {v, src};
  }
  STRATA_RETURN_IF_ERROR(num("cpu_optimizer", "params_per_s", &v), "");
  if (fastest && j["cpu_optimizer"].contains("by_threads")) {
    for (const auto& t : j["cpu_optimizer"]["by_threads"]) {
      v = std::max(v, best_of(t.value("spread", json()), 0.0));
    }
  }
  p.optimizer_pps = {v, src};
  // The recommended case's fastest pass, from the embedded io probe report.
  auto nvme_best = [&](bool read, double median) {
    if (!fastest || !j["nvme"].contains("io_probe") || !j["nvme"].contains("aio")) return median;
    const json& a = j["nvme"]["aio"];
    for (const auto& c : j["nvme"]["io_probe"].value("cases", json::array())) {
      if (c.value("op", "") == (read ? "read" : "write") &&
          c.value("backend", "") == a.value("backend", "") &&
          c.value("block_size", 0) == a.value("block_size", 0) &&
          c.value("queue_depth", 0) == a.value("queue_depth", 0)) {
        return c.value("gbps_max", median);
      }
    }
    return median;
  };
  if (j.contains("nvme") && j["nvme"].is_object()) {
    STRATA_RETURN_IF_ERROR(num("nvme", "read_gbps", &v), "");
    p.nvme_read_gbps = {nvme_best(true, v), src};
    STRATA_RETURN_IF_ERROR(num("nvme", "write_gbps", &v), "");
    p.nvme_write_gbps = {nvme_best(false, v), src};
    const json& n = j["nvme"];
    if (n.contains("io_probe") && n["io_probe"].is_object()) {
      for (const auto& c : n["io_probe"].value("cases", json::array())) {
        MachineProfile::NvmeCase k;
        k.backend = c.value("backend", "");
        k.block_size = c.value("block_size", size_t{0});
        k.queue_depth = c.value("queue_depth", 0);
        const double g = fastest ? c.value("gbps_max", 0.0) : c.value("gbps_median", 0.0);
        auto it = std::find_if(p.nvme_cases.begin(), p.nvme_cases.end(), [&](const auto& x) {
          return x.backend == k.backend && x.block_size == k.block_size &&
                 x.queue_depth == k.queue_depth;
        });
        if (it == p.nvme_cases.end()) it = p.nvme_cases.insert(p.nvme_cases.end(), k);
        (c.value("op", "") == "read" ? it->read_gbps : it->write_gbps) = g;
      }
    }
    if (n.contains("aio") && n["aio"].is_object()) {
      p.aio_backend = n["aio"].value("backend", p.aio_backend);
      p.aio_block_size = n["aio"].value("block_size", p.aio_block_size);
      p.aio_queue_depth = n["aio"].value("queue_depth", p.aio_queue_depth);
    }
  }
  if (j.contains("collectives") && j["collectives"].is_object()) {
    STRATA_RETURN_IF_ERROR(num("collectives", "busbw_gbps", &v), "");
    p.collective_gbps = {v, src};
  }
  return p;
}

}  // namespace

Result<MachineProfile> parse_machine_profile(const std::string& text, const std::string& origin,
                                             bool fastest) {
  // A field of the wrong type (a string where an object or a number belongs) throws inside
  // nlohmann::json: an invalid profile, never an abort.
  try {
    return parse_profile_fields(text, origin, fastest);
  } catch (const std::exception& e) {
    return invalid_argument(fmt::format(
        "{}: not a valid profile ({}); regenerate it with `strata probe --path <nvme dir> --json "
        "{}`",
        origin, e.what(), origin));
  }
}

Result<MachineProfile> load_machine_profile(const std::string& path, bool fastest) {
  std::ifstream in(path);
  if (!in) {
    return not_found(
        fmt::format("--profile {}: cannot open; create it with `strata probe --path "
                    "<nvme dir> --json {}`",
                    path, path));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_machine_profile(ss.str(), path, fastest);
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

namespace {
// Log-log interpolation of (x, y) points sorted by x, clamped at the ends.
double interpolate_log(const std::vector<std::pair<double, double>>& pts, double x) {
  if (x <= pts.front().first) return pts.front().second;
  if (x >= pts.back().first) return pts.back().second;
  for (size_t i = 1; i < pts.size(); ++i) {
    if (x > pts[i].first) continue;
    const double f = std::log(x / pts[i - 1].first) / std::log(pts[i].first / pts[i - 1].first);
    return std::exp(std::log(pts[i - 1].second) * (1 - f) + std::log(pts[i].second) * f);
  }
  return pts.back().second;
}
}  // namespace

double gemm_rate_at(const MachineProfile& p, int width, int tokens) {
  if (p.gemm_by_width.empty()) return p.gemm_flops.value;
  // Per token count: the rate at this width; then across token counts.
  std::vector<std::pair<double, double>> by_tokens;
  for (size_t i = 0; i < p.gemm_by_width.size();) {
    const int tk = p.gemm_by_width[i].tokens;
    std::vector<std::pair<double, double>> by_width;
    for (; i < p.gemm_by_width.size() && p.gemm_by_width[i].tokens == tk; ++i) {
      by_width.emplace_back(p.gemm_by_width[i].width, p.gemm_by_width[i].flops);
    }
    by_tokens.emplace_back(tk, interpolate_log(by_width, width));
  }
  return interpolate_log(by_tokens, tokens);
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
  const ActivationSizes acts = activations_of(m, r.micro_batch, r.seq, r.dtype, r.activations);
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
  const double C = m.width, L = m.layers, Vp = double(ceil_div(uint64_t(m.vocab), 64) * 64);
  // Forward FLOPs per token: 2 per weight of each GEMM (12C^2 per block + the Vp x C head) +
  // attention's QK^T and AV over the whole T x T square (4TC per block); backward twice that.
  const double fwd_per_token = 2.0 * (12.0 * C * C * L + Vp * C) + 4.0 * r.seq * C * L;
  // Recompute/offload re-run every block's forward once in backward (the head is not re-run).
  const double block_fwd_per_token = 2.0 * 12.0 * C * C * L + 4.0 * r.seq * C * L;
  const double recompute_per_token =
      r.activations == ActivationMode::kKeep ? 0.0 : block_fwd_per_token;
  o.flops = uint64_t((3.0 * fwd_per_token + recompute_per_token) * tokens * A);
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
    const double rc = recompute_per_token / fwd_per_token;
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

// ---- outputs ----------------------------------------------------------------------------------

std::string plan_config_json(const PlanReport& rep, const PlanOption& o) {
  const PlanRequest& r = rep.request;
  const std::string nvme = r.hw.nvme_paths.empty() ? "runs/swap" : r.hw.nvme_paths.front();
  auto offload = [&](PlanTier t, bool opt) {
    json j;
    j["device"] = t == PlanTier::kDevice ? "none" : t == PlanTier::kHost ? "cpu" : "nvme";
    if (t == PlanTier::kNvme) {
      j["nvme_path"] = r.hw.nvme_paths.empty() ? json(nvme) : json(r.hw.nvme_paths);
    }
    if (t != PlanTier::kDevice) j["pin_memory"] = true;
    if (opt && t == PlanTier::kNvme) j["buffer_count"] = r.buffer_count;
    return j;
  };
  json c;
  const int64_t world = r.hw.gpus;
  c["train_micro_batch_size_per_gpu"] = r.micro_batch;
  c["gradient_accumulation_steps"] = r.accumulation;
  c["train_batch_size"] = int64_t(r.micro_batch) * r.accumulation * world;
  c["gradient_clipping"] = 1.0;
  if (r.dtype == DType::kBF16) c["bf16"] = {{"enabled", true}};
  if (r.dtype == DType::kF16) c["fp16"] = {{"enabled", true}};
  c["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", 3e-4}, {"weight_decay", 0.1}}}};
  json z;
  z["stage"] = 3;
  z["offload_param"] = offload(o.placement.params, false);
  z["offload_optimizer"] = offload(o.placement.optimizer, true);
  z["stage3_prefetch_bucket_size"] = r.prefetch_bytes / dtype_size(r.dtype);
  c["zero_optimization"] = z;
  const MachineProfile& p = r.profile;
  c["aio"] = {{"block_size", p.aio_block_size}, {"queue_depth", p.aio_queue_depth}};
  if (p.aio_backend != "auto") c["aio"]["backend"] = p.aio_backend;
  c["model"] = {{"n_layer", r.model.layers},
                {"n_head", r.model.heads},
                {"n_embd", r.model.width},
                {"vocab_size", r.model.vocab},
                {"context", r.model.context}};
  c["data"] = {{"source", "synthetic"}, {"seq_len", r.seq}};
  json dev;
  dev["backend"] = p.cpu_backend ? "cpu" : "cuda";
  if (r.hw.gpu_mem > 0) dev["memory_limit"] = r.hw.gpu_mem;
  c["device"] = dev;
  if (r.hw.host_mem > 0) c["strata"] = {{"host_memory_limit", r.hw.host_mem / uint64_t(world)}};
  if (r.activations != ActivationMode::kKeep) {
    c["strata"]["activations"] = activation_mode_name(r.activations);
  }
  c["train"] = {{"steps", 100}, {"checkpoint_dir", "runs/planned"}};
  return c.dump(2) + "\n";
}

std::string plan_json(const PlanReport& rep) {
  const PlanRequest& r = rep.request;
  json j;
  j["magic"] = "strata-plan";
  j["version"] = 1;
  j["model"] = {{"name", r.model.name},   {"layers", r.model.layers}, {"width", r.model.width},
                {"heads", r.model.heads}, {"vocab", r.model.vocab},   {"context", r.model.context},
                {"params", rep.params},   {"note", r.model.note}};
  j["batch"] = {{"micro_batch", r.micro_batch}, {"seq", r.seq}, {"accumulation", r.accumulation}};
  {
    json a;
    a["mode"] = activation_mode_name(r.activations);
    for (auto mode :
         {ActivationMode::kKeep, ActivationMode::kRecompute, ActivationMode::kOffload}) {
      const ActivationSizes x = activations_of(r.model, r.micro_batch, r.seq, r.dtype, mode);
      a[activation_mode_name(mode)] = {{"device", x.bytes}, {"host", x.host_bytes}};
    }
    j["activations"] = a;
  }
  j["hardware"] = {{"gpus", r.hw.gpus},
                   {"gpu_mem", r.hw.gpu_mem},
                   {"host_mem", r.hw.host_mem},
                   {"nvme_paths", r.hw.nvme_paths}};
  const MachineProfile& p = r.profile;
  auto rate = [](const Rate& x) { return json{{"value", x.value}, {"source", x.source}}; };
  j["rates"] = {{"backend", p.cpu_backend ? "cpu" : "cuda"},
                {"gemm_flops", rate(p.gemm_flops)},
                {"link_gbps", rate(p.link_gbps)},
                {"optimizer_params_per_s", rate(p.optimizer_pps)},
                {"nvme_read_gbps", rate(p.nvme_read_gbps)},
                {"nvme_write_gbps", rate(p.nvme_write_gbps)},
                {"collective_busbw_gbps", rate(p.collective_gbps)}};
  json opts = json::array();
  for (const auto& o : rep.options) {
    auto tb = [](const TierBytes& b) {
      return json{{"state", b.state},      {"buffers", b.buffers}, {"activations", b.activations},
                  {"total", b.total()},    {"peak", b.peak},       {"undo", b.undo},
                  {"capacity", b.capacity}};
    };
    opts.push_back({{"name", o.placement.name},
                    {"params", plan_tier_name(o.placement.params)},
                    {"optimizer", plan_tier_name(o.placement.optimizer)},
                    {"device", tb(o.device)},
                    {"host", tb(o.host)},
                    {"nvme", tb(o.nvme)},
                    {"fits", o.fits},
                    {"runnable", o.runnable},
                    {"why", o.why},
                    {"flops", o.flops},
                    {"link_bytes", o.link_bytes},
                    {"nvme_read_bytes", o.nvme_read_bytes},
                    {"nvme_write_bytes", o.nvme_write_bytes},
                    {"time_s",
                     {{"compute", o.time.compute_s},
                      {"link", o.time.link_s},
                      {"nvme", o.time.nvme_s},
                      {"cpu_optimizer", o.time.cpu_optim_s},
                      {"collectives", o.time.collectives_s},
                      {"step", o.time.step_s},
                      {"step_after_backward", o.time.step_after_s},
                      {"optimizer_hidden_share", o.time.hidden_share}}},
                    {"bottleneck", o.time.bottleneck}});
  }
  j["options"] = opts;
  j["best"] = rep.best >= 0 ? json(rep.options[size_t(rep.best)].placement.name) : json(nullptr);
  return j.dump(2) + "\n";
}

std::string plan_table(const PlanReport& rep) {
  const PlanRequest& r = rep.request;
  std::string s = fmt::format(
      "model {}: {} layers, width {}, {} heads, vocab {}, context {} = {:.3g}B params\n",
      r.model.name, r.model.layers, r.model.width, r.model.heads, r.model.vocab, r.model.context,
      double(rep.params) / 1e9);
  if (!r.model.note.empty()) s += "  note: " + r.model.note + "\n";
  s += fmt::format(
      "batch: {} x {} tokens per micro-batch, {} micro-batches per step, {} rank(s); {} backend\n",
      r.micro_batch, r.seq, r.accumulation, r.hw.gpus, r.profile.cpu_backend ? "cpu" : "cuda");
  const MachineProfile& p = r.profile;
  s += fmt::format(
      "rates: GEMM {:.3g} TFLOP/s{} [{}], link {:.3g} GB/s [{}], CPU optimizer {:.3g} Mparam/s "
      "[{}], NVMe read {:.3g} / write {:.3g} GB/s [{}]{}\n",
      p.gemm_flops.value / 1e12,
      p.gemm_by_width.empty() || rep.options.empty()
          ? std::string()
          : fmt::format(" (model step at width {}, {} tokens per micro-batch: {:.3g})",
                        r.model.width, r.micro_batch * r.seq,
                        rep.options[0].time.gemm_flops / 1e12),
      p.gemm_flops.source, p.link_gbps.value, p.link_gbps.source, p.optimizer_pps.value / 1e6,
      p.optimizer_pps.source, p.nvme_read_gbps.value, p.nvme_write_gbps.value,
      p.nvme_read_gbps.source,
      r.hw.gpus > 1 ? fmt::format(", collectives {:.3g} GB/s [{}]", p.collective_gbps.value,
                                  p.collective_gbps.source)
                    : "");
  {
    // Activations per micro-batch under each strata.activations mode (rank 0's; every rank
    // holds the same).
    std::string line = "activations (strata.activations):";
    for (auto mode :
         {ActivationMode::kKeep, ActivationMode::kRecompute, ActivationMode::kOffload}) {
      const ActivationSizes x = activations_of(r.model, r.micro_batch, r.seq, r.dtype, mode);
      line += fmt::format(" {}{} {} device{}{}", activation_mode_name(mode),
                          mode == r.activations ? " [this plan]" : "", gb(double(x.bytes)),
                          x.host_bytes ? " + " + gb(double(x.host_bytes)) + " host" : "",
                          mode == ActivationMode::kOffload ? "" : ",");
    }
    s += line + "\n";
  }
  s += fmt::format("{:<22} {:>10} {:>10} {:>10} {:>5} {:>9} | {:>8} {:>8} {:>8} {:>8} {:>8}  {}\n",
                   "placement", "device", "host", "nvme", "fits", "step", "compute", "link", "nvme",
                   "cpu-opt", "coll", "bottleneck");
  auto ms = [](double x) { return fmt::format("{:.0f}ms", x * 1e3); };
  auto sec = [&](double x) { return x >= 10 ? fmt::format("{:.1f}s", x) : ms(x); };
  for (size_t i = 0; i < rep.options.size(); ++i) {
    const auto& o = rep.options[i];
    s += fmt::format(
        "{:<22} {:>10} {:>10} {:>10} {:>5} {:>9} | {:>8} {:>8} {:>8} {:>8} {:>8}  {}{}\n",
        o.placement.name + (int(i) == rep.best ? " *" : ""), gb(double(o.device.total())),
        gb(double(o.host.total())), gb(double(o.nvme.total())),
        !o.runnable ? "n/a"
        : o.fits    ? "yes"
                    : "no",
        sec(o.time.step_s), sec(o.time.compute_s), sec(o.time.link_s), sec(o.time.nvme_s),
        sec(o.time.cpu_optim_s), sec(o.time.collectives_s), o.time.bottleneck,
        !o.runnable ? " (optimizer on the GPU is not built yet)" : "");
  }
  for (const auto& o : rep.options) {
    for (const auto& w : o.why) s += fmt::format("  {} does not fit: {}\n", o.placement.name, w);
  }
  if (rep.best >= 0) {
    const auto& b = rep.options[size_t(rep.best)];
    const double tok = double(r.micro_batch) * r.seq * r.accumulation * r.hw.gpus;
    s += fmt::format("best: {} — {:.3g} s/step, {:.0f} tokens/s, bound by {}\n", b.placement.name,
                     b.time.step_s, tok / b.time.step_s, b.time.bottleneck);
    if (b.time.step_after_s > b.time.step_s * 1.005) {
      s += fmt::format(
          "  a step after one that clipped (or overflowed) steps the optimizer after backward: "
          "{:.3g} s\n",
          b.time.step_after_s);
    }
    if (b.nvme.undo > 0) {
      s += fmt::format(
          "  optimizer under backward: the pre-step master + moments stay on NVMe while the step "
          "goes to fresh extents: {} more NVMe at the peak\n",
          gb(double(b.nvme.undo)));
    }
    if (b.host.undo > 0 || b.time.hidden_share < 1.0) {
      s += fmt::format(
          "  optimizer under backward: undo copies of master + moments take {} of host memory "
          "beyond the reservation{}\n",
          gb(double(b.host.undo)),
          b.time.hidden_share < 1.0
              ? fmt::format(" — only {:.0f}% fit, the rest is stepped after backward",
                            100.0 * b.time.hidden_share)
              : std::string());
    }
  } else {
    s += "no placement fits this machine at this batch";
    // Which activation mode would need less device memory (the table above has the numbers).
    const ActivationSizes now =
        activations_of(r.model, r.micro_batch, r.seq, r.dtype, r.activations);
    const ActivationSizes rec =
        activations_of(r.model, r.micro_batch, r.seq, r.dtype, ActivationMode::kRecompute);
    const ActivationSizes off =
        activations_of(r.model, r.micro_batch, r.seq, r.dtype, ActivationMode::kOffload);
    bool device_short = false;  // some placement failed on the device (not only host/nvme)
    for (const auto& o : rep.options) {
      for (const auto& w : o.why) device_short |= w.rfind("device needs", 0) == 0;
    }
    s += fmt::format(": activations ({}) take {} of device memory at micro-batch {} x {} tokens",
                     activation_mode_name(r.activations), gb(double(now.bytes)), r.micro_batch,
                     r.seq);
    if (!device_short) {
      s += " and fit; host or nvme is short (above)";
    } else if (r.activations == ActivationMode::kKeep) {
      s += fmt::format("; strata.activations = recompute needs {}, offload {} (+ {} host)",
                       gb(double(rec.bytes)), gb(double(off.bytes)), gb(double(off.host_bytes)));
    } else if (r.activations == ActivationMode::kRecompute) {
      s += fmt::format("; strata.activations = offload needs {} (+ {} host)", gb(double(off.bytes)),
                       gb(double(off.host_bytes)));
    }
    s += device_short ? "; lower --batch or --seq, or add devices\n" : "\n";
  }
  return s;
}

std::string plan_svg(const PlanReport& rep) {
  const int W = 900, row = 34, top = 70, left = 190, barw = 560;
  const int H = top + row * int(rep.options.size()) + 60;
  double maxt = 1e-9;
  for (const auto& o : rep.options) {
    const auto& t = o.time;
    maxt = std::max(
        {maxt, t.step_s, t.compute_s + t.link_s + t.nvme_s + t.cpu_optim_s + t.collectives_s});
  }
  const char* colors[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f"};
  // XML text: "<" and ">" escaped.
  const char* names[] = {"compute", "host&lt;-&gt;device link", "nvme", "cpu optimizer",
                         "collectives"};
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
      "fill=\"white\"/>\n<text x=\"10\" y=\"22\" font-size=\"15\" font-weight=\"bold\">strata "
      "plan: {} ({:.3g}B params), {} x {} tokens x {} micro-batches, {} rank(s)</text>\n",
      W, H, rep.request.model.name, double(rep.params) / 1e9, rep.request.micro_batch,
      rep.request.seq, rep.request.accumulation, rep.request.hw.gpus);
  for (int k = 0; k < 5; ++k) {
    s += fmt::format(
        "<rect x=\"{}\" y=\"36\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{}\" "
        "y=\"46\">{}</text>\n",
        10 + k * 150, colors[k], 26 + k * 150, names[k]);
  }
  for (size_t i = 0; i < rep.options.size(); ++i) {
    const auto& o = rep.options[i];
    const int y = top + row * int(i);
    const double v[] = {o.time.compute_s, o.time.link_s, o.time.nvme_s, o.time.cpu_optim_s,
                        o.time.collectives_s};
    s += fmt::format("<text x=\"10\" y=\"{}\"{}>{}{}</text>\n", y + 16,
                     o.fits && o.runnable ? "" : " fill=\"#999\"", o.placement.name,
                     int(i) == rep.best ? " (best)"
                     : !o.fits          ? " (does not fit)"
                                        : "");
    double x = left;
    for (int k = 0; k < 5; ++k) {
      const double w = v[k] / maxt * barw;
      if (w <= 0) continue;
      s += fmt::format(
          "<rect x=\"{:.1f}\" y=\"{}\" width=\"{:.1f}\" height=\"20\" fill=\"{}\" "
          "opacity=\"{}\"><title>{}: {:.1f} ms</title></rect>\n",
          x, y + 2, w, colors[k], o.fits && o.runnable ? "1" : "0.35", names[k], v[k] * 1e3);
      x += w;
    }
    const double sx = left + o.time.step_s / maxt * barw;
    s += fmt::format(
        "<line x1=\"{:.1f}\" x2=\"{:.1f}\" y1=\"{}\" y2=\"{}\" stroke=\"black\" "
        "stroke-width=\"2\"/><text x=\"{:.1f}\" y=\"{}\">step {:.3g} s</text>\n",
        sx, sx, y, y + 24, std::max(x, sx) + 6, y + 16, o.time.step_s);
  }
  s += fmt::format(
      "<text x=\"10\" y=\"{}\" fill=\"#555\">bars: each resource's busy time per step (stacked); "
      "black line: predicted step time (overlapping terms counted once)</text>\n</svg>\n",
      H - 20);
  return s;
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
