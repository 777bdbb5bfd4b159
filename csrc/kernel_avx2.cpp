// AVX2+FMA build of the replay kernels; only called after a runtime CPU check.
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma")
#define GOCKPT_SIMD 256
#endif
#define GOCKPT_ISA_NS avx2
#include "kernel_impl.h"
