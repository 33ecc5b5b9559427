#include "src/model/architecture.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "src/base/rng.h"
#include "src/model/family.h"
#include "strata/kernels.h"

namespace strata {

size_t ModelLayout::num_params() const {
  size_t n = 0;
  for (const auto& m : modules) n += m.numel;
  return n;
}

void Architecture::init_module(int m, uint64_t seed, float* master) const {
  init_range(m, seed, 0, layout().modules[size_t(m)].numel, master);
}

Result<std::unique_ptr<KvDecoder>> Architecture::create_kv_decoder(Device&, DType) const {
  return unavailable(fmt::format("model.type {} has no key/value cache for generation", name()));
}

void init_module_range(const ModuleSpec& spec, uint64_t seed, uint64_t stream, size_t zero_begin,
                       size_t zero_end, size_t begin, size_t count, float* out) {
  const size_t end = begin + count;
  std::fill(out, out + count, 0.0f);
  uint64_t normals = 0;  // drawn by the tensors before t
  for (const TensorSpec& t : spec.tensors) {
    const size_t lo = std::max(begin, t.offset), hi = std::min(end, t.offset + t.numel);
    if (lo < hi) {
      float* p = out + (lo - begin);
      if (t.init_kind == 0) {
        // The k-th normal of the stream: pairs of uniforms give a cos and a sin value.
        const uint64_t k = normals + (lo - t.offset);
        Rng rng(seed, stream);
        rng.discard(k / 2 * 2);
        if (k % 2) rng.normal();
        for (size_t i = 0; i < hi - lo; ++i) p[i] = static_cast<float>(rng.normal()) * t.init_std;
      } else if (t.init_kind == kInitUniform) {
        // The k-th uniform of the stream, scaled to (-std, std).
        Rng rng(seed, stream);
        rng.discard(normals + (lo - t.offset));
        for (size_t i = 0; i < hi - lo; ++i) {
          p[i] = static_cast<float>((2.0 * rng.uniform() - 1.0) * double(t.init_std));
        }
      } else {
        std::fill(p, p + (hi - lo), t.init_kind == 2 ? 1.0f : 0.0f);
      }
    }
    if (t.init_kind == kInitNormal || t.init_kind == kInitUniform) normals += t.numel;
  }
  const size_t zlo = std::max(begin, zero_begin), zhi = std::min(end, zero_end);
  if (zlo < zhi) std::fill(out + (zlo - begin), out + (zhi - begin), 0.0f);
}

uint64_t training_dropout_key(uint64_t seed, int64_t step, int micro, int rank) {
  uint64_t k = dropout_mix(seed ^ 0x6c6f72615f64726full);  // "lora_dro"
  k = dropout_mix(k + uint64_t(step));
  k = dropout_mix(k + uint64_t(uint32_t(micro)));
  k = dropout_mix(k + uint64_t(uint32_t(rank)));
  return k | 1;
}

bool segment_starts(const Program& program, size_t i, size_t begin) {
  if (i == begin) return true;
  const auto ends = [&](size_t j) {
    const auto k = program.ops[j].kind;
    return k == ProgramOp::kReleaseParams || k == ProgramOp::kDrainGrads;
  };
  return !ends(i) && ends(i - 1);
}

size_t grad_part_bytes(const Program& program, const std::function<size_t(int)>& grad_bytes,
                       int group) {
  if (group <= 1) return 0;
  std::vector<int> acquired_in;  // per module: the segment of its kAcquireGrads, -1 none
  size_t held = 0, one = 0;
  int segment = -1;
  for (size_t i = 0; i < program.ops.size(); ++i) {
    if (segment_starts(program, i, 0)) ++segment;
    const ProgramOp& op = program.ops[i];
    if (op.kind != ProgramOp::kAcquireGrads && op.kind != ProgramOp::kDrainGrads) continue;
    if (size_t(op.module) >= acquired_in.size()) acquired_in.resize(size_t(op.module) + 1, -1);
    int& at = acquired_in[size_t(op.module)];
    if (op.kind == ProgramOp::kAcquireGrads) {
      if (at < 0) at = segment;
    } else if (at >= 0) {
      if (at == segment) {
        one = std::max(one, grad_bytes(op.module));
      } else {
        held += grad_bytes(op.module);
      }
      at = -1;
    }
  }
  return held * size_t(group - 1) + one;
}

size_t program_peak_bytes(const Program& program, const std::function<size_t(int)>& param_bytes,
                          const std::function<size_t(int)>& grad_bytes, int* live_modules) {
  std::vector<int> params_held, grads_held;  // per module: acquire count / held flag
  size_t live = 0, peak = 0;
  int modules = 0, peak_modules = 0;
  auto grow = [](std::vector<int>& v, int m) {
    if (size_t(m) >= v.size()) v.resize(size_t(m) + 1, 0);
  };
  auto is_live = [&](int m) {
    return (size_t(m) < params_held.size() && params_held[size_t(m)] > 0) ||
           (size_t(m) < grads_held.size() && grads_held[size_t(m)] > 0);
  };
  for (const ProgramOp& op : program.ops) {
    const int m = op.module;
    if (op.kind == ProgramOp::kCompute) continue;
    grow(params_held, m);
    grow(grads_held, m);
    const bool was_live = is_live(m);
    switch (op.kind) {
      case ProgramOp::kAcquireParams:
        if (params_held[size_t(m)]++ == 0) live += param_bytes(m);
        break;
      case ProgramOp::kReleaseParams:
        if (params_held[size_t(m)] > 0 && --params_held[size_t(m)] == 0) live -= param_bytes(m);
        break;
      case ProgramOp::kAcquireGrads:
        if (grads_held[size_t(m)] == 0) {
          grads_held[size_t(m)] = 1;
          live += grad_bytes(m);
        }
        break;
      case ProgramOp::kDrainGrads:
        if (grads_held[size_t(m)] != 0) {
          grads_held[size_t(m)] = 0;
          live -= grad_bytes(m);
        }
        break;
      case ProgramOp::kCompute:
        break;
    }
    modules += int(is_live(m)) - int(was_live);
    peak = std::max(peak, live);
    peak_modules = std::max(peak_modules, modules);
  }
  if (live_modules) *live_modules = peak_modules;
  return peak;
}

const char* activation_mode_name(ActivationMode mode) {
  switch (mode) {
    case ActivationMode::kKeep:
      return "keep";
    case ActivationMode::kRecompute:
      return "recompute";
    case ActivationMode::kOffload:
      return "offload";
  }
  return "?";
}

Result<ActivationMode> parse_activation_mode(const std::string& name) {
  for (auto m : {ActivationMode::kKeep, ActivationMode::kRecompute, ActivationMode::kOffload}) {
    if (name == activation_mode_name(m)) return m;
  }
  return invalid_argument(
      fmt::format("strata.activations: \"{}\" is not one of keep, recompute, offload", name));
}

Result<std::unique_ptr<Architecture>> create_architecture(const ModelConfig& config) {
  const ModelFamily* family = family_for_type(config.type);
  if (family == nullptr) {
    return invalid_argument(fmt::format("model.type: \"{}\" is not a known architecture ({})",
                                        config.type, family_type_names()));
  }
  STRATA_ASSIGN_OR_RETURN(auto a, family->create(config), "model");
  return a;
}

}  // namespace strata
