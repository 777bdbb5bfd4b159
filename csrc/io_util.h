// What the checkpoint writer (writer.cpp) and reader (reader.cpp) share: the 4096-byte
// alignment O_DIRECT needs, an owned aligned buffer, an owned file descriptor, pread/pwrite
// loops that retry EINTR and short transfers, and the OS error type bound to Python's OSError
// (module.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace gockpt {
namespace io {

constexpr uint64_t kAlign = 4096;           // O_DIRECT alignment of offsets, lengths and memory
constexpr uint64_t kIoBytes = 16ull << 20;  // target size of one pread/pwrite (several chunks)

inline uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
inline uint64_t round_down(uint64_t x, uint64_t a) { return x / a * a; }
// Whether [off, off + n) is a range of file offsets (signed 64-bit off_t), computed without
// overflow: pread/pwrite would take a wrapped or negative offset for anything else.
inline bool fits_off(uint64_t off, uint64_t n) {
  constexpr uint64_t kMax = 0x7fffffffffffffffull;
  return off <= kMax && n <= kMax - off;
}
inline bool aligned_ptr(const void* p) { return (reinterpret_cast<uintptr_t>(p) & (kAlign - 1)) == 0; }

// An OS error with its errno (translated to Python's OSError).
struct IoError : std::runtime_error {
  int err;
  IoError(int e, const std::string& msg) : std::runtime_error(msg), err(e) {}
};

// Owned memory aligned to kAlign (posix_memalign; throws std::bad_alloc). Empty when
// default-constructed; movable, not copyable.
class AlignedBuf {
 public:
  AlignedBuf() = default;
  explicit AlignedBuf(size_t size, bool zeroed = false);
  ~AlignedBuf();
  AlignedBuf(AlignedBuf&& o) noexcept;
  AlignedBuf& operator=(AlignedBuf&& o) noexcept;
  AlignedBuf(const AlignedBuf&) = delete;
  AlignedBuf& operator=(const AlignedBuf&) = delete;

  uint8_t* data() const { return p_; }
  size_t size() const { return n_; }
  bool empty() const { return p_ == nullptr; }

 private:
  uint8_t* p_ = nullptr;
  size_t n_ = 0;
};

// An owned file descriptor (-1: none), closed on destruction or reset().
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset();

 private:
  int fd_ = -1;
};

// Writes all n bytes at offset off: 0 or errno (EOVERFLOW: the range is not a file range).
int pwrite_all(int fd, const uint8_t* p, uint64_t n, uint64_t off);
// Reads up to n bytes at offset off, stopping early only at end of file: bytes read, or -errno
// (-EOVERFLOW: the range is not a file range).
int64_t pread_full(int fd, uint8_t* p, uint64_t n, uint64_t off);
// Threads for threads <= 0: the hardware concurrency (2 if unknown).
int resolve_threads(int threads);

}  // namespace io
}  // namespace gockpt
