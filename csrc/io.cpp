// Parallel checkpoint I/O for gockpt.storage: crc32c, a multi-threaded writer (large aligned
// pwrites at precomputed offsets, O_DIRECT where the file system accepts it) and a
// multi-threaded reader (pread straight into the destination, per-block crc32c verified).
//
// No libtorch link: memory arrives as raw addresses, validated by gockpt/_io.py and
// gockpt/storage.py (which also keep the memory alive while the C++ side uses it).
#include "io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define GOCKPT_X86 1
#endif

namespace gockpt {
namespace io {

// ------------------------------------------------------------------------------ crc32c

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // Castagnoli, reflected

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
      for (int s = 1; s < 8; s++) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};
const Tables& tables() {
  static const Tables tab;
  return tab;
}

// Raw (not pre/post-inverted) state.
uint32_t crc_sw(uint32_t c, const uint8_t* p, size_t n) {
  const auto& t = tables().t;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
    n--;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
        t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^
        t[0][(w >> 56) & 0xff];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return c;
}

uint32_t gf2_times(const uint32_t* mat, uint32_t vec);
void gf2_square(uint32_t* sq, const uint32_t* mat);

// The linear operator "append kStream zero bytes" on the raw register, as 4 byte tables, so
// that three independent crc32 streams can be merged: crc(A||B) = shift(crc(A)) ^ crc0(B).
constexpr size_t kStream = 4096;
struct ShiftTable {
  uint32_t t[4][256];
  ShiftTable() {
    uint32_t op[32];  // column i = image of bit i
    for (int i = 0; i < 32; i++) op[i] = crc32c_combine(1u << i, 0, kStream);
    for (int j = 0; j < 4; j++)
      for (uint32_t v = 0; v < 256; v++) t[j][v] = gf2_times(op + 8 * j, v);
  }
  uint32_t operator()(uint32_t c) const {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
  }
};
const ShiftTable& shift_table() {
  static const ShiftTable tab;
  return tab;
}

#ifdef GOCKPT_X86
__attribute__((target("sse4.2"))) uint32_t crc_hw(uint32_t c, const uint8_t* p, size_t n) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = _mm_crc32_u8(c, *p++);
    n--;
  }
  if (n >= 3 * kStream) {
    const ShiftTable& shift = shift_table();
    while (n >= 3 * kStream) {  // three interleaved streams: the crc32 latency is hidden
      uint64_t c0 = c, c1 = 0, c2 = 0;
      for (size_t i = 0; i < kStream; i += 8) {
        uint64_t w0, w1, w2;
        std::memcpy(&w0, p + i, 8);
        std::memcpy(&w1, p + kStream + i, 8);
        std::memcpy(&w2, p + 2 * kStream + i, 8);
        c0 = _mm_crc32_u64(c0, w0);
        c1 = _mm_crc32_u64(c1, w1);
        c2 = _mm_crc32_u64(c2, w2);
      }
      c = shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
      c = shift(c) ^ static_cast<uint32_t>(c2);
      p += 3 * kStream;
      n -= 3 * kStream;
    }
  }
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (n--) c = _mm_crc32_u8(c, *p++);
  return c;
}
#endif

int g_crc_impl = -1;  // -1 undecided, 0 software, 1 sse4.2

bool use_hw() {
  if (g_crc_impl < 0) {
#ifdef GOCKPT_X86
    __builtin_cpu_init();
    g_crc_impl = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
    g_crc_impl = 0;
#endif
  }
  return g_crc_impl == 1;
}

uint32_t gf2_times(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  while (vec) {
    if (vec & 1) sum ^= *mat;
    vec >>= 1;
    mat++;
  }
  return sum;
}

void gf2_square(uint32_t* sq, const uint32_t* mat) {
  for (int n = 0; n < 32; n++) sq[n] = gf2_times(mat, mat[n]);
}

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#ifdef GOCKPT_X86
  if (use_hw()) return ~crc_hw(c, p, n);
#endif
  return ~crc_sw(c, p, n);
}

const char* crc32c_impl() { return use_hw() ? "sse4.2" : "software"; }

