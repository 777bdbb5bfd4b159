// Cutting batches of segments into pieces and tasks (parallel.h).
#include "parallel.h"

#include <algorithm>
#include <limits>
#include <thread>

namespace gockpt {

int threads_for(int64_t cost, int threads, int64_t min_per_thread) {
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  const int64_t useful = std::max<int64_t>(1, cost / std::max<int64_t>(1, min_per_thread));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, useful)));
}

BatchPlan plan_batch(const int64_t* size, int64_t n, int threads, int64_t seg_cost,
                     int64_t min_per_thread) {
  int64_t cost = 0;
  for (int64_t i = 0; i < n; ++i) cost += size[i] + seg_cost;
  BatchPlan plan;
  plan.threads = threads_for(cost, threads, min_per_thread);
  // About 8 tasks per thread: dynamic hand-out balances threads slowed by other load.
  const int64_t chunk =
      plan.threads <= 1
          ? std::numeric_limits<int64_t>::max()
          : std::max<int64_t>(min_per_thread, (cost / (plan.threads * 8) + 15) / 16 * 16);
  plan.pieces.reserve(static_cast<size_t>(n));
  plan.task_begin.push_back(0);
  int64_t task_cost = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t b = 0; b < size[i]; b += chunk) {
      const int64_t e = size[i] - b > chunk ? b + chunk : size[i];
      plan.pieces.push_back({i, b, e});
      task_cost += e - b + seg_cost;
      if (task_cost >= chunk) {
        plan.task_begin.push_back(static_cast<int64_t>(plan.pieces.size()));
        task_cost = 0;
      }
    }
  }
  if (plan.task_begin.back() != static_cast<int64_t>(plan.pieces.size()))
    plan.task_begin.push_back(static_cast<int64_t>(plan.pieces.size()));
  return plan;
}

}  // namespace gockpt
