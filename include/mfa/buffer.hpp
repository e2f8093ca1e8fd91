// Device memory: a backend's storage, a shared handle to it, and a
// size-bucketed pool that reuses storage between dispatches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>

namespace mfa {

// Memory a backend owns or wraps. contents() is host-visible (unified memory
// on Apple GPUs, plain memory on the cpu backend).
class BufferStorage {
 public:
  virtual ~BufferStorage() = default;
  virtual void* contents() = 0;
  virtual std::size_t size() const = 0;
};

// A shared handle to storage; size() is what was asked for, which may be less
// than the storage's (page-rounded, bucketed) size.
class BufferPool;

class Buffer {
 public:
  Buffer() = default;
  // `pool`: the pool the storage returns to, or nullptr (wrapped memory).
  Buffer(std::shared_ptr<BufferStorage> storage, std::size_t size, const BufferPool* pool = nullptr);

  void* data() const { return storage_ ? storage_->contents() : nullptr; }
  std::size_t size() const { return size_; }
  BufferStorage* storage() const { return storage_.get(); }
  const BufferPool* pool() const { return pool_; }
  explicit operator bool() const { return storage_ != nullptr; }

 private:
  std::shared_ptr<BufferStorage> storage_;
  std::size_t size_ = 0;
  const BufferPool* pool_ = nullptr;
};

struct BufferPoolStats {
  std::uint64_t hits = 0;       // acquire() served from the cache
  std::uint64_t misses = 0;     // acquire() that allocated
  std::uint64_t trimmed = 0;    // cached buffers freed by trimming
  std::size_t bytes_cached = 0; // free storage held for reuse
  std::size_t bytes_in_use = 0; // storage handed out and not yet returned
  std::size_t limit = 0;        // bytes_cached is trimmed back to this
};

// Reuses storage by size bucket. Storage returns to the pool when the last
// Buffer handle to it goes away; least recently returned storage is freed
// first when the cache grows past its limit. Thread-safe.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  using Allocator = std::function<std::shared_ptr<BufferStorage>(std::size_t bytes)>;

  // Use create(): the pool must be owned by a shared_ptr.
  static std::shared_ptr<BufferPool> create(Allocator allocate, std::size_t limit,
                                            std::size_t page_size = 16384);

  Buffer acquire(std::size_t bytes);
  void trim(std::size_t limit);   // free cached storage until bytes_cached <= limit
  void set_limit(std::size_t limit);
  BufferPoolStats stats() const;

  // The storage size a request of `bytes` is served with: page-rounded, then
  // a power of two, or a multiple of 1/8 of one above 1 MiB (<= 12.5% waste).
  static std::size_t bucket_size(std::size_t bytes, std::size_t page_size);

 private:
  BufferPool(Allocator allocate, std::size_t limit, std::size_t page_size);
  void give_back(std::size_t bucket, std::shared_ptr<BufferStorage> storage);
  void trim_locked(std::size_t limit);

  Allocator allocate_;
  std::size_t page_size_;
  mutable std::mutex mutex_;
  BufferPoolStats stats_;
  struct Cached {
    std::size_t bucket;
    std::shared_ptr<BufferStorage> storage;
  };
  // Free storage, most recently returned at the front; indexed by bucket.
  std::list<Cached> lru_;
  std::multimap<std::size_t, std::list<Cached>::iterator> by_size_;
};

}  // namespace mfa
