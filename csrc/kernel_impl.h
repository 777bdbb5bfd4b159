// Per-element Adam/AdamW replay arithmetic, included by one translation unit per
// instruction set (kernel_generic.cpp, kernel_avx2.cpp).  Every operation is written as
// torch 2.13 computes it on the CPU; the TU is compiled with -ffp-contract=off so the only
// fused multiply-adds are the explicit std::fma calls.  Loops are plain, branch-free
// element loops (GCC vectorises them with exact IEEE lane arithmetic).
//
// This header must not include STL containers: it is compiled under a different
// target pragma in kernel_avx2.cpp and any inline (vague linkage) function from a
// shared header could otherwise be merged with the generic copy.
#include <cstdint>

#include "kernel_api.h"

namespace gockpt {
namespace GOCKPT_ISA_NS {

namespace {

// Phase 1 of the single-tensor / foreach path:
//   weight decay, lerp (exp_avg), mul + addcmul (exp_avg_sq).
// m, v updated in place (p is read only for Adam's L2 term).
template <bool L2, bool DECAY, bool SMALL>
inline void phase1_t(float* __restrict p, float* __restrict m, float* __restrict v,
                     const float* __restrict g, int64_t n, const AdamScalars& s) {
  const float wd = s.wd, decay = s.decay, w1 = s.w1, w1m1 = s.w1m1, b2 = s.b2, c2 = s.c2;
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    float pi = p[i];
    if (L2) gi = __builtin_fmaf(pi, wd, gi);            // grad.add(param, alpha=wd): fmadd(p, wd, g)
    (void)decay;  // param.mul_(1 - lr*wd) is applied in phase 2 (same rounding)
    const float mi = m[i];
    const float d = gi - mi;                      // lerp: end - self
    m[i] = SMALL ? __builtin_fmaf(w1, d, mi) : __builtin_fmaf(w1m1, d, gi);
    const float vb = v[i] * b2;                   // exp_avg_sq.mul_(beta2)
    v[i] = __builtin_fmaf(c2 * gi, gi, vb);             // .addcmul_(g, g, value=1-beta2)
  }
}

// Phase 2 of the single-tensor / foreach path, given sq = sqrt(exp_avg_sq) as torch computes it:
//   denom = sq / bc2_sqrt + eps;  p += (-step_size * m) / denom
template <bool DECAY>
inline void phase2_t(float* __restrict p, const float* __restrict m, const float* __restrict sq,
                     int64_t n, const AdamScalars& s) {
  const float bc2s = s.bc2s, eps = s.eps, nss = s.nss, decay = s.decay;
  for (int64_t i = 0; i < n; ++i) {
    const float p1 = DECAY ? p[i] * decay : p[i];  // param.mul_(1 - lr*wd)
    const float den = sq[i] / bc2s + eps;
    p[i] = p1 + (nss * m[i]) / den;
  }
}

// torch's fused CPU kernel.  TAIL selects the scalar remainder loop's contraction
// (exp_avg_sq = fma(v, b2, (c2*g)*g)) instead of the vector body's (fma(c2*g, g, v*b2)).
template <bool L2, bool DECAY, bool SMALL, bool TAIL>
inline void fused_t(float* __restrict p, float* __restrict m, float* __restrict v,
                    const float* __restrict g, int64_t n, const AdamScalars& s) {
  const float wd = s.wd, decay = s.decay, w1 = s.w1, w1m1 = s.w1m1, b2 = s.b2, c2 = s.c2;
  const float bc2s = s.bc2s, eps = s.eps, nss = s.nss;
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    float pi = p[i];
    if (L2) gi = __builtin_fmaf(pi, wd, gi);
    if (DECAY) pi = pi * decay;
    const float mi = m[i];
    const float d = gi - mi;
    const float mn = SMALL ? __builtin_fmaf(w1, d, mi) : __builtin_fmaf(w1m1, d, gi);
    m[i] = mn;
    float vn;
    if (TAIL) {
      vn = __builtin_fmaf(v[i], b2, (c2 * gi) * gi);
    } else {
      vn = __builtin_fmaf(c2 * gi, gi, v[i] * b2);
    }
    v[i] = vn;
    const float den = __builtin_sqrtf(vn) / bc2s + eps;
    p[i] = pi + (nss * mn) / den;
  }
}

template <bool L2, bool DECAY>
inline void phase1_d(float* p, float* m, float* v, const float* g, int64_t n, const AdamScalars& s) {
  if (s.small) phase1_t<L2, DECAY, true>(p, m, v, g, n, s);
  else phase1_t<L2, DECAY, false>(p, m, v, g, n, s);
}

template <bool L2, bool DECAY, bool TAIL>
inline void fused_d(float* p, float* m, float* v, const float* g, int64_t n, const AdamScalars& s) {
  if (s.small) fused_t<L2, DECAY, true, TAIL>(p, m, v, g, n, s);
  else fused_t<L2, DECAY, false, TAIL>(p, m, v, g, n, s);
}

}  // namespace

void adam_phase1(float* p, float* m, float* v, const float* g, int64_t n, const AdamScalars& s) {
  if (s.l2) phase1_d<true, false>(p, m, v, g, n, s);
  else if (s.decay_on) phase1_d<false, true>(p, m, v, g, n, s);
  else phase1_d<false, false>(p, m, v, g, n, s);
}

void adam_phase2(float* p, const float* m, const float* sq, int64_t n, const AdamScalars& s) {
  if (s.decay_on) phase2_t<true>(p, m, sq, n, s);
  else phase2_t<false>(p, m, sq, n, s);
}

void adam_fused(float* p, float* m, float* v, const float* g, int64_t n, const AdamScalars& s,
                bool tail) {
  if (tail) {
    if (s.l2) fused_d<true, false, true>(p, m, v, g, n, s);
    else if (s.decay_on) fused_d<false, true, true>(p, m, v, g, n, s);
    else fused_d<false, false, true>(p, m, v, g, n, s);
  } else {
    if (s.l2) fused_d<true, false, false>(p, m, v, g, n, s);
    else if (s.decay_on) fused_d<false, true, false>(p, m, v, g, n, s);
    else fused_d<false, false, false>(p, m, v, g, n, s);
  }
}

}  // namespace GOCKPT_ISA_NS
}  // namespace gockpt
