// CRC32C (Castagnoli) of a byte range: the SSE4.2 crc32 instruction where the
// CPU has it (chosen at run time, the build stays generic x86-64), a table
// otherwise. Used by the store's integrity mode, one checksum per extent.
#pragma once

#include <cstddef>
#include <cstdint>

namespace infinity::aio {

// Continues `crc` (0 to start) over [data, data + n).
uint32_t crc32c(const void* data, size_t n, uint32_t crc);
bool crc32c_is_hardware();

}  // namespace infinity::aio
