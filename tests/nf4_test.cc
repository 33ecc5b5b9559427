// NF4 (src/base/nf4.h) against bitsandbytes itself: tests/fixtures/nf4/reference.safetensors
// (tools/make_nf4_fixture.py, bitsandbytes 0.50.2 on the CPU) holds its code book, inputs with
// outliers, values exactly on the midpoints between codes, a block of zeros and a partial last
// block, and what bitsandbytes made of them. strata's code book, packed bytes and absmax scales
// must equal bitsandbytes', and its dequantization must give bitsandbytes' fp32 values bit for
// bit.
#include "src/base/nf4.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "tests/hf_test_util.h"

namespace strata {
namespace {

std::map<std::string, std::vector<float>> reference() {
  return test::read_safetensors_f32(std::string(STRATA_SOURCE_DIR) +
                                    "/tests/fixtures/nf4/reference.safetensors");
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(Nf4, CodeBookBytesScalesAndDequantizedBitsAreBitsandbytes) {
  auto ref = reference();
  ASSERT_EQ(ref["code"].size(), 16u);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(bits(kNf4Code[i]), bits(ref["code"][size_t(i)])) << i;
  const std::vector<float>& x = ref["x"];
  const size_t n = x.size();
  ASSERT_EQ(n % kNf4Block, 24u);  // a partial last block
  std::vector<uint8_t> q(nf4_packed_bytes(n));
  std::vector<float> absmax(nf4_blocks(n));
  nf4_quantize(x.data(), n, q.data(), absmax.data());
  ASSERT_EQ(q.size(), ref["q"].size());
  ASSERT_EQ(absmax.size(), ref["absmax"].size());
  size_t bad = 0;
  for (size_t i = 0; i < q.size(); ++i) bad += q[i] != uint8_t(ref["q"][i]);
  EXPECT_EQ(bad, 0u) << "packed bytes that differ from bitsandbytes'";
  for (size_t b = 0; b < absmax.size(); ++b) EXPECT_EQ(bits(absmax[b]), bits(ref["absmax"][b]));
  // Dequantizing bitsandbytes' own bytes and scales: its fp32 values, bit for bit.
  std::vector<uint8_t> qref(q.size());
  for (size_t i = 0; i < q.size(); ++i) qref[i] = uint8_t(ref["q"][i]);
  std::vector<float> y(n);
  nf4_dequantize(qref.data(), ref["absmax"].data(), n, y.data());
  bad = 0;
  for (size_t i = 0; i < n; ++i) bad += bits(y[i]) != bits(ref["y"][i]);
  EXPECT_EQ(bad, 0u) << "dequantized values that differ from bitsandbytes'";
  // The midpoints block (3) has every code and the ties: a value on a midpoint takes the lower.
  for (int k = 0; k < 15; ++k) EXPECT_EQ(q[3 * 32 + size_t(k) / 2] >> (k % 2 ? 0 : 4) & 0xf, k);
  // The zero block dequantizes to zeros.
  for (size_t i = 5 * kNf4Block; i < 6 * kNf4Block; ++i) EXPECT_EQ(y[i], 0.0f);
}

TEST(Nf4, RoundTripErrorIsWithinHalfTheWidestCodeGap) {
  // Fresh inputs: each value comes back within half the widest gap between codes (-1 to
  // -0.696: 0.304) times its block's absmax.
  std::vector<float> x(64 * 100 + 1);
  uint32_t s = 12345;
  for (float& v : x) {
    s = s * 1664525u + 1013904223u;
    v = float(int32_t(s >> 8) - (1 << 23)) / float(1 << 23);
  }
  std::vector<uint8_t> q(nf4_packed_bytes(x.size()));
  std::vector<float> absmax(nf4_blocks(x.size())), y(x.size());
  nf4_quantize(x.data(), x.size(), q.data(), absmax.data());
  nf4_dequantize(q.data(), absmax.data(), x.size(), y.data());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_LE(std::fabs(y[i] - x[i]), 0.5f * 0.3039f * absmax[i / kNf4Block] + 1e-7f) << i;
  }
}

}  // namespace
}  // namespace strata