void force_crc32c_impl(const std::string& which) {
  if (which == "software") {
    g_crc_impl = 0;
  } else if (which == "auto") {
    g_crc_impl = -1;
    use_hw();
  } else if (which == "sse4.2") {
    g_crc_impl = -1;
    if (!use_hw()) throw std::runtime_error("this CPU has no SSE4.2 crc32 instruction");
  } else {
    throw std::invalid_argument("crc32c implementation must be auto|sse4.2|software");
  }
}

// zlib's crc32_combine with the Castagnoli polynomial: crc(A || B) from crc(A), crc(B), |B|.
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
  if (len2 == 0) return crc1;
  uint32_t even[32], odd[32];
  odd[0] = kPoly;
  uint32_t row = 1;
  for (int n = 1; n < 32; n++) {
    odd[n] = row;
    row <<= 1;
  }
  gf2_square(even, odd);  // two zero bits
  gf2_square(odd, even);  // four zero bits
  do {
    gf2_square(even, odd);
    if (len2 & 1) crc1 = gf2_times(even, crc1);
    len2 >>= 1;
    if (!len2) break;
    gf2_square(odd, even);
    if (len2 & 1) crc1 = gf2_times(odd, crc1);
    len2 >>= 1;
  } while (len2);
  return crc1 ^ crc2;
}

// ------------------------------------------------------------------------------ helpers

namespace {

constexpr uint64_t kAlign = 4096;
constexpr uint64_t kSub = 256 << 10;       // copy+crc granularity (stays in L2)
constexpr uint64_t kIoBytes = 16ull << 20;  // target size of one pread/pwrite (several blocks)
// Writes smaller than this (and the 4 KiB edge blocks) go through the page cache even with
// O_DIRECT: many small synchronous device writes cost latency each, fsync batches them.
constexpr uint64_t kSmall = 64 << 10;

inline uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
inline uint64_t round_down(uint64_t x, uint64_t a) { return x / a * a; }
inline bool aligned_ptr(const void* p) { return (reinterpret_cast<uintptr_t>(p) & (kAlign - 1)) == 0; }

struct AlignedBuf {
  uint8_t* p = nullptr;
  size_t n = 0;
  explicit AlignedBuf(size_t size) : n(size) {
    if (size && posix_memalign(reinterpret_cast<void**>(&p), kAlign, size) != 0) throw std::bad_alloc();
  }
  ~AlignedBuf() { std::free(p); }
  AlignedBuf(const AlignedBuf&) = delete;
  AlignedBuf& operator=(const AlignedBuf&) = delete;
};

// 0 or errno.
int pwrite_all(int fd, const uint8_t* p, uint64_t n, uint64_t off) {
  while (n) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(off));
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (w == 0) return EIO;
    p += w;
    n -= static_cast<uint64_t>(w);
    off += static_cast<uint64_t>(w);
  }
  return 0;
}

// Bytes read (stops early at end of file), or -errno.
int64_t pread_full(int fd, uint8_t* p, uint64_t n, uint64_t off) {
  uint64_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, p + got, n - got, static_cast<off_t>(off + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -static_cast<int64_t>(errno);
    }
    if (r == 0) break;
    got += static_cast<uint64_t>(r);
  }
  return static_cast<int64_t>(got);
}

int default_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 2;
}

}  // namespace

// ------------------------------------------------------------------------------ writer

