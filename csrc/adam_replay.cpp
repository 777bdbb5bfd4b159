// Scalar set-up, ISA dispatch, proof checks and the batched driver of the Adam replay: every
// args entry prepared once per call, segments cut into tasks (parallel.h), each piece run by
// the kernels of its entry (kernel_api.h).
#include "adam_replay.h"

#include "cuda_math.h"
#include "parallel.h"
#include "vml.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace gockpt {

namespace {

Isa g_isa_forced = Isa::Auto;

Isa detect_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
#endif
  return Isa::Generic;
}

struct IsaFns {
  void (*single)(float*, float*, float*, const float*, int64_t, const AdamScalars&, SqrtFn,
                 int64_t);
  void (*fused)(float*, float*, float*, const float*, int64_t, const AdamScalars&, bool);
  void (*cuda_pointwise)(float*, float*, float*, const float*, int64_t, const CudaScalars&);
  void (*cuda_fused)(float*, float*, float*, const float*, int64_t, int64_t,
                     const CudaScalars&);
  void (*ds_cpu)(float*, float*, float*, const float*, int64_t, const DsScalars&, bool);
  void (*ds_cuda_moments)(float*, float*, const float*, int64_t, const DsScalars&);
};

#define GOCKPT_ISA_FNS(NS) \
  {NS::adam_single, NS::adam_fused, NS::cuda_pointwise, NS::cuda_fused, NS::ds_cpu, \
   NS::ds_cuda_moments}

IsaFns fns_for(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return GOCKPT_ISA_FNS(avx512);
    case Isa::Avx2: return GOCKPT_ISA_FNS(avx2);
    default: return GOCKPT_ISA_FNS(generic);
  }
}

// Elements of a single-tensor/foreach replay are processed in tiles small enough that two
// tiles' p, m, v, g and sqrt(v) stay in L1 (kernel_impl.h: single_t).  512 measured best on
// the 2-core AVX-512 test machine: 256 and 1024 within noise, 2048 slower; each vmsSqrt call
// costs ~30 ns (re-measure: experiments/bench_replay.py's gockpt_replay rows, with another
// value here or set by _C._set_tile).
int64_t g_tile = 512;

}  // namespace

void set_tile(int64_t tile) {
  g_tile = std::max<int64_t>(16, std::min<int64_t>(kMaxSqrtTile, tile));
}

Isa resolved_isa() { return g_isa_forced == Isa::Auto ? detect_isa() : g_isa_forced; }

void force_isa(Isa isa) {
  if (isa == Isa::Avx512 || isa == Isa::Avx2) {
    Isa hw = detect_isa();
    if (hw == Isa::Generic || (isa == Isa::Avx512 && hw != Isa::Avx512))
      throw std::invalid_argument("ISA not supported by this CPU");
  }
  g_isa_forced = isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    case Isa::Generic: return "generic";
    default: return "auto";
  }
}

AdamScalars make_scalars(const ReplayArgs& a) {
  // Python side of torch.optim.Adam(W) (single/foreach), in double.
  const double bc1 = 1.0 - std::pow(a.beta1, a.step);
  const double bc2 = 1.0 - std::pow(a.beta2, a.step);
  const double step_size = a.lr / bc1;
  // single/foreach: bias_correction2 ** 0.5 (Python float pow); fused: std::sqrt.
  const double bc2s = a.impl == Impl::Fused ? std::sqrt(bc2) : std::pow(bc2, 0.5);
  AdamScalars s;
  s.wd = static_cast<float>(a.weight_decay);
  s.decay = static_cast<float>(1.0 - a.lr * a.weight_decay);
  s.w1 = static_cast<float>(1.0 - a.beta1);
  s.w1m1 = s.w1 - 1.0f;
  s.b2 = static_cast<float>(a.beta2);
  s.c2 = static_cast<float>(1.0 - a.beta2);
  s.bc2s = static_cast<float>(bc2s);
  s.eps = static_cast<float>(a.eps);
  s.nss = static_cast<float>(-step_size);
  s.l2 = !a.decoupled && a.weight_decay != 0.0;
  s.decay_on = a.decoupled && a.weight_decay != 0.0;
  s.small = std::fabs(s.w1) < 0.5f;
  return s;
}

