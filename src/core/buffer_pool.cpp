#include "mfa/buffer.hpp"

#include "mfa/errors.hpp"

namespace mfa {

Buffer::Buffer(std::shared_ptr<BufferStorage> storage, std::size_t size, const BufferPool* pool)
    : storage_(std::move(storage)), size_(size), pool_(pool) {}

std::shared_ptr<BufferPool> BufferPool::create(Allocator allocate, std::size_t limit,
                                               std::size_t page_size) {
  return std::shared_ptr<BufferPool>(new BufferPool(std::move(allocate), limit, page_size));
}

BufferPool::BufferPool(Allocator allocate, std::size_t limit, std::size_t page_size)
    : allocate_(std::move(allocate)), page_size_(page_size) {
  if (page_size_ == 0 || (page_size_ & (page_size_ - 1)) != 0)
    throw ArgumentError("BufferPool page_size must be a power of two, got " + std::to_string(page_size));
  stats_.limit = limit;
}

std::size_t BufferPool::bucket_size(std::size_t bytes, std::size_t page_size) {
  std::size_t pages = (bytes == 0 ? 1 : (bytes + page_size - 1) / page_size);
  std::size_t size = pages * page_size;
  std::size_t power = page_size;
  while (power < size) power <<= 1;
  constexpr std::size_t kFineAbove = std::size_t(1) << 20;
  if (power <= kFineAbove) return power;
  // size lies in (power/2, power]: steps of 1/8 of power/2 waste <= 12.5%.
  std::size_t step = power / 16;
  return (size + step - 1) / step * step;
}

Buffer BufferPool::acquire(std::size_t bytes) {
  const std::size_t bucket = bucket_size(bytes, page_size_);
  std::shared_ptr<BufferStorage> storage;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = by_size_.find(bucket);
    if (found != by_size_.end()) {
      storage = std::move(found->second->storage);
      lru_.erase(found->second);
      by_size_.erase(found);
      stats_.bytes_cached -= bucket;
      ++stats_.hits;
    } else {
      ++stats_.misses;
    }
    stats_.bytes_in_use += bucket;
  }
  if (!storage) {
    try {
      storage = allocate_(bucket);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      stats_.bytes_in_use -= bucket;
      throw;
    }
  }
  // The handle given out returns the storage to this pool when the last copy
  // of it goes away (or frees it, if the pool is gone by then).
  std::weak_ptr<BufferPool> pool = weak_from_this();
  BufferStorage* raw = storage.get();
  std::shared_ptr<BufferStorage> handle(
      raw, [pool, bucket, owner = std::move(storage)](BufferStorage*) mutable {
        if (auto alive = pool.lock()) alive->give_back(bucket, std::move(owner));
      });
  return Buffer(std::move(handle), bytes, this);
}

void BufferPool::give_back(std::size_t bucket, std::shared_ptr<BufferStorage> storage) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.bytes_in_use -= bucket;
  lru_.push_front(Cached{bucket, std::move(storage)});
  by_size_.emplace(bucket, lru_.begin());
  stats_.bytes_cached += bucket;
  trim_locked(stats_.limit);
}

void BufferPool::trim(std::size_t limit) {
  std::lock_guard<std::mutex> lock(mutex_);
  trim_locked(limit);
}

void BufferPool::set_limit(std::size_t limit) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.limit = limit;
  trim_locked(limit);
}

void BufferPool::trim_locked(std::size_t limit) {
  while (stats_.bytes_cached > limit && !lru_.empty()) {
    auto oldest = std::prev(lru_.end());
    const std::size_t bucket = oldest->bucket;
    auto range = by_size_.equal_range(bucket);
    for (auto it = range.first; it != range.second; ++it) {
      if (it->second == oldest) {
        by_size_.erase(it);
        break;
      }
    }
    lru_.erase(oldest);
    stats_.bytes_cached -= bucket;
    ++stats_.trimmed;
  }
}

BufferPoolStats BufferPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace mfa
