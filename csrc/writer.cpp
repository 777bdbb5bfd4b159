// The checkpoint writer (writer.h): file creation with the space reserved and the header
// written (the O_DIRECT probe), the worker pool, one copy+checksum pass per task, pages shared
// by several tasks gathered in memory, and the coverage check that turns pieces into per-chunk
// crc32c at finish().
#include "writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "crc32c.h"

namespace gockpt {
namespace io {

namespace {

constexpr uint64_t kSub = 256 << 10;  // copy+crc granularity (stays in L2)
// Writes smaller than this (and the 4096-byte edge pages) go through the page cache even with
// O_DIRECT: many small synchronous device writes cost latency each, fsync batches them.
constexpr uint64_t kSmall = 64 << 10;

[[noreturn]] void throw_errno(int e, const std::string& what) {
  throw IoError(e, what + ": " + std::strerror(e));
}

}  // namespace

Writer::Writer(const std::string& path, uint64_t file_size, const std::string& header,
               const std::vector<std::pair<uint64_t, uint64_t>>& tensors, uint64_t chunk_bytes,
               int threads, bool direct)
    : path_(path), file_size_(file_size), chunk_bytes_(chunk_bytes) {
  if (chunk_bytes == 0 || chunk_bytes % kAlign)
    throw std::invalid_argument("chunk_bytes must be a positive multiple of 4096");
  io_unit_ = std::max<uint64_t>(1, kIoBytes / chunk_bytes) * chunk_bytes;
  if (header.size() % kAlign || header.size() > file_size || file_size % kAlign)
    throw std::invalid_argument("header and file size must be multiples of 4096");
  for (auto& t : tensors) {
    if (t.first % kAlign || t.first < header.size() || t.first + t.second > file_size)
      throw std::invalid_argument("tensor region misaligned or outside the file");
    Tensor x;
    x.file_off = t.first;
    x.nbytes = t.second;
    x.chunks.resize((t.second + chunk_bytes - 1) / chunk_bytes);
    tensors_.push_back(std::move(x));
  }
  // From here on a throw closes the descriptors and frees the buffers (members are RAII).
  open_file(direct);
  write_header(header);
  int n = resolve_threads(threads);
  if (dfd_.valid())
    for (int i = 0; i < n; i++) bounce_.emplace_back(io_unit_);
  try {
    for (int i = 0; i < n; i++) workers_.emplace_back([this, i] { work(i); });
  } catch (...) {
    close();  // join the workers already started
    throw;
  }
}

Writer::~Writer() { close(); }

// Creates the file (it must not exist), reserves its size and opens the O_DIRECT descriptor
// when asked (else fallback_ says why not).
void Writer::open_file(bool direct) {
  int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw_errno(errno, "cannot create " + path_);
  fd_ = Fd(fd);
  // Reserve the space up front: a full disk fails here, before any data is written.
  if (file_size_ && ::fallocate(fd, 0, 0, static_cast<off_t>(file_size_)) != 0) {
    int e = errno;
    if (e != EOPNOTSUPP && e != ENOSYS && e != EINVAL)
      throw_errno(e, "cannot reserve " + std::to_string(file_size_) + " bytes for " + path_);
  }
  if (!direct) {
    fallback_ = "buffered writes requested";
    return;
  }
#ifdef O_DIRECT
  int dfd = ::open(path_.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
  if (dfd < 0) fallback_ = std::string("O_DIRECT refused at open: ") + std::strerror(errno);
  dfd_ = Fd(dfd);
#else
  fallback_ = "O_DIRECT is not available on this platform";
#endif
}

// The header, also the probe: some file systems accept O_DIRECT at open but not at write.
void Writer::write_header(const std::string& header) {
  if (header.empty()) return;
  AlignedBuf hb(header.size());
  std::memcpy(hb.data(), header.data(), header.size());
  int err = 0;
  bool done = false;
  if (dfd_.valid()) {
    err = pwrite_all(dfd_.get(), hb.data(), header.size(), 0);
    if (err == EINVAL) {
      fallback_ = std::string("O_DIRECT write refused: ") + std::strerror(err);
      dfd_.reset();
      err = 0;
    } else if (err == 0) {
      done = true;
    }
  }
  if (!err && !done) err = pwrite_all(fd_.get(), hb.data(), header.size(), 0);
  if (err) throw_errno(err, "writing the header of " + path_ + " failed");
}

void Writer::fail(int e, const std::string& msg) {
  std::lock_guard<std::mutex> g(mu_);
  if (!err_) {
    err_ = e;
    err_msg_ = msg;
  }
}

void Writer::submit(uint32_t tensor, uintptr_t src, uint64_t tstart, uint64_t len) {
  if (tensor >= tensors_.size()) throw std::out_of_range("tensor index out of range");
  const Tensor& t = tensors_[tensor];
  if (tstart > t.nbytes || len > t.nbytes - tstart)
    throw std::out_of_range("write beyond the end of the tensor");
  std::lock_guard<std::mutex> g(mu_);
  if (closed_ || finished_) throw std::runtime_error("the writer was already finished or closed");
  uint64_t pos = tstart, end = tstart + len;
  while (pos < end) {
    uint64_t unit_end = (pos / io_unit_ + 1) * io_unit_;
    uint64_t e = std::min(end, unit_end);
    queue_.push_back(Task{reinterpret_cast<const uint8_t*>(src) + (pos - tstart), e - pos, tensor, pos});
    submitted_++;
    pos = e;
  }
  cv_work_.notify_all();
}

void Writer::work(int idx) {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_work_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      task = queue_.front();
      queue_.pop_front();
    }
    bool skip;
    {
      std::lock_guard<std::mutex> g(mu_);
      skip = err_ != 0;
    }
    if (!skip) process(task, idx);
    {
      std::lock_guard<std::mutex> g(mu_);
      done_++;
      if (done_ == submitted_) cv_done_.notify_all();
    }
  }
}

int Writer::raw_write(bool direct, const uint8_t* p, uint64_t n, uint64_t off) {
  if (fault_after_ >= 0 && writes_.fetch_add(1) >= fault_after_) return fault_errno_;
  return pwrite_all(direct ? dfd_.get() : fd_.get(), p, n, off);
}

void Writer::process(const Task& task, int idx) {
  const Tensor& t = tensors_[task.tensor];
  const uint64_t fs = t.file_off + task.tstart, fe = fs + task.len;
  const uint8_t* src = task.src;
  const bool direct = dfd_.valid();
  // [a, b): whole 4096-byte pages of the file, written with one pwrite; the bytes before a and
  // from b on share a page with bytes of other tasks and go through edge().
  uint64_t a = std::min(round_up(fs, kAlign), fe), b = std::max(round_down(fe, kAlign), a);
  const uint64_t ia = a - fs, ib = b - fs;  // interior in task coordinates
  const uint8_t* interior = src + ia;
  const bool small = ib - ia < kSmall;
  const bool bounce = direct && !small && !aligned_ptr(interior);
  uint8_t* buf = bounce ? bounce_[idx].data() : nullptr;
  std::vector<Piece> pieces = copy_and_checksum(task, ia, ib, buf);

  int err = 0;
  if (ia > 0) err = edge(task.tensor, fs, a, src);
  if (!err && ib > ia) err = raw_write(direct && !small, bounce ? buf : interior, ib - ia, a);
  if (!err && ib < task.len) err = edge(task.tensor, b, fe, src + ib);
  if (err == EEXIST) {
    fail(EINVAL, "tensor " + std::to_string(task.tensor) + ": some bytes were written more than once");
    return;
  }
  if (err) {
    fail(err, "writing " + path_ + " at offset " + std::to_string(fs) + " failed: " + std::strerror(err));
    return;
  }
  std::lock_guard<std::mutex> g(mu_);
  for (auto& pc : pieces) tensors_[task.tensor].chunks[pc.start / chunk_bytes_].push_back(pc);
}

// One pass over the task's bytes in order: copy the interior [ia, ib) into `bounce` (when not
// null) and checksum per chunk of the tensor while the data is hot in cache.
std::vector<Writer::Piece> Writer::copy_and_checksum(const Task& task, uint64_t ia, uint64_t ib,
                                                     uint8_t* bounce) const {
  std::vector<Piece> pieces;
  uint32_t crc = 0;
  uint64_t piece_start = task.tstart;
  for (uint64_t o = 0; o < task.len;) {
    uint64_t tpos = task.tstart + o;
    uint64_t lim = std::min(task.len, (tpos / chunk_bytes_ + 1) * chunk_bytes_ - task.tstart);
    lim = std::min(lim, (o / kSub + 1) * kSub);
    if (o < ia) lim = std::min(lim, ia);
    else if (o < ib) lim = std::min(lim, ib);
    uint64_t m = lim - o;
    const uint8_t* p = task.src + o;
    if (bounce && o >= ia && o < ib) {
      std::memcpy(bounce + (o - ia), p, m);
      p = bounce + (o - ia);
    }
    crc = crc32c(crc, p, m);
    o = lim;
    if ((task.tstart + o) % chunk_bytes_ == 0 || o == task.len) {
      pieces.push_back(Piece{piece_start, task.tstart + o - piece_start, crc});
      piece_start = task.tstart + o;
      crc = 0;
    }
  }
  return pieces;
}

// Bytes [fs, fe) of the file (inside one tensor's region) that do not fill whole 4096-byte
// pages themselves: gathered in a zero-filled page buffer that is written once all of the
// tensor's bytes in that page have arrived (the rest of the page is padding and stays zero).
int Writer::edge(uint32_t tensor, uint64_t fs, uint64_t fe, const uint8_t* src) {
  const Tensor& t = tensors_[tensor];
  for (uint64_t k = fs / kAlign; k * kAlign < fe; k++) {
    uint64_t lo = std::max(fs, k * kAlign), hi = std::min(fe, (k + 1) * kAlign);
    AlignedBuf ready;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = edges_.find(k);
      if (it == edges_.end()) {
        Edge e;
        try {
          e.buf = AlignedBuf(kAlign, /*zeroed=*/true);
        } catch (const std::bad_alloc&) {
          return ENOMEM;
        }
        e.remaining = std::min(t.file_off + t.nbytes, (k + 1) * kAlign) - k * kAlign;
        it = edges_.emplace(k, std::move(e)).first;
      }
      Edge& e = it->second;
      if (hi - lo > e.remaining) return EEXIST;  // bytes written twice
      std::memcpy(e.buf.data() + (lo - k * kAlign), src + (lo - fs), hi - lo);
      e.remaining -= hi - lo;
      if (e.remaining == 0) {
        ready = std::move(e.buf);
        edges_.erase(it);
      }
    }
    if (!ready.empty()) {
      int err = raw_write(false, ready.data(), kAlign, k * kAlign);
      if (err) return err;
    }
  }
  return 0;
}