Writer::Writer(const std::string& path, uint64_t file_size, const std::string& header,
               const std::vector<std::pair<uint64_t, uint64_t>>& tensors, uint64_t block_bytes,
               int threads, bool direct)
    : path_(path), file_size_(file_size), block_bytes_(block_bytes) {
  if (block_bytes == 0 || block_bytes % kAlign)
    throw std::invalid_argument("block_bytes must be a positive multiple of 4096");
  io_unit_ = std::max<uint64_t>(1, kIoBytes / block_bytes) * block_bytes;
  if (header.size() % kAlign || header.size() > file_size || file_size % kAlign)
    throw std::invalid_argument("header and file size must be multiples of 4096");
  for (auto& t : tensors) {
    if (t.first % kAlign || t.first < header.size() || t.first + t.second > file_size)
      throw std::invalid_argument("tensor region misaligned or outside the file");
    Tensor x;
    x.file_off = t.first;
    x.nbytes = t.second;
    x.blocks.resize((t.second + block_bytes - 1) / block_bytes);
    tensors_.push_back(std::move(x));
  }
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) throw_errno(errno, "cannot create " + path);
  // Reserve the space up front: a full disk fails here, before any data is written.
  if (file_size && ::fallocate(fd_, 0, 0, static_cast<off_t>(file_size)) != 0) {
    int e = errno;
    if (e != EOPNOTSUPP && e != ENOSYS && e != EINVAL) {
      ::close(fd_);
      fd_ = -1;
      throw_errno(e, "cannot reserve " + std::to_string(file_size) + " bytes for " + path);
    }
  }
  if (direct) {
#ifdef O_DIRECT
    dfd_ = ::open(path.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
    if (dfd_ < 0) fallback_ = std::string("O_DIRECT refused at open: ") + std::strerror(errno);
#else
    fallback_ = "O_DIRECT is not available on this platform";
#endif
  } else {
    fallback_ = "buffered writes requested";
  }
  // The header, also the probe: some file systems accept O_DIRECT at open but not at write.
  AlignedBuf hb(header.size());
  if (!header.empty()) std::memcpy(hb.p, header.data(), header.size());
  int err = 0;
  if (dfd_ >= 0 && !header.empty()) {
    err = pwrite_all(dfd_, hb.p, header.size(), 0);
    if (err == EINVAL) {
      fallback_ = std::string("O_DIRECT write refused: ") + std::strerror(err);
      ::close(dfd_);
      dfd_ = -1;
      err = 0;
    } else if (err == 0) {
      header_done_ = true;
    }
  }
  if (!err && !header_done_ && !header.empty()) err = pwrite_all(fd_, hb.p, header.size(), 0);
  if (err) {
    close_fds();
    throw_errno(err, "writing the header of " + path + " failed");
  }
  int n = threads > 0 ? threads : default_threads();
  if (dfd_ >= 0) {
    for (int i = 0; i < n; i++) {
      void* p = nullptr;
      if (posix_memalign(&p, kAlign, io_unit_) != 0) {
        close();
        throw std::bad_alloc();
      }
      bounce_.push_back(static_cast<uint8_t*>(p));
    }
  }
  for (int i = 0; i < n; i++) workers_.emplace_back([this, i] { work(i); });
}

Writer::~Writer() { close(); }

void Writer::throw_errno(int e, const std::string& what) {
  throw IoError(e, what + ": " + std::strerror(e));
}

void Writer::close_fds() {
  if (dfd_ >= 0) ::close(dfd_);
  if (fd_ >= 0) ::close(fd_);
  dfd_ = fd_ = -1;
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
  return pwrite_all(direct ? dfd_ : fd_, p, n, off);
}

void Writer::process(const Task& task, int idx) {
  const Tensor& t = tensors_[task.tensor];
  const uint64_t fs = t.file_off + task.tstart, fe = fs + task.len;
  const uint8_t* src = task.src;
  const bool direct = dfd_ >= 0;
  // [a, b): whole 4 KiB file blocks, written with one pwrite; the bytes before a and from b
  // on share a file block with bytes of other tasks and go through edge().
  uint64_t a = std::min(round_up(fs, kAlign), fe), b = std::max(round_down(fe, kAlign), a);
  const uint64_t ia = a - fs, ib = b - fs;  // interior in task coordinates
  const uint8_t* interior = src + ia;
  const bool small = ib - ia < kSmall;
  const bool bounce = direct && !small && !aligned_ptr(interior);
  uint8_t* buf = bounce ? bounce_[idx] : nullptr;

  // One pass over the bytes in order: copy the interior into the bounce buffer (if needed)
  // and checksum per block of the tensor while the data is hot in cache.
  std::vector<Piece> pieces;
  uint32_t crc = 0;
  uint64_t piece_start = task.tstart;
  for (uint64_t o = 0; o < task.len;) {
    uint64_t tpos = task.tstart + o;
    uint64_t lim = std::min(task.len, (tpos / block_bytes_ + 1) * block_bytes_ - task.tstart);
    lim = std::min(lim, (o / kSub + 1) * kSub);
    if (o < ia) lim = std::min(lim, ia);
    else if (o < ib) lim = std::min(lim, ib);
    uint64_t m = lim - o;
    const uint8_t* p = src + o;
    if (bounce && o >= ia && o < ib) {
      std::memcpy(buf + (o - ia), p, m);
      p = buf + (o - ia);
    }
    crc = crc32c(crc, p, m);
    o = lim;
    if ((task.tstart + o) % block_bytes_ == 0 || o == task.len) {
      pieces.push_back(Piece{piece_start, task.tstart + o - piece_start, crc});
      piece_start = task.tstart + o;
      crc = 0;
    }
  }

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
  for (auto& pc : pieces) tensors_[task.tensor].blocks[pc.start / block_bytes_].push_back(pc);
}

