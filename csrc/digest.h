// Digest of a float32 tensor's bit patterns: two 64-bit integer sums that a GPU computes
// identically with plain torch int64 ops (gockpt/replay/digest.py: digest_torch), so a replayed
// host block can be checked against the live training tensor without copying it.
//
// For n uint32 words w_i (zero-extended) with element indices idx_i = first + i:
//   d1 = sum w_i * (2*idx_i + 1)                          (mod 2^64)
//   d2 = sum w_i * ((idx_i * kDigestMultiplier) | 1)      (mod 2^64)
// Both weights are odd, hence invertible mod 2^64: changing any single word changes both sums.
// Integer addition mod 2^64 is order-independent, so slices can be digested apart (with their
// own `first`) and their digests added.
//
// This header is also included by the per-ISA translation units (kernel_*.cpp): no STL.
#pragma once
#include <cstdint>

namespace gockpt {

constexpr uint64_t kDigestMultiplier = 0x9E3779B97F4A7C15ull;

struct Digest {
  uint64_t d1 = 0, d2 = 0;
  Digest& operator+=(const Digest& o) {
    d1 += o.d1;
    d2 += o.d2;
    return *this;
  }
};

// Digest of the n words at w whose first word has element index `first` (digest.cpp).
Digest digest(const uint32_t* w, int64_t n, int64_t first);

// Segment i: nwords[i] words at address src[i], first element index first[i]; its digest goes
// to out[2i], out[2i+1].  Pieces of all segments run on up to `threads` threads (0: all cores).
void digest_batch(const int64_t* src, const int64_t* nwords, const int64_t* first, int64_t n,
                  uint64_t* out, int threads);

// The per-ISA reduction the digest is assembled from (digest_impl.h), with local indices
// i = 0..n-1 and all sums mod 2^64: sums[0] = sum of w_i over even i, sums[1] = over odd i,
// sums[2] = sum of w_i * i.
#define GOCKPT_DECLARE_DIGEST_ISA(NS) \
  namespace NS {                      \
  void digest_sums(const uint32_t* w, int64_t n, uint64_t sums[3]); \
  }

GOCKPT_DECLARE_DIGEST_ISA(generic)
GOCKPT_DECLARE_DIGEST_ISA(avx2)
GOCKPT_DECLARE_DIGEST_ISA(avx512)

}  // namespace gockpt
