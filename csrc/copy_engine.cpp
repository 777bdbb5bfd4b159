// The copy engine (copy_engine.h): priority queues of jobs, the worker that runs them one
// piece at a time, link pacing, and ticket bookkeeping.
#include "copy_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace gockpt {

namespace {

// A piece also ends after this many segments: thousands of tiny segments make pieces of few
// bytes but many memcpy calls, and a piece bounds how long better-priority work waits.
constexpr int kMaxSegsPerPiece = 4096;

}  // namespace

// One submission: copy segments, and how far the worker got.
struct CopyEngine::Job {
  int64_t ticket = 0;
  std::vector<CopySegment> copies;
  Cursor next;

  size_t count() const { return copies.size(); }
  int64_t units(size_t i) const { return copies[i].nbytes; }
};

CopyEngine::CopyEngine(double link_bytes_per_s, int64_t piece_bytes)
    : rate_(link_bytes_per_s), piece_bytes_(piece_bytes) {
  if (!(link_bytes_per_s >= 0) || std::isinf(link_bytes_per_s))
    throw std::invalid_argument("link_bytes_per_s must be a finite rate >= 0 (0: no pacing)");
  if (piece_bytes < 4) throw std::invalid_argument("piece_bytes must be >= 4");
  worker_ = std::thread(&CopyEngine::work, this);
}

CopyEngine::~CopyEngine() { close(); }

int64_t CopyEngine::submit(int priority, std::vector<CopySegment> segs) {
  auto job = std::make_unique<Job>();
  job->copies = std::move(segs);
  return enqueue(priority, std::move(job));
}

int64_t CopyEngine::enqueue(int priority, std::unique_ptr<Job> job) {
  int64_t nbytes = 0;
  for (size_t i = 0; i < job->count(); ++i) nbytes += job->units(i);
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) throw std::runtime_error("gockpt copy engine is closed");
  const int64_t id = next_ticket_++;
  job->ticket = id;
  TicketInfo& info = tickets_[id];
  info.nbytes = nbytes;
  info.done = job->count() == 0;
  if (!info.done) {
    queues_[priority].push_back(std::move(job));
    cv_work_.notify_one();
  }
  return id;
}

// The end of the next piece of job: up to piece_bytes from job.next, whole tiny segments or
// part of a big one.
CopyEngine::Cursor CopyEngine::take_piece(Job& job) const {
  Cursor c = job.next;
  int64_t budget = piece_bytes_;
  for (int segs = 0; c.seg < job.count() && segs < kMaxSegsPerPiece; ++segs) {
    const int64_t left = job.units(c.seg) - c.off;
    if (left > budget) {
      c.off += budget;
      break;
    }
    budget -= left;
    ++c.seg;
    c.off = 0;
    if (budget == 0) break;
  }
  return c;
}

// Runs [from, to) of job; returns the nanoseconds it took (pacing included) and sets *copied
// to the bytes copied.
int64_t CopyEngine::run_piece(Job& job, Cursor from, Cursor to, int64_t* copied) {
  const Clock::time_point t0 = Clock::now();
  int64_t bytes = 0;
  for (size_t s = from.seg; s < job.count() && (s < to.seg || (s == to.seg && to.off > 0)); ++s) {
    const int64_t lo = s == from.seg ? from.off : 0;
    const int64_t hi = s == to.seg ? to.off : job.units(s);
    if (hi <= lo) continue;
    const CopySegment& c = job.copies[s];
    std::memcpy(static_cast<char*>(c.dst) + lo, static_cast<const char*>(c.src) + lo,
                static_cast<size_t>(hi - lo));
    bytes += hi - lo;
  }
  if (rate_ > 0) {
    // The piece occupies the link for bytes / rate from when the link was free (rounded up to
    // whole nanoseconds: seconds() is never below bytes / rate).
    const Clock::time_point start = std::max(t0, link_free_at_);
    const auto busy = std::chrono::nanoseconds(static_cast<int64_t>(std::ceil(bytes / rate_ * 1e9)));
    link_free_at_ = start + std::chrono::duration_cast<Clock::duration>(busy);
    std::this_thread::sleep_until(link_free_at_);
  }
  *copied = bytes;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

// The worker: the first job of the best non-empty priority, one piece at a time, re-choosing
// after every piece.  Only this thread touches a queued job's cursor.
void CopyEngine::work() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_work_.wait(lk, [&] { return closed_ || !queues_.empty(); });
    if (queues_.empty()) return;  // closed and drained
    auto q = queues_.begin();
    Job& job = *q->second.front();
    const Cursor from = job.next;
    job.next = take_piece(job);
    std::unique_ptr<Job> last;  // set when this piece ends the job
    if (job.next.seg >= job.count()) {
      last = std::move(q->second.front());
      q->second.pop_front();
      if (q->second.empty()) queues_.erase(q);
    }
    lk.unlock();
    int64_t copied = 0;
    const int64_t ns = run_piece(job, from, job.next, &copied);
    lk.lock();
    auto it = tickets_.find(job.ticket);  // present: release() waits for completion
    if (it != tickets_.end()) {
      it->second.ns += ns;
      if (last) it->second.done = true;
    }
    bytes_done_ += copied;
    copy_ns_ += ns;
    if (last) cv_done_.notify_all();
  }
}

bool CopyEngine::done(int64_t ticket) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = tickets_.find(ticket);
  return it == tickets_.end() || it->second.done;
}

void CopyEngine::wait(int64_t ticket) const {
  std::unique_lock<std::mutex> lk(mu_);
  cv_done_.wait(lk, [&] {
    auto it = tickets_.find(ticket);
    return it == tickets_.end() || it->second.done;
  });
}

double CopyEngine::seconds(int64_t ticket) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) throw std::invalid_argument("unknown ticket " + std::to_string(ticket));
  return static_cast<double>(it->second.ns) * 1e-9;
}

int64_t CopyEngine::nbytes(int64_t ticket) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) throw std::invalid_argument("unknown ticket " + std::to_string(ticket));
  return it->second.nbytes;
}

void CopyEngine::release(int64_t ticket) {
  wait(ticket);
  std::lock_guard<std::mutex> lk(mu_);
  tickets_.erase(ticket);
}

bool CopyEngine::take_done(int64_t ticket, double* seconds) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {  // (released: done, as done() says; its time is not known)
    *seconds = 0.0;
    return true;
  }
  if (!it->second.done) return false;
  *seconds = static_cast<double>(it->second.ns) * 1e-9;
  tickets_.erase(it);
  return true;
}

std::pair<int64_t, double> CopyEngine::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return {bytes_done_, static_cast<double>(copy_ns_) * 1e-9};
}

void CopyEngine::close() {
  std::lock_guard<std::mutex> closing(close_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
  }
  cv_work_.notify_all();
  if (worker_.joinable()) worker_.join();
}

}  // namespace gockpt
