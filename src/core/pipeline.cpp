#include "mfa/pipeline.hpp"

#include <cmath>
#include <limits>
#include <sstream>

#include "core/sha256.hpp"
#include "mfa/errors.hpp"

namespace mfa {

std::string CompileOptions::cache_key() const {
  std::ostringstream key;
  key << "msl=" << language_version << ";fast_math=" << fast_math << ";bounds_check=" << bounds_check << ";sanitize=" << sanitize;
  for (const auto& [name, value] : macros) key << ";-D" << name << '=' << value;
  return key.str();
}

const ArgumentInfo* FunctionInfo::buffer(int index) const {
  for (const ArgumentInfo& argument : arguments)
    if (argument.kind == ArgumentKind::buffer && argument.index == index) return &argument;
  return nullptr;
}

Library::Library(std::string key, std::string source, std::vector<FunctionInfo> functions,
                 std::shared_ptr<BackendLibrary> backend)
    : key_(std::move(key)), source_(std::move(source)), functions_(std::move(functions)),
      backend_(std::move(backend)) {}

const FunctionInfo& Library::function(const std::string& name) const {
  std::string names;
  for (const FunctionInfo& function : functions_) {
    if (function.name == name) return function;
    names += (names.empty() ? "" : ", ") + function.name;
  }
  throw ArgumentError("no kernel named '" + name + "' in the source (it has: " +
                      (names.empty() ? "no kernel functions" : names) + ")");
}

// ---------------------------------------------------------------------------
// Function constants

namespace {

std::string describe(const FunctionConstantInfo& constant) {
  return "function constant '" + constant.name + "' (index " + std::to_string(constant.index) +
         ", " + constant.type + ")";
}

bool is_float_type(const std::string& type) {
  return type == "float" || type == "half" || type == "bfloat";
}

// Range of each integer type MSL allows for function constants.
bool integer_range(const std::string& type, long double& low, long double& high) {
  struct Range { const char* name; long double low, high; };
  static const Range ranges[] = {
      {"char", -128.0L, 127.0L},          {"uchar", 0.0L, 255.0L},
      {"short", -32768.0L, 32767.0L},     {"ushort", 0.0L, 65535.0L},
      {"int", -2147483648.0L, 2147483647.0L}, {"uint", 0.0L, 4294967295.0L},
      {"long", -9223372036854775808.0L, 9223372036854775807.0L},
      {"ulong", 0.0L, 18446744073709551615.0L},
  };
  for (const Range& range : ranges) {
    if (type == range.name) {
      low = range.low;
      high = range.high;
      return true;
    }
  }
  return false;
}

void check_value(const FunctionConstantInfo& constant, const ConstantValue& value) {
  const std::string& type = constant.type;
  if (type == "bool") {
    if (!std::holds_alternative<bool>(value))
      throw TypeError(describe(constant) + " needs a bool value");
    return;
  }
  if (is_float_type(type)) {
    if (std::holds_alternative<bool>(value))
      throw TypeError(describe(constant) + " needs a number, got a bool");
    return;
  }
  long double low = 0, high = 0;
  if (!integer_range(type, low, high))
    throw TypeError(describe(constant) + " has a type function constants cannot have");
  if (!std::holds_alternative<std::int64_t>(value))
    throw TypeError(describe(constant) + " needs an integer value");
  const long double v = static_cast<long double>(std::get<std::int64_t>(value));
  if (v < low || v > high)
    throw ArgumentError(describe(constant) + ": value " + std::to_string(std::get<std::int64_t>(value)) +
                        " is out of range for " + type);
}

std::string constant_text(const ConstantValue& value) {
  std::ostringstream text;
  text.precision(std::numeric_limits<double>::max_digits10);
  std::visit([&](auto v) { text << v; }, value);
  return text.str();
}

}  // namespace

FunctionConstants& FunctionConstants::set(const std::string& name, ConstantValue value) {
  values_.emplace_back(name, value);
  return *this;
}

FunctionConstants& FunctionConstants::set(int index, ConstantValue value) {
  values_.emplace_back(index, value);
  return *this;
}

std::map<int, ConstantValue> FunctionConstants::resolve(const FunctionInfo& function) const {
  std::map<int, ConstantValue> resolved;
  for (const auto& [key, value] : values_) {
    const FunctionConstantInfo* found = nullptr;
    for (const FunctionConstantInfo& constant : function.constants) {
      const bool match = std::holds_alternative<int>(key) ? constant.index == std::get<int>(key)
                                                          : constant.name == std::get<std::string>(key);
      if (match) found = &constant;
    }
    if (!found) {
      std::string known;
      for (const FunctionConstantInfo& constant : function.constants)
        known += (known.empty() ? "" : ", ") + constant.name + " (" + std::to_string(constant.index) + ")";
      const std::string what = std::holds_alternative<int>(key)
                                   ? "index " + std::to_string(std::get<int>(key))
                                   : "'" + std::get<std::string>(key) + "'";
      throw ArgumentError("kernel '" + function.name + "' has no function constant " + what +
                          " (it has: " + (known.empty() ? "none" : known) + ")");
    }
    check_value(*found, value);
    resolved[found->index] = value;
  }
  return resolved;
}

Pipeline::Pipeline(std::string key, std::shared_ptr<const Library> library, FunctionInfo function,
                   std::map<int, ConstantValue> constants, std::shared_ptr<BackendPipeline> backend)
    : key_(std::move(key)), library_(std::move(library)), function_(std::move(function)),
      constants_(std::move(constants)), backend_(std::move(backend)) {}

// ---------------------------------------------------------------------------
// The cache

namespace {

// Looks `key` up in `entries`; the first caller of a key builds it with
// `make` while later callers wait on the same future. A failed build is not
// kept, so the next request tries again (and gets the compiler's error again).
template <class T, class Make>
std::shared_ptr<const T> get_or_build(std::mutex& mutex,
                                      std::map<std::string, std::shared_future<std::shared_ptr<const T>>>& entries,
                                      std::uint64_t& hits, std::uint64_t& misses, const std::string& key,
                                      Make make) {
  std::promise<std::shared_ptr<const T>> promise;
  std::shared_future<std::shared_ptr<const T>> future;
  bool build = false;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = entries.find(key);
    if (found != entries.end()) {
      ++hits;
      future = found->second;
    } else {
      ++misses;
      future = promise.get_future().share();
      entries.emplace(key, future);
      build = true;
    }
  }
  if (build) {
    try {
      promise.set_value(make());
    } catch (...) {
      promise.set_exception(std::current_exception());
      std::lock_guard<std::mutex> lock(mutex);
      entries.erase(key);
    }
  }
  return future.get();
}

}  // namespace

