// Compiled kernels and the two-level cache that holds them:
//   library  key = hash(source, compile options)
//   pipeline key = (library, entry point, function-constant values)
#pragma once

#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <variant>
#include <vector>

#include "mfa/backend.hpp"
#include "mfa/reflection.hpp"
#include "mfa/types.hpp"

namespace mfa {

// Always owned by a shared_ptr (the cache makes them), so a Library or
// Pipeline reference can recover its owner with shared_from_this().
class Library : public std::enable_shared_from_this<Library> {
 public:
  Library(std::string key, std::string source, std::vector<FunctionInfo> functions,
          std::shared_ptr<BackendLibrary> backend);

  const std::string& key() const { return key_; }
  const std::string& source() const { return source_; }
  const std::vector<FunctionInfo>& functions() const { return functions_; }
  // Throws ArgumentError naming the kernels the library does have.
  const FunctionInfo& function(const std::string& name) const;
  const BackendLibrary& backend() const { return *backend_; }

 private:
  std::string key_;
  std::string source_;
  std::vector<FunctionInfo> functions_;
  std::shared_ptr<BackendLibrary> backend_;
};

// Function-constant values set by name or by index.
class FunctionConstants {
 public:
  FunctionConstants& set(const std::string& name, ConstantValue value);
  FunctionConstants& set(int index, ConstantValue value);
  bool empty() const { return values_.empty(); }

  // Maps every value to the index the kernel declares for it. Throws
  // ArgumentError for an unknown name or index, a value that does not fit the
  // declared type, or a required constant left unset.
  std::map<int, ConstantValue> resolve(const FunctionInfo& function) const;

 private:
  std::vector<std::pair<std::variant<int, std::string>, ConstantValue>> values_;
};

class Pipeline : public std::enable_shared_from_this<Pipeline> {
 public:
  Pipeline(std::string key, std::shared_ptr<const Library> library, FunctionInfo function,
           std::map<int, ConstantValue> constants, std::shared_ptr<BackendPipeline> backend);

  const std::string& key() const { return key_; }
  const std::string& name() const { return function_.name; }
  const FunctionInfo& function() const { return function_; }
  const Library& library() const { return *library_; }
  const std::map<int, ConstantValue>& constants() const { return constants_; }
  std::uint32_t max_total_threads_per_threadgroup() const {
    return backend_->max_total_threads_per_threadgroup();
  }
  const BackendPipeline& backend() const { return *backend_; }

 private:
  std::string key_;
  std::shared_ptr<const Library> library_;
  FunctionInfo function_;
  std::map<int, ConstantValue> constants_;
  std::shared_ptr<BackendPipeline> backend_;
};

struct PipelineCacheStats {
  std::uint64_t library_hits = 0, library_misses = 0;
  std::uint64_t pipeline_hits = 0, pipeline_misses = 0;
  std::size_t libraries = 0, pipelines = 0;
};

// Thread-safe. Concurrent requests for one key compile once; the others wait
// for that result (or its exception).
class PipelineCache {
 public:
  explicit PipelineCache(Backend& backend) : backend_(backend) {}

  // `binary`: the backend's compiled form of `source` (Backend::load_library),
  // or nullptr to compile. The key is the source's and the options' either
  // way: a library made from a binary is the one compiled from its source.
  std::shared_ptr<const Library> library(const std::string& source, const CompileOptions& options,
                                         const std::vector<unsigned char>* binary = nullptr);
  std::shared_ptr<const Pipeline> pipeline(const std::shared_ptr<const Library>& library,
                                           const std::string& entry,
                                           const FunctionConstants& constants);
  PipelineCacheStats stats() const;
  void clear();

 private:
  Backend& backend_;
  mutable std::mutex mutex_;
  PipelineCacheStats stats_;
  std::map<std::string, std::shared_future<std::shared_ptr<const Library>>> libraries_;
  std::map<std::string, std::shared_future<std::shared_ptr<const Pipeline>>> pipelines_;
};

}  // namespace mfa
