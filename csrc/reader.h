// The checkpoint reader: several threads pread byte ranges of one file straight into
// destination memory (O_DIRECT when possible, through an aligned bounce buffer where the
// destination is not aligned), checking every chunk's crc32c. Bound in module.cpp, wrapped by
// gockpt/storage/io.py.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace gockpt {
namespace io {

// One byte range of the file and where it goes.
struct ReadItem {
  uint64_t file_off = 0, nbytes = 0;
  uintptr_t dst = 0;          // address of nbytes of writable memory
  uint64_t chunk_bytes = 0;   // checksum granularity (the manifest's "block_bytes")
  std::vector<uint32_t> crcs;  // expected crc32c per chunk (only read when verifying)
};

// What read_into() found.
struct ReadResult {
  int err = 0;                // 0, the errno of the first failed read, or EINVAL for an unsound item
  std::string msg;
  int64_t bad_item = -1;      // the item whose read failed, or -1
  bool direct = false;        // whether O_DIRECT was used
  std::vector<std::tuple<uint32_t, uint64_t, uint32_t>> mismatches;  // (item, chunk, crc found), sorted
  std::vector<std::pair<uint32_t, uint64_t>> truncated;              // (item, file offset of EOF), sorted
};

// pread every item's bytes into item.dst (several threads, O_DIRECT when possible), checking
// each chunk's crc32c against item.crcs when verify. Every item is checked first (a chunk size
// > 0, file offsets within off_t, an address range that does not wrap, one checksum per chunk
// when verifying): if one is not, nothing is read and err is EINVAL with bad_item and msg.
ReadResult read_into(const std::string& path, const std::vector<ReadItem>& items, bool verify,
                     int threads, bool direct);

}  // namespace io
}  // namespace gockpt
