// The kernels directory of the disk cache, bounded in size. An entry is the
// files of one key: <key>.so, <key>.so.sha256 and <key>.cpp; names holding
// ".tmp-" are a writer's temporary files. An entry's last use is the newest
// modification time of its files (a hit renews the library's). Several
// processes share the directory: a process loading an entry holds a shared
// lock on its library, which eviction never takes away; files that vanish
// (another process evicted them) are a miss, and the entry is rebuilt.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "file_descriptor.hpp"

namespace mfa::cpu {

constexpr std::uint64_t kDefaultCacheMaxBytes = std::uint64_t(2) << 30;  // 2 GiB

// "<cache_dir>/kernels".
std::string kernels_directory(const std::string& cache_dir);

// A number of bytes, optionally followed by K, M, G or T (powers of 1024).
// Throws ArgumentError for anything else (negative, fractional, overflowing).
std::uint64_t parse_byte_size(std::string_view text);

// MFA_NATIVE_CACHE_MAX_BYTES (parse_byte_size), else kDefaultCacheMaxBytes.
std::uint64_t default_cache_max_bytes();

struct CacheUsage {
  std::uint64_t entries = 0;
  std::uint64_t bytes = 0;  // all files of the entries; temporary files are not counted
};

struct Eviction {
  std::uint64_t entries = 0;  // removed by this call
  std::uint64_t bytes = 0;
  std::uint64_t in_use = 0;   // kept: another thread or process was loading them
};

CacheUsage cache_usage(const std::string& kernels_dir);

// Removes the least recently used entries until at most `max_bytes` remain,
// and temporary files older than an hour (left by a writer that died).
// Never throws: files that are gone or cannot be removed are skipped.
Eviction evict_least_recently_used(const std::string& kernels_dir, std::uint64_t max_bytes);

// A shared lock on an entry's library while this process reads and loads it.
class EntryLoadLock {
 public:
  // Opens and locks `library`; nullopt when there is no such file (the entry
  // is missing, or was evicted before the lock was taken).
  static std::optional<EntryLoadLock> acquire(const std::string& library);
  // The locked file's contents; false if it cannot be read.
  bool read(std::string& bytes) const;
  // Makes the entry the most recently used (its library's modification time is now).
  void mark_used() const;

 private:
  explicit EntryLoadLock(FileDescriptor fd) : fd_(std::move(fd)) {}
  FileDescriptor fd_;
};

}  // namespace mfa::cpu
