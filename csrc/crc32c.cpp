// crc32c (Castagnoli): slicing-by-8 software tables, the SSE4.2 instruction path with three
// interleaved streams merged by a zero-append operator, the AVX-512 carry-less multiply path
// (the data folded 256 bytes per step, as in Intel's "Fast CRC Computation Using PCLMULQDQ"),
// and zlib's crc32_combine in GF(2).
#include "crc32c.h"

#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
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

#ifdef GOCKPT_X86
// Folding constants, for a 128-bit lane X (little-endian bytes of the message: bit k is the
// coefficient of x^(127-k)) moved D bits further: X * x^D = H * x^(D+64) + L * x^D, with H
// the lane's low and L its high quadword. The carry-less product of two such reflected
// 64-bit values comes out multiplied by x, hence the constants x^(D+63) and x^(D-1) mod P,
// reflected into the high half of a quadword. Lane layout: (low) for H, (high) for L.
uint64_t reflected_xpow(unsigned n) {  // x^n mod P, bit i -> bit 63 - i
  uint64_t r = 1;
  for (unsigned i = 0; i < n; i++) {
    r <<= 1;
    if (r >> 32) r ^= (1ull << 32) | 0x1EDC6F41u;  // P in normal form
  }
  uint64_t out = 0;
  for (int i = 0; i < 32; i++)
    if ((r >> i) & 1) out |= 1ull << (63 - i);
  return out;
}

struct FoldConstants {
  uint64_t k[5][2];  // D = 2048, 512, 384, 256, 128: {x^(D+63), x^(D-1)}
  FoldConstants() {
    const unsigned d[5] = {2048, 512, 384, 256, 128};
    for (int i = 0; i < 5; i++) k[i][0] = reflected_xpow(d[i] + 63), k[i][1] = reflected_xpow(d[i] - 1);
  }
};
const FoldConstants& fold_constants() {
  static const FoldConstants c;
  return c;
}

// X moved by the distance whose constants are k, plus b: four 128-bit lanes at once.
__attribute__((target("avx512f,vpclmulqdq"))) inline __m512i fold512(__m512i x, __m512i k, __m512i b) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), b,
                                   0x96);
}

__attribute__((target("pclmul,sse4.2"))) inline __m128i fold128(__m128i x, const uint64_t* k, __m128i b) {
  __m128i kk = _mm_set_epi64x(static_cast<long long>(k[1]), static_cast<long long>(k[0]));
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, kk, 0x00), _mm_clmulepi64_si128(x, kk, 0x11)), b);
}

__attribute__((target("avx512f"))) inline __m512i bcast(const uint64_t* k) {
  long long lo = static_cast<long long>(k[0]), hi = static_cast<long long>(k[1]);
  return _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo);
}

// The raw crc32c register c over n >= 256 bytes: four 512-bit accumulators (16 lanes of 128
// bits) fold 256 bytes per step, then fold into one lane, whose 16 bytes have the crc of all
// the folded data (the crc32 instruction takes it from there, with the tail).
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2"))) uint32_t crc_fold(uint32_t c, const uint8_t* p,
                                                                              size_t n) {
  const FoldConstants& fc = fold_constants();
  __m512i a0 = _mm512_loadu_si512(p), a1 = _mm512_loadu_si512(p + 64), a2 = _mm512_loadu_si512(p + 128),
          a3 = _mm512_loadu_si512(p + 192);
  a0 = _mm512_xor_si512(a0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(c))));  // the initial register
  p += 256;
  n -= 256;
  const __m512i k2048 = bcast(fc.k[0]);
  while (n >= 256) {
    a0 = fold512(a0, k2048, _mm512_loadu_si512(p));
    a1 = fold512(a1, k2048, _mm512_loadu_si512(p + 64));
    a2 = fold512(a2, k2048, _mm512_loadu_si512(p + 128));
    a3 = fold512(a3, k2048, _mm512_loadu_si512(p + 192));
    p += 256;
    n -= 256;
  }
  const __m512i k512 = bcast(fc.k[1]);
  __m512i z = fold512(a0, k512, a1);
  z = fold512(z, k512, a2);
  z = fold512(z, k512, a3);
  while (n >= 64) {
    z = fold512(z, k512, _mm512_loadu_si512(p));
    p += 64;
    n -= 64;
  }
  alignas(64) uint8_t lanes[64];
  _mm512_store_si512(lanes, z);
  auto lane = [&lanes](int i) { return _mm_load_si128(reinterpret_cast<const __m128i*>(lanes + 16 * i)); };
  __m128i y = fold128(lane(0), fc.k[2], lane(3));
  y = fold128(lane(1), fc.k[3], y);
  y = fold128(lane(2), fc.k[4], y);
  while (n >= 16) {
    y = fold128(y, fc.k[4], _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    p += 16;
    n -= 16;
  }
  uint64_t r = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(y)));
  r = _mm_crc32_u64(r, static_cast<uint64_t>(_mm_extract_epi64(y, 1)));
  return crc_hw(static_cast<uint32_t>(r), p, n);
}
#endif

int g_crc_impl = -1;  // -1 undecided, 0 software, 1 sse4.2, 2 avx512 carry-less multiply

int impl() {
  if (g_crc_impl < 0) {
#ifdef GOCKPT_X86
    __builtin_cpu_init();
    g_crc_impl = !__builtin_cpu_supports("sse4.2") ? 0
                 : __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
                         __builtin_cpu_supports("pclmul")
                     ? 2
                     : 1;
#else
    g_crc_impl = 0;
#endif
  }
  return g_crc_impl;
}

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#ifdef GOCKPT_X86
  int which = impl();
  if (which == 2 && n >= 256) return ~crc_fold(c, p, n);
  if (which >= 1) return ~crc_hw(c, p, n);
#endif
  return ~crc_sw(c, p, n);
}

const char* crc32c_impl() {
  static const char* names[] = {"software", "sse4.2", "avx512-vpclmulqdq"};
  return names[impl()];
}

void force_crc32c_impl(const std::string& which) {
  if (which == "software") {
    g_crc_impl = 0;
  } else if (which == "auto") {
    g_crc_impl = -1;
    impl();
  } else if (which == "sse4.2" || which == "avx512-vpclmulqdq") {
    g_crc_impl = -1;
    int best = impl();
    int want = which == "sse4.2" ? 1 : 2;
    if (best < want) {
      g_crc_impl = -1;
      throw std::runtime_error("this CPU has no " + which + " path for crc32c");
    }
    g_crc_impl = want;
  } else {
    throw std::invalid_argument("crc32c implementation must be auto|avx512-vpclmulqdq|sse4.2|software");
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
