// The bounded kernel disk cache on its own: sizes, least-recently-used order,
// the limit, locks of entries being loaded, stale temporaries. Entries here are
// plain files; test_kernel_compiler.cpp covers eviction through real compiles.
#include <gtest/gtest.h>

#include <stdlib.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "kernel_cache.hpp"
#include "mfa/errors.hpp"

namespace {

namespace fs = std::filesystem;
using mfa::cpu::cache_usage;
using mfa::cpu::EntryLoadLock;
using mfa::cpu::evict_least_recently_used;
using mfa::cpu::parse_byte_size;

class KernelCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/mfa_kernel_cache_test_XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  void write(const std::string& name, std::size_t bytes, int minutes_ago) const {
    std::ofstream(dir_ / name, std::ios::binary) << std::string(bytes, 'x');
    fs::last_write_time(dir_ / name, fs::file_time_type::clock::now() - std::chrono::minutes(minutes_ago));
  }
  // An entry of 1000 + 100 + 400 bytes whose files were last written `minutes_ago`.
  void entry(const std::string& key, int minutes_ago) const {
    write(key + ".so", 1000, minutes_ago);
    write(key + ".so.sha256", 100, minutes_ago);
    write(key + ".cpp", 400, minutes_ago);
  }
  bool has(const std::string& name) const { return fs::exists(dir_ / name); }
  std::vector<std::string> keys() const {
    std::vector<std::string> found;
    for (const char* key : {"a", "b", "c", "d"}) {
      if (has(std::string(key) + ".so")) found.push_back(key);
    }
    return found;
  }
  std::string dir() const { return dir_.string(); }

  static constexpr std::uint64_t kEntry = 1500;
  fs::path dir_;
};

TEST_F(KernelCacheTest, UsageCountsEntriesAndTheirFilesButNotTemporaries) {
  EXPECT_EQ(cache_usage(dir() + "/missing").entries, 0u);
  entry("a", 4);
  entry("b", 3);
  write("c.cpp", 400, 1);                   // a source whose compile failed: an entry too
  write("d.so.tmp-1-2-3", 5000, 0);         // a writer in progress
  write("d.tmp-1-2-3.cpp", 5000, 0);
  write("notes.txt", 7000, 0);              // not ours
  auto usage = cache_usage(dir());
  EXPECT_EQ(usage.entries, 3u);
  EXPECT_EQ(usage.bytes, 2 * kEntry + 400);
}

TEST_F(KernelCacheTest, EvictsLeastRecentlyUsedFirstDownToTheLimit) {
  entry("a", 30);
  entry("b", 10);
  entry("c", 40);  // oldest
  entry("d", 20);
  fs::last_write_time(dir_ / "c.so", fs::file_time_type::clock::now());  // a hit renewed c
  // Under or at the limit: nothing goes.
  EXPECT_EQ(evict_least_recently_used(dir(), 4 * kEntry).entries, 0u);
  EXPECT_EQ(keys().size(), 4u);
  // One byte over: the least recently used entry (a) goes, whole.
  auto eviction = evict_least_recently_used(dir(), 4 * kEntry - 1);
  EXPECT_EQ(eviction.entries, 1u);
  EXPECT_EQ(eviction.bytes, kEntry);
  EXPECT_EQ(keys(), (std::vector<std::string>{"b", "c", "d"}));
  EXPECT_FALSE(has("a.so.sha256") || has("a.cpp"));
  // Room for one and a half: d then b go, c (the hit) stays.
  eviction = evict_least_recently_used(dir(), kEntry + kEntry / 2);
  EXPECT_EQ(eviction.entries, 2u);
  EXPECT_EQ(keys(), (std::vector<std::string>{"c"}));
  EXPECT_LE(cache_usage(dir()).bytes, kEntry + kEntry / 2);
  // Zero clears everything.
  EXPECT_EQ(evict_least_recently_used(dir(), 0).entries, 1u);
  EXPECT_EQ(cache_usage(dir()).entries, 0u);
}

