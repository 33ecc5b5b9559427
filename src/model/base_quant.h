// A quantized LoRA base (QLoRA; lora.base_quantization): how a frozen block module's parameters
// are stored in the tiers, filled at init/import and dequantized on the device before use.
//
// The frozen base's linear-layer weights — every matmul weight of every block, adapted or not
// (Llama's q|k|v, o, gate|up, down; GPT-2's c_attn, c_proj, c_fc, mlp c_proj) — are quantized
// once, when the tier manager initializes the state (from model.from_pretrained or the random
// init), and are stored and moved quantized through the device, host and NVMe tiers. Everything
// else keeps full precision, as bitsandbytes / peft do: the embeddings, the head and the final
// norm stay separate unquantized modules (model dtype), and a block's norm weights and biases are
// stored in fp32 inside its quantized module (a few thousand values per block).
//
//   nf4   QLoRA's 4-bit NormalFloat (src/base/nf4.h, bitsandbytes' bits): per weight matrix,
//         blocks of 64 consecutive elements of the flattened [out, in] matrix (bitsandbytes'
//         Linear4bit quantizes each weight that way), two codes per byte and one fp32 absmax per
//         block: 0.5625 B/param.
//   int8  per row of the [out, in] matrix (bitsandbytes' LLM.int8 row-wise absmax): scale =
//         absmax / 127 in fp32, q = round-to-nearest-even(x / scale) in [-127, 127] — exactly
//         Kernels::quantize(8, ...) with block = in, so Kernels::dequantize(8, ...) reads it:
//         1 B/param + 4 B per row.
//
// The stored module is a byte string of `bytes`: its elements in order, cut into segments —
// a run of unquantized elements (fp32), or one quantized weight (its codes, then its fp32
// scales) — each starting at a multiple of kQuantAlign bytes. The tiers hold it as
// ceil(bytes / es) elements of the model dtype (ModuleSpec::stored_bytes; memory_model.h), so
// sharding, sub-groups, NVMe extents and fetches move it as they move any frozen module.
//
// On the device a block's compute first dequantizes the whole module into one scratch buffer of
// numel model-dtype elements (part of the runner's activation carve): fp32 segments by
// Kernels::cast, nf4 by Kernels::dequantize_nf4, int8 by Kernels::dequantize(8, ...). Every value
// is computed in fp32 and rounded once to the model dtype, so a run over a quantized base is bit
// for bit a run with base_quantization none whose base weights are base_quant_values()' values.
//
// Thread safety: a BaseQuant is immutable; fill() may run on several threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "strata/kernels.h"
#include "strata/status.h"

namespace strata {

class Stream;

enum class BaseQuantKind : uint8_t { kNone, kInt8, kNf4 };
// lora.base_quantization's values; an unknown one is kInvalidArgument naming the key.
Result<BaseQuantKind> parse_base_quantization(const std::string& name);
const char* base_quant_name(BaseQuantKind kind);  // "none", "int8", "nf4"

inline constexpr size_t kQuantAlign = 64;  // every segment starts at a multiple of this

// A weight matrix of a module to quantize: elements [begin, begin + rows * cols), [rows, cols]
// row-major (strata's [out, in]).
struct QuantWeight {
  size_t begin = 0, rows = 0, cols = 0;
};

// One segment of a stored module.
struct QuantSegment {
  size_t begin = 0, n = 0;  // the module's elements [begin, begin + n)
  size_t block = 0;         // 0: stored as fp32; else elements per scale (nf4: 64, int8: a row)
  size_t at = 0;            // byte offset of its fp32 values, or of its codes
  size_t scales_at = 0;     // byte offset of its fp32 scales (quantized segments)
  size_t blocks() const { return block ? (n + block - 1) / block : 0; }
};

struct BaseQuant {
  BaseQuantKind kind = BaseQuantKind::kNone;
  size_t numel = 0;            // the module's elements
  size_t bytes = 0;            // its stored size
  size_t quantized_numel = 0;  // of which quantized
  std::vector<QuantSegment> segments;
  // Bytes of a quantized segment's codes.
  size_t code_bytes(const QuantSegment& s) const {
    return kind == BaseQuantKind::kNf4 ? (s.n + 1) / 2 : s.n;
  }
};

// The stored layout of a module of `numel` elements whose `weights` (disjoint, any order) are
// quantized as `kind` (not kNone).
BaseQuant base_quant_layout(BaseQuantKind kind, size_t numel, std::vector<QuantWeight> weights);

// Fills out[0, count) with the stored bytes [begin, begin + count) of the module (bytes past
// `bytes`, and the alignment padding, are 0). `values(b, c, out)` gives the module's fp32 values
// [b, b + c) (the init's range function); fill asks it for whole quantization blocks, at most
// 64 Ki values at a time, and passes its failure up. Quantizing a block needs all of it, so a
// range that starts inside a weight's scales reads that weight's values again.
using QuantValuesFn = std::function<Status(size_t begin, size_t count, float* out)>;
Status base_quant_fill(const BaseQuant& q, size_t begin, size_t count, uint8_t* out,
                       const QuantValuesFn& values);

// Host: the fp32 value each element of the stored module `stored` (q.bytes) dequantizes to,
// before the device's rounding to the model dtype; out[0, numel).
void base_quant_values(const BaseQuant& q, const uint8_t* stored, float* out);

// describe()'s suffix ("; blocks stored nf4: 12.3 MiB (0.5655 B per block parameter, 4
// layers)"); "" for nullptr.
std::string base_quant_describe(const BaseQuant* q, int n_layer);

// Device: enqueues the dequantization of the stored module at `stored` into `out` (numel
// elements of dt) on `s`.
void base_quant_dequantize(const BaseQuant& q, Kernels& k, Stream& s, DType dt, const void* stored,
                           void* out);

}  // namespace strata
