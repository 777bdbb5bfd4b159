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

#define GOCKPT_DECLARE_ISA(NS)                                                              \
  namespace NS {                                                                            \
  void adam_phase1(float* p, float* m, float* v, const float* g, int64_t n,                 \
                   const AdamScalars& s);                                                   \
  void adam_phase2(float* p, const float* m, const float* sq, int64_t n,                    \
                   const AdamScalars& s);                                                   \
  void adam_fused(float* p, float* m, float* v, const float* g, int64_t n,                  \
                  const AdamScalars& s, bool tail);                                         \
  }

GOCKPT_DECLARE_ISA(generic)
GOCKPT_DECLARE_ISA(avx2)
GOCKPT_DECLARE_ISA(avx512)

}  // namespace gockpt