// Bytes [fs, fe) of the file (inside one tensor's region) that do not fill whole 4 KiB blocks
// themselves: gathered in a zero-filled block buffer that is written once all of the tensor's
// bytes in that block have arrived (the rest of the block is padding and stays zero).
int Writer::edge(uint32_t tensor, uint64_t fs, uint64_t fe, const uint8_t* src) {
  const Tensor& t = tensors_[tensor];
  for (uint64_t k = fs / kAlign; k * kAlign < fe; k++) {
    uint64_t lo = std::max(fs, k * kAlign), hi = std::min(fe, (k + 1) * kAlign);
    uint8_t* ready = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = edges_.find(k);
      if (it == edges_.end()) {
        Edge e;
        if (posix_memalign(reinterpret_cast<void**>(&e.buf), kAlign, kAlign) != 0) return ENOMEM;
        std::memset(e.buf, 0, kAlign);
        e.remaining = std::min(t.file_off + t.nbytes, (k + 1) * kAlign) - k * kAlign;
        it = edges_.emplace(k, e).first;
      }
      Edge& e = it->second;
      if (hi - lo > e.remaining) return EEXIST;  // bytes written twice
      std::memcpy(e.buf + (lo - k * kAlign), src + (lo - fs), hi - lo);
      e.remaining -= hi - lo;
      if (e.remaining == 0) {
        ready = e.buf;
        edges_.erase(it);
      }
    }
    if (ready) {
      int err = raw_write(false, ready, kAlign, k * kAlign);
      std::free(ready);
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
  for (size_t i = 0; i < tensors_.size(); i++) {
    Tensor& t = tensors_[i];
    for (size_t k = 0; k < t.blocks.size(); k++) {
      auto& pieces = t.blocks[k];
      std::sort(pieces.begin(), pieces.end(), [](const Piece& x, const Piece& y) { return x.start < y.start; });
      uint64_t pos = k * block_bytes_, end = std::min(t.nbytes, pos + block_bytes_);
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
        return r;
      }
      r.crcs[i].push_back(crc);
    }
  }
  if (!edges_.empty()) {  // cannot happen once every piece is accounted for
    r.err = -1;
    r.msg = "incomplete padding block";
    return r;
  }
  if (::fsync(fd_) != 0) {
    r.err = errno;
    r.msg = "fsync of " + path_ + " failed: " + std::strerror(errno);
  }
  return r;
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
  for (auto& kv : edges_) std::free(kv.second.buf);
  edges_.clear();
  for (auto* p : bounce_) std::free(p);
  bounce_.clear();
  close_fds();
}

void Writer::inject_fault(int64_t after_writes, int err) {
  fault_errno_ = err;
  writes_ = 0;
  fault_after_ = after_writes;
}

// ------------------------------------------------------------------------------ reader

ReadResult read_into(const std::string& path, const std::vector<ReadItem>& items, bool verify,
                     int threads, bool direct) {
  ReadResult res;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    res.err = errno;
    res.msg = std::string("cannot open ") + path + ": " + std::strerror(errno);
    return res;
  }
  int dfd = -1;
#ifdef O_DIRECT
  if (direct) dfd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
