// The checkpoint reader (reader.h): items cut into tasks of whole chunks, a pool of threads
// reading them (O_DIRECT with a buffered retry where refused) and verifying each chunk.
#include "reader.h"

#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <new>
#include <thread>

#include "crc32c.h"
#include "io_util.h"

namespace gockpt {
namespace io {

namespace {

// A run of whole checksum chunks of one item, about kIoBytes long, read with one pread
// (O_DIRECT: straight into an aligned destination) and then checksummed per chunk.
struct Task {
  uint32_t item;
  uint64_t first_chunk, nchunks;
};

std::vector<Task> plan_tasks(const std::vector<ReadItem>& items) {
  std::vector<Task> tasks;
  for (uint32_t i = 0; i < items.size(); i++) {
    const ReadItem& it = items[i];
    if (it.chunk_bytes == 0 || it.nbytes == 0) continue;
    uint64_t nc = (it.nbytes + it.chunk_bytes - 1) / it.chunk_bytes;
    uint64_t per = std::max<uint64_t>(1, kIoBytes / it.chunk_bytes);
    for (uint64_t k = 0; k < nc; k += per) tasks.push_back(Task{i, k, std::min(per, nc - k)});
  }
  return tasks;
}

// One read_into() call: the open file, its tasks, the result the workers fill in.
class Reader {
 public:
  Reader(const std::string& path, const std::vector<ReadItem>& items, bool verify, Fd fd)
      : path_(path), items_(items), verify_(verify), fd_(std::move(fd)), tasks_(plan_tasks(items)) {}

  ReadResult run(int threads, bool direct);

 private:
  void work();
  bool run_task(const Task& task, AlignedBuf& bounce);
  void verify_chunks(const Task& task, const uint8_t* dst, uint64_t len);
  int64_t read_range(uint8_t* dst, uint64_t n, uint64_t foff, AlignedBuf& bounce);

  const std::string& path_;
  const std::vector<ReadItem>& items_;
  const bool verify_;
  Fd fd_, dfd_;
  const std::vector<Task> tasks_;
  std::atomic<size_t> next_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;  // guards res_
  ReadResult res_;
};

ReadResult Reader::run(int threads, bool direct) {
#ifdef O_DIRECT
  if (direct) dfd_ = Fd(::open(path_.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
#else
  (void)direct;
#endif
  res_.direct = dfd_.valid();
  int n = resolve_threads(threads);
  n = static_cast<int>(std::min<size_t>(n, std::max<size_t>(1, tasks_.size())));
  std::vector<std::thread> pool;
  for (int i = 1; i < n; i++) pool.emplace_back([this] { work(); });
  work();
  for (auto& t : pool) t.join();
  dfd_.reset();
  fd_.reset();
  std::sort(res_.mismatches.begin(), res_.mismatches.end());
  std::sort(res_.truncated.begin(), res_.truncated.end());
  return std::move(res_);
}

void Reader::work() {
  AlignedBuf bounce;  // allocated on first need
  for (;;) {
    if (stop_.load()) return;
    size_t ti = next_.fetch_add(1);
    if (ti >= tasks_.size()) return;
    if (!run_task(tasks_[ti], bounce)) return;
  }
}

// Reads one task and checks its chunks; false when the read failed (every worker stops).
bool Reader::run_task(const Task& task, AlignedBuf& bounce) {
  const ReadItem& it = items_[task.item];
  uint64_t start = task.first_chunk * it.chunk_bytes;
  uint64_t len = std::min(task.nchunks * it.chunk_bytes, it.nbytes - start);
  uint8_t* dst = reinterpret_cast<uint8_t*>(it.dst) + start;
  int64_t got = read_range(dst, len, it.file_off + start, bounce);
  if (got < 0) {
    std::lock_guard<std::mutex> g(mu_);
    if (!res_.err) {
      res_.err = static_cast<int>(-got);
      res_.msg = "reading " + path_ + " at offset " + std::to_string(it.file_off + start) + " failed: " +
                 std::strerror(static_cast<int>(-got));
      res_.bad_item = task.item;
    }
    stop_ = true;
    return false;
  }
  if (static_cast<uint64_t>(got) < len) {
    std::lock_guard<std::mutex> g(mu_);
    res_.truncated.push_back({task.item, it.file_off + start + static_cast<uint64_t>(got)});
    return true;
  }
  if (verify_) verify_chunks(task, dst, len);
  return true;
}

// Compares the crc32c of each chunk of the task (len bytes read to dst) with the item's.
void Reader::verify_chunks(const Task& task, const uint8_t* dst, uint64_t len) {
  const ReadItem& it = items_[task.item];
  for (uint64_t k = 0; k < task.nchunks; k++) {
    uint64_t cs = k * it.chunk_bytes, cn = std::min(it.chunk_bytes, len - cs);
    uint32_t crc = crc32c(0, dst + cs, cn);
    uint64_t chunk = task.first_chunk + k;
    if (chunk >= it.crcs.size() || crc != it.crcs[chunk]) {
      std::lock_guard<std::mutex> g(mu_);
      res_.mismatches.push_back({task.item, chunk, crc});
    }
  }
}

// Reads [foff, foff+n) into dst; returns bytes read (short at EOF) or -errno.
int64_t Reader::read_range(uint8_t* dst, uint64_t n, uint64_t foff, AlignedBuf& bounce) {
  uint64_t done = 0;
  while (done < n) {
    uint64_t fo = foff + done, m = n - done;
    int64_t got;
    if (dfd_.valid() && fo % kAlign == 0) {
      if (aligned_ptr(dst + done) && m >= kAlign) {
        got = pread_full(dfd_.get(), dst + done, round_down(m, kAlign), fo);
      } else {
        try {
          if (bounce.empty()) bounce = AlignedBuf(kIoBytes);
        } catch (const std::bad_alloc&) {
          return -ENOMEM;
        }
        uint64_t take = std::min(m, kIoBytes);
        got = pread_full(dfd_.get(), bounce.data(), round_up(take, kAlign), fo);
        if (got > 0) {
          got = std::min<int64_t>(got, static_cast<int64_t>(take));
          std::memcpy(dst + done, bounce.data(), static_cast<size_t>(got));
        }
      }
      if (got == -EINVAL) got = pread_full(fd_.get(), dst + done, m, fo);  // O_DIRECT refused: buffered
    } else {
      got = pread_full(fd_.get(), dst + done, m, fo);
    }
    if (got < 0) return got;
    if (got == 0) break;
    done += static_cast<uint64_t>(got);
  }
  return static_cast<int64_t>(done);
}

}  // namespace

ReadResult read_into(const std::string& path, const std::vector<ReadItem>& items, bool verify,
                     int threads, bool direct) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    ReadResult res;
    res.err = e;
    res.msg = std::string("cannot open ") + path + ": " + std::strerror(e);
    return res;
  }
  Reader reader(path, items, verify, Fd(fd));
  return reader.run(threads, direct);
}

}  // namespace io
}  // namespace gockpt
