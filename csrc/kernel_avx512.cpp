// AVX-512 build of the replay kernels; only called after a runtime CPU check.
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512vl,avx2,fma,prefer-vector-width=512")
#define GOCKPT_SIMD 512
#endif
#define GOCKPT_ISA_NS avx512
#include "kernel_impl.h"
