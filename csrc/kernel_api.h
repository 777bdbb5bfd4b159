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

// Scalars of the CUDA torch profiles (docs/arithmetics.md), rounded to float as CUDA rounds them.
struct CudaScalars {
  // forloop / foreach (Python-double scalars, cast to float by the CUDA kernels)
  float wd;        // f(weight_decay): Adam's grad.add(param, alpha=wd)
  float decay;     // f(1 - lr*wd): AdamW's param.mul_
  float w1;        // f(1 - beta1): lerp weight (only |w1| < 0.5 is replayed)
  float b2;        // f(beta2)
  float c2;        // f(1 - beta2): addcmul value
  float bc2s;      // foreach: f(bc2 ** 0.5) (divisor); forloop: f(1 / bc2 ** 0.5) (multiplier)
  float eps;       // f(eps)
  float nss;       // f(-lr / bc1): addcdiv value
  // fused (float hyperparameters, bias corrections on the device)
  float fb1, fb2;  // f(beta1), f(beta2)
  float lrwd;      // f(lr) * f(wd) in float: AdamW's param -= lr*wd*param
  float fbc2s;     // sqrtf(1 - powf(beta2, step))
  float step_size; // f(lr) / (1 - powf(beta1, step))
  float grad_scale;// GradScaler scale the fused kernel divides the gradient by (scaled only)
  bool l2;         // Adam with weight_decay != 0
  bool decay_on;   // AdamW with weight_decay != 0
  bool recip;      // forloop: sqrt(v) times the reciprocal of bc2 ** 0.5 (CUDA div by CPU scalar)
  bool scaled;     // fused with grad_scale
};

// Scalars of DeepSpeed's CPU Adam op (cpu_adam.h: Step_AVX and Step_1), all float as it has them.
struct DsScalars {
  float b1, b2;      // f(beta1), f(beta2)
  float c1, c2;      // 1 - b1, 1 - b2 (float)
  float bc2;         // 1 / sqrtf(1 - beta2^t) (1 without bias correction)
  float eps;         // f(eps)
  float step_size;   // -lr / (1 - beta1^t)
  float w_decay;     // -lr * wd: AdamW's param += w_decay * param
  float wd;          // f(weight_decay): Adam's grad += param * wd
  bool l2;           // Adam (adam_w_mode False) with weight_decay > 0
  bool decay_on;     // AdamW with weight_decay > 0
};

// sqrt as torch computes it (MKL vmsSqrt or IEEE), out-of-place, n <= kMaxSqrtTile.
using SqrtFn = void (*)(const float* in, float* out, int64_t n);

// Largest tile (elements) of the single-tensor/foreach kernel: its sqrt buffer lives on the
// stack of the calling thread (64 KiB).  ("Block" is the 4 MiB copy unit of training state.)
constexpr int64_t kMaxSqrtTile = 16384;

#define GOCKPT_DECLARE_ISA(NS)                                                              \
  namespace NS {                                                                            \
  /* single-tensor / foreach arithmetic; tiles of `tile` elements (<= kMaxSqrtTile):   */  \
  /* m, v of the tile, then sqrt_fn(v) into a stack buffer, then p, while all is in L1   */  \
  void adam_single(float* p, float* m, float* v, const float* g, int64_t n,                 \
                   const AdamScalars& s, SqrtFn sqrt_fn, int64_t tile);                     \
  /* torch's fused CPU kernel (IEEE sqrt); tail: scalar-remainder contraction          */   \
  void adam_fused(float* p, float* m, float* v, const float* g, int64_t n,                  \
                  const AdamScalars& s, bool tail);                                         \
  /* CUDA torch for-loop / foreach arithmetic (IEEE sqrt)                                */   \
  void cuda_pointwise(float* p, float* m, float* v, const float* g, int64_t n,              \
                      const CudaScalars& s);                                                \
  /* CUDA torch fused kernel; `index` = global index of p[0] (its 4-wide vector lane)    */   \
  void cuda_fused(float* p, float* m, float* v, const float* g, int64_t n, int64_t index,   \
                  const CudaScalars& s);                                                    \
  /* DeepSpeed's CPU Adam op: its SIMD body, or (tail) its scalar remainder's contraction */   \
  void ds_cpu(float* p, float* m, float* v, const float* g, int64_t n, const DsScalars& s,  \
              bool tail);                                                                   \
  /* DeepSpeed's CUDA FusedAdam, its moments only (fast-math: subnormals flushed)         */   \
  void ds_cuda_moments(float* m, float* v, const float* g, int64_t n, const DsScalars& s);  \
  }

GOCKPT_DECLARE_ISA(generic)
GOCKPT_DECLARE_ISA(avx2)
GOCKPT_DECLARE_ISA(avx512)

}  // namespace gockpt
