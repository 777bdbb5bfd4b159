// crc32c (Castagnoli): slicing-by-8 software tables, the SSE4.2 instruction path with three
// interleaved streams merged by a zero-append operator, and zlib's crc32_combine in GF(2).
#include "crc32c.h"

#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define GOCKPT_X86 1
#endif

namespace gockpt {
namespace io {

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // Castagnoli, reflected

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
      for (int s = 1; s < 8; s++) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};
const Tables& tables() {
  static const Tables tab;
  return tab;
}

// Raw (not pre/post-inverted) state.
uint32_t crc_sw(uint32_t c, const uint8_t* p, size_t n) {
  const auto& t = tables().t;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
    n--;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
        t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^
        t[0][(w >> 56) & 0xff];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return c;
}

uint32_t gf2_times(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  while (vec) {
    if (vec & 1) sum ^= *mat;
    vec >>= 1;
    mat++;
  }
  return sum;
}

void gf2_square(uint32_t* sq, const uint32_t* mat) {
  for (int n = 0; n < 32; n++) sq[n] = gf2_times(mat, mat[n]);
}

// The linear operator "append kStream zero bytes" on the raw register, as 4 byte tables, so
// that three independent crc32 streams can be merged: crc(A||B) = shift(crc(A)) ^ crc0(B).
constexpr size_t kStream = 4096;
struct ShiftTable {
  uint32_t t[4][256];
  ShiftTable() {
    uint32_t op[32];  // column i = image of bit i
    for (int i = 0; i < 32; i++) op[i] = crc32c_combine(1u << i, 0, kStream);
    for (int j = 0; j < 4; j++)
      for (uint32_t v = 0; v < 256; v++) t[j][v] = gf2_times(op + 8 * j, v);
  }
  uint32_t operator()(uint32_t c) const {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
  }
};
const ShiftTable& shift_table() {
  static const ShiftTable tab;
  return tab;
}

#ifdef GOCKPT_X86
__attribute__((target("sse4.2"))) uint32_t crc_hw(uint32_t c, const uint8_t* p, size_t n) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = _mm_crc32_u8(c, *p++);
    n--;
  }
  if (n >= 3 * kStream) {
    const ShiftTable& shift = shift_table();
    while (n >= 3 * kStream) {  // three interleaved streams: the crc32 latency is hidden
      uint64_t c0 = c, c1 = 0, c2 = 0;
      for (size_t i = 0; i < kStream; i += 8) {
        uint64_t w0, w1, w2;
        std::memcpy(&w0, p + i, 8);
        std::memcpy(&w1, p + kStream + i, 8);
        std::memcpy(&w2, p + 2 * kStream + i, 8);
        c0 = _mm_crc32_u64(c0, w0);
        c1 = _mm_crc32_u64(c1, w1);
        c2 = _mm_crc32_u64(c2, w2);
      }
      c = shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
      c = shift(c) ^ static_cast<uint32_t>(c2);
      p += 3 * kStream;
      n -= 3 * kStream;
    }
  }
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (n--) c = _mm_crc32_u8(c, *p++);
  return c;
}
#endif

int g_crc_impl = -1;  // -1 undecided, 0 software, 1 sse4.2

bool use_hw() {
  if (g_crc_impl < 0) {
#ifdef GOCKPT_X86
    __builtin_cpu_init();
    g_crc_impl = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
    g_crc_impl = 0;
#endif
  }
  return g_crc_impl == 1;
}

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#ifdef GOCKPT_X86
  if (use_hw()) return ~crc_hw(c, p, n);
#endif
  return ~crc_sw(c, p, n);
}

const char* crc32c_impl() { return use_hw() ? "sse4.2" : "software"; }

void force_crc32c_impl(const std::string& which) {
  if (which == "software") {
    g_crc_impl = 0;
  } else if (which == "auto") {
    g_crc_impl = -1;
    use_hw();
  } else if (which == "sse4.2") {
    g_crc_impl = -1;
    if (!use_hw()) throw std::runtime_error("this CPU has no SSE4.2 crc32 instruction");
  } else {
    throw std::invalid_argument("crc32c implementation must be auto|sse4.2|software");
  }
}

// zlib's crc32_combine with the Castagnoli polynomial: crc(A || B) from crc(A), crc(B), |B|.
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
  if (len2 == 0) return crc1;
  uint32_t even[32], odd[32];
  odd[0] = kPoly;
  uint32_t row = 1;
  for (int n = 1; n < 32; n++) {
    odd[n] = row;
    row <<= 1;
  }
  gf2_square(even, odd);  // two zero bits
  gf2_square(odd, even);  // four zero bits
  do {
    gf2_square(even, odd);
    if (len2 & 1) crc1 = gf2_times(even, crc1);
    len2 >>= 1;
    if (!len2) break;
    gf2_square(odd, even);
    if (len2 & 1) crc1 = gf2_times(odd, crc1);
    len2 >>= 1;
  } while (len2);
  return crc1 ^ crc2;
}

}  // namespace io
}  // namespace gockpt
