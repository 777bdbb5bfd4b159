// Parallel checkpoint I/O (see io.cpp). Bound in module.cpp, wrapped by gockpt/_io.py.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace gockpt {
namespace io {

// crc32c (Castagnoli), zlib-style continuation: crc32c(crc32c(0, a), b) == crc32c(0, a || b).
uint32_t crc32c(uint32_t crc, const void* data, size_t n);
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
const char* crc32c_impl();                     // "sse4.2" or "software"
void force_crc32c_impl(const std::string& which);  // auto | sse4.2 | software (tests)

// An OS error with its errno (translated to Python's OSError).
struct IoError : std::runtime_error {
  int err;
  IoError(int e, const std::string& msg) : std::runtime_error(msg), err(e) {}
};

struct FinishResult {
  int err = 0;               // 0 ok, errno, or -1 (bad_tensor/bad_offset/msg say what)
  std::string msg;
  int64_t bad_tensor = -1;
  uint64_t bad_offset = 0;
  std::vector<std::vector<uint32_t>> crcs;  // per tensor, per block
};

// Writes one file laid out by the caller: a header of a multiple of 4096 bytes at offset 0,
// then tensor regions starting at multiples of 4096, each followed by zero padding up to the
// next multiple of 4096. Tensor bytes arrive via submit() in any order from any thread;
// worker threads copy (through aligned bounce buffers when O_DIRECT needs them), checksum
// per block of block_bytes of each tensor, and pwrite at the precomputed offsets.
class Writer {
 public:
  Writer(const std::string& path, uint64_t file_size, const std::string& header,
         const std::vector<std::pair<uint64_t, uint64_t>>& tensors,  // (file offset, nbytes)
         uint64_t block_bytes, int threads, bool direct);
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // Queue bytes [tstart, tstart+len) of tensor `tensor` from memory at `src` (which must stay
  // valid and unchanged until finish() or close() returns).
  void submit(uint32_t tensor, uintptr_t src, uint64_t tstart, uint64_t len);
  // Wait for every queued write, check that every tensor byte was written exactly once,
  // fsync; returns the per-block checksums or the first error.
  FinishResult finish();
  // Stop the workers (dropping queued work) and close the file. Idempotent.
  void close();

  bool direct() const { return dfd_ >= 0; }
  const std::string& fallback_reason() const { return fallback_; }
  int threads() const { return static_cast<int>(workers_.size()); }
  void inject_fault(int64_t after_writes, int err);  // tests: fail the n-th pwrite

 private:
  struct Piece {
    uint64_t start, len;
    uint32_t crc;
  };
  struct Tensor {
    uint64_t file_off = 0, nbytes = 0;
    std::vector<std::vector<Piece>> blocks;
  };
  struct Task {
    const uint8_t* src = nullptr;
    uint64_t len = 0;
    uint32_t tensor = 0;
    uint64_t tstart = 0;
  };
  struct Edge {
    uint8_t* buf = nullptr;
    uint64_t remaining = 0;
  };

  [[noreturn]] static void throw_errno(int e, const std::string& what);
  void close_fds();
  void fail(int e, const std::string& msg);
  void work(int idx);
  void process(const Task& task, int idx);
  int edge(uint32_t tensor, uint64_t fs, uint64_t fe, const uint8_t* src);
  int raw_write(bool direct, const uint8_t* p, uint64_t n, uint64_t off);

  std::string path_;
  uint64_t file_size_;
  uint64_t block_bytes_;
  uint64_t io_unit_ = 0;  // tasks never cross a multiple of this (a multiple of block_bytes_)
  int fd_ = -1, dfd_ = -1;
  bool header_done_ = false;
  std::string fallback_;
  std::vector<Tensor> tensors_;
  std::vector<uint8_t*> bounce_;
  std::vector<std::thread> workers_;

  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::deque<Task> queue_;
  std::map<uint64_t, Edge> edges_;
  uint64_t submitted_ = 0, done_ = 0;
  bool stop_ = false, closed_ = false, finished_ = false;
  int err_ = 0;
  std::string err_msg_;

  std::atomic<int64_t> fault_after_{-1};
  std::atomic<int64_t> writes_{0};
  int fault_errno_ = 0;
};

struct ReadItem {
  uint64_t file_off = 0, nbytes = 0;
  uintptr_t dst = 0;
  uint64_t block_bytes = 0;
  std::vector<uint32_t> crcs;
};

struct ReadResult {
  int err = 0;
  std::string msg;
  int64_t bad_item = -1;
  bool direct = false;
  std::vector<std::tuple<uint32_t, uint64_t, uint32_t>> mismatches;  // (item, block, crc found)
  std::vector<std::pair<uint32_t, uint64_t>> truncated;              // (item, file offset of EOF)
};

// pread every item's bytes into item.dst (several threads, O_DIRECT when possible), checking
// each block's crc32c against item.crcs when verify.
ReadResult read_into(const std::string& path, const std::vector<ReadItem>& items, bool verify,
                     int threads, bool direct);

}  // namespace io
}  // namespace gockpt
