#include "kernel_cache.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <vector>

#include "file_descriptor.hpp"
#include "mfa/errors.hpp"

namespace mfa::cpu {
namespace {

namespace fs = std::filesystem;

constexpr auto kStaleTemporary = std::chrono::hours(1);  // no compile takes this long
constexpr const char* kLibrarySuffix = ".so";
constexpr const char* kEntrySuffixes[] = {".so", ".so.sha256", ".cpp"};

bool is_temporary(const std::string& name) { return name.find(".tmp-") != std::string::npos; }

// The key of an entry file ("<key><suffix>"), or "" for anything else.
std::string entry_key(const std::string& name) {
  std::size_t dot = name.find('.');
  if (dot == 0 || dot == std::string::npos) return "";
  std::string_view suffix = std::string_view(name).substr(dot);
  for (const char* known : kEntrySuffixes) {
    if (suffix == known) return name.substr(0, dot);
  }
  return "";
}

struct Entry {
  std::string key;
  std::uint64_t bytes = 0;
  fs::file_time_type last_used = fs::file_time_type::min();
  bool has_library = false;
};

// Every entry of `dir`; removes stale temporary files on the way when asked.
std::vector<Entry> scan(const std::string& dir, bool remove_stale_temporaries) {
  std::map<std::string, Entry> entries;
  const auto stale_before = fs::file_time_type::clock::now() - kStaleTemporary;
  std::error_code error;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    std::error_code file_error;
    const fs::file_time_type modified = fs::last_write_time(it->path(), file_error);
    if (file_error) continue;  // vanished
    if (is_temporary(name)) {
      if (remove_stale_temporaries && modified < stale_before) fs::remove(it->path(), file_error);
      continue;
    }
    const std::string key = entry_key(name);
    if (key.empty()) continue;
    const std::uintmax_t bytes = fs::file_size(it->path(), file_error);
    if (file_error) continue;
    Entry& entry = entries[key];
    entry.key = key;
    entry.bytes += bytes;
    entry.last_used = std::max(entry.last_used, modified);
    entry.has_library |= name == key + kLibrarySuffix;
  }
  std::vector<Entry> list;
  for (auto& [key, entry] : entries) list.push_back(std::move(entry));
  return list;
}

enum class Removal { removed, gone, in_use };

bool same_file(const struct stat& a, const struct stat& b) { return a.st_dev == b.st_dev && a.st_ino == b.st_ino; }

// Whether `path` still names the file open as `fd` (it was not removed or replaced by rename).
bool still_named(int fd, const std::string& path) {
  struct stat opened {}, named {};
  return fstat(fd, &opened) == 0 && stat(path.c_str(), &named) == 0 && same_file(opened, named);
}

// Removes an entry's files. A library is removed only under an exclusive lock,
// which a loader's shared lock denies.
Removal remove_entry(const std::string& dir, const Entry& entry) {
  const std::string stem = dir + "/" + entry.key;
  const std::string library_path = stem + kLibrarySuffix;
  std::error_code ignored;
  if (entry.has_library) {
    FileDescriptor library(open(library_path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!library) return Removal::gone;
    if (flock(library.get(), LOCK_EX | LOCK_NB) != 0) return Removal::in_use;
    // Replaced meanwhile by a build of the same key, which someone may be loading: keep it.
    if (!still_named(library.get(), library_path)) return Removal::in_use;
    if (!fs::remove(library_path, ignored)) return Removal::gone;
  }
  for (const char* suffix : kEntrySuffixes) fs::remove(stem + suffix, ignored);
  return Removal::removed;
}

}  // namespace

std::string kernels_directory(const std::string& cache_dir) { return cache_dir + "/kernels"; }

std::uint64_t parse_byte_size(std::string_view text) {
  auto fail = [&]() -> std::uint64_t {
    throw ArgumentError("'" + std::string(text) +
                        "' is not a size in bytes: expected digits, optionally followed by K, M, G or T "
                        "(powers of 1024), e.g. 2G");
  };
  std::size_t digits = 0;
  std::uint64_t value = 0;
  constexpr std::uint64_t kMax = ~std::uint64_t(0);
  for (; digits < text.size() && text[digits] >= '0' && text[digits] <= '9'; ++digits) {
    const std::uint64_t digit = std::uint64_t(text[digits] - '0');
    if (value > (kMax - digit) / 10) return fail();
    value = value * 10 + digit;
  }
  if (digits == 0) return fail();
  std::string_view unit = text.substr(digits);
  if (unit.empty()) return value;
  const std::string_view units = "KMGT";
  const std::size_t power = unit.size() == 1 ? units.find(unit[0]) : std::string_view::npos;
  if (power == std::string_view::npos) return fail();
  const unsigned shift = 10 * unsigned(power + 1);
  if (value > (kMax >> shift)) return fail();
  return value << shift;
}

std::uint64_t default_cache_max_bytes() {
  const char* text = std::getenv("MFA_NATIVE_CACHE_MAX_BYTES");
  if (!text || !*text) return kDefaultCacheMaxBytes;
  try {
    return parse_byte_size(text);
  } catch (const ArgumentError& e) {
    throw ArgumentError(std::string("MFA_NATIVE_CACHE_MAX_BYTES: ") + e.what());
  }
}

CacheUsage cache_usage(const std::string& kernels_dir) {
  CacheUsage usage;
  for (const Entry& entry : scan(kernels_dir, false)) {
    ++usage.entries;
    usage.bytes += entry.bytes;
  }
  return usage;
}

Eviction evict_least_recently_used(const std::string& kernels_dir, std::uint64_t max_bytes) {
  std::vector<Entry> entries = scan(kernels_dir, true);
  std::uint64_t total = 0;
  for (const Entry& entry : entries) total += entry.bytes;
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.last_used < b.last_used; });
  Eviction eviction;
  for (const Entry& entry : entries) {
    if (total <= max_bytes) break;
    switch (remove_entry(kernels_dir, entry)) {
      case Removal::removed:
        ++eviction.entries;
        eviction.bytes += entry.bytes;
        total -= entry.bytes;
        break;
      case Removal::gone:  // another process evicted it
        total -= entry.bytes;
        break;
      case Removal::in_use:
        ++eviction.in_use;
        break;
    }
  }
  return eviction;
}

// ---- EntryLoadLock ---------------------------------------------------------

std::optional<EntryLoadLock> EntryLoadLock::acquire(const std::string& library) {
  FileDescriptor fd(open(library.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return std::nullopt;
  while (flock(fd.get(), LOCK_SH) != 0) {
    if (errno != EINTR) return std::nullopt;
  }
  // Eviction may have removed the file between open and lock: then it is a miss.
  if (!still_named(fd.get(), library)) return std::nullopt;
  return EntryLoadLock(std::move(fd));
}

bool EntryLoadLock::read(std::string& bytes) const {
  bytes.clear();
  char chunk[1 << 16];
  for (off_t at = 0;;) {
    ssize_t n = pread(fd_.get(), chunk, sizeof chunk, at);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    if (n == 0) return true;
    bytes.append(chunk, std::size_t(n));
    at += n;
  }
}

void EntryLoadLock::mark_used() const {
  futimens(fd_.get(), nullptr);  // best effort: a read-only cache still works, its order just does not change
}

}  // namespace mfa::cpu