bool is_deepspeed(Impl impl) {
  return impl == Impl::DsCpu1 || impl == Impl::DsCpu8 || impl == Impl::DsCpu16 ||
         impl == Impl::DsCudaMoments;
}

DsScalars make_ds_scalars(const ReplayArgs& a) {
  // The op takes float hyperparameters; IncrementStep keeps beta^t in float (running product,
  // or std::pow(float, size_t) -- a double pow -- rounded to float on a jump of t).
  const float lr = static_cast<float>(a.lr), b1 = static_cast<float>(a.beta1);
  const float b2 = static_cast<float>(a.beta2), wd = static_cast<float>(a.weight_decay);
  const auto steps = static_cast<double>(static_cast<uint64_t>(a.step));
  const float b1t = a.beta1_power > 0 ? static_cast<float>(a.beta1_power)
                                      : static_cast<float>(std::pow(static_cast<double>(b1), steps));
  const float b2t = a.beta2_power > 0 ? static_cast<float>(a.beta2_power)
                                      : static_cast<float>(std::pow(static_cast<double>(b2), steps));
  DsScalars s{};
  s.b1 = b1;
  s.b2 = b2;
  s.c1 = 1.0f - b1;
  s.c2 = 1.0f - b2;
  s.bc2 = 1.0f / std::sqrt(1.0f - b2t);
  s.eps = static_cast<float>(a.eps);
  s.step_size = -lr / (1.0f - b1t);
  s.w_decay = -lr * wd;
  s.wd = wd;
  s.l2 = !a.decoupled && wd > 0.0f;
  s.decay_on = a.decoupled && wd > 0.0f;
  return s;
}

bool is_cuda(Impl impl) {
  return impl == Impl::CudaForloop || impl == Impl::CudaForeach || impl == Impl::CudaFused;
}

CudaScalars make_cuda_scalars(const ReplayArgs& a) {
  CudaScalars s{};
  // forloop / foreach: torch.optim.adam's Python scalars (double), cast to float by the kernels
  const double bc1 = 1.0 - std::pow(a.beta1, a.step);
  const double bc2 = 1.0 - std::pow(a.beta2, a.step);
  const double bc2s = std::pow(bc2, 0.5);
  s.wd = static_cast<float>(a.weight_decay);
  s.decay = static_cast<float>(1.0 - a.lr * a.weight_decay);
  s.w1 = static_cast<float>(1.0 - a.beta1);
  s.b2 = static_cast<float>(a.beta2);
  s.c2 = static_cast<float>(1.0 - a.beta2);
  s.recip = a.impl == Impl::CudaForloop;
  // div_true_kernel_cuda with a CPU scalar divisor multiplies by its reciprocal, taken in double
  s.bc2s = static_cast<float>(s.recip ? 1.0 / bc2s : bc2s);
  s.eps = static_cast<float>(a.eps);
  s.nss = static_cast<float>(-(a.lr / bc1));  // foreach's (lr / bc1) * -1 is the same double
  // fused: hyperparameters cast to float once; bias corrections in float on the device
  const float lr = static_cast<float>(a.lr), step = static_cast<float>(a.step);
  s.fb1 = static_cast<float>(a.beta1);
  s.fb2 = static_cast<float>(a.beta2);
  s.lrwd = lr * s.wd;
  s.fbc2s = std::sqrt(1.0f - cuda_powf(s.fb2, step));
  s.step_size = lr / (1.0f - cuda_powf(s.fb1, step));
  s.scaled = a.grad_scale != 0.0;
  s.grad_scale = static_cast<float>(a.grad_scale);
  s.l2 = !a.decoupled && a.weight_decay != 0.0;
  s.decay_on = a.decoupled && a.weight_decay != 0.0;
  return s;
}