TEST_F(KernelCacheTest, AnEntryBeingLoadedIsNeverEvicted) {
  entry("a", 30);
  entry("b", 20);
  {
    std::optional<EntryLoadLock> loading = EntryLoadLock::acquire(dir() + "/a.so");
    ASSERT_TRUE(loading);
    auto eviction = evict_least_recently_used(dir(), 0);
    EXPECT_EQ(eviction.entries, 1u);
    EXPECT_EQ(eviction.in_use, 1u);
    EXPECT_EQ(keys(), (std::vector<std::string>{"a"}));
    EXPECT_TRUE(has("a.so.sha256") && has("a.cpp"));
    std::string bytes;
    ASSERT_TRUE(loading->read(bytes));
    EXPECT_EQ(bytes, std::string(1000, 'x'));
  }
  // Loaded (the lock is gone): now it may go.
  auto eviction = evict_least_recently_used(dir(), 0);
  EXPECT_EQ(eviction.entries, 1u);
  EXPECT_EQ(eviction.in_use, 0u);
  EXPECT_TRUE(keys().empty());
}

TEST_F(KernelCacheTest, ALockOnAMissingLibraryIsAMissAndAHitRenewsTheEntry) {
  EXPECT_FALSE(EntryLoadLock::acquire(dir() + "/missing.so"));
  entry("a", 5);
  std::optional<EntryLoadLock> lock = EntryLoadLock::acquire(dir() + "/a.so");
  ASSERT_TRUE(lock);
  lock->mark_used();
  auto age = fs::file_time_type::clock::now() - fs::last_write_time(dir_ / "a.so");
  EXPECT_LT(age, std::chrono::minutes(1));  // renewed from 5 minutes ago
}

TEST_F(KernelCacheTest, StaleTemporariesAreRemovedFreshOnesKept) {
  write("a.so.tmp-1-2-3", 10, 2 * 60);      // a writer that died two hours ago
  write("a.tmp-1-2-4.cpp", 10, 2 * 60);
  write("b.so.tmp-1-2-5", 10, 1);           // a compile in progress
  write("notes.txt", 10, 2 * 60);           // not ours: never touched
  evict_least_recently_used(dir(), kEntry);
  EXPECT_FALSE(has("a.so.tmp-1-2-3") || has("a.tmp-1-2-4.cpp"));
  EXPECT_TRUE(has("b.so.tmp-1-2-5") && has("notes.txt"));
}

TEST(ByteSize, ParsesBytesAndBinaryUnits) {
  EXPECT_EQ(parse_byte_size("0"), 0u);
  EXPECT_EQ(parse_byte_size("12345"), 12345u);
  EXPECT_EQ(parse_byte_size("1K"), 1024u);
  EXPECT_EQ(parse_byte_size("512M"), 512ull << 20);
  EXPECT_EQ(parse_byte_size("2G"), 2ull << 30);
  EXPECT_EQ(parse_byte_size("3T"), 3ull << 40);
  EXPECT_EQ(parse_byte_size("18446744073709551615"), ~0ull);
  for (const char* bad : {"", "-1", "1.5G", "G", "2GB", "2g", "2 G", " 2", "abc", "18446744073709551616",
                          "16777216T"}) {
    EXPECT_THROW(parse_byte_size(bad), mfa::ArgumentError) << bad;
  }
}

TEST(ByteSize, TheLimitComesFromTheEnvironment) {
  ASSERT_EQ(unsetenv("MFA_NATIVE_CACHE_MAX_BYTES"), 0);
  EXPECT_EQ(mfa::cpu::default_cache_max_bytes(), 2ull << 30);
  setenv("MFA_NATIVE_CACHE_MAX_BYTES", "64M", 1);
  EXPECT_EQ(mfa::cpu::default_cache_max_bytes(), 64ull << 20);
  setenv("MFA_NATIVE_CACHE_MAX_BYTES", "lots", 1);
  try {
    mfa::cpu::default_cache_max_bytes();
    FAIL() << "accepted 'lots'";
  } catch (const mfa::ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("MFA_NATIVE_CACHE_MAX_BYTES: 'lots' is not a size in bytes"),
              std::string::npos) << e.what();
  }
  unsetenv("MFA_NATIVE_CACHE_MAX_BYTES");
}

}  // namespace
