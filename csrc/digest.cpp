// The digest (digest.h) assembled from the per-ISA sums, and its batched, parallel form.
#include "digest.h"

#include <vector>

#include "adam_replay.h"
#include "parallel.h"

namespace gockpt {

namespace {

using SumsFn = void (*)(const uint32_t*, int64_t, uint64_t*);

SumsFn sums_fn() {
  switch (resolved_isa()) {  // the replay's ISA choice (set_isa forces both)
    case Isa::Avx512: return avx512::digest_sums;
    case Isa::Avx2: return avx2::digest_sums;
    default: return generic::digest_sums;
  }
}

// From local sums (even, odd, weighted = sum w_i * i) to the digest at global indices first + i:
// with T = sum w_i * idx_i = first * (even + odd) + weighted,
//   d1 = sum w_i * (2 idx_i + 1) = 2T + (even + odd)
//   d2 = sum w_i * (idx_i * K | 1) = K*T + sum of w_i over even idx_i,
// since idx*K | 1 = idx*K + 1 exactly when idx*K is even, i.e. idx is even (K is odd).
Digest assemble(const uint64_t sums[3], int64_t first) {
  const uint64_t f = static_cast<uint64_t>(first), total = sums[0] + sums[1];
  const uint64_t t = f * total + sums[2];
  const uint64_t even_global = (f & 1) ? sums[1] : sums[0];
  return {2 * t + total, kDigestMultiplier * t + even_global};
}

Digest digest_with(SumsFn fn, const uint32_t* w, int64_t n, int64_t first) {
  if (n <= 0) return {};
  uint64_t sums[3];
  fn(w, n, sums);
  return assemble(sums, first);
}

// Words worth waking one more thread for, and the cost of one segment in words.
constexpr int64_t kMinWordsPerThread = 1 << 18;
constexpr int64_t kSegCostWords = 64;

struct BatchJob {
  SumsFn fn;
  const int64_t *src, *first;
  const BatchPlan& plan;
  std::vector<Digest>& parts;  // one per piece
};

void run_batch_task(void* ctx, int64_t t) {
  const BatchJob& j = *static_cast<const BatchJob*>(ctx);
  for (int64_t q = j.plan.task_begin[t]; q < j.plan.task_begin[t + 1]; ++q) {
    const Piece& pc = j.plan.pieces[q];
    const auto* w = reinterpret_cast<const uint32_t*>(static_cast<uintptr_t>(j.src[pc.seg]));
    j.parts[q] = digest_with(j.fn, w + pc.b, pc.e - pc.b, j.first[pc.seg] + pc.b);
  }
}

}  // namespace

Digest digest(const uint32_t* w, int64_t n, int64_t first) {
  return digest_with(sums_fn(), w, n, first);
}

void digest_batch(const int64_t* src, const int64_t* nwords, const int64_t* first, int64_t n,
                  uint64_t* out, int threads) {
  const BatchPlan plan = plan_batch(nwords, n, threads, kSegCostWords, kMinWordsPerThread);
  std::vector<Digest> parts(plan.pieces.size());
  BatchJob job{sums_fn(), src, first, plan, parts};
  parallel_tasks(plan.tasks(), plan.threads, false, run_batch_task, &job);
  // A segment's digest is the sum of its pieces' (each computed at its own first index).
  std::vector<Digest> total(static_cast<size_t>(n));
  for (size_t q = 0; q < parts.size(); ++q) total[plan.pieces[q].seg] += parts[q];
  for (int64_t i = 0; i < n; ++i) {
    out[2 * i] = total[i].d1;
    out[2 * i + 1] = total[i].d2;
  }
}

}  // namespace gockpt