std::shared_ptr<const Library> PipelineCache::library(const std::string& source, const CompileOptions& options,
                                                      const std::vector<unsigned char>* binary) {
  const std::string key = sha256_hex(options.cache_key() + '\n' + source);
  return get_or_build<Library>(mutex_, libraries_, stats_.library_hits, stats_.library_misses, key, [&] {
    std::vector<FunctionInfo> functions = reflect_msl(source);
    std::shared_ptr<BackendLibrary> compiled =
        binary ? backend_.load_library(source, *binary, options) : backend_.compile_library(source, options);
    return std::make_shared<const Library>(key, source, std::move(functions), std::move(compiled));
  });
}

std::shared_ptr<const Pipeline> PipelineCache::pipeline(const std::shared_ptr<const Library>& library,
                                                        const std::string& entry,
                                                        const FunctionConstants& constants) {
  const FunctionInfo& function = library->function(entry);
  std::map<int, ConstantValue> resolved = constants.resolve(function);
  std::string identity = library->key() + '\n' + entry;
  for (const auto& [index, value] : resolved)
    identity += '\n' + std::to_string(index) + '=' + std::to_string(value.index()) + ':' + constant_text(value);
  const std::string key = sha256_hex(identity);
  return get_or_build<Pipeline>(mutex_, pipelines_, stats_.pipeline_hits, stats_.pipeline_misses, key, [&] {
    std::shared_ptr<BackendPipeline> compiled =
        backend_.make_pipeline(library->backend(), function, resolved);
    return std::make_shared<const Pipeline>(key, library, function, resolved, std::move(compiled));
  });
}

PipelineCacheStats PipelineCache::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  PipelineCacheStats stats = stats_;
  stats.libraries = libraries_.size();
  stats.pipelines = pipelines_.size();
  return stats;
}

void PipelineCache::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  libraries_.clear();
  pipelines_.clear();
}

}  // namespace mfa
