// Generation's attention against a key/value cache (Kernels::attention_decode): the new
// positions' keys and values are copied into the caches (the same bits), then each (sequence,
// new position, query head) is one task: its scores against every cached key up to its
// position, the softmax and the value sum, all in fp32, in key order. Tasks write disjoint rows
// of out: the results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {

void attention_decode(DType dt, void* out, void* kcache, void* vcache, const void* qkv, int B,
                      int T, int pos0, int maxT, int NH, int KVH, int hs) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    auto* kc = static_cast<Tp*>(kcache);
    auto* vc = static_cast<Tp*>(vcache);
    auto* in = static_cast<const Tp*>(qkv);
    const size_t Q = size_t(NH) * hs, KV = size_t(KVH) * hs, W = Q + 2 * KV;
    for (int b = 0; b < B; ++b) {
      for (int t = 0; t < T; ++t) {
        const Tp* row = in + (size_t(b) * T + t) * W;
        const size_t at = (size_t(b) * maxT + size_t(pos0 + t)) * KV;
        std::memcpy(kc + at, row + Q, KV * sizeof(Tp));
        std::memcpy(vc + at, row + Q + KV, KV * sizeof(Tp));
      }
    }
    const int rep = NH / KVH;
    const float scale = 1.0f / std::sqrt(float(hs));
    parallel_ranges(size_t(B) * T * NH, 1, [&](size_t p0, size_t p1) {
      std::vector<float> q(static_cast<size_t>(hs)), acc(static_cast<size_t>(hs)),
          s(static_cast<size_t>(pos0 + T));
      for (size_t p = p0; p < p1; ++p) {
        const int h = int(p % NH), t = int(p / NH % T), b = int(p / NH / T);
        const int len = pos0 + t + 1, kvh = h / rep;
        load_span(in + (size_t(b) * T + t) * W + size_t(h) * hs, q.data(), hs);
        const Tp* keys = kc + size_t(b) * maxT * KV + size_t(kvh) * hs;
        const Tp* vals = vc + size_t(b) * maxT * KV + size_t(kvh) * hs;
        float mx = -INFINITY;
        for (int j = 0; j < len; ++j) {
          float d = 0;
          for (int i = 0; i < hs; ++i) d += q[size_t(i)] * to_float(keys[size_t(j) * KV + i]);
          s[size_t(j)] = d * scale;
          mx = std::max(mx, s[size_t(j)]);
        }
        float sum = 0;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int j = 0; j < len; ++j) {
          const float e = std::exp(s[size_t(j)] - mx);
          sum += e;
          for (int i = 0; i < hs; ++i) acc[size_t(i)] += e * to_float(vals[size_t(j) * KV + i]);
        }
        Tp* o = y + (size_t(b) * T + t) * Q + size_t(h) * hs;
        for (int i = 0; i < hs; ++i) o[i] = from_float<Tp>(acc[size_t(i)] / sum);
      }
    });
  });
}

}  // namespace strata::cpu
