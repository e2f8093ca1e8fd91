#include "mfa/device.hpp"

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "core/backends.hpp"
#include "mfa/errors.hpp"

namespace mfa {

struct Device::State {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<PipelineCache> cache;
  std::shared_ptr<BufferPool> pool;
  std::atomic<std::uint64_t> batches_committed{0};
  std::atomic<std::uint64_t> bytes_host_bound{0};
  std::atomic<std::uint64_t> bytes_staged_in{0};
  std::atomic<std::uint64_t> bytes_copied_back{0};

  explicit State(std::unique_ptr<Backend> b) : backend(std::move(b)) {
    cache = std::make_unique<PipelineCache>(*backend);
    Backend* raw = backend.get();
    pool = BufferPool::create([raw](std::size_t bytes) { return raw->allocate(bytes); },
                              backend->recommended_pool_limit(), backend->page_size());
  }
};

const std::shared_ptr<Device::State>& Device::state_for(DeviceKind kind) {
  static std::once_flag once[2];
  static std::shared_ptr<State> states[2];
  const int slot = kind == DeviceKind::cpu ? 0 : 1;
  std::call_once(once[slot], [&] {
    std::unique_ptr<Backend> backend;
    if (kind == DeviceKind::cpu) backend = make_cpu_backend();
#if defined(MFA_HAVE_METAL)
    if (kind == DeviceKind::metal) backend = make_metal_backend();
#endif
    if (backend) states[slot] = std::make_shared<State>(std::move(backend));
  });
  return states[slot];
}

std::vector<Device> Device::available() {
  std::vector<Device> devices;
  for (DeviceKind kind : {DeviceKind::metal, DeviceKind::cpu})
    if (const auto& state = state_for(kind)) devices.push_back(Device(state));
  return devices;
}

bool Device::is_available(DeviceKind kind) { return state_for(kind) != nullptr; }

Device Device::get(DeviceKind kind) {
  const auto& state = state_for(kind);
  if (!state) {
#if defined(MFA_HAVE_METAL)
    throw UnavailableError("no Metal device is available on this machine");
#else
    throw UnavailableError(std::string("the ") + to_string(kind) +
                           " device is not available: this build of mfa_native has no Metal backend "
                           "(Metal needs macOS on Apple silicon); use the cpu device");
#endif
  }
  return Device(state);
}

Device Device::default_device() {
  if (const char* requested = std::getenv("MFA_NATIVE_DEVICE"); requested && *requested) {
    DeviceKind kind;
    try {
      kind = device_kind_from_string(requested);
    } catch (const ArgumentError&) {
      throw ArgumentError(std::string("MFA_NATIVE_DEVICE must be 'cpu' or 'metal', got '") + requested + "'");
    }
    return get(kind);
  }
  return is_available(DeviceKind::metal) ? get(DeviceKind::metal) : get(DeviceKind::cpu);
}

DeviceKind Device::kind() const { return state_->backend->kind(); }
std::string Device::name() const { return state_->backend->name(); }
DeviceLimits Device::limits() const { return state_->backend->limits(); }
TuningFacts Device::tuning() const { return state_->backend->tuning(); }
std::vector<std::pair<std::string, std::string>> Device::properties() const {
  return state_->backend->properties();
}

namespace {

// The options as compiled: the cpu device takes MFA_NATIVE_SANITIZE when the
// caller names no sanitizer, and MFA_NATIVE_BOUNDS_CHECK=1 turns bounds checks
// on, so that every op of a process can run checked.
CompileOptions effective_options(const CompileOptions& options, DeviceKind kind) {
  CompileOptions effective = options;
  if (const char* bounds = std::getenv("MFA_NATIVE_BOUNDS_CHECK"); kind == DeviceKind::cpu && bounds != nullptr) {
    const std::string value = bounds;
    if (value != "0" && value != "1" && !value.empty()) {
      throw ArgumentError("MFA_NATIVE_BOUNDS_CHECK must be 1 (check every kernel) or 0, got '" + value + "'");
    }
    effective.bounds_check = effective.bounds_check || value == "1";
  }
  // MFA_NATIVE_SANITIZE=address is mfa_native.Kernel's (it runs kernels in a child process).
  if (const char* requested = std::getenv("MFA_NATIVE_SANITIZE"); kind == DeviceKind::cpu &&
      effective.sanitize.empty() && requested != nullptr && std::string(requested) != "address") {
    effective.sanitize = requested;
  }
  if (!effective.sanitize.empty() && effective.sanitize != "race" && effective.sanitize != "address") {
    throw ArgumentError("sanitize must be 'race', 'address' (or empty), got '" + effective.sanitize + "'" +
                        (options.sanitize.empty() ? " from MFA_NATIVE_SANITIZE" : ""));
  }
  // The address sanitizer sees heap and stack memory; the exact array checks see what it cannot
  // (an index past a threadgroup or thread array into its neighbour): asking for one asks for both.
  if (effective.sanitize == "address") effective.bounds_check = true;
  if (!effective.sanitize.empty() && kind != DeviceKind::cpu) {
    throw ArgumentError("sanitize='" + effective.sanitize + "' needs the cpu device");
  }
  return effective;
}

}  // namespace

std::shared_ptr<const Library> Device::library(const std::string& source, const CompileOptions& options,
                                               const std::vector<unsigned char>* binary) const {
  return state_->cache->library(source, effective_options(options, kind()), binary);
}

std::shared_ptr<const Pipeline> Device::pipeline(const std::shared_ptr<const Library>& library,
                                                 const std::string& entry,
                                                 const FunctionConstants& constants) const {
  return state_->cache->pipeline(library, entry, constants);
}

std::shared_ptr<const Pipeline> Device::pipeline(const std::string& source, const std::string& entry,
                                                 const FunctionConstants& constants,
                                                 const CompileOptions& options) const {
  return pipeline(library(source, options), entry, constants);
}

Buffer Device::new_buffer(std::size_t bytes) const { return state_->pool->acquire(bytes); }
BufferPool& Device::buffer_pool() const { return *state_->pool; }
PipelineCache& Device::pipeline_cache() const { return *state_->cache; }
Backend& Device::backend() const { return *state_->backend; }

BatchStats Device::batch_stats() const {
  return BatchStats{state_->batches_committed.load(), state_->bytes_host_bound.load(),
                    state_->bytes_staged_in.load(), state_->bytes_copied_back.load()};
}

void Device::count_commit(std::uint64_t host_bound, std::uint64_t staged_in) const {
  state_->batches_committed.fetch_add(1, std::memory_order_relaxed);
  state_->bytes_host_bound.fetch_add(host_bound, std::memory_order_relaxed);
  state_->bytes_staged_in.fetch_add(staged_in, std::memory_order_relaxed);
}

void Device::count_copy_back(std::uint64_t copied_back) const {
  state_->bytes_copied_back.fetch_add(copied_back, std::memory_order_relaxed);
}

}  // namespace mfa
