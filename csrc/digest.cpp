// Digests of many regions (digest.h): rows summed exactly in 64-bit integers, a region cut
// into pieces of whole rows so that one large tensor spreads over the threads, each piece's
// partial (a, b) added to its region's in a fixed order afterwards (integer sums: the result
// does not depend on how the work was cut).
#include <algorithm>
#include "digest.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel.h"

namespace gockpt {

namespace {

// Rows per piece: 2**16 words of 4 bytes is 256 KiB, a piece handed out per task.
constexpr int64_t kPieceRows = 256;

// (a, b) of rows [r0, r1) of n words at p, rows numbered from r0 (mod 2**64).  The sums of
// sign-extended words vectorise (the AVX2 clone where the CPU has it).
template <typename T>
__attribute__((target_clones("avx2", "default")))
void rows_digest(const T* p, int64_t n, int64_t r0, int64_t r1, uint64_t* a, uint64_t* b) {
  uint64_t sa = 0, sb = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t lo = r * kDigestRow;
    const int64_t hi = lo + kDigestRow < n ? lo + kDigestRow : n;
    int64_t s = 0;
    if (sizeof(T) < 8) {
      for (int64_t i = lo; i < hi; ++i) s += static_cast<int64_t>(p[i]);  // exact: < 2**40
    } else {
      uint64_t u = 0;  // 64-bit words: the row's sum itself wraps
      for (int64_t i = lo; i < hi; ++i) u += static_cast<uint64_t>(p[i]);
      s = static_cast<int64_t>(u);
    }
    const uint64_t row = static_cast<uint64_t>(s);
    sa += row;
    sb += row * static_cast<uint64_t>(2 * r + 1);
  }
  *a = sa;
  *b = sb;
}

struct Job {
  const uint64_t* addr;
  const int64_t* words;
  const int64_t* elsize;
  std::vector<int64_t> region, r0, r1;  // per piece
  std::vector<uint64_t> pa, pb;         // per piece: its partial (a, b)
};

void run_piece(void* ctx, int64_t k) {
  Job& job = *static_cast<Job*>(ctx);
  const int64_t i = job.region[k];
  const void* p = reinterpret_cast<const void*>(static_cast<uintptr_t>(job.addr[i]));
  const int64_t n = job.words[i];
  uint64_t* a = &job.pa[k];
  uint64_t* b = &job.pb[k];
  switch (job.elsize[i]) {
    case 1: rows_digest(static_cast<const int8_t*>(p), n, job.r0[k], job.r1[k], a, b); break;
    case 2: rows_digest(static_cast<const int16_t*>(p), n, job.r0[k], job.r1[k], a, b); break;
    case 4: rows_digest(static_cast<const int32_t*>(p), n, job.r0[k], job.r1[k], a, b); break;
    default: rows_digest(static_cast<const int64_t*>(p), n, job.r0[k], job.r1[k], a, b); break;
  }
}

}  // namespace

void digest_batch(const uint64_t* addr, const int64_t* words, const int64_t* elsize, int64_t n,
                  int threads, int64_t* out) {
  Job job{addr, words, elsize, {}, {}, {}, {}, {}};
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = elsize[i];
    if (e != 1 && e != 2 && e != 4 && e != 8)
      throw std::invalid_argument("digest: element size " + std::to_string(e) +
                                  " is not 1, 2, 4 or 8");
    if (words[i] < 0) throw std::invalid_argument("digest: negative word count");
    if (words[i] > 0 && addr[i] == 0) throw std::invalid_argument("digest: null address");
    const int64_t rows = (words[i] + kDigestRow - 1) / kDigestRow;
    for (int64_t r = 0; r < rows; r += kPieceRows) {
      job.region.push_back(i);
      job.r0.push_back(r);
      job.r1.push_back(r + kPieceRows < rows ? r + kPieceRows : rows);
    }
    total += words[i] * e;
  }
  const int64_t pieces = static_cast<int64_t>(job.region.size());
  job.pa.assign(pieces, 0);
  job.pb.assign(pieces, 0);
  // one more thread per 4 MiB: waking a helper costs more than summing less
  const int use = threads_for(total, threads, int64_t{4} << 20);
  parallel_tasks(pieces, use, false, run_piece, &job);
  std::vector<uint64_t> a(n, 0), b(n, 0);
  for (int64_t k = 0; k < pieces; ++k) {
    a[job.region[k]] += job.pa[k];
    b[job.region[k]] += job.pb[k];
  }
  for (int64_t i = 0; i < n; ++i) {
    out[2 * i] = static_cast<int64_t>(a[i]);
    out[2 * i + 1] = static_cast<int64_t>(b[i]);
  }
}

}  // namespace gockpt

namespace gockpt {

namespace {

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// float -> bfloat16 as torch 2.13's CPU kernels round it: to nearest even, every NaN to 0xFFFF
// (what .to(torch.bfloat16) gives there; an image is valid only if it gives its gradient back
// anyway, so another NaN image could only send that step in fp32)
inline uint16_t to_bf16(float x) {
  if (std::isnan(x)) return 0xFFFF;
  const uint32_t u = bits_of(x);
  return static_cast<uint16_t>((u + (((u >> 16) & 1) + 0x7FFFu)) >> 16);
}

}  // namespace

namespace {

// One pass: each image made and compared back, bit for bit. IEEE division and product, one
// rounding each (the file is built with -ffp-contract=off): what the replay computes from the
// image. Inlined into each ISA's copy below, which the compiler vectorises for that ISA.
// Checked a chunk at a time: gradients that are not bf16 values (an fp32 model's, where the
// transport is on because a link carries the copies) are refused after their first chunk,
// not a whole pass (the training thread pays for it at every step of a window).
constexpr int64_t kImageChunk = 4096;

template <bool WithMul>
inline bool images_pass(const float* g, uint16_t* out, int64_t n, float mul) {
  for (int64_t lo = 0; lo < n; lo += kImageChunk) {
    const int64_t hi = std::min(n, lo + kImageChunk);
    uint32_t wrong = 0;
    for (int64_t i = lo; i < hi; ++i) {
      const float x = g[i];
      const uint16_t image = to_bf16(WithMul ? x / mul : x);
      out[i] = image;
      const float back = float_of(static_cast<uint32_t>(image) << 16);
      wrong |= bits_of(WithMul ? back * mul : back) ^ bits_of(x);
    }
    if (wrong != 0) return false;
  }
  return true;
}

bool images_portable(const float* g, uint16_t* out, int64_t n, bool with_mul, float mul) {
  return with_mul ? images_pass<true>(g, out, n, mul) : images_pass<false>(g, out, n, mul);
}

// 8 lanes instead of SSE's 4 (the same IEEE operations, lane by lane): the pass runs on the
// training thread at every step of a window, over the gradients captured so far
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2"))) bool images_avx2(const float* g, uint16_t* out, int64_t n,
                                                 bool with_mul, float mul) {
  return with_mul ? images_pass<true>(g, out, n, mul) : images_pass<false>(g, out, n, mul);
}
#endif

}  // namespace

bool bf16_images(const float* g, uint16_t* out, int64_t n, bool with_mul, float mul) {
#if defined(__x86_64__) || defined(__i386__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return images_avx2(g, out, n, with_mul, mul);
#endif
  return images_portable(g, out, n, with_mul, mul);
}

}  // namespace gockpt
