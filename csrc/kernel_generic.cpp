// Portable build of the replay kernels and the digest (baseline x86-64 / any ISA).
#define GOCKPT_ISA_NS generic
#include "kernel_impl.h"
#include "digest_impl.h"
