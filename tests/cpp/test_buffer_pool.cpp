#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "fake_backend.hpp"
#include "mfa/buffer.hpp"
#include "mfa/errors.hpp"

namespace {

using mfa::BufferPool;
using mfa::testing::FakeStorage;

struct CountingAllocator {
  std::shared_ptr<int> calls = std::make_shared<int>(0);
  BufferPool::Allocator get() {
    auto counter = calls;
    return [counter](std::size_t bytes) {
      ++*counter;
      return std::make_shared<FakeStorage>(bytes);
    };
  }
};

TEST(BufferPool, BucketsArePageRoundedPowersOfTwoThenEighths) {
  EXPECT_EQ(BufferPool::bucket_size(0, 4096), 4096u);
  EXPECT_EQ(BufferPool::bucket_size(1, 4096), 4096u);
  EXPECT_EQ(BufferPool::bucket_size(4097, 4096), 8192u);
  EXPECT_EQ(BufferPool::bucket_size(300000, 4096), 524288u);
  // Above 1 MiB, steps of 1/8 of the power of two keep waste under 12.5%.
  const std::size_t big = (std::size_t(1) << 21) + 1;
  const std::size_t bucket = BufferPool::bucket_size(big, 4096);
  EXPECT_GE(bucket, big);
  EXPECT_LE(double(bucket) / double(big), 1.125);
  EXPECT_EQ(bucket % 4096, 0u);
}

TEST(BufferPool, BuffersNameThePoolTheyReturnTo) {
  CountingAllocator allocator;
  auto pool = BufferPool::create(allocator.get(), 1 << 20, 4096);
  auto other = BufferPool::create(allocator.get(), 1 << 20, 4096);
  EXPECT_EQ(pool->acquire(10).pool(), pool.get());
  EXPECT_EQ(other->acquire(10).pool(), other.get());
  EXPECT_EQ(mfa::Buffer(std::make_shared<FakeStorage>(10), 10).pool(), nullptr);  // wrapped memory
}

TEST(BufferPool, ReusesStorageOfTheSameBucket) {
  CountingAllocator allocator;
  auto pool = BufferPool::create(allocator.get(), 1 << 20, 4096);
  void* first = nullptr;
  {
    mfa::Buffer a = pool->acquire(1000);
    first = a.data();
    std::memset(a.data(), 7, a.size());
    EXPECT_EQ(a.size(), 1000u);
    EXPECT_EQ(pool->stats().bytes_in_use, 4096u);
  }
  EXPECT_EQ(pool->stats().bytes_cached, 4096u);
  mfa::Buffer b = pool->acquire(3000);  // same 4 KiB bucket
  EXPECT_EQ(b.data(), first);
  EXPECT_EQ(*allocator.calls, 1);
  mfa::Buffer c = pool->acquire(5000);  // another bucket
  EXPECT_NE(c.data(), first);
  const mfa::BufferPoolStats stats = pool->stats();
  EXPECT_EQ(stats.hits, 1u);
  EXPECT_EQ(stats.misses, 2u);
  EXPECT_EQ(stats.bytes_cached, 0u);
  EXPECT_EQ(stats.bytes_in_use, 4096u + 8192u);
}

TEST(BufferPool, CopiesOfAHandleShareOneStorageUntilTheLastGoes) {
  CountingAllocator allocator;
  auto pool = BufferPool::create(allocator.get(), 1 << 20, 4096);
  mfa::Buffer copy;
  {
    mfa::Buffer a = pool->acquire(100);
    copy = a;
  }
  EXPECT_EQ(pool->stats().bytes_cached, 0u);  // still held by `copy`
  copy = mfa::Buffer();
  EXPECT_EQ(pool->stats().bytes_cached, 4096u);
}

TEST(BufferPool, TrimsLeastRecentlyReturnedFirst) {
  CountingAllocator allocator;
  auto pool = BufferPool::create(allocator.get(), 1 << 20, 4096);
  void* older;
  void* newer;
  {
    mfa::Buffer a = pool->acquire(4096);
    mfa::Buffer b = pool->acquire(4096);
    older = a.data();
    newer = b.data();
    a = mfa::Buffer();  // returned first: least recent
  }
  EXPECT_EQ(pool->stats().bytes_cached, 8192u);
  pool->trim(4096);
  EXPECT_EQ(pool->stats().bytes_cached, 4096u);
  EXPECT_EQ(pool->stats().trimmed, 1u);
  mfa::Buffer again = pool->acquire(4096);
  EXPECT_EQ(again.data(), newer);
  EXPECT_NE(again.data(), older);
}

TEST(BufferPool, StaysUnderItsLimitAsBuffersReturn) {
  CountingAllocator allocator;
  auto pool = BufferPool::create(allocator.get(), 3 * 4096, 4096);
  {
    std::vector<mfa::Buffer> held;
    for (int i = 0; i < 6; ++i) held.push_back(pool->acquire(4096));
  }
  EXPECT_LE(pool->stats().bytes_cached, 3u * 4096u);
  EXPECT_EQ(pool->stats().trimmed, 3u);
  pool->set_limit(0);
  EXPECT_EQ(pool->stats().bytes_cached, 0u);
}

TEST(BufferPool, OutlivedByItsBuffers) {
  CountingAllocator allocator;
  mfa::Buffer survivor;
  {
    auto pool = BufferPool::create(allocator.get(), 1 << 20, 4096);
    survivor = pool->acquire(64);
  }
  std::memset(survivor.data(), 1, survivor.size());  // storage is still alive
  survivor = mfa::Buffer();                          // and freed, not returned
}

TEST(BufferPool, ConcurrentAcquireAndReturnKeepsTheBooksBalanced) {
  CountingAllocator allocator;
  auto pool = BufferPool::create(allocator.get(), 1 << 22, 4096);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        mfa::Buffer b = pool->acquire(std::size_t(1 + (i * 7 + t) % 5) * 3000);
        static_cast<unsigned char*>(b.data())[0] = 1;
      }
    });
  for (auto& thread : threads) thread.join();
  const mfa::BufferPoolStats stats = pool->stats();
  EXPECT_EQ(stats.bytes_in_use, 0u);
  EXPECT_EQ(stats.hits + stats.misses, 2000u);
  EXPECT_LT(stats.misses, 100u);
}

TEST(BufferPool, RejectsAPageSizeThatIsNotAPowerOfTwo) {
  CountingAllocator allocator;
  EXPECT_THROW(BufferPool::create(allocator.get(), 0, 3000), mfa::ArgumentError);
}

}  // namespace