#endif
  res.direct = dfd >= 0;

  // A task is a run of whole checksum blocks of one item, about kIoBytes long, read with one
  // pread (O_DIRECT: straight into an aligned destination) and then checksummed per block.
  struct RTask {
    uint32_t item;
    uint64_t first_block, nblocks;
  };
  std::vector<RTask> tasks;
  for (uint32_t i = 0; i < items.size(); i++) {
    const ReadItem& it = items[i];
    if (it.block_bytes == 0 || it.nbytes == 0) continue;
    uint64_t nb = (it.nbytes + it.block_bytes - 1) / it.block_bytes;
    uint64_t per = std::max<uint64_t>(1, kIoBytes / it.block_bytes);
    for (uint64_t k = 0; k < nb; k += per) tasks.push_back(RTask{i, k, std::min(per, nb - k)});
  }
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::atomic<bool> stop{false};

  // Reads [foff, foff+n) into dst; returns bytes read (short at EOF) or -errno.
  auto read_range = [&](uint8_t* dst, uint64_t n, uint64_t foff, std::unique_ptr<AlignedBuf>& bounce) -> int64_t {
    uint64_t done = 0;
    while (done < n) {
      uint64_t fo = foff + done, m = n - done;
      int64_t got;
      if (dfd >= 0 && fo % kAlign == 0) {
        if (aligned_ptr(dst + done) && m >= kAlign) {
          got = pread_full(dfd, dst + done, round_down(m, kAlign), fo);
        } else {
          if (!bounce) bounce.reset(new AlignedBuf(kIoBytes));
          uint64_t take = std::min(m, kIoBytes);
          got = pread_full(dfd, bounce->p, round_up(take, kAlign), fo);
          if (got > 0) {
            got = std::min<int64_t>(got, static_cast<int64_t>(take));
            std::memcpy(dst + done, bounce->p, static_cast<size_t>(got));
          }
        }
        if (got == -EINVAL) got = pread_full(fd, dst + done, m, fo);  // O_DIRECT refused: buffered
      } else {
        got = pread_full(fd, dst + done, m, fo);
      }
      if (got < 0) return got;
      if (got == 0) break;
      done += static_cast<uint64_t>(got);
    }
    return static_cast<int64_t>(done);
  };

  auto worker = [&]() {
    std::unique_ptr<AlignedBuf> bounce;
    for (;;) {
      if (stop.load()) return;
      size_t ti = next.fetch_add(1);
      if (ti >= tasks.size()) return;
      const RTask& task = tasks[ti];
      const ReadItem& it = items[task.item];
      uint64_t start = task.first_block * it.block_bytes;
      uint64_t len = std::min(task.nblocks * it.block_bytes, it.nbytes - start);
      uint8_t* dst = reinterpret_cast<uint8_t*>(it.dst) + start;
      int64_t got = read_range(dst, len, it.file_off + start, bounce);
      if (got < 0) {
        std::lock_guard<std::mutex> g(mu);
        if (!res.err) {
          res.err = static_cast<int>(-got);
          res.msg = "reading " + path + " at offset " + std::to_string(it.file_off + start) + " failed: " +
                    std::strerror(static_cast<int>(-got));
          res.bad_item = task.item;
        }
        stop = true;
        return;
      }
      if (static_cast<uint64_t>(got) < len) {
        std::lock_guard<std::mutex> g(mu);
        res.truncated.push_back({task.item, it.file_off + start + static_cast<uint64_t>(got)});
        continue;
      }
      if (!verify) continue;
      for (uint64_t k = 0; k < task.nblocks; k++) {
        uint64_t bs = k * it.block_bytes, bn = std::min(it.block_bytes, len - bs);
        uint32_t crc = crc32c(0, dst + bs, bn);
        uint64_t blk = task.first_block + k;
        if (blk >= it.crcs.size() || crc != it.crcs[blk]) {
          std::lock_guard<std::mutex> g(mu);
          res.mismatches.push_back({task.item, blk, crc});
        }
      }
    }
  };
  int n = threads > 0 ? threads : default_threads();
  n = static_cast<int>(std::min<size_t>(n, std::max<size_t>(1, tasks.size())));
  std::vector<std::thread> pool;
  for (int i = 1; i < n; i++) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (dfd >= 0) ::close(dfd);
  ::close(fd);
  std::sort(res.mismatches.begin(), res.mismatches.end());
  std::sort(res.truncated.begin(), res.truncated.end());
  return res;
}

}  // namespace io
}  // namespace gockpt

