// Per-element Adam/AdamW replay arithmetic, included by one translation unit per
// instruction set (kernel_generic.cpp, kernel_avx2.cpp, kernel_avx512.cpp).  Every operation
// is written as torch 2.13 computes it on the CPU (and, in the CUDA profiles, as torch's CUDA
// kernels compute it on an H100); the TUs are compiled with
// -ffp-contract=off so the only fused multiply-adds are the explicit ones (__builtin_fmaf,
// _mm*_fmadd_ps).  IEEE arithmetic is lane-independent, so the SIMD bodies (explicit
// intrinsics, GOCKPT_SIMD = 512 or 256) and the scalar loops (generic build and the SIMD
// remainders) give the same bits for every element.
//
// This header must not include STL containers: it is compiled under a different
// target pragma per TU and any inline (vague linkage) function from a shared header could
// otherwise be merged with the generic copy.  Everything here lives in an anonymous
// namespace inside the per-ISA namespace.
#include <cstdint>

#if defined(GOCKPT_SIMD)
#include <immintrin.h>
#endif

#include "kernel_api.h"

namespace gockpt {
namespace GOCKPT_ISA_NS {

namespace {

// ---------------------------------------------------------------- scalar element loops
// Phase 1 of the single-tensor / foreach path:
//   (Adam) grad.add(param, alpha=wd); lerp (exp_avg); mul + addcmul (exp_avg_sq).
// AdamW's param.mul_(1 - lr*wd) is applied in phase 2 (same rounding, p is not read here).
template <bool L2, bool SMALL>
inline void phase1_scalar(const float* __restrict p, float* __restrict m, float* __restrict v,
                          const float* __restrict g, int64_t n, const AdamScalars& s) {
  const float wd = s.wd, w1 = s.w1, w1m1 = s.w1m1, b2 = s.b2, c2 = s.c2;
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    if (L2) gi = __builtin_fmaf(p[i], wd, gi);  // grad.add(param, alpha=wd): fmadd(p, wd, g)
    const float mi = m[i];
    const float d = gi - mi;                      // lerp: end - self
    m[i] = SMALL ? __builtin_fmaf(w1, d, mi) : __builtin_fmaf(w1m1, d, gi);
    const float vb = v[i] * b2;                   // exp_avg_sq.mul_(beta2)
    v[i] = __builtin_fmaf(c2 * gi, gi, vb);       // .addcmul_(g, g, value=1-beta2)
  }
}

// Phase 2, given sq = sqrt(exp_avg_sq) as torch computes it:
//   denom = sq / bc2_sqrt + eps;  p = p*decay + (-step_size * m) / denom
template <bool DECAY>
inline void phase2_scalar(float* __restrict p, const float* __restrict m,
                          const float* __restrict sq, int64_t n, const AdamScalars& s) {
  const float bc2s = s.bc2s, eps = s.eps, nss = s.nss, decay = s.decay;
  for (int64_t i = 0; i < n; ++i) {
    const float p1 = DECAY ? p[i] * decay : p[i];  // param.mul_(1 - lr*wd)
    const float den = sq[i] / bc2s + eps;
    p[i] = p1 + (nss * m[i]) / den;
  }
}

// ---------------------------------------------------------------- SIMD bodies
// Software prefetch distance (elements) for the streams read from memory.  Measured on a
// 2-core AVX-512 Xeon (KVM, shared): with 512-element tiles, 512 ahead gave ~+10-15% over no
// prefetch (the hardware prefetcher alone leaves too few misses in flight), 2048 less
// (re-measure: build with -DGOCKPT_PF_AHEAD=N, experiments/bench_replay.py's gockpt_replay
// rows).
#ifndef GOCKPT_PF_AHEAD
#define GOCKPT_PF_AHEAD 512
#endif
#if defined(GOCKPT_SIMD)
// One set of thin wrappers per vector width (P: the intrinsics' prefix, _mm512 / _mm256).
#define GOCKPT_VECTOR_OPS(VT, WIDTH, P)                                                  \
  using vf = VT;                                                                         \
  constexpr int64_t kW = WIDTH;                                                          \
  inline vf vload(const float* a) { return P##_loadu_ps(a); }                            \
  inline void vstore(float* a, vf x) { P##_storeu_ps(a, x); }                            \
  inline vf vset1(float x) { return P##_set1_ps(x); }                                    \
  inline vf vadd(vf a, vf b) { return P##_add_ps(a, b); }                                \
  inline vf vsub(vf a, vf b) { return P##_sub_ps(a, b); }                                \
  inline vf vmul(vf a, vf b) { return P##_mul_ps(a, b); }                                \
  inline vf vdiv(vf a, vf b) { return P##_div_ps(a, b); }                                \
  inline vf vfma(vf a, vf b, vf c) { return P##_fmadd_ps(a, b, c); } /* a*b+c, 1 rounding */
#if GOCKPT_SIMD == 512
GOCKPT_VECTOR_OPS(__m512, 16, _mm512)
#elif GOCKPT_SIMD == 256
GOCKPT_VECTOR_OPS(__m256, 8, _mm256)
#else
#error "GOCKPT_SIMD must be 512 or 256"
#endif
#undef GOCKPT_VECTOR_OPS


// Broadcast scalars, built once per call.
struct VScalars {
  vf wd, w1, w1m1, b2, c2, bc2s, eps, nss, decay;
  explicit VScalars(const AdamScalars& s)
      : wd(vset1(s.wd)), w1(vset1(s.w1)), w1m1(vset1(s.w1m1)), b2(vset1(s.b2)),
        c2(vset1(s.c2)), bc2s(vset1(s.bc2s)), eps(vset1(s.eps)), nss(vset1(s.nss)),
        decay(vset1(s.decay)) {}
};

// One vector of phase 1 (m, v): FMAs exactly where torch fuses, nothing else fused.
template <bool L2, bool SMALL>
inline void moments_vec(const float* p, float* m, float* v, const float* g, const VScalars& c) {
  vf gi = vload(g);
  if (L2) gi = vfma(vload(p), c.wd, gi);
  const vf mi = vload(m);
  const vf d = vsub(gi, mi);
  vstore(m, SMALL ? vfma(c.w1, d, mi) : vfma(c.w1m1, d, gi));
  const vf vb = vmul(vload(v), c.b2);
  vstore(v, vfma(vmul(c.c2, gi), gi, vb));
}

// One vector of phase 2 (p), from m and sqrt(v): two roundings for den, no FMA.
template <bool DECAY>
inline void update_vec(float* p, const float* m, const float* sq, const VScalars& c) {
  vf pp = vload(p);
  if (DECAY) pp = vmul(pp, c.decay);
  const vf den = vadd(vdiv(vload(sq), c.bc2s), c.eps);
  vstore(p, vadd(pp, vdiv(vmul(c.nss, vload(m)), den)));
}

inline void prefetch(const float* a) {
  if (GOCKPT_PF_AHEAD) _mm_prefetch(reinterpret_cast<const char*>(a + GOCKPT_PF_AHEAD), _MM_HINT_T0);
}

template <bool L2, bool SMALL>
inline void phase1(const float* __restrict p, float* __restrict m, float* __restrict v,
                   const float* __restrict g, int64_t n, const AdamScalars& s) {
  const VScalars c(s);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    prefetch(g + i); prefetch(m + i); prefetch(v + i);
    moments_vec<L2, SMALL>(p + i, m + i, v + i, g + i, c);
  }
  if (i < n) phase1_scalar<L2, SMALL>(p + i, m + i, v + i, g + i, n - i, s);
}

template <bool DECAY>
inline void phase2(float* __restrict p, const float* __restrict m, const float* __restrict sq,
                   int64_t n, const AdamScalars& s) {
  const VScalars c(s);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) update_vec<DECAY>(p + i, m + i, sq + i, c);
  if (i < n) phase2_scalar<DECAY>(p + i, m + i, sq + i, n - i, s);
}

// Software pipeline step: phase 2 of one tile (p, m2, sq; n2 elements) interleaved, vector by
// vector, with phase 1 of the next tile (m, v, g; n1 elements), so the out-of-order core
// overlaps the divisions of one with the loads of the other and all four memory streams are
// in flight at once (torch's fused loop has the same property).
template <bool L2, bool DECAY, bool SMALL>
inline void phase21(float* __restrict p2, const float* __restrict m2, const float* __restrict sq,
                    int64_t n2, const float* __restrict p1, float* __restrict m1,
                    float* __restrict v1, const float* __restrict g1, int64_t n1,
                    const AdamScalars& s) {
  const VScalars c(s);
  const int64_t nb = n1 < n2 ? n1 : n2;
  int64_t i = 0;
  for (; i + kW <= nb; i += kW) {
    prefetch(g1 + i); prefetch(m1 + i); prefetch(v1 + i); prefetch(p2 + i);
    moments_vec<L2, SMALL>(p1 + i, m1 + i, v1 + i, g1 + i, c);  // phase 1 of the next tile
    update_vec<DECAY>(p2 + i, m2 + i, sq + i, c);              // phase 2 of this tile
  }
  if (i < n2) phase2<DECAY>(p2 + i, m2 + i, sq + i, n2 - i, s);
  if (i < n1) phase1<L2, SMALL>(p1 + i, m1 + i, v1 + i, g1 + i, n1 - i, s);
}
#else
template <bool L2, bool DECAY, bool SMALL>
inline void phase21(float* p2, const float* m2, const float* sq, int64_t n2, const float* p1,
                    float* m1, float* v1, const float* g1, int64_t n1, const AdamScalars& s) {
  phase2_scalar<DECAY>(p2, m2, sq, n2, s);
  phase1_scalar<L2, SMALL>(p1, m1, v1, g1, n1, s);
}
template <bool L2, bool SMALL>
inline void phase1(const float* p, float* m, float* v, const float* g, int64_t n,
                   const AdamScalars& s) {
  phase1_scalar<L2, SMALL>(p, m, v, g, n, s);
}
template <bool DECAY>
inline void phase2(float* p, const float* m, const float* sq, int64_t n, const AdamScalars& s) {
  phase2_scalar<DECAY>(p, m, sq, n, s);
}
#endif

// One pass over the range in tiles of `tile` elements, software-pipelined:
//   phase1(t0); sqrt(t0); { phase2(t_k) interleaved with phase1(t_k+1); sqrt(t_k+1) }...;
//   phase2(last)
// sqrt(v) of a tile goes to a stack buffer (vmsSqrt is an opaque library call, hence the
// split).  A tile's m, v and sqrt stay in L1 between the steps, so memory sees each array
// once (read p, m, v, g; write p, m, v), as in torch's fused kernel.
template <bool L2, bool DECAY, bool SMALL>
void single_t(float* p, float* m, float* v, const float* g, int64_t n, const AdamScalars& s,
              SqrtFn sqrt_fn, int64_t tile) {
  alignas(64) float sq[kMaxSqrtTile];
  int64_t k = n < tile ? n : tile;
  phase1<L2, SMALL>(p, m, v, g, k, s);
  sqrt_fn(v, sq, k);
  for (int64_t i = 0;;) {
    const int64_t j = i + k;  // next tile
    const int64_t kn = n - j < tile ? n - j : tile;
    if (kn <= 0) {
      phase2<DECAY>(p + i, m + i, sq, k, s);
      break;
    }
    phase21<L2, DECAY, SMALL>(p + i, m + i, sq, k, p + j, m + j, v + j, g + j, kn, s);
    sqrt_fn(v + j, sq, kn);
    i = j;
    k = kn;
  }
}

// torch's fused CPU kernel.  TAIL selects the scalar remainder loop's contraction
// (exp_avg_sq = fma(v, b2, (c2*g)*g)) instead of the vector body's (fma(c2*g, g, v*b2)).
// Plain loop: GCC vectorises it with the same lane arithmetic.
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

// ---------------------------------------------------------------- CUDA torch profiles
// Plain loops of IEEE operations and explicit fmas (CUDA without fast-math: no FTZ, IEEE div
// and sqrt); GCC vectorises them with the same lane arithmetic.  docs/arithmetics.md says
// which golden cases prove each line.

// for-loop (RECIP) and foreach: one CUDA elementwise kernel per torch op, in this order.
template <bool L2, bool DECAY, bool RECIP>
inline void cuda_pointwise_t(float* __restrict p, float* __restrict m, float* __restrict v,
                             const float* __restrict g, int64_t n, const CudaScalars& s) {
  const float wd = s.wd, decay = s.decay, w1 = s.w1, b2 = s.b2, c2 = s.c2;
  const float bc2s = s.bc2s, eps = s.eps, nss = s.nss;
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    float pi = p[i];
    if (L2) gi = __builtin_fmaf(wd, pi, gi);     // add(param, alpha=wd): fma(alpha, other, self)
    if (DECAY) pi = pi * decay;                   // param.mul_(1 - lr*wd)
    const float mi = m[i];
    const float mn = __builtin_fmaf(w1, gi - mi, mi);  // lerp, weight < 0.5: fma(w, end-self, self)
    m[i] = mn;
    const float vn = __builtin_fmaf(c2, gi * gi, v[i] * b2);  // mul_(b2); addcmul: fma(c, t1*t2, x)
    v[i] = vn;
    const float sq = __builtin_sqrtf(vn);
    // foreach divides by the scalar; the for-loop's div by a CPU scalar multiplies by 1/scalar
    const float den = (RECIP ? sq * bc2s : sq / bc2s) + eps;
    p[i] = __builtin_fmaf(nss, mn / den, pi);     // addcdiv: fma(value, t1/t2, self)
  }
}

// torch's fused CUDA kernel (torch >= 2.11).  Adam's L2 line `grad += param * wd` is compiled
// as mul + add (two roundings) in lane 0 of the kernel's 4-wide vector path and as one fma in
// lanes 1..3 (measured on an H100: the golden vectors of
// tests/replay/test_replay_arithmetic_golden.py; the lane is the element's index mod 4).
template <bool L2, bool DECAY, bool SCALED>
inline void cuda_fused_t(float* __restrict p, float* __restrict m, float* __restrict v,
                         const float* __restrict g, int64_t n, int64_t index,
                         const CudaScalars& s) {
  const float b1 = s.fb1, b2 = s.fb2, wd = s.wd, lrwd = s.lrwd, bc2s = s.fbc2s, eps = s.eps;
  const float step_size = s.step_size, scale = s.grad_scale;
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    float pi = p[i];
    if (SCALED) gi = gi / scale;
    if (L2) gi = ((index + i) & 3) == 0 ? gi + pi * wd : __builtin_fmaf(pi, wd, gi);
    if (DECAY) pi = __builtin_fmaf(-lrwd, pi, pi);  // param -= lr*wd*param
    const float mn = __builtin_fmaf(b1, m[i], __builtin_fmaf(-b1, gi, gi));
    m[i] = mn;
    const float gg = gi * gi;
    const float vn = __builtin_fmaf(b2, v[i], __builtin_fmaf(-b2, gg, gg));
    v[i] = vn;
    const float den = __builtin_sqrtf(vn) / bc2s + eps;
    p[i] = pi - (step_size * mn) / den;
  }
}

// DeepSpeed's CPU Adam (ops/csrc/includes/cpu_adam.h, Step_AVX / Step_1, DeepSpeed 0.19.8):
// the SIMD body's explicit fmas; the scalar remainder as GCC contracted it (the moments fuse
// the other product).  Measured bit for bit against the op
// (tests/replay/test_replay_arithmetic_deepspeed.py).
template <bool L2, bool DECAY, bool TAIL>
inline void ds_cpu_t(float* __restrict p, float* __restrict m, float* __restrict v,
                     const float* __restrict g, int64_t n, const DsScalars& s) {
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    float pi = p[i];
    if (L2) gi = __builtin_fmaf(pi, s.wd, gi);
    const float mn = TAIL ? __builtin_fmaf(m[i], s.b1, gi * s.c1)
                          : __builtin_fmaf(gi, s.c1, m[i] * s.b1);
    const float gg = gi * gi;
    const float vn = TAIL ? __builtin_fmaf(v[i], s.b2, gg * s.c2)
                          : __builtin_fmaf(gg, s.c2, v[i] * s.b2);
    m[i] = mn;
    v[i] = vn;
    const float u = mn / __builtin_fmaf(__builtin_sqrtf(vn), s.bc2, s.eps);
    if (DECAY) pi = __builtin_fmaf(pi, s.w_decay, pi);
    p[i] = __builtin_fmaf(u, s.step_size, pi);
  }
}

// DeepSpeed's CUDA FusedAdam (csrc/adam/multi_tensor_adam.cu, DeepSpeed 0.19.8, built with
// --use_fast_math), its moments only: `beta1 * m + (1 - beta1) * g` and
// `beta2 * v + (1 - beta2) * g * g` with float scalars, contracted by nvcc into
// fma(beta1, m, (1-beta1)*g) and fma(beta2, v, ((1-beta2)*g)*g); fast-math flushes subnormal
// operands and results of every float operation to zero (sign kept).  Measured bit for bit on
// the golden vectors of tests/replay/test_replay_arithmetic_golden.py (AdamW mode: its
// moments do not read the parameter; the parameter line divides and takes sqrt with
// approximate instructions and is not replayed).
inline float ftz(float x) {
  // below the smallest normal float in magnitude (a subnormal, or a zero): a zero of its sign
  return __builtin_fabsf(x) < 1.17549435e-38f ? __builtin_copysignf(0.0f, x) : x;
}

inline void ds_cuda_moments_t(float* __restrict m, float* __restrict v,
                              const float* __restrict g, int64_t n, const DsScalars& s) {
  const float b1 = s.b1, b2 = s.b2, c1 = s.c1, c2 = s.c2;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = ftz(g[i]);
    m[i] = ftz(__builtin_fmaf(b1, ftz(m[i]), ftz(c1 * gi)));
    v[i] = ftz(__builtin_fmaf(b2, ftz(v[i]), ftz(ftz(c2 * gi) * gi)));
  }
}

// ---------------------------------------------------------------- entry points
// Every kernel is a template over its flags (one instantiation per combination, the choice
// made once per call, outside the element loop).  with_flags(s, f, b...) calls
// f(Flag<L2>, Flag<DECAY>, Flag<b>...): L2 and DECAY from the scalars' weight decay (Adam's
// L2 term s.l2, AdamW's decoupled decay s.decay_on, never both), then the run-time bools b.
// A Flag converts to its bool in a constant expression: f passes its arguments on as
// template arguments.
template <bool B>
struct Flag {
  constexpr operator bool() const { return B; }
};

template <typename F>
inline void with_bools(F&& f) {
  f();
}

template <typename F, typename... Bools>
inline void with_bools(F&& f, bool b, Bools... rest) {
  if (b) with_bools([&](auto... more) { f(Flag<true>{}, more...); }, rest...);
  else with_bools([&](auto... more) { f(Flag<false>{}, more...); }, rest...);
}

template <typename S, typename F, typename... Bools>
inline void with_flags(const S& s, F&& f, Bools... b) {
  if (s.l2) with_bools([&](auto... x) { f(Flag<true>{}, Flag<false>{}, x...); }, b...);
  else if (s.decay_on) with_bools([&](auto... x) { f(Flag<false>{}, Flag<true>{}, x...); }, b...);
  else with_bools([&](auto... x) { f(Flag<false>{}, Flag<false>{}, x...); }, b...);
}

}  // namespace

void ds_cpu(float* p, float* m, float* v, const float* g, int64_t n, const DsScalars& s,
            bool tail) {
  with_flags(s, [&](auto L2, auto DECAY, auto TAIL) {
    ds_cpu_t<L2, DECAY, TAIL>(p, m, v, g, n, s);
  }, tail);
}

void ds_cuda_moments(float* m, float* v, const float* g, int64_t n, const DsScalars& s) {
  ds_cuda_moments_t(m, v, g, n, s);
}

void adam_single(float* p, float* m, float* v, const float* g, int64_t n, const AdamScalars& s,
                 SqrtFn sqrt_fn, int64_t tile) {
  if (tile < 1) tile = 1;
  if (tile > kMaxSqrtTile) tile = kMaxSqrtTile;
  with_flags(s, [&](auto L2, auto DECAY, auto SMALL) {
    single_t<L2, DECAY, SMALL>(p, m, v, g, n, s, sqrt_fn, tile);
  }, s.small);
}

void adam_fused(float* p, float* m, float* v, const float* g, int64_t n, const AdamScalars& s,
                bool tail) {
  with_flags(s, [&](auto L2, auto DECAY, auto SMALL, auto TAIL) {
    fused_t<L2, DECAY, SMALL, TAIL>(p, m, v, g, n, s);
  }, s.small, tail);
}

void cuda_pointwise(float* p, float* m, float* v, const float* g, int64_t n,
                    const CudaScalars& s) {
  with_flags(s, [&](auto L2, auto DECAY, auto RECIP) {
    cuda_pointwise_t<L2, DECAY, RECIP>(p, m, v, g, n, s);
  }, s.recip);
}

void cuda_fused(float* p, float* m, float* v, const float* g, int64_t n, int64_t index,
                const CudaScalars& s) {
  with_flags(s, [&](auto L2, auto DECAY, auto SCALED) {
    cuda_fused_t<L2, DECAY, SCALED>(p, m, v, g, n, index, s);
  }, s.scaled);
}

}  // namespace GOCKPT_ISA_NS
}  // namespace gockpt
