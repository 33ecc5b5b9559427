// CRC32C (Castagnoli), hardware-accelerated through Intel ISA-L (crc32_iscsi).
// Used for checkpoint payloads and, optionally, per storage extent. Also CRC-32 (IEEE, zlib's
// crc32), for files Python writes (a token file's loss mask names its tokens' CRC-32).
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

// Extends `crc` (start with 0) over n bytes; crc32c(crc32c(0,a),b) == crc32c(0, a||b).
uint32_t crc32c(uint32_t crc, const void* data, size_t n);
// The same for CRC-32 (IEEE 802.3, as zlib.crc32 computes it; ISA-L's crc32_gzip_refl).
uint32_t crc32_ieee(uint32_t crc, const void* data, size_t n);

}  // namespace strata
