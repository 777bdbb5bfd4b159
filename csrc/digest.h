// The digest of a tensor's words (gockpt/core/digest.py has the definition): with rows of
// kDigestRow words of the element size, signed, and r_j the exact sum of row j (the last row
// may be short), a = sum r_j and b = sum r_j * (2j + 1), both mod 2**64.  One pass over memory
// on threads of gockpt's pool, never torch's: the live state is digested while training runs.
#pragma once
#include <cstdint>

namespace gockpt {

constexpr int64_t kDigestRow = 256;

// Region i: words[i] words of elsize[i] bytes (1, 2, 4 or 8) at addr[i]; out[2i], out[2i+1]
// get its (a, b) as the two's-complement int64 of the unsigned sums.  threads: as
// parallel_tasks (<= 0: the hardware concurrency).
void digest_batch(const uint64_t* addr, const int64_t* words, const int64_t* elsize, int64_t n,
                  int threads, int64_t* out);

}  // namespace gockpt

namespace gockpt {

// The bf16 gradient transport's image on the CPU (gockpt/capture/transport.py), one pass:
// out[i] = bf16(g[i] / mul) rounded to nearest even as torch rounds (with_mul false: bf16(g[i])),
// and whether every float(out[i]) * mul (float(out[i])) gives g[i] back bit for bit.
bool bf16_images(const float* g, uint16_t* out, int64_t n, bool with_mul, float mul);

}  // namespace gockpt
