#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "fiber.hpp"
#include "mfa/errors.hpp"

namespace mfa::cpu {
namespace {

std::size_t page_size() {
  static const std::size_t size = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

}  // namespace

FiberStack::FiberStack(std::size_t bytes) {
  const std::size_t page = page_size();
  usable_bytes_ = (bytes + page - 1) / page * page;
  mapping_bytes_ = usable_bytes_ + page;  // the guard page sits below the stack
  int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
#ifdef MAP_STACK
  flags |= MAP_STACK;
#endif
  void* mapping = mmap(nullptr, mapping_bytes_, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (mapping == MAP_FAILED) {
    throw Error("cannot map a fiber stack of " + std::to_string(mapping_bytes_) +
                " bytes: " + std::strerror(errno));
  }
  if (mprotect(mapping, page, PROT_NONE) != 0) {
    const int error = errno;
    munmap(mapping, mapping_bytes_);
    throw Error(std::string("cannot protect a fiber stack's guard page: ") + std::strerror(error));
  }
  mapping_ = mapping;
  usable_ = static_cast<char*>(mapping) + page;
}

FiberStack::~FiberStack() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_bytes_);
#ifdef MFA_FIBER_TSAN
  if (tsan_fiber_ != nullptr) destroy_tsan_fiber(tsan_fiber_);
#endif
}

FiberStack::FiberStack(FiberStack&& other) noexcept
    : mapping_(std::exchange(other.mapping_, nullptr)),
      mapping_bytes_(std::exchange(other.mapping_bytes_, 0)),
      usable_(std::exchange(other.usable_, nullptr)),
      usable_bytes_(std::exchange(other.usable_bytes_, 0)) {
#ifdef MFA_FIBER_TSAN
  tsan_fiber_ = std::exchange(other.tsan_fiber_, nullptr);
#endif
}

}  // namespace mfa::cpu