FinishResult Writer::finish() {
  FinishResult r;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (finished_ || closed_) throw std::runtime_error("the writer was already finished or closed");
    cv_done_.wait(lk, [&] { return done_ == submitted_; });
    finished_ = true;
    if (err_) {
      r.err = err_;
      r.msg = err_msg_;
      return r;
    }
  }
  r.crcs.resize(tensors_.size());
  for (size_t i = 0; i < tensors_.size(); i++)
    if (!combine_chunks(i, r)) return r;
  if (!edges_.empty()) {  // a page never completed; cannot happen once every piece is accounted for
    r.err = -1;
    r.msg = "incomplete padding block";
    return r;
  }
  if (::fsync(fd_.get()) != 0) {
    r.err = errno;
    r.msg = "fsync of " + path_ + " failed: " + std::strerror(errno);
  }
  return r;
}

// Checks that the pieces of tensor i tile each of its chunks exactly once and appends each
// chunk's crc32c (combined from its pieces) to r.crcs[i]; false, with r saying where, if not.
bool Writer::combine_chunks(size_t i, FinishResult& r) {
  Tensor& t = tensors_[i];
  for (size_t k = 0; k < t.chunks.size(); k++) {
    auto& pieces = t.chunks[k];
    std::sort(pieces.begin(), pieces.end(), [](const Piece& x, const Piece& y) { return x.start < y.start; });
    uint64_t pos = k * chunk_bytes_, end = std::min(t.nbytes, pos + chunk_bytes_);
    uint32_t crc = 0;
    const char* problem = nullptr;
    for (auto& p : pieces) {
      if (p.start != pos) {
        problem = p.start > pos ? "not all bytes were written" : "some bytes were written more than once";
        break;
      }
      crc = crc32c_combine(crc, p.crc, p.len);
      pos += p.len;
    }
    if (!problem && pos != end) problem = pos < end ? "not all bytes were written" : "some bytes were written more than once";
    if (problem) {
      r.err = -1;
      r.bad_tensor = static_cast<int64_t>(i);
      r.bad_offset = pos;
      r.msg = problem;
      return false;
    }
    r.crcs[i].push_back(crc);
  }
  return true;
}

void Writer::close() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) return;
    closed_ = true;
    stop_ = true;
    if (!err_) {
      err_ = ECANCELED;  // queued work is dropped
      err_msg_ = "aborted";
    }
  }
  cv_work_.notify_all();
  for (auto& w : workers_) w.join();
  workers_.clear();
  edges_.clear();
  bounce_.clear();
  dfd_.reset();
  fd_.reset();
}

void Writer::inject_fault(int64_t after_writes, int err) {
  fault_errno_ = err;
  writes_ = 0;
  fault_after_ = after_writes;
}

}  // namespace io
}  // namespace gockpt