// ------------------------------------------------------------------------------ bindings

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace py = pybind11;

namespace gockpt {
namespace io {

void bind_io(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      PyObject* args = Py_BuildValue("(is)", e.err, e.what());
      PyErr_SetObject(PyExc_OSError, args);
      Py_XDECREF(args);
    }
  });

  m.def(
      "crc32c",
      [](py::buffer data, uint32_t crc) {
        py::buffer_info info = data.request();
        size_t n = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
        const void* p = info.ptr;
        py::gil_scoped_release release;
        return crc32c(crc, p, n);
      },
      py::arg("data"), py::arg("crc") = 0, "crc32c of a contiguous buffer, continuing from crc.");
  m.def(
      "crc32c_addr",
      [](uintptr_t addr, uint64_t n, uint32_t crc) {
        py::gil_scoped_release release;
        return crc32c(crc, reinterpret_cast<const void*>(addr), n);
      },
      py::arg("addr"), py::arg("n"), py::arg("crc") = 0);
  m.def("crc32c_combine", &crc32c_combine, py::arg("crc1"), py::arg("crc2"), py::arg("len2"));
  m.def("crc32c_impl", []() { return std::string(crc32c_impl()); });
  m.def("force_crc32c_impl", &force_crc32c_impl, py::arg("which"));

  py::class_<Writer>(m, "IoWriter")
      .def(py::init([](const std::string& path, uint64_t file_size, py::bytes header,
                       const std::vector<std::pair<uint64_t, uint64_t>>& tensors,
                       uint64_t block_bytes, int threads, bool direct) {
             std::string h = header;
             py::gil_scoped_release release;
             return new Writer(path, file_size, h, tensors, block_bytes, threads, direct);
           }),
           py::arg("path"), py::arg("file_size"), py::arg("header"), py::arg("tensors"),
           py::arg("block_bytes"), py::arg("threads"), py::arg("direct"))
      .def("submit", &Writer::submit, py::arg("tensor"), py::arg("src"), py::arg("tstart"),
           py::arg("len"), py::call_guard<py::gil_scoped_release>())
      .def("finish",
           [](Writer& w) {
             FinishResult r;
             {
               py::gil_scoped_release release;
               r = w.finish();
             }
             return py::make_tuple(r.err, r.msg, r.bad_tensor, r.bad_offset, r.crcs);
           })
      .def("close", &Writer::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("direct", &Writer::direct)
      .def_property_readonly("fallback_reason", &Writer::fallback_reason)
      .def_property_readonly("threads", &Writer::threads)
      .def("inject_fault", &Writer::inject_fault, py::arg("after_writes"), py::arg("errno"));

  m.def(
      "read_into",
      [](const std::string& path, const std::vector<std::tuple<uint64_t, uint64_t, uintptr_t, uint64_t,
                                                               std::vector<uint32_t>>>& items,
         bool verify, int threads, bool direct) {
        std::vector<ReadItem> v;
        v.reserve(items.size());
        for (auto& t : items) {
          ReadItem r;
          r.file_off = std::get<0>(t);
          r.nbytes = std::get<1>(t);
          r.dst = std::get<2>(t);
          r.block_bytes = std::get<3>(t);
          r.crcs = std::get<4>(t);
          v.push_back(std::move(r));
        }
        ReadResult r;
        {
          py::gil_scoped_release release;
          r = read_into(path, v, verify, threads, direct);
        }
        return py::make_tuple(r.err, r.msg, r.bad_item, r.direct, r.mismatches, r.truncated);
      },
      py::arg("path"), py::arg("items"), py::arg("verify"), py::arg("threads"), py::arg("direct"),
      "items: (file_offset, nbytes, dst_address, block_bytes, crcs); returns (errno, message, "
      "item, direct, mismatches [(item, block, crc)], truncated [(item, eof_offset)]).");
}

}  // namespace io
}  // namespace gockpt
