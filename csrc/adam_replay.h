#pragma once
#include <cstdint>
#include <vector>

#include "kernel_api.h"

namespace gockpt {

// CPU torch implementations (Single, Foreach, Fused) and the CUDA torch ones
// (docs/arithmetics.md).
// DsCpu{1,8,16}: DeepSpeed's CPU Adam op (cpu_adam.h) built scalar, AVX256 or AVX512 (its
// vector width decides which elements take the scalar remainder's contraction).
// DsCudaMoments: DeepSpeed's CUDA FusedAdam (multi_tensor_adam.cu), its moments only: the
// parameter is neither read nor written (its line is not reproducible: --use_fast_math).
enum class Impl { Single = 0, Foreach = 1, Fused = 2, CudaForloop = 3, CudaForeach = 4, CudaFused = 5,
                  DsCpu1 = 6, DsCpu8 = 7, DsCpu16 = 8, DsCudaMoments = 9 };
enum class Isa { Auto = 0, Generic = 1, Avx2 = 2, Avx512 = 3 };

struct ReplayArgs {
  Impl impl = Impl::Single;
  bool decoupled = true;
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0, step = 1.0;
  int64_t offset = 0;
  int64_t full_numel = 0;
  int threads = 0;        // replay threads, 0 = hardware concurrency
  double grad_scale = 0;  // CudaFused only: GradScaler scale the kernel divides by (0 = none)
  // DsCpu only: the op's float32 running products beta1^t, beta2^t (0: pow(beta, step), as
  // the op computes them when t jumps)
  double beta1_power = 0, beta2_power = 0;
  // The gradient as transported (adam_replay_batch only): bfloat16, the consumed float32
  // gradient being float(g) * float(grad_mul) -- one float rounding, as the training's own
  // unscale/clip multiply computed it (grad_mul 1: float(g) exactly).
  bool grad_bf16 = false;
  double grad_mul = 1.0;
};

bool is_cuda(Impl impl);
bool is_deepspeed(Impl impl);
DsScalars make_ds_scalars(const ReplayArgs& a);
AdamScalars make_scalars(const ReplayArgs& a);
CudaScalars make_cuda_scalars(const ReplayArgs& a);
// Throws std::invalid_argument for settings a profile has no proof for (docs/arithmetics.md).
void check_proven(const ReplayArgs& a);
void adam_replay(float* p, float* m, float* v, const float* g, int64_t n, const ReplayArgs& a);

// A batch of slices, struct of arrays of n entries (addresses as int64): segment i is the
// numel[i] floats at p[i] (param), m[i] (exp_avg), v[i] (exp_avg_sq), g[i] (grad: float32, or
// bfloat16 where its args entry says grad_bf16), elements
// [offset[i], offset[i] + numel[i]) of a parameter of full_numel[i] elements, replayed with
// entry arg[i] of the args table.
struct ReplaySegments {
  const int64_t *p, *m, *v, *g, *numel, *offset, *full_numel, *arg;
  int64_t n;
};

// One step on every segment, each bit-identical to adam_replay on it alone (table entries:
// offset, full_numel and threads unused).  Throws std::invalid_argument, naming the entry or
// the segment, before anything is written.
void adam_replay_batch(const ReplaySegments& segs, const std::vector<ReplayArgs>& table,
                       int threads);

void set_tile(int64_t tile);  // benchmarking aid: elements per sqrt tile
Isa resolved_isa();
void force_isa(Isa isa);
const char* isa_name(Isa isa);

}  // namespace gockpt