namespace {

// Why settings of one args entry are not proven (nullptr: proven), numel aside.
const char* unproven_settings(const ReplayArgs& a) {
  if (a.grad_scale != 0.0 && a.impl != Impl::CudaFused)
    return "grad_scale is only taken by the CUDA fused arithmetic";
  if ((a.impl == Impl::CudaForloop || a.impl == Impl::CudaForeach) &&
      !(std::fabs(static_cast<float>(1.0 - a.beta1)) < 0.5f))
    return "CUDA for-loop/foreach replay is proven for beta1 > 0.5 only (lerp weight 1-beta1 < 0.5)";
  if (a.impl == Impl::CudaFused && a.weight_decay != 0.0 && !a.decoupled && a.grad_scale != 0.0)
    return "CUDA fused Adam with weight_decay != 0 and grad_scale is not proven (only AdamW)";
  if (a.impl == Impl::DsCudaMoments && !a.decoupled && a.weight_decay != 0.0)
    return "DeepSpeed's CUDA FusedAdam with adam_w_mode=False and weight_decay != 0 adds the "
           "parameter to the gradient, and its parameter line is not reproducible: its "
           "moments cannot be replayed past one step";
  return nullptr;
}

// Why a parameter of full_numel elements is not proven under settings a (nullptr: proven).
const char* unproven_numel(const ReplayArgs& a, int64_t full_numel) {
  // The weight-decay line is the CUDA fused kernel's one contractible mul+add pair, and nvcc
  // contracted it per vector lane (lane 0 of Adam's L2 line is unfused).  Only the 4-wide
  // vector path, taken when numel % 4 == 0, is measured (the golden vectors of
  // tests/replay/test_replay_arithmetic_golden.py).
  if (a.impl == Impl::CudaFused && a.weight_decay != 0.0 && full_numel % 4 != 0)
    return "CUDA fused Adam/AdamW with weight_decay != 0 is proven for numel % 4 == 0 only (the "
           "kernel's vector path; its weight-decay line rounds differently per vector lane)";
  return nullptr;
}

}  // namespace

void check_proven(const ReplayArgs& a) {
  const char* why = unproven_numel(a, a.full_numel);
  if (!why) why = unproven_settings(a);
  if (why) throw std::invalid_argument(why);
}

namespace {

// One args entry ready to run: its kernels and scalars, computed once per call.
struct Prepared {
  Impl impl;
  IsaFns f;
  AdamScalars s;
  CudaScalars cs;
  DsScalars ds;
  int64_t tile;
  bool grad_bf16;  // the gradient is bfloat16, consumed as float(g) * grad_mul
  float grad_mul;
};

Prepared prepare(const ReplayArgs& a) {
  const bool cuda = is_cuda(a.impl), ds = is_deepspeed(a.impl);
  return {a.impl, fns_for(resolved_isa()), cuda || ds ? AdamScalars{} : make_scalars(a),
          cuda ? make_cuda_scalars(a) : CudaScalars{}, ds ? make_ds_scalars(a) : DsScalars{},
          g_tile, a.grad_bf16, static_cast<float>(a.grad_mul)};
}

bool uses_mkl(Impl impl) { return impl == Impl::Single || impl == Impl::Foreach; }

// Fused CPU path (measured against torch 2.13, ATen AVX512 and AVX2, by
// tests/replay/test_replay_kernels.py): torch splits the tensor into 64-byte units across its
// threads, so only the last thread's range has a remainder after the Vectorized<float> loop,
// at the end of the whole parameter.  GCC vectorised that remainder loop 8 wide with the
// body's arithmetic, so exactly the last full_numel % 8 elements run scalar code, whatever
// torch's thread count and vector width.
// Single-tensor / foreach: the scalar remainders of torch's elementwise ops compute the same
// roundings as their vector bodies, so no element depends on its position or on torch's
// thread count.
// Returns the local index (in a slice of n elements at `offset`) where the scalar tail starts.
// DeepSpeed's CPU op: its SIMD loops cover the largest multiple of the vector width (in
// elements) of the tensor it is called on; the rest runs its scalar remainder.
int64_t fused_tail_local(Impl impl, int64_t offset, int64_t full_numel, int64_t n) {
  int64_t width;
  switch (impl) {
    case Impl::Fused: width = 8; break;
    case Impl::DsCpu1: width = 1; break;  // no SIMD: every element is the "remainder"
    case Impl::DsCpu8: width = 8; break;
    case Impl::DsCpu16: width = 16; break;
    default: return n;
  }
  const int64_t tail_global = impl == Impl::DsCpu1 ? 0 : full_numel - full_numel % width;
  return std::max<int64_t>(0, std::min<int64_t>(n, tail_global - offset));
}

// The per-range body of one replay: the arithmetic of k.impl on [b, e) of a slice whose
// element 0 has global index `offset`.
struct RangeKernel {
  float *p, *m, *v;
  const float* g;
  const Prepared& k;
  int64_t offset;
  int64_t tail_local;  // CPU fused: local index where the scalar-tail contraction starts

