// Pass templates read from JSON, and their evaluation for a call's sizes: the
// C++ twin of python/mfa_native/runtime/templates.py (schema 1). evaluate()
// follows the same rules as Python's: the template's sizes (each must be
// given), the derived sizes in order, every guard, then each expression.
// Caller buffers' (inputs' and inouts') strides get 0 on axes of extent 1;
// nbytes is a caller buffer's span, an output's or intermediate's contiguous
// size, a constant's 4 bytes a word.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "json.hpp"
#include "mfa/types.hpp"
#include "size_expression.hpp"

namespace mfa {

constexpr int kTemplateSchema = 1;

struct KernelTemplate {
  std::string entry;
  std::string source;
  // The device's compiled form of `source` a bundle stores (`bundle --metallib`:
  // a Metal library), or null: the device compiles the source.
  std::shared_ptr<const std::vector<unsigned char>> binary;
  std::vector<SizeExpression> threadgroups;    // 3
  Size3 threads_per_threadgroup;
  std::vector<std::string> buffers;            // [[buffer(i)]] binds buffers[i]
};

struct BufferTemplate {
  std::string name;
  std::string role;                            // input, inout, output, intermediate, constant
  // Caller memory bound in place: an input, or an inout (an input some kernel writes).
  bool caller() const { return role == "input" || role == "inout"; }
  std::string dtype;                           // numpy names: float32, float16, bfloat16, bool, uint32, ...
  std::vector<SizeExpression> shape;
  std::vector<int> readers, writers;
  std::vector<SizeExpression> strides;         // inputs and inouts
  std::vector<SizeExpression> value;           // constants: one per uint32 word
};

struct PassTemplate {
  std::string name;
  std::vector<std::string> sizes;
  std::vector<std::pair<std::string, SizeExpression>> derived;
  std::vector<SizeExpression> guards;
  json::Value valid_for;                       // [[name, value], ...] as written
  std::vector<KernelTemplate> kernels;
  std::vector<BufferTemplate> buffers;
  std::vector<std::pair<std::string, std::string>> compile_options;  // (name, JSON text of the value)

  // Reads a template object (PassTemplate.to_json's); JsonError / ArgumentError when malformed.
  static PassTemplate from_json(const json::Value& value);
  // The value valid_for records under `name`, or nullptr.
  const json::Value* fact(const std::string& name) const;
};

struct EvaluatedKernel {
  const KernelTemplate* kernel;
  Size3 threadgroups;
};

struct EvaluatedBuffer {
  const BufferTemplate* buffer;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;           // inputs and inouts only
  std::vector<std::uint32_t> value;            // constants only
  std::size_t nbytes = 0;
};

struct EvaluatedPass {
  const PassTemplate* pass;
  std::vector<EvaluatedKernel> kernels;
  std::vector<EvaluatedBuffer> buffers;
};

// Bytes per element of a buffer dtype (numpy names); ArgumentError for others.
std::size_t dtype_bytes(const std::string& dtype);

// The environment of `pass` for `sizes`: its sizes (ArgumentError naming those
// missing), then its derived sizes in order.
SizeEnv template_env(const PassTemplate& pass, const SizeEnv& sizes);
// Whether every guard holds in `env` (template_env's).
bool guards_hold(const PassTemplate& pass, const SizeEnv& env);
// The concrete pass; ArgumentError when a size is missing or a guard does not hold.
EvaluatedPass evaluate(const PassTemplate& pass, const SizeEnv& sizes);

}  // namespace mfa
