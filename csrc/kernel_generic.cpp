// Portable build of the replay kernels (baseline x86-64 / any ISA).
#define GOCKPT_ISA_NS generic
#include "kernel_impl.h"
