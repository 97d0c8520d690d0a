// File: embstore/internal/crc32.hpp (private: not installed)
//
// CRC-32 with zlib's polynomial (reflected 0xEDB88320), the checksum of every checkpoint
// section (docs/checkpoint.md): crc32(data) == zlib.crc32(data), and a running crc may be
// continued: crc32(b, crc32(a)) == crc32(a + b).
#pragma once

#include <cstddef>  // size_t
#include <cstdint>  // uint32_t

namespace embstore::internal {

// Carry-less multiplication (PCLMULQDQ) where the CPU has it, else slicing-by-16 tables.
uint32_t crc32(const void* data, size_t n, uint32_t crc = 0) noexcept;
// The tables only (tests compare the two).
uint32_t crc32_portable(const void* data, size_t n, uint32_t crc = 0) noexcept;

}  // namespace embstore::internal
