// CRC32C (Castagnoli), hardware-accelerated through Intel ISA-L (crc32_iscsi).
// Used for checkpoint payloads and, optionally, per storage extent.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

// Extends `crc` (start with 0) over n bytes; crc32c(crc32c(0,a),b) == crc32c(0, a||b).
uint32_t crc32c(uint32_t crc, const void* data, size_t n);

}  // namespace strata
