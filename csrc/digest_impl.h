// Per-ISA body of the digest (digest.h), included by kernel_generic.cpp, kernel_avx2.cpp and
// kernel_avx512.cpp after kernel_impl.h (same GOCKPT_ISA_NS / GOCKPT_SIMD; no STL, see there).
//
// digest_sums needs sum w_i, split by the parity of i, and sum w_i * i.  The products are not
// formed: a step j loads words [W*j, W*j+W) (2 words per 64-bit lane), adds the even and odd
// words of each lane to SE and SO, then SE and SO to running sums RE and RO.  After N steps
// RE = sum_j (N - j) * X_j, so sum_j j * X_j = N*SE - RE, and the words of lane k in step j
// have indices W*j + 2k (even) and W*j + 2k + 1 (odd).  Everything is mod 2^64, where
// these identities hold exactly: 7 integer adds/logic ops per vector, no multiply, no limit
// on n; memory-bound.
#include <cstdint>

#if defined(GOCKPT_SIMD)
#include <immintrin.h>
#endif

#include "digest.h"

namespace gockpt {
namespace GOCKPT_ISA_NS {

namespace {

// vu: one vector of 64-bit lanes, each holding two consecutive words (low = even index).
#if defined(GOCKPT_SIMD) && GOCKPT_SIMD == 512
using vu = __m512i;
constexpr int64_t kLanes = 8;
inline vu uzero() { return _mm512_setzero_si512(); }
inline vu uadd(vu a, vu b) { return _mm512_add_epi64(a, b); }
inline void ustore(uint64_t* a, vu x) { _mm512_storeu_si512(a, x); }
inline void load_pairs(const uint32_t* w, vu& even, vu& odd) {
  const vu x = _mm512_loadu_si512(w);
  even = _mm512_and_si512(x, _mm512_set1_epi64(0xffffffffll));
  odd = _mm512_maskz_srli_epi64(0xff, x, 32);  // = srli; GCC 12 warns on srli's undefined source
}
#elif defined(GOCKPT_SIMD) && GOCKPT_SIMD == 256
using vu = __m256i;
constexpr int64_t kLanes = 4;
inline vu uzero() { return _mm256_setzero_si256(); }
inline vu uadd(vu a, vu b) { return _mm256_add_epi64(a, b); }
inline void ustore(uint64_t* a, vu x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), x); }
inline void load_pairs(const uint32_t* w, vu& even, vu& odd) {
  const vu x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  even = _mm256_and_si256(x, _mm256_set1_epi64x(0xffffffffll));
  odd = _mm256_srli_epi64(x, 32);
}
#else
using vu = uint64_t;
constexpr int64_t kLanes = 1;
inline vu uzero() { return 0; }
inline vu uadd(vu a, vu b) { return a + b; }
inline void ustore(uint64_t* a, vu x) { *a = x; }
inline void load_pairs(const uint32_t* w, vu& even, vu& odd) {
  even = w[0];
  odd = w[1];
}
#endif

}  // namespace

void digest_sums(const uint32_t* w, int64_t n, uint64_t sums[3]) {
  // Two vectors per step with their own sums (independent add chains); their lanes are numbered
  // on: lane k covers words 2k and 2k+1 of every step.
  constexpr int kUnroll = 2;
  constexpr int64_t kL = kLanes * kUnroll;  // lanes per step
  constexpr int64_t W = 2 * kL;             // words per step
  const int64_t steps = n / W;
  vu se[kUnroll], so[kUnroll], re[kUnroll], ro[kUnroll];
  for (int u = 0; u < kUnroll; ++u) se[u] = so[u] = re[u] = ro[u] = uzero();
  for (int64_t j = 0; j < steps; ++j) {
    for (int u = 0; u < kUnroll; ++u) {
      vu even, odd;
      load_pairs(w + W * j + 2 * kLanes * u, even, odd);
      se[u] = uadd(se[u], even);
      so[u] = uadd(so[u], odd);
      re[u] = uadd(re[u], se[u]);
      ro[u] = uadd(ro[u], so[u]);
    }
  }
  alignas(64) uint64_t a_se[kL], a_so[kL], a_re[kL], a_ro[kL];
  for (int u = 0; u < kUnroll; ++u) {
    ustore(a_se + kLanes * u, se[u]);
    ustore(a_so + kLanes * u, so[u]);
    ustore(a_re + kLanes * u, re[u]);
    ustore(a_ro + kLanes * u, ro[u]);
  }
  const uint64_t N = static_cast<uint64_t>(steps);
  uint64_t even = 0, odd = 0, weighted = 0;
  for (int64_t k = 0; k < kL; ++k) {
    const uint64_t k2 = 2 * static_cast<uint64_t>(k);
    even += a_se[k];
    odd += a_so[k];
    weighted += W * (N * a_se[k] - a_re[k]) + k2 * a_se[k];
    weighted += W * (N * a_so[k] - a_ro[k]) + (k2 + 1) * a_so[k];
  }
  for (int64_t i = W * steps; i < n; ++i) {  // the last < W words
    const uint64_t x = w[i];
    if (i & 1) odd += x;
    else even += x;
    weighted += x * static_cast<uint64_t>(i);
  }
  sums[0] = even;
  sums[1] = odd;
  sums[2] = weighted;
}

}  // namespace GOCKPT_ISA_NS
}  // namespace gockpt
