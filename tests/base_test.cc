// Status, dtype conversions, checksums.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "strata/checksum.h"
#include "strata/dtype.h"
#include "strata/status.h"

namespace strata {
namespace {

Status fails_deep() { return io_error("read /x at offset 4096: EIO"); }
Status fails_with_context() {
  STRATA_RETURN_IF_ERROR(fails_deep(), "loading shard 3");
  return Status::ok();
}
Result<int> half(int x) {
  if (x % 2) return invalid_argument("odd");
  return x / 2;
}
Status use_half(int x, int* out) {
  STRATA_ASSIGN_OR_RETURN(*out, half(x), "halving");
  return Status::ok();
}

TEST(Status, OkAndErrorsCarryContext) {
  EXPECT_TRUE(Status::ok().is_ok());
  Status s = fails_with_context();
  EXPECT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.message(), "loading shard 3: read /x at offset 4096: EIO");
  int v = 0;
  EXPECT_TRUE(use_half(8, &v).is_ok());
  EXPECT_EQ(v, 4);
  Status odd = use_half(3, &v);
  EXPECT_EQ(odd.to_string(), "invalid argument: halving: odd");
  EXPECT_EQ(errno_status(28, "write").code(), StatusCode::kNoSpace);
}

// Double-precision reference rounding to a format with `man` mantissa bits, nearest-even.
double round_to_bits(double x, int man_bits, int min_exp) {
  if (x == 0 || std::isinf(x) || std::isnan(x)) return x;
  int e;
  std::frexp(x, &e);  // x = f * 2^e, 0.5 <= |f| < 1
  int exp = std::max(e - 1, min_exp);
  double ulp = std::ldexp(1.0, exp - man_bits);
  return std::nearbyint(x / ulp) * ulp;
}

TEST(DType, Bf16RoundsToNearestEven) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1e4f, 1e4f);
  for (int i = 0; i < 100000; ++i) {
    float x = u(rng) * std::pow(2.0f, float(int(rng() % 60) - 30));
    float got = bf16_to_f32(f32_to_bf16(x));
    double want = round_to_bits(x, 7, -126);
    ASSERT_EQ(got, static_cast<float>(want)) << "x=" << x;
  }
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isinf(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::infinity()))));
  // Tie: 1 + 2^-8 is halfway between 1 and 1 + 2^-7: rounds to even (1).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
}

TEST(DType, Fp16RoundsToNearestEvenWithSubnormals) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int i = 0; i < 100000; ++i) {
    float x = u(rng) * std::pow(2.0f, float(int(rng() % 40) - 26));
    float got = f16_to_f32(f32_to_f16(x));
    double want = round_to_bits(x, 10, -14);
    if (std::fabs(want) >= 65520.0) want = std::copysign(INFINITY, x);
    ASSERT_EQ(got, static_cast<float>(want)) << "x=" << x;
  }
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even (0)
  for (uint32_t h = 0; h < 0x7c00; ++h) {                // every finite fp16 round-trips
    ASSERT_EQ(f32_to_f16(f16_to_f32(uint16_t(h))), h);
  }
}

TEST(Checksum, Crc32cMatchesStandardVector) {
  const char* s = "123456789";
  EXPECT_EQ(crc32c(0, s, 9), 0xE3069283u);
  EXPECT_EQ(crc32c(crc32c(0, s, 4), s + 4, 5), 0xE3069283u);
}

}  // namespace
}  // namespace strata
