// The persistent thread pool and parallel_tasks; cutting batches of segments into pieces and
// tasks (parallel.h).
#include "parallel.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>

#include "vml.h"

namespace gockpt {

namespace {

// Whether this thread is one of the pool's workers (which run nothing but pool jobs).
thread_local bool t_pool_worker = false;

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
  // 2-core test machine 0..4000 were within noise for 1M-element calls; 40000 was worse
  // (re-measure: build with -DGOCKPT_POOL_SPIN=N, experiments/bench_replay.py, its _calls1M
  // rows).
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

void parallel_tasks(int64_t ntasks, int threads, bool mkl_sequential,
                    void (*body)(void*, int64_t), void* ctx) {
  if (ntasks <= 0) return;
  if (threads <= 1 || ntasks == 1) {
    std::optional<MklSequential> mkl_seq;
    if (mkl_sequential) mkl_seq.emplace(t_pool_worker);
    for (int64_t t = 0; t < ntasks; ++t) body(ctx, t);
    return;
  }
  struct Job {
    void (*body)(void*, int64_t);
    void* ctx;
    int64_t ntasks;
    bool mkl_sequential;
    std::atomic<int64_t> next{0};
  } job{body, ctx, ntasks, mkl_sequential};
  const int helpers = static_cast<int>(std::min<int64_t>(threads, ntasks)) - 1;
  pool().run(helpers, [](void* c) {
    Job& j = *static_cast<Job*>(c);
    std::optional<MklSequential> mkl_seq;
    if (j.mkl_sequential) mkl_seq.emplace(t_pool_worker);
    for (int64_t t; (t = j.next.fetch_add(1, std::memory_order_relaxed)) < j.ntasks;)
      j.body(j.ctx, t);
  }, &job);
}

// ------------------------------------------------------------------ cutting a batch
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
