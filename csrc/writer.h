// The checkpoint writer: one data file filled by a pool of threads with large aligned pwrites at
// precomputed offsets (O_DIRECT where the file system accepts it, else buffered + fsync), every
// chunk of every tensor checksummed (crc32c) while the bytes pass. Bound in module.cpp, wrapped
// by gockpt/storage/io.py.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "io_util.h"

namespace gockpt {
namespace io {

// What Writer::finish() found.
struct FinishResult {
  int err = 0;               // 0 ok, errno, or -1 (bad_tensor/bad_offset/msg say what)
  std::string msg;
  int64_t bad_tensor = -1;   // the tensor not covered exactly once, or -1
  uint64_t bad_offset = 0;   // its first byte not covered exactly once
  std::vector<std::vector<uint32_t>> crcs;  // per tensor, per chunk (the last one shorter)
};

// Writes one file laid out by the caller: a header of a multiple of 4096 bytes at offset 0,
// then tensor regions starting at multiples of 4096, each followed by zero padding up to the
// next multiple of 4096. Tensor bytes arrive via submit() in any order from any thread;
// worker threads copy (through aligned bounce buffers when O_DIRECT needs them), checksum
// per chunk of chunk_bytes of each tensor, and pwrite at the precomputed offsets.
class Writer {
 public:
  Writer(const std::string& path, uint64_t file_size, const std::string& header,
         const std::vector<std::pair<uint64_t, uint64_t>>& tensors,  // (file offset, nbytes)
         uint64_t chunk_bytes, int threads, bool direct);
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // Queue bytes [tstart, tstart+len) of tensor `tensor` from memory at `src` (which must stay
  // valid and unchanged until finish() or close() returns).
  void submit(uint32_t tensor, uintptr_t src, uint64_t tstart, uint64_t len);
  // Wait for every queued write, check that every tensor byte was written exactly once,
  // fsync; returns the per-chunk checksums or the first error.
  FinishResult finish();
  // Stop the workers (dropping queued work) and close the file. Idempotent.
  void close();

  bool direct() const { return dfd_.valid(); }
  const std::string& fallback_reason() const { return fallback_; }
  int threads() const { return static_cast<int>(workers_.size()); }
  void inject_fault(int64_t after_writes, int err);  // tests: fail the n-th pwrite and later ones

 private:
  struct Piece {  // a checksummed run of bytes inside one chunk of a tensor
    uint64_t start, len;
    uint32_t crc;
  };
  struct Tensor {
    uint64_t file_off = 0, nbytes = 0;
    std::vector<std::vector<Piece>> chunks;  // the pieces seen so far, per chunk
  };
  struct Task {
    const uint8_t* src = nullptr;
    uint64_t len = 0;
    uint32_t tensor = 0;
    uint64_t tstart = 0;
  };
  struct Edge {  // a 4096-byte page of the file shared by several tasks, gathered in memory
    AlignedBuf buf;
    uint64_t remaining = 0;  // tensor bytes of the page not yet arrived
  };

  void open_file(bool direct);
  void write_header(const std::string& header);
  void fail(int e, const std::string& msg);
  void work(int idx);
  void process(const Task& task, int idx);
  std::vector<Piece> copy_and_checksum(const Task& task, uint64_t ia, uint64_t ib, uint8_t* bounce) const;
  int edge(uint32_t tensor, uint64_t fs, uint64_t fe, const uint8_t* src);
  int raw_write(bool direct, const uint8_t* p, uint64_t n, uint64_t off);
  bool combine_chunks(size_t i, FinishResult& r);

  std::string path_;
  uint64_t file_size_;
  uint64_t chunk_bytes_;
  uint64_t io_unit_ = 0;  // tasks never cross a multiple of this (a multiple of chunk_bytes_)
  Fd fd_, dfd_;           // buffered and (when usable) O_DIRECT descriptors of the file
  std::string fallback_;
  std::vector<Tensor> tensors_;
  std::vector<AlignedBuf> bounce_;  // per worker, io_unit_ bytes (O_DIRECT only)
  std::vector<std::thread> workers_;

  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::deque<Task> queue_;
  std::map<uint64_t, Edge> edges_;  // page index -> partly gathered page
  uint64_t submitted_ = 0, done_ = 0;
  bool stop_ = false, closed_ = false, finished_ = false;
  int err_ = 0;
  std::string err_msg_;

  std::atomic<int64_t> fault_after_{-1};
  std::atomic<int64_t> writes_{0};
  int fault_errno_ = 0;
};

}  // namespace io
}  // namespace gockpt
