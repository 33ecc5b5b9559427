#include "src/model/base_quant.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "src/base/nf4.h"
#include "strata/device.h"
#include "strata/dtype.h"

namespace strata {

Result<BaseQuantKind> parse_base_quantization(const std::string& name) {
  if (name == "none") return BaseQuantKind::kNone;
  if (name == "int8") return BaseQuantKind::kInt8;
  if (name == "nf4") return BaseQuantKind::kNf4;
  return invalid_argument(
      fmt::format("lora.base_quantization: unknown value \"{}\"; use none, int8 or nf4", name));
}

const char* base_quant_name(BaseQuantKind kind) {
  switch (kind) {
    case BaseQuantKind::kInt8:
      return "int8";
    case BaseQuantKind::kNf4:
      return "nf4";
    default:
      return "none";
  }
}

namespace {

size_t align(size_t n) { return (n + kQuantAlign - 1) / kQuantAlign * kQuantAlign; }

// Kernels::quantize(8, kF32, ...) of one block of m values: its scale and codes.
void int8_quantize(const float* x, size_t m, int8_t* q, float* scale) {
  float amax = 0.0f;
  for (size_t i = 0; i < m; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = amax / 127.0f;
  *scale = s;
  for (size_t i = 0; i < m; ++i) {
    const float r = s > 0.0f ? std::nearbyint(x[i] / s) : 0.0f;  // ties to even
    q[i] = int8_t(std::fmin(std::fmax(r, -127.0f), 127.0f));
  }
}

// Copies the part of src (bytes [src_at, src_at + len) of the stored module) that falls in the
// window [begin, begin + count) to out (the window's bytes).
void copy_overlap(uint8_t* out, size_t begin, size_t count, const void* src, size_t src_at,
                  size_t len) {
  const size_t lo = std::max(begin, src_at), hi = std::min(begin + count, src_at + len);
  if (lo >= hi) return;
  std::memcpy(out + (lo - begin), static_cast<const uint8_t*>(src) + (lo - src_at), hi - lo);
}

// The units [lo, hi) of `unit` bytes each, laid out from byte `at`, whose bytes overlap the
// window [begin, begin + count) (none: lo == hi), at most `units`.
void overlap_units(size_t begin, size_t count, size_t at, size_t unit, size_t units, size_t* lo,
                   size_t* hi) {
  const size_t end = begin + count, len = units * unit;
  *lo = *hi = 0;
  if (end <= at || begin >= at + len) return;
  const size_t b0 = begin > at ? begin - at : 0, b1 = std::min(end - at, len);
  *lo = b0 / unit;
  *hi = std::min(units, (b1 + unit - 1) / unit);
}

constexpr size_t kChunkValues = size_t(1) << 16;

}  // namespace

std::string base_quant_describe(const BaseQuant* q, int n_layer) {
  if (!q) return "";
  return fmt::format("; blocks stored {}: {:.1f} MiB ({:.4f} B per block parameter, {} layers)",
                     base_quant_name(q->kind), double(q->bytes) * n_layer / (1 << 20),
                     double(q->bytes) / double(q->numel), n_layer);
}

BaseQuant base_quant_layout(BaseQuantKind kind, size_t numel, std::vector<QuantWeight> weights) {
  STRATA_CHECK(kind != BaseQuantKind::kNone, "base_quant_layout: nothing to quantize");
  std::sort(weights.begin(), weights.end(),
            [](const QuantWeight& a, const QuantWeight& b) { return a.begin < b.begin; });
  BaseQuant q;
  q.kind = kind;
  q.numel = numel;
  size_t at = 0, e = 0;
  auto raw = [&](size_t end) {
    if (end <= e) return;
    q.segments.push_back({e, end - e, 0, at, 0});
    at = align(at + (end - e) * 4);
  };
  for (const QuantWeight& w : weights) {
    STRATA_CHECK(w.begin >= e && w.begin + w.rows * w.cols <= numel,
                 "base_quant_layout: weights overlap or run past the module");
    raw(w.begin);
    QuantSegment s{w.begin, w.rows * w.cols, kind == BaseQuantKind::kNf4 ? kNf4Block : w.cols, at,
                   0};
    s.scales_at = align(at + q.code_bytes(s));
    at = align(s.scales_at + s.blocks() * 4);
    q.quantized_numel += s.n;
    q.segments.push_back(s);
    e = w.begin + s.n;
  }
  raw(numel);
  q.bytes = at;
  return q;
}

Status base_quant_fill(const BaseQuant& q, size_t begin, size_t count, uint8_t* out,
                       const QuantValuesFn& values) {
  std::memset(out, 0, count);
  std::vector<float> x;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  for (const QuantSegment& s : q.segments) {
    if (s.block == 0) {  // fp32 values: the elements whose bytes overlap the window
      size_t lo, hi;
      overlap_units(begin, count, s.at, 4, s.n, &lo, &hi);
      for (size_t a = lo; a < hi; a += kChunkValues) {
        const size_t c = std::min(kChunkValues, hi - a);
        x.resize(c);
        STRATA_RETURN_IF_ERROR(values(s.begin + a, c, x.data()), "");
        copy_overlap(out, begin, count, x.data(), s.at + a * 4, c * 4);
      }
      continue;
    }
    // The blocks whose codes or scales overlap the window.
    const bool nf4 = q.kind == BaseQuantKind::kNf4;
    size_t c0, c1, s0, s1;
    overlap_units(begin, count, s.at, nf4 ? s.block / 2 : s.block, s.blocks(), &c0, &c1);
    overlap_units(begin, count, s.scales_at, 4, s.blocks(), &s0, &s1);
    size_t b0 = c0, b1 = c1;
    if (s0 < s1) {
      b0 = c0 < c1 ? std::min(c0, s0) : s0;
      b1 = std::max(b1, s1);
    }
    const size_t per = std::max<size_t>(1, kChunkValues / s.block);
    for (size_t b = b0; b < b1; b += per) {
      const size_t nb = std::min(per, b1 - b);
      const size_t e0 = b * s.block, e1 = std::min(s.n, (b + nb) * s.block);
      x.resize(e1 - e0);
      scales.resize(nb);
      STRATA_RETURN_IF_ERROR(values(s.begin + e0, e1 - e0, x.data()), "");
      if (nf4) {
        codes.resize(nf4_packed_bytes(e1 - e0));
        nf4_quantize(x.data(), e1 - e0, codes.data(), scales.data());
        copy_overlap(out, begin, count, codes.data(), s.at + e0 / 2, codes.size());
      } else {
        codes.resize(e1 - e0);
        for (size_t j = 0; j < nb; ++j) {
          const size_t a = j * s.block, m = std::min(s.block, e1 - e0 - a);
          int8_quantize(x.data() + a, m, reinterpret_cast<int8_t*>(codes.data()) + a, &scales[j]);
        }
        copy_overlap(out, begin, count, codes.data(), s.at + e0, codes.size());
      }
      copy_overlap(out, begin, count, scales.data(), s.scales_at + b * 4, nb * 4);
    }
  }
  return Status::ok();
}

void base_quant_values(const BaseQuant& q, const uint8_t* stored, float* out) {
  for (const QuantSegment& s : q.segments) {
    float* o = out + s.begin;
    if (s.block == 0) {
      std::memcpy(o, stored + s.at, s.n * 4);
      continue;
    }
    std::vector<float> scales(s.blocks());
    std::memcpy(scales.data(), stored + s.scales_at, scales.size() * 4);
    if (q.kind == BaseQuantKind::kNf4) {
      nf4_dequantize(stored + s.at, scales.data(), s.n, o);
    } else {
      const int8_t* c = reinterpret_cast<const int8_t*>(stored + s.at);
      for (size_t i = 0; i < s.n; ++i) o[i] = float(c[i]) * scales[i / s.block];
    }
  }
}

void base_quant_dequantize(const BaseQuant& q, Kernels& k, Stream& s, DType dt, const void* stored,
                           void* out) {
  const auto* in = static_cast<const uint8_t*>(stored);
  auto* o = static_cast<uint8_t*>(out);
  const size_t es = dtype_size(dt);
  for (const QuantSegment& g : q.segments) {
    void* dst = o + g.begin * es;
    const auto* scales = reinterpret_cast<const float*>(in + g.scales_at);
    if (g.block == 0) {
      k.cast(s, dst, dt, in + g.at, DType::kF32, g.n);
    } else if (q.kind == BaseQuantKind::kNf4) {
      k.dequantize_nf4(s, dt, dst, in + g.at, scales, g.n);
    } else {
      k.dequantize(s, 8, dt, dst, in + g.at, scales, g.n, int(g.block), false);
    }
  }
}

}  // namespace strata
