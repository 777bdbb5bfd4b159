// Host emulation of the CUDA device math that the replayed CUDA optimizers use, and the
// scalars of the CUDA replay profiles (docs/arithmetics.md).
#pragma once
#include <cstdint>

namespace gockpt {

// powf as CUDA 13.0's libdevice computes it (__nv_powf, non-FTZ: what torch's fused Adam kernel
// calls for its bias corrections).  It is not correctly rounded: powf(0.95f, 6.0f) is one ulp
// below the correctly rounded value, and the recorded fused AdamW run shows it.  The one
// hardware-approximate step, MUFU.RCP of the base's mantissa + 1, is modelled as the IEEE
// reciprocal; within +-1 ulp of it, 1 - powf changed for 7 of 8e7 random (beta, step) pairs.
float cuda_powf(float a, float b);

}  // namespace gockpt
