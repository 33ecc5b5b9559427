#include "strata/checksum.h"

#include <isa-l/crc.h>

namespace strata {

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  // ISA-L's crc32_iscsi takes and returns the raw (non-inverted) register; wrap it so that
  // the result is the standard CRC32C (RFC 3720) and chains across calls.
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  uint32_t reg = ~crc;
  constexpr size_t kChunk = size_t{1} << 30;  // ISA-L takes an int length
  while (n > 0) {
    size_t len = n < kChunk ? n : kChunk;
    reg = crc32_iscsi(p, static_cast<int>(len), reg);
    p += len;
    n -= len;
  }
  return ~reg;
}

uint32_t crc32_ieee(uint32_t crc, const void* data, size_t n) {
  // crc32_gzip_refl takes and returns the standard (inverted) value: zlib.crc32's, chained.
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), n);
}

}  // namespace strata
