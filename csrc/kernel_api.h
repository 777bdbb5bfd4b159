// Scalars and per-ISA entry points of the Adam replay kernels.
#pragma once
#include <cstdint>

namespace gockpt {

// All scalars already rounded to float exactly as torch rounds them.
struct AdamScalars {
  float wd;      // f(weight_decay), Adam L2 term
  float decay;   // f(1 - lr*wd), AdamW decoupled decay
  float w1;      // f(1 - beta1), lerp weight
  float w1m1;    // w1 - 1 (float), lerp coefficient when |w1| >= 0.5
  float b2;      // f(beta2)
  float c2;      // f(1 - beta2)
  float bc2s;    // f(bias_correction2 ** 0.5)  (fused: f(sqrt(bias_correction2)))
  float eps;     // f(eps)
  float nss;     // f(-lr / bias_correction1)
  bool l2;       // Adam with weight_decay != 0
  bool decay_on; // AdamW with weight_decay != 0
  bool small;    // |w1| < 0.5
};

// sqrt as torch computes it (MKL vmsSqrt or IEEE), out-of-place, n <= kMaxSqrtBlock.
using SqrtFn = void (*)(const float* in, float* out, int64_t n);

// Largest chunk (elements) of the single-tensor/foreach kernel: its sqrt buffer lives on the
// stack of the calling thread (64 KiB).
constexpr int64_t kMaxSqrtBlock = 16384;

#define GOCKPT_DECLARE_ISA(NS)                                                              \
  namespace NS {                                                                            \
  /* single-tensor / foreach arithmetic; chunks of `block` elements (<= kMaxSqrtBlock):  */ \
  /* m, v of the chunk, then sqrt_fn(v) into a stack buffer, then p, while all is in L1  */ \
  void adam_single(float* p, float* m, float* v, const float* g, int64_t n,                 \
                   const AdamScalars& s, SqrtFn sqrt_fn, int64_t block);                    \
  /* torch's fused CPU kernel (IEEE sqrt); tail: scalar-remainder contraction          */   \
  void adam_fused(float* p, float* m, float* v, const float* g, int64_t n,                  \
                  const AdamScalars& s, bool tail);                                         \
  }

GOCKPT_DECLARE_ISA(generic)
GOCKPT_DECLARE_ISA(avx2)
GOCKPT_DECLARE_ISA(avx512)

}  // namespace gockpt
