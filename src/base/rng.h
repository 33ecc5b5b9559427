// Deterministic random numbers that do not depend on the standard library's distributions
// (which differ between implementations): SplitMix64 streams keyed by (seed, stream id), and
// Box-Muller normals. Used for weight init and data sampling, so runs are reproducible bit for
// bit on any machine.
#pragma once

#include <cmath>
#include <cstdint>

namespace strata {

class Rng {
 public:
  Rng(uint64_t seed, uint64_t stream) : state_(mix(seed ^ mix(stream + 0x632be59bd9b4e019ull))) {}

  uint64_t next_u64() { return mix(state_ += kGamma); }
  // Advances the stream as if next_u64() had been called n times (O(1): SplitMix64's state
  // moves by a constant per draw), and drops a spare normal. normal() draws two uniforms per
  // pair of values, so the k-th normal of a fresh stream is: discard(k / 2 * 2), then for an
  // odd k one normal() thrown away.
  void discard(uint64_t n) {
    state_ += n * kGamma;
    has_spare_ = false;
  }
  // Uniform in [0, 1) with 53 bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t n) { return static_cast<uint64_t>(uniform() * static_cast<double>(n)); }
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(6.283185307179586 * u2);
    has_spare_ = true;
    return r * std::cos(6.283185307179586 * u2);
  }

  static uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

 private:
  static constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;
  uint64_t state_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

}  // namespace strata
