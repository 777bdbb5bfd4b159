// crc32c (Castagnoli), the checksum of every chunk of a checkpoint's tensors: AVX-512
// carry-less multiplies folding the data where the CPU has them (several times the speed of
// the crc32 instruction, so that a checksum costs little next to the copy it rides on), else
// SSE4.2 crc32 instructions (three interleaved streams), else slicing-by-8 tables.
// Used by writer.cpp and reader.cpp; bound in module.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gockpt {
namespace io {

// crc32c of n bytes at data, zlib-style continuation: crc32c(crc32c(0, a), b) == crc32c(0, a || b).
uint32_t crc32c(uint32_t crc, const void* data, size_t n);
// crc32c(A || B) from crc1 = crc32c(A), crc2 = crc32c(B) and len2 = |B|.
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
// The implementation in use: "avx512-vpclmulqdq", "sse4.2" or "software".
const char* crc32c_impl();
// Tests: force the implementation, "auto" | "avx512-vpclmulqdq" | "sse4.2" | "software" (throws
// where the CPU lacks it).
void force_crc32c_impl(const std::string& which);

}  // namespace io
}  // namespace gockpt
