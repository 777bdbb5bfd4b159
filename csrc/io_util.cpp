// The helpers of io_util.h: aligned buffers, file descriptors, pread/pwrite loops.
#include "io_util.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>

namespace gockpt {
namespace io {

AlignedBuf::AlignedBuf(size_t size, bool zeroed) : n_(size) {
  if (size && posix_memalign(reinterpret_cast<void**>(&p_), kAlign, size) != 0) throw std::bad_alloc();
  if (size && zeroed) std::memset(p_, 0, size);
}

AlignedBuf::~AlignedBuf() { std::free(p_); }

AlignedBuf::AlignedBuf(AlignedBuf&& o) noexcept : p_(o.p_), n_(o.n_) {
  o.p_ = nullptr;
  o.n_ = 0;
}

AlignedBuf& AlignedBuf::operator=(AlignedBuf&& o) noexcept {
  if (this != &o) {
    std::free(p_);
    p_ = o.p_;
    n_ = o.n_;
    o.p_ = nullptr;
    o.n_ = 0;
  }
  return *this;
}

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

int pwrite_all(int fd, const uint8_t* p, uint64_t n, uint64_t off) {
  if (!fits_off(off, n)) return EOVERFLOW;
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

int64_t pread_full(int fd, uint8_t* p, uint64_t n, uint64_t off) {
  if (!fits_off(off, n)) return -EOVERFLOW;
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

int resolve_threads(int threads) {
  if (threads > 0) return threads;
  unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 2;
}

}  // namespace io
}  // namespace gockpt