  void operator()(int64_t b, int64_t e) const {
    if (b >= e) return;
    switch (k.impl) {
      case Impl::Fused: split_at_tail(k.f.fused, k.s, b, e); break;
      case Impl::DsCpu1:
      case Impl::DsCpu8:
      case Impl::DsCpu16: split_at_tail(k.f.ds_cpu, k.ds, b, e); break;
      case Impl::CudaForloop:
      case Impl::CudaForeach: k.f.cuda_pointwise(p + b, m + b, v + b, g + b, e - b, k.cs); break;
      case Impl::CudaFused:
        k.f.cuda_fused(p + b, m + b, v + b, g + b, e - b, offset + b, k.cs);
        break;
      case Impl::DsCudaMoments: k.f.ds_cuda_moments(m + b, v + b, g + b, e - b, k.ds); break;
      default: k.f.single(p + b, m + b, v + b, g + b, e - b, k.s, torch_sqrt, k.tile);
    }
  }

  // A kernel with a scalar-tail variant (fn(..., tail)) on [b, e): the body's arithmetic before
  // tail_local, the tail's from there on.
  template <typename S>
  void split_at_tail(void (*fn)(float*, float*, float*, const float*, int64_t, const S&, bool),
                     const S& s, int64_t b, int64_t e) const {
    const int64_t mid = std::max(b, std::min(e, tail_local));
    if (mid > b) fn(p + b, m + b, v + b, g + b, mid - b, s, false);
    if (e > mid) fn(p + mid, m + mid, v + mid, g + mid, e - mid, s, true);
  }
};

// Per segment work is counted as this many elements when cutting a batch (a tiny segment costs
// about as much as streaming 64 elements: kernel entry, one sqrt call; an estimate that no
// bench isolates).
constexpr int64_t kSegCost = 64;
// Elements worth waking one more thread for (a pool hand-off costs a few microseconds; the
// effect shows in experiments/bench_replay.py's _calls1M rows at 2 threads).
constexpr int64_t kMinPerThread = 1 << 15;

template <typename T>
T* addr(int64_t a) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(a));
}

// Everything adam_replay_batch throws for, checked before anything is written.
void check_segments(const ReplaySegments& s, const std::vector<ReplayArgs>& table) {
  const int64_t na = static_cast<int64_t>(table.size());
  auto fail = [](int64_t i, const std::string& why) {
    throw std::invalid_argument("segment " + std::to_string(i) + why);
  };
  for (int64_t i = 0; i < s.n; ++i) {
    if (s.arg[i] < 0 || s.arg[i] >= na)
      fail(i, ": args entry " + std::to_string(s.arg[i]) + " out of range [0, " +
                  std::to_string(na) + ")");
    if (s.numel[i] < 0 || s.offset[i] < 0 || s.offset[i] > s.full_numel[i] - s.numel[i])
      fail(i, ": slice [offset, offset+numel) must lie inside [0, full_numel)");
    if (const char* why = unproven_numel(table[s.arg[i]], s.full_numel[i]))
      fail(i, " (args entry " + std::to_string(s.arg[i]) + "): " + why);
  }
}

