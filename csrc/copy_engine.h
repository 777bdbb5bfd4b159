// The copy engine: one worker thread running queued host memory copies by
// priority (0 before 1; first in, first out within a priority), in pieces of at most
// piece_bytes, so work of a better priority submitted meanwhile waits for at most one piece.
// Optionally paced like a link of a given rate (an emulated PCIe-like device link for CPU-only
// development).  Bound in module.cpp as _C.CopyEngine, wrapped by gockpt/capture/transfer.py.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace gockpt {

struct CopySegment {
  void* dst;
  const void* src;
  int64_t nbytes;
};

class CopyEngine {
 public:
  // link_bytes_per_s > 0: every copy piece occupies the link for bytes / rate seconds (the
  // worker sleeps until the link is free again).  0: no pacing.
  CopyEngine(double link_bytes_per_s, int64_t piece_bytes);
  ~CopyEngine();  // close()
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Queue memcpy(dst, src, nbytes) for every segment; returns the ticket id.  The memory must
  // stay valid until the ticket is done.  Throws std::runtime_error after close().
  int64_t submit(int priority, std::vector<CopySegment> segs);

  // done/wait on a ticket already released (or never issued) report it done: release() only
  // forgets completed tickets.
  bool done(int64_t ticket) const;
  void wait(int64_t ticket) const;
  // Worker time spent on the ticket so far (excluding queueing) and the bytes it copies;
  // std::invalid_argument for an unknown ticket.
  double seconds(int64_t ticket) const;
  int64_t nbytes(int64_t ticket) const;
  // Waits for the ticket, then forgets it.  Unknown ids: no-op.
  void release(int64_t ticket);
  // A done ticket's worker seconds, the ticket forgotten, in one step that never waits: false
  // (nothing changed) while it is not done; an unknown id is done (0 seconds), as done() says.
  bool take_done(int64_t ticket, double* seconds);
  // Bytes copied and worker seconds spent copying, since construction.
  std::pair<int64_t, double> stats() const;
  // Finish all queued work and join the worker.  Idempotent.
  void close();

 private:
  using Clock = std::chrono::steady_clock;
  struct Job;
  struct Cursor {
    size_t seg = 0;
    int64_t off = 0;  // next byte of segment seg
  };
  struct TicketInfo {
    int64_t nbytes = 0;
    int64_t ns = 0;  // worker nanoseconds spent on it
    bool done = false;
  };

  int64_t enqueue(int priority, std::unique_ptr<Job> job);
  Cursor take_piece(Job& job) const;
  int64_t run_piece(Job& job, Cursor from, Cursor to, int64_t* copied);
  void work();

  const double rate_;
  const int64_t piece_bytes_;
  Clock::time_point link_free_at_{};  // the worker's only

  mutable std::mutex mu_;
  mutable std::condition_variable cv_work_, cv_done_;
  std::map<int, std::deque<std::unique_ptr<Job>>> queues_;  // non-empty queues only
  std::unordered_map<int64_t, TicketInfo> tickets_;
  int64_t next_ticket_ = 1;
  int64_t bytes_done_ = 0, copy_ns_ = 0;
  bool closed_ = false;

  std::mutex close_mu_;  // one close() joins the worker
  std::thread worker_;
};

}  // namespace gockpt
