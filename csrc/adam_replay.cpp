// Scalar set-up, ISA dispatch, MKL VML sqrt resolution and threading of the Adam replay.
#include "adam_replay.h"

#include "cuda_math.h"

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace gockpt {

namespace {

// MKL VML: void vmsSqrt(MKL_INT n, const float* a, float* r, MKL_INT64 mode), LP64 MKL_INT.
using vms_sqrt_fn = void (*)(int, const float*, float*, long long);
// Mode flags as ATen's vml.h passes them: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
constexpr long long kVmlHA = 0x00000002LL;
constexpr long long kVmlFtzDazOff = 0x00140000LL;
constexpr long long kVmlErrIgnore = 0x00000100LL;
constexpr long long kVmlMode = kVmlHA | kVmlFtzDazOff | kVmlErrIgnore;
constexpr int kVmlChunk = 1 << 30;

vms_sqrt_fn g_vms_sqrt = nullptr;
// int MKL_Set_Num_Threads_Local(int) (C by-value API; the lower-case symbol is the Fortran
// by-reference one): keeps MKL from opening its own OpenMP team inside our
// worker threads (torch calls vmsSqrt from inside its parallel region, i.e. sequentially).
using mkl_threads_local_fn = int (*)(int);
mkl_threads_local_fn g_mkl_threads_local = nullptr;
std::string g_sqrt_source;
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
};

#define GOCKPT_ISA_FNS(NS) {NS::adam_single, NS::adam_fused, NS::cuda_pointwise, NS::cuda_fused}

IsaFns fns_for(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return GOCKPT_ISA_FNS(avx512);
    case Isa::Avx2: return GOCKPT_ISA_FNS(avx2);
    default: return GOCKPT_ISA_FNS(generic);
  }
}

