// libFuzzer target: the token-file reader (llm.c .bin, uint16, uint32, text) and batches drawn
// from what it loaded. Input: byte 0 picks the format, byte 1 the vocabulary; the rest is the
// file.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "src/train/data.h"
#include "strata/log.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  static const char* kFormats[] = {"auto", "llmc", "uint16", "uint32", "text"};
  strata::DataConfig dc;
  dc.format = kFormats[data[0] % 5];
  const int vocab = 1 + data[1] * 257;  // 1 .. 65536
  strata::fuzz::MemFile f(data + 2, size - 2);
  if (!f.ok()) return 0;
  dc.source = f.path();
  dc.eval_fraction = 0.25;
  auto d = strata::Dataset::load(dc, vocab, 1);
  if (!d.is_ok()) return 0;
  constexpr int T = 4;
  if (d->train_tokens() < T + 2 || d->eval_tokens() < T + 2) return 0;
  std::vector<int32_t> tok(2 * T), tgt(2 * T);
  d->train_batch(7, 3, 1, 1, 2, T, tok.data(), tgt.data());
  d->eval_batch(5, 2, T, tok.data(), tgt.data(), 1, 2);
  return 0;
}
