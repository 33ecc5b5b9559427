// The safetensors reader (src/hf/safetensors.h): a well-formed file reads back its tensors,
// metadata and bytes (and converts bf16/fp16 to fp32); every malformed file is refused with an
// error naming the file, the tensor and the offset.
#include "src/hf/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace strata {
namespace {

// Writes header JSON (padded with spaces to a multiple of 8, as the format's writer does) and
// `data` to a file; returns its path.
std::string write_st(const std::string& name, const std::string& header,
                     const std::vector<unsigned char>& data, int64_t len_override = -1) {
  const std::string path = test::temp_dir("strata_st", name) + "/model.safetensors";
  std::string h = header;
  while (h.size() % 8) h += ' ';
  uint64_t n = len_override >= 0 ? uint64_t(len_override) : h.size();
  std::ofstream f(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) f.put(char((n >> (8 * i)) & 0xff));
  f.write(h.data(), std::streamsize(h.size()));
  f.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size()));
  return path;
}

std::vector<unsigned char> f32_bytes(const std::vector<float>& v) {
  std::vector<unsigned char> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

TEST(Safetensors, ReadsTensorsMetadataAndConverts) {
  // a: F32 [2,3] at [0,24); b: BF16 [2] at [24,28) holding 1.5 and -2.
  std::vector<unsigned char> data = f32_bytes({1, 2, 3, 4, 5, 6});
  for (uint16_t bits : {uint16_t(0x3fc0), uint16_t(0xc000)}) {
    data.push_back(bits & 0xff);
    data.push_back(bits >> 8);
  }
  const std::string path = write_st(
      "ok",
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2],"data_offsets":[24,28]},)"
      R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})",
      data);
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  ASSERT_EQ((*f)->tensors().size(), 2u);
  EXPECT_EQ((*f)->tensors()[0].name, "a");  // file order
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  const SafetensorsTensor* a = (*f)->find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  std::vector<float> got(6);
  ASSERT_TRUE((*f)->read_as(*a, DType::kF32, got.data()).is_ok());
  EXPECT_EQ(got, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  std::vector<float> b(2);
  ASSERT_TRUE((*f)->read_as(*(*f)->find("b"), DType::kF32, b.data()).is_ok());
  EXPECT_EQ(b, (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ((*f)->find("c"), nullptr);
}

// Each malformed file must fail, and the message must hold every fragment given.
void expect_refused(const std::string& path, std::vector<std::string> fragments) {
  auto f = SafetensorsFile::open(path);
  ASSERT_FALSE(f.is_ok()) << path << " was accepted";
  const std::string msg = f.status().to_string();
  fragments.push_back(path);
  for (const std::string& s : fragments) {
    EXPECT_NE(msg.find(s), std::string::npos) << "\"" << s << "\" missing from: " << msg;
  }
}

TEST(Safetensors, EveryMalformedFileIsRefusedWithTensorFileAndOffset) {
  const auto six = f32_bytes({1, 2, 3, 4, 5, 6});
  // Header length past the end of the file.
  expect_refused(write_st("hdr", R"({})", six, 1 << 20), {"offset 0", "past the end"});
  // Too short for the length.
  {
    const std::string p = test::temp_dir("strata_st", "short") + "/model.safetensors";
    std::ofstream(p, std::ios::binary).write("abc", 3);
    expect_refused(p, {"too short"});
  }
  // Not JSON.
  expect_refused(write_st("json", "{not json", six), {"offset 8", "not a JSON object"});
  // Truncated data: the tensor needs 24 bytes, the file has 20.
  expect_refused(write_st("trunc", R"({"w":{"dtype":"F32","shape":[6],"data_offsets":[0,24]}})",
                          std::vector<unsigned char>(six.begin(), six.begin() + 20)),
                 {"\"w\"", "past its end", "truncated"});
  // Offsets that disagree with the shape.
  expect_refused(
      write_st("shape", R"({"w":{"dtype":"F32","shape":[5],"data_offsets":[0,24]}})", six),
      {"\"w\"", "needs 20"});
  // Overlapping tensors.
  expect_refused(write_st("overlap",
                          R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                          R"("y":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                          six),
                 {"\"x\"", "\"y\"", "overlap"});
  // A dtype strata does not read; a missing key.
  expect_refused(
      write_st("dtype", R"({"w":{"dtype":"I64","shape":[3],"data_offsets":[0,24]}})", six),
      {"\"w\"", "I64"});
  expect_refused(write_st("keys", R"({"w":{"dtype":"F32","shape":[6]}})", six),
                 {"\"w\"", "data_offsets"});
  // A missing file.
  auto f = SafetensorsFile::open("/nonexistent/model.safetensors");
  ASSERT_FALSE(f.is_ok());
  EXPECT_NE(f.status().to_string().find("/nonexistent/model.safetensors"), std::string::npos);
}

// Headers whose numbers wrap or hide a fault (found by tests/fuzz/fuzz_safetensors and by
// reading the reader while writing it): each was accepted before and is refused now.
TEST(Safetensors, WrappingSizesHiddenOverlapsAndDeepHeadersAreRefused) {
  // [2^63] F16 elements: 2^64 bytes, which wrapped to 0 and matched data_offsets [0, 0]
  // (seed tests/fuzz/corpus/safetensors/near-huge-shape).
  expect_refused(
      write_st("wrap",
               R"({"w":{"dtype":"F16","shape":[9223372036854775808],"data_offsets":[0,0]}})", {}),
      {"\"w\"", "more elements than a file can hold"});
  // [2^32, 2^32] F32: the element count wraps to 0.
  expect_refused(write_st("wrap2",
                          R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],)"
                          R"("data_offsets":[0,0]}})",
                          {}),
                 {"\"w\"", "more elements than a file can hold"});
  // [2^62] F32: 2^62 elements fit, 2^64 bytes do not.
  expect_refused(
      write_st("wrap3",
               R"({"w":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", {}),
      {"\"w\"", "needs more bytes than a file can hold"});
  // x [0,16) and y [8,16) overlap; an empty tensor e at offset 4 sorted between them hid it.
  expect_refused(write_st("overlap_empty",
                          R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                          R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                          R"("y":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                          f32_bytes({1, 2, 3, 4})),
                 {"\"x\"", "\"y\"", "overlap"});
  // 100,000 nested arrays in the header: refused by the depth check before the parser runs.
  expect_refused(
      write_st("deep", "{\"w\":" + std::string(100000, '[') + std::string(100000, ']') + "}", {}),
      {"offset 8", "nested deeper than 64 levels"});
  // Empty tensors anywhere, and a tensor right after one, are fine.
  auto ok =
      SafetensorsFile::open(write_st("empty_ok",
                                     R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                     R"("e":{"dtype":"BF16","shape":[0,3],"data_offsets":[8,8]},)"
                                     R"("y":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                                     f32_bytes({1, 2, 3, 4})));
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ((*ok)->tensors().size(), 3u);
}

}  // namespace
}  // namespace strata