void sqrt_tile(const float* in, float* out, int64_t n) {
  if (g_vms_sqrt) {
    while (n > 0) {
      const int k = static_cast<int>(std::min<int64_t>(n, kVmlChunk));
      g_vms_sqrt(k, in, out, kVmlMode);
      in += k;
      out += k;
      n -= k;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = std::sqrt(in[i]);
  }
}

// Elements of a single-tensor/foreach replay are processed in tiles small enough that two
// tiles' p, m, v, g and sqrt(v) stay in L1 (kernel_impl.h: single_t); 512 measured best
// (256 and 1024 within noise, 2048 slower; the vmsSqrt call costs ~30 ns).
int64_t g_tile = 512;

// Sequential MKL in the calling thread while it replays (MKL would otherwise be free to open
// an OpenMP team inside vmsSqrt; torch calls vmsSqrt from inside its own parallel region, i.e.
// sequentially).  Pool threads set it once for their lifetime; other threads get their own
// setting back afterwards (MKL_Set_Num_Threads_Local returns the previous local value).
thread_local bool t_pool_worker = false;
thread_local mkl_threads_local_fn t_mkl_local_set = nullptr;

struct MklSequential {
  mkl_threads_local_fn fn = nullptr;
  int prev = 0;
  MklSequential() {
    mkl_threads_local_fn f = g_vms_sqrt ? g_mkl_threads_local : nullptr;
    if (!f) return;
    if (t_pool_worker) {
      if (t_mkl_local_set != f) {
        f(1);
        t_mkl_local_set = f;
      }
      return;
    }
    fn = f;
    prev = fn(1);
  }
  ~MklSequential() {
    if (fn) fn(prev);
  }
};

// ------------------------------------------------------------------ persistent thread pool
// Workers live for the whole process (detached, parked on a condition variable after a short
// spin).  A job is a function every participant runs until the job's shared work counter is
// exhausted; the caller participates too.  Helpers that have not woken up by the time the
// caller has finished its part do not join (the caller never waits for a sleeping thread),
// so results and progress never depend on how many helpers actually ran.
class ThreadPool {
 public:
  using Fn = void (*)(void*);

  // Run fn(ctx) on the calling thread and on up to `helpers` pool threads.
  void run(int helpers, Fn fn, void* ctx) {
    std::unique_lock<std::mutex> submit(submit_, std::try_to_lock);
    if (helpers <= 0 || !submit.owns_lock()) {  // another caller owns the pool: run alone
      fn(ctx);
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (static_cast<int>(nthreads_) < helpers) {
        std::thread(&ThreadPool::worker, this).detach();
        ++nthreads_;
      }
      fn_ = fn;
      ctx_ = ctx;
      open_ = true;
      max_helpers_ = helpers;
      joined_ = 0;
      running_ = 0;
      ++gen_;
      gen_atomic_.store(gen_, std::memory_order_release);
    }
    cv_work_.notify_all();
    fn(ctx);
    std::unique_lock<std::mutex> lk(mu_);
    open_ = false;  // helpers waking from now on skip this job
    cv_done_.wait(lk, [&] { return running_ == 0; });
  }

 private:
#ifndef GOCKPT_POOL_SPIN
#define GOCKPT_POOL_SPIN 1000
#endif
  // Pause loops before parking (covers the gap between back-to-back calls).  On the shared
  // 2-core test machine 0..4000 were within noise for 1M-element calls; 40000 was worse.
  static constexpr int kSpin = GOCKPT_POOL_SPIN;

  void worker() {
    t_pool_worker = true;
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    seen = gen_;  // a job announced before this thread started is not for it
    for (;;) {
      if (gen_ == seen) {
        lk.unlock();
        for (int i = 0; i < kSpin && gen_atomic_.load(std::memory_order_acquire) == seen; ++i)
          cpu_relax();
        lk.lock();
        cv_work_.wait(lk, [&] { return gen_ != seen; });
      }
      seen = gen_;
      if (!open_ || joined_ >= max_helpers_) continue;
      ++joined_;
      ++running_;
      const Fn fn = fn_;
      void* const ctx = ctx_;
      lk.unlock();
      fn(ctx);
      lk.lock();
      if (--running_ == 0) cv_done_.notify_all();
    }
  }

  static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  std::mutex submit_;  // one job at a time
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::atomic<uint64_t> gen_atomic_{0};
  uint64_t gen_ = 0;
  size_t nthreads_ = 0;
  bool open_ = false;
  int max_helpers_ = 0, joined_ = 0, running_ = 0;
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
};

// Leaked on purpose: detached workers may still be parked in it at process exit.  After
// fork() the child gets a fresh pool (the parent's workers do not exist in the child).
std::atomic<ThreadPool*> g_pool{nullptr};

void pool_after_fork_child() { g_pool.store(nullptr, std::memory_order_relaxed); }

ThreadPool& pool() {
  ThreadPool* p = g_pool.load(std::memory_order_acquire);
  if (p) return *p;
  static std::once_flag atfork_once;
  std::call_once(atfork_once, [] { pthread_atfork(nullptr, nullptr, pool_after_fork_child); });
  ThreadPool* fresh = new ThreadPool();  // no threads yet: cheap to discard
  if (g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;
  return *p;
}

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

std::string init_vml_sqrt(const std::string& lib_path) {
  g_vms_sqrt = nullptr;
  g_sqrt_source.clear();
  void* sym = nullptr;
  if (!lib_path.empty()) {
    // Only attach to a library the process already loaded (torch's libtorch_cpu).
    void* h = dlopen(lib_path.c_str(), RTLD_NOLOAD | RTLD_LAZY);
    if (h) {
      sym = dlsym(h, "vmsSqrt");
      if (sym) g_sqrt_source = lib_path;
    }
  }
  if (!sym) {
    sym = dlsym(RTLD_DEFAULT, "vmsSqrt");
    if (sym) g_sqrt_source = "<global>";
  }
  g_vms_sqrt = reinterpret_cast<vms_sqrt_fn>(sym);
  g_mkl_threads_local = nullptr;
  if (sym) {
    Dl_info info;
    void* h = nullptr;
    if (dladdr(sym, &info) && info.dli_fname) h = dlopen(info.dli_fname, RTLD_NOLOAD | RTLD_LAZY);
    void* t = h ? dlsym(h, "MKL_Set_Num_Threads_Local") : nullptr;
    if (!t) t = dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local");
    g_mkl_threads_local = reinterpret_cast<mkl_threads_local_fn>(t);
  }
  return sqrt_backend();
}

void disable_vml_sqrt() {
  g_vms_sqrt = nullptr;
  g_sqrt_source.clear();
}

std::string sqrt_backend() { return g_vms_sqrt ? "mkl-vml" : "ieee"; }
std::string sqrt_source() {
  return g_sqrt_source + (g_mkl_threads_local ? " (+MKL_Set_Num_Threads_Local)" : "");
}

void torch_sqrt(const float* in, float* out, int64_t n) { sqrt_tile(in, out, n); }

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

void check_proven(const ReplayArgs& a) {
  if (a.grad_scale != 0.0 && a.impl != Impl::CudaFused)
    throw std::invalid_argument("grad_scale is only taken by the CUDA fused arithmetic");
  if ((a.impl == Impl::CudaForloop || a.impl == Impl::CudaForeach) &&
      !(std::fabs(static_cast<float>(1.0 - a.beta1)) < 0.5f))
    throw std::invalid_argument(
        "CUDA for-loop/foreach replay is proven for beta1 > 0.5 only (lerp weight 1-beta1 < 0.5)");
  if (a.impl == Impl::CudaFused && a.weight_decay != 0.0) {
    // The weight-decay line is the fused kernel's one contractible mul+add pair, and nvcc
    // contracted it per vector lane (lane 0 of Adam's L2 line is unfused).  Only the 4-wide
    // vector path, taken when numel % 4 == 0, is measured.
    if (a.full_numel % 4 != 0)
      throw std::invalid_argument(
          "CUDA fused Adam/AdamW with weight_decay != 0 is proven for numel % 4 == 0 only (the "
          "kernel's vector path; its weight-decay line rounds differently per vector lane)");
    if (!a.decoupled && a.grad_scale != 0.0)
      throw std::invalid_argument(
          "CUDA fused Adam with weight_decay != 0 and grad_scale is not proven (only AdamW)");
  }
}

namespace {

// The per-range body of one replay: the arithmetic of a.impl on [b, e) of the slice.
struct RangeKernel {
  float *p, *m, *v;
  const float* g;
  const ReplayArgs& a;
  IsaFns f;
  AdamScalars s;
  CudaScalars cs;
  int64_t tail_local;  // CPU fused: local index where the scalar-tail contraction starts
  int64_t tile;

  void operator()(int64_t b, int64_t e) const {
    if (b >= e) return;
    switch (a.impl) {
      case Impl::Fused: {
        const int64_t mid = std::max(b, std::min(e, tail_local));
        if (mid > b) f.fused(p + b, m + b, v + b, g + b, mid - b, s, false);
        if (e > mid) f.fused(p + mid, m + mid, v + mid, g + mid, e - mid, s, true);
        break;
      }
      case Impl::CudaForloop:
      case Impl::CudaForeach: f.cuda_pointwise(p + b, m + b, v + b, g + b, e - b, cs); break;
      case Impl::CudaFused: f.cuda_fused(p + b, m + b, v + b, g + b, e - b, a.offset + b, cs); break;
      default: f.single(p + b, m + b, v + b, g + b, e - b, s, sqrt_tile, tile);
    }
  }
};

// Fused CPU path (measured against torch 2.13, ATen AVX512 and AVX2): torch splits the tensor
// into 64-byte units across its threads, so only the last thread's range has a remainder
// after the Vectorized<float> loop, at the end of the whole parameter.  GCC vectorised that
// remainder loop 8 wide with the body's arithmetic, so exactly the last full_numel % 8
// elements run scalar code, whatever torch's thread count and vector width.
// Single-tensor / foreach: the scalar remainders of torch's elementwise ops compute the same
// roundings as their vector bodies, so no element depends on its position (torch_threads is
// accepted for API stability only).
int64_t fused_tail_local(const ReplayArgs& a, int64_t n) {
  if (a.impl != Impl::Fused) return n;
  constexpr int64_t kScalarTail = 8;
  const int64_t tail_global = a.full_numel - a.full_numel % kScalarTail;
  return std::max<int64_t>(0, std::min<int64_t>(n, tail_global - a.offset));
}

// Runs body over [0, n) on up to `threads` threads.  Dynamic chunks (64-byte aligned) handed
// out by an atomic counter, so a thread slowed by other load on the machine does not hold the
// whole step back.  Results do not depend on the chunking: every element's arithmetic depends
// on its global index only.
void run_parallel(const RangeKernel& body, int64_t n, int threads, bool uses_mkl) {
  constexpr int64_t kMinPerThread = 1 << 15;
  threads = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, n / kMinPerThread)));
  if (threads <= 1) {
    std::unique_ptr<MklSequential> mkl_seq(uses_mkl ? new MklSequential() : nullptr);
    body(0, n);
    return;
  }
  struct Job {
    const RangeKernel* body;
    int64_t n, chunk;
    bool uses_mkl;
    std::atomic<int64_t> next{0};
  } job{&body, n, std::max<int64_t>(kMinPerThread, (n / (threads * 8) + 15) / 16 * 16),
        uses_mkl};
  pool().run(threads - 1, [](void* ctx) {
    Job& j = *static_cast<Job*>(ctx);
    std::unique_ptr<MklSequential> mkl_seq(j.uses_mkl ? new MklSequential() : nullptr);
    for (;;) {
      const int64_t b = j.next.fetch_add(j.chunk, std::memory_order_relaxed);
      if (b >= j.n) break;
      (*j.body)(b, std::min(j.n, b + j.chunk));
    }
  }, &job);
}

}  // namespace

void adam_replay(float* p, float* m, float* v, const float* g, int64_t n, const ReplayArgs& a) {
  check_proven(a);
  if (n <= 0) return;
  const bool cuda = is_cuda(a.impl);
  const RangeKernel body{p, m, v, g, a, fns_for(resolved_isa()),
                         cuda ? AdamScalars{} : make_scalars(a),
                         cuda ? make_cuda_scalars(a) : CudaScalars{},
                         fused_tail_local(a, n), g_tile};
  int threads = a.threads > 0 ? a.threads : static_cast<int>(std::thread::hardware_concurrency());
  const bool uses_mkl = a.impl == Impl::Single || a.impl == Impl::Foreach;
  run_parallel(body, n, std::max(threads, 1), uses_mkl);
}

}  // namespace gockpt
