// libdevice __nv_powf (CUDA 13.0) on the host.  Read from the NVVM IR of libdevice.10.bc and
// checked against the SASS nvcc emits for sm_90 (no contraction beyond the explicit fmas below:
// the one plain mul/sub pair, `m1 - u`, stays unfused).  Compiled with -ffp-contract=off.
#include "cuda_math.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace gockpt {

namespace {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// MUFU.RCP (rcp.approx.ftz.f32): not specified bit-exactly; modelled as IEEE 1/x.  Its input is
// the base's reduced mantissa + 1, in [1.7, 2.5): never subnormal, so FTZ does not matter.
inline float rcp_approx(float x) { return 1.0f / x; }

// log2(|a|) as an unevaluated sum hi + lo (libdevice __internal_log2_ep).
void log2_ep(float a, float* hi_out, float* lo_out) {
  float ax = std::fabs(a), expo = 0.0f;
  if (ax < 0x1p-126f) {  // subnormal: scale into the normal range first
    ax *= 0x1p24f;
    expo = -24.0f;
  }
  // a = m * 2^e with m in [sqrt(1/2), sqrt(2))
  const uint32_t ia = float_to_bits(ax);
  const int32_t e = static_cast<int32_t>((ia - 0x3F3504F3u) & 0xFF800000u);
  const float m = bits_to_float(ia - static_cast<uint32_t>(e));
  const float ex = std::fma(static_cast<float>(e), 0x1p-23f, expo);
  // log(m) = 2 atanh(s), s = (m-1)/(m+1); u = 2s as a double-float u + ulo
  const float m1 = m - 1.0f;
  const float r = rcp_approx(m + 1.0f);
  const float u = (m1 + m1) * r;
  const float u2 = u * u;
  float d = m1 - u;
  d = d + d;
  const float ulo = r * std::fma(-u, m1, d);
  float q = std::fma(bits_to_float(0x3a2c32e4), u2, bits_to_float(0x3b52e7db));
  q = std::fma(q, u2, bits_to_float(0x3c93bb73));
  q = std::fma(q, u2, bits_to_float(0x3df6384f));
  q = q * u2;
  const float l2e = bits_to_float(0x3fb8aa3b), l2e_lo = bits_to_float(0x32a55e34);
  const float hi = std::fma(u, l2e, ex);
  float lo = std::fma(u, l2e, ex - hi);
  lo = std::fma(ulo, l2e, lo);
  lo = std::fma(u, l2e_lo, lo);
  lo = std::fma(q * 3.0f, ulo, lo);
  lo = std::fma(q, u, lo);
  const float s = hi + lo;  // renormalise
  *hi_out = s;
  *lo_out = lo - (s - hi);
}

// 2^(hi + lo) for the product b * log2(a) (libdevice __internal_powf_exp2 and its scaling).
float exp2_ep(float p, float plo) {
  const float rn = std::nearbyint(p);  // FRND: round half to even
  const float f = (p - rn) + plo;
  float y = std::fma(bits_to_float(0x391fcb8e), f, bits_to_float(0x3aaf85ed));
  y = std::fma(y, f, bits_to_float(0x3c1d9856));
  y = std::fma(y, f, bits_to_float(0x3d6357bb));
  y = std::fma(y, f, bits_to_float(0x3e75fdec));
  y = std::fma(y, f, bits_to_float(0x3f317218));
  y = std::fma(y, f, 1.0f);
  // y * 2^rn in two multiplications, so that a subnormal result is rounded once
  const int32_t ir = static_cast<int32_t>(rn);
  const uint32_t off = rn > 0.0f ? 0u : 0x83000000u;
  y = y * bits_to_float(0x7f000000u + off);
  y = y * bits_to_float((static_cast<uint32_t>(ir) << 23) - off);
  if (std::fabs(p) > 152.0f) y = p < 0.0f ? 0.0f : std::numeric_limits<float>::infinity();
  return y;
}

float powf_core(float a, float b) {
  float s, slo;
  log2_ep(a, &s, &slo);
  const float p = s * b;
  float plo = std::fma(s, b, -p);
  plo = std::fma(slo, b, plo);
  return exp2_ep(p, plo);
}

}  // namespace

float cuda_powf(float a, float b) {
  // b odd integer?  (b - 2*trunc(b/2) is exact)
  const bool b_odd = std::fabs(b - 2.0f * std::trunc(0.5f * b)) == 1.0f;
  if (a == 1.0f || b == 0.0f) return 1.0f;
  if (std::isnan(a) || std::isnan(b)) return a + b;
  if (a == 0.0f || std::isinf(a)) {  // 0 or inf, with the sign of a for odd b
    uint32_t t = float_to_bits(a + a);
    if (b < 0.0f) t ^= 0x7F800000u;
    if (!b_odd) t &= 0x7FFFFFFFu;
    return bits_to_float(t);
  }
  if (a == -1.0f && std::isinf(b)) return 1.0f;
  float t = powf_core(a, b);
  if (a < 0.0f) {
    if (b_odd) t = -t;
    if (std::floor(b) != b) t = bits_to_float(0x7FFFFFFFu);
  }
  return t;
}

}  // namespace gockpt
