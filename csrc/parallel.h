// Batches of segments on a persistent thread pool: cutting a batch into pieces and tasks
// (plan_batch) and running the tasks (parallel_tasks).  Used by the batched replay
// (adam_replay.cpp).
#pragma once
#include <cstdint>
#include <vector>

namespace gockpt {

// Runs body(ctx, t) exactly once for every task t in [0, ntasks), on the calling thread and up
// to threads - 1 pool threads; tasks are handed out by an atomic counter, so a thread slowed by
// other load does not hold the rest back.  mkl_sequential: each participant keeps MKL
// single-threaded while it runs tasks (MklSequential, vml.h: the replay's sqrt).
void parallel_tasks(int64_t ntasks, int threads, bool mkl_sequential,
                    void (*body)(void* ctx, int64_t task), void* ctx);

// Threads to use: `threads` (<= 0: the hardware concurrency), at most one per min_per_thread
// units of cost, at least 1.
int threads_for(int64_t cost, int threads, int64_t min_per_thread);

// Units [b, e) of segment seg.
struct Piece {
  int64_t seg, b, e;
};

// A batch cut for parallel_tasks: segments longer than a chunk are cut into chunks (multiples
// of 16 units), and consecutive pieces are grouped into tasks of about a chunk of cost each (a
// piece costs its units plus seg_cost), so thousands of tiny segments cost one task hand-out
// per chunk, not one each.  Empty segments have no piece.  One thread: one task, no cuts.
struct BatchPlan {
  std::vector<Piece> pieces;
  std::vector<int64_t> task_begin;  // task t is pieces [task_begin[t], task_begin[t + 1])
  int threads = 1;
  int64_t tasks() const { return static_cast<int64_t>(task_begin.size()) - 1; }
};

// size[i]: units of segment i (>= 0).  min_per_thread: units worth waking one more thread for.
BatchPlan plan_batch(const int64_t* size, int64_t n, int threads, int64_t seg_cost,
                     int64_t min_per_thread);

}  // namespace gockpt
