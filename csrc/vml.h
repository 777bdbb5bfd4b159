// sqrt as torch computes it on CPU float32: MKL VML's vmsSqrt, resolved at run time from the
// libtorch_cpu the process has already loaded (gockpt._C links neither torch nor MKL), called
// with the mode ATen passes; IEEE sqrt where it cannot be resolved (docs/arithmetics.md).  And
// keeping MKL sequential in the replay's threads, as torch calls vmsSqrt from inside its own
// parallel region.
#pragma once
#include <cstdint>
#include <string>

namespace gockpt {

// Resolves vmsSqrt from lib_path if the process has loaded that library (never loads it), else
// from the process's global symbols; returns sqrt_backend().
std::string init_vml_sqrt(const std::string& lib_path);
void disable_vml_sqrt();
std::string sqrt_backend();  // "mkl-vml" or "ieee"
std::string sqrt_source();   // where vmsSqrt was found (empty: nowhere)

// sqrt of n floats, out-of-place, as torch computes it (vmsSqrt if resolved, else IEEE); the
// SqrtFn of the single-tensor/foreach kernels (kernel_api.h).
void torch_sqrt(const float* in, float* out, int64_t n);

// While alive, MKL stays single-threaded in the thread that made it (without it MKL would be
// free to open an OpenMP team inside vmsSqrt).  A no-op unless vmsSqrt and MKL's
// MKL_Set_Num_Threads_Local were resolved.  for_thread_life: the thread does nothing but such
// work for its whole life (a pool worker): the setting is made once per thread and kept;
// otherwise the thread's own setting comes back at destruction.
class MklSequential {
 public:
  explicit MklSequential(bool for_thread_life);
  ~MklSequential();
  MklSequential(const MklSequential&) = delete;
  MklSequential& operator=(const MklSequential&) = delete;

 private:
  int (*restore_)(int) = nullptr;  // MKL_Set_Num_Threads_Local, when there is one to restore
  int prev_ = 0;
};

}  // namespace gockpt