struct BatchJob {
  const ReplaySegments& s;
  const std::vector<Prepared>& prep;
  const BatchPlan& plan;
};

// Elements of a bfloat16 gradient decoded at a time (on the stack, L1-sized).
constexpr int64_t kDecodeChunk = 2048;

// The consumed float32 gradient of a bfloat16 transport: float(g) * mul, one rounding.
void decode_bf16(const uint16_t* g, float* out, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(g[i]) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    out[i] = x * mul;
  }
}

// Piece [b, e) of segment i with a bfloat16 gradient: decoded chunk by chunk, each chunk run
// as a slice of its own (every element's arithmetic depends on its global index only).
void run_bf16_piece(const ReplaySegments& s, const Prepared& k, int64_t i, int64_t b,
                    int64_t e) {
  alignas(64) float buf[kDecodeChunk];
  float *p = addr<float>(s.p[i]), *m = addr<float>(s.m[i]), *v = addr<float>(s.v[i]);
  const uint16_t* g = addr<const uint16_t>(s.g[i]);
  for (int64_t c = b; c < e; c += kDecodeChunk) {
    const int64_t n = std::min(e, c + kDecodeChunk) - c;
    decode_bf16(g + c, buf, n, k.grad_mul);
    const int64_t at = s.offset[i] + c;
    const RangeKernel body{p + c, m + c, v + c, buf, k, at,
                           fused_tail_local(k.impl, at, s.full_numel[i], s.numel[i] - c)};
    body(0, n);
  }
}

void run_batch_task(void* ctx, int64_t t) {
  const BatchJob& j = *static_cast<const BatchJob*>(ctx);
  const ReplaySegments& s = j.s;
  for (int64_t q = j.plan.task_begin[t]; q < j.plan.task_begin[t + 1]; ++q) {
    const Piece& pc = j.plan.pieces[q];
    const int64_t i = pc.seg;
    const Prepared& k = j.prep[s.arg[i]];
    if (k.grad_bf16) {
      run_bf16_piece(s, k, i, pc.b, pc.e);
      continue;
    }
    const RangeKernel body{addr<float>(s.p[i]), addr<float>(s.m[i]), addr<float>(s.v[i]),
                           addr<const float>(s.g[i]), k, s.offset[i],
                           fused_tail_local(k.impl, s.offset[i], s.full_numel[i], s.numel[i])};
    body(pc.b, pc.e);
  }
}

}  // namespace

void adam_replay_batch(const ReplaySegments& segs, const std::vector<ReplayArgs>& table,
                       int threads) {
  std::vector<Prepared> prep;
  prep.reserve(table.size());
  bool mkl = false;
  for (size_t k = 0; k < table.size(); ++k) {
    if (const char* why = unproven_settings(table[k]))
      throw std::invalid_argument("args entry " + std::to_string(k) + ": " + why);
    prep.push_back(prepare(table[k]));
    mkl = mkl || uses_mkl(table[k].impl);
  }
  check_segments(segs, table);
  // Results never depend on the plan: every element's arithmetic depends on its args entry and
  // global index only.
  const BatchPlan plan = plan_batch(segs.numel, segs.n, threads, kSegCost, kMinPerThread);
  BatchJob job{segs, prep, plan};
  parallel_tasks(plan.tasks(), plan.threads, mkl, run_batch_task, &job);
}

void adam_replay(float* p, float* m, float* v, const float* g, int64_t n, const ReplayArgs& a) {
  check_proven(a);
  if (n <= 0) return;
  const int64_t addrs[4] = {static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)),
                            static_cast<int64_t>(reinterpret_cast<uintptr_t>(m)),
                            static_cast<int64_t>(reinterpret_cast<uintptr_t>(v)),
                            static_cast<int64_t>(reinterpret_cast<uintptr_t>(g))};
  const int64_t arg = 0;
  const ReplaySegments one{&addrs[0], &addrs[1], &addrs[2], &addrs[3], &n, &a.offset,
                           &a.full_numel, &arg, 1};
  adam_replay_batch(one, {a}, a.threads);
}

}  // namespace gockpt
