// MKL VML's vmsSqrt and MKL_Set_Num_Threads_Local found with dlsym in the already-loaded
// libtorch_cpu (vml.h).
#include "vml.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>

namespace gockpt {

namespace {

// MKL VML: void vmsSqrt(MKL_INT n, const float* a, float* r, MKL_INT64 mode), LP64 MKL_INT.
using vms_sqrt_fn = void (*)(int, const float*, float*, long long);
// Mode flags as ATen's vml.h passes them: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
constexpr long long kVmlHA = 0x00000002LL;
constexpr long long kVmlFtzDazOff = 0x00140000LL;
constexpr long long kVmlErrIgnore = 0x00000100LL;
constexpr long long kVmlMode = kVmlHA | kVmlFtzDazOff | kVmlErrIgnore;
constexpr int kVmlChunk = 1 << 30;  // n is an int: longer inputs go in calls of this many

vms_sqrt_fn g_vms_sqrt = nullptr;
// int MKL_Set_Num_Threads_Local(int) (C by-value API; the lower-case symbol is the Fortran
// by-reference one); returns the thread's previous local setting.
using mkl_threads_local_fn = int (*)(int);
mkl_threads_local_fn g_mkl_threads_local = nullptr;
std::string g_sqrt_source;

// The MKL_Set_Num_Threads_Local this thread has already called with 1 for its whole life.
thread_local mkl_threads_local_fn t_mkl_local_set = nullptr;

}  // namespace

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
    // The thread control of the same MKL: the library vmsSqrt came from first.
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

void torch_sqrt(const float* in, float* out, int64_t n) {
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

MklSequential::MklSequential(bool for_thread_life) {
  const mkl_threads_local_fn f = g_vms_sqrt ? g_mkl_threads_local : nullptr;
  if (!f) return;
  if (for_thread_life) {
    if (t_mkl_local_set != f) {
      f(1);
      t_mkl_local_set = f;
    }
    return;
  }
  restore_ = f;
  prev_ = f(1);
}

MklSequential::~MklSequential() {
  if (restore_) restore_(prev_);
}

}  // namespace gockpt
