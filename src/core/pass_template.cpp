#include "pass_template.hpp"

#include <limits>

namespace mfa {

namespace {

std::vector<SizeExpression> expressions(const json::Value& list, const char* what) {
  std::vector<SizeExpression> out;
  for (const json::Value& item : list.as_array(what)) out.emplace_back(item.as_string(what));
  return out;
}

std::vector<int> indices(const json::Value& list, const char* what) {
  std::vector<int> out;
  for (const json::Value& item : list.as_array(what)) {
    const std::int64_t i = item.as_int(what);
    if (i < 0 || i > std::numeric_limits<int>::max()) throw ArgumentError(std::string(what) + " out of range");
    out.push_back(int(i));
  }
  return out;
}

std::uint32_t extent(std::int64_t value, const std::string& what, std::int64_t low = 1) {
  if (value < low || value > std::numeric_limits<std::uint32_t>::max())
    throw ArgumentError(what + " is " + std::to_string(value) + ", out of range");
  return std::uint32_t(value);
}

}  // namespace

std::size_t dtype_bytes(const std::string& dtype) {
  if (dtype == "float32" || dtype == "uint32" || dtype == "int32") return 4;
  if (dtype == "float16" || dtype == "bfloat16" || dtype == "uint16" || dtype == "int16") return 2;
  if (dtype == "bool" || dtype == "uint8" || dtype == "int8") return 1;
  if (dtype == "float64" || dtype == "int64" || dtype == "uint64") return 8;
  throw ArgumentError("unknown buffer dtype '" + dtype + "'");
}

PassTemplate PassTemplate::from_json(const json::Value& value) {
  const json::Value* schema = value.find("schema");
  if (!schema || schema->kind() != json::Value::Kind::number || schema->as_int("schema") != kTemplateSchema)
    throw ArgumentError("pass template schema is not " + std::to_string(kTemplateSchema));
  PassTemplate t;
  t.name = value.at("name").as_string("name");
  for (const json::Value& s : value.at("sizes").as_array("sizes")) t.sizes.push_back(s.as_string("sizes"));
  for (const json::Value& d : value.at("derived").as_array("derived")) {
    const auto& pair = d.as_array("derived");
    if (pair.size() != 2) throw ArgumentError("derived sizes are (name, expression) pairs");
    t.derived.emplace_back(pair[0].as_string("derived"), SizeExpression(pair[1].as_string("derived")));
  }
  t.guards = expressions(value.at("guards"), "guards");
  t.valid_for = value.at("valid_for");
  for (const json::Value& pair : t.valid_for.as_array("valid_for"))
    if (pair.as_array("valid_for").size() != 2 || pair.as_array("valid_for")[0].kind() != json::Value::Kind::string)
      throw ArgumentError("valid_for holds (name, value) pairs");
  for (const json::Value& k : value.at("kernels").as_array("kernels")) {
    KernelTemplate kernel;
    kernel.entry = k.at("entry").as_string("entry");
    kernel.source = k.at("source").as_string("source");
    kernel.threadgroups = expressions(k.at("threadgroups"), "threadgroups");
    const auto& threads = k.at("threads_per_threadgroup").as_array("threads_per_threadgroup");
    if (kernel.threadgroups.size() != 3 || threads.size() != 3)
      throw ArgumentError("kernel '" + kernel.entry + "': grids have 3 axes");
    kernel.threads_per_threadgroup = {extent(threads[0].as_int("threads"), "threads"),
                                      extent(threads[1].as_int("threads"), "threads"),
                                      extent(threads[2].as_int("threads"), "threads")};
    for (const json::Value& b : k.at("buffers").as_array("buffers")) kernel.buffers.push_back(b.as_string("buffers"));
    t.kernels.push_back(std::move(kernel));
  }
  for (const json::Value& b : value.at("buffers").as_array("buffers")) {
    BufferTemplate buffer;
    buffer.name = b.at("name").as_string("name");
    buffer.role = b.at("role").as_string("role");
    if (!buffer.caller() && buffer.role != "output" && buffer.role != "intermediate" && buffer.role != "constant")
      throw ArgumentError("buffer '" + buffer.name + "' has role '" + buffer.role + "'");
    buffer.dtype = b.at("dtype").as_string("dtype");
    dtype_bytes(buffer.dtype);
    buffer.shape = expressions(b.at("shape"), "shape");
    buffer.readers = indices(b.at("readers"), "readers");
    buffer.writers = indices(b.at("writers"), "writers");
    const json::Value* strides = b.find("strides");
    if (buffer.caller()) {
      if (!strides || strides->is_null()) throw ArgumentError(buffer.role + " '" + buffer.name + "' has no strides");
      buffer.strides = expressions(*strides, "strides");
      if (buffer.strides.size() != buffer.shape.size())
        throw ArgumentError(buffer.role + " '" + buffer.name + "': strides and shape differ in length");
    }
    const json::Value* words = b.find("value");
    if (buffer.role == "constant") {
      if (!words || words->is_null()) throw ArgumentError("constant '" + buffer.name + "' has no value");
      buffer.value = expressions(*words, "value");
    }
    t.buffers.push_back(std::move(buffer));
  }
  for (const KernelTemplate& kernel : t.kernels)
    for (const std::string& name : kernel.buffers) {
      bool declared = false;
      for (const BufferTemplate& buffer : t.buffers) declared = declared || buffer.name == name;
      if (!declared) throw ArgumentError("kernel '" + kernel.entry + "' binds undeclared '" + name + "'");
    }
  if (const json::Value* options = value.find("compile_options"))
    for (const json::Value& pair : options->as_array("compile_options")) {
      const auto& kv = pair.as_array("compile_options");
      if (kv.size() != 2) throw ArgumentError("compile_options holds (name, value) pairs");
      const json::Value& v = kv[1];
      std::string text = v.kind() == json::Value::Kind::string  ? v.as_string("option")
                         : v.kind() == json::Value::Kind::boolean ? (v.as_bool("option") ? "true" : "false")
                                                                 : std::to_string(v.as_double("option"));
      t.compile_options.emplace_back(kv[0].as_string("compile_options"), std::move(text));
    }
  return t;
}

const json::Value* PassTemplate::fact(const std::string& name) const {
  for (const json::Value& pair : valid_for.as_array("valid_for")) {
    const auto& kv = pair.as_array("valid_for");
    if (kv[0].as_string("valid_for") == name) return &kv[1];
  }
  return nullptr;
}

SizeEnv template_env(const PassTemplate& pass, const SizeEnv& sizes) {
  SizeEnv env;
  std::string missing;
  for (const std::string& name : pass.sizes) {
    auto it = sizes.find(name);
    if (it == sizes.end()) missing += (missing.empty() ? "" : ", ") + name;
    else env[name] = it->second;
  }
  if (!missing.empty()) throw ArgumentError("pass '" + pass.name + "' needs sizes [" + missing + "]");
  for (const auto& [name, expression] : pass.derived) env[name] = expression.evaluate(env);
  return env;
}

bool guards_hold(const PassTemplate& pass, const SizeEnv& env) {
  for (const SizeExpression& guard : pass.guards)
    if (!guard.evaluate(env)) return false;
  return true;
}

EvaluatedPass evaluate(const PassTemplate& pass, const SizeEnv& sizes) {
  const SizeEnv env = template_env(pass, sizes);
  for (const SizeExpression& guard : pass.guards)
    if (!guard.evaluate(env))
      throw ArgumentError("pass '" + pass.name + "' is not valid for these sizes: " + guard.text() + " does not hold");
  EvaluatedPass out{&pass, {}, {}};
  for (const KernelTemplate& kernel : pass.kernels) {
    const std::string what = "kernel '" + kernel.entry + "' threadgroups";
    out.kernels.push_back({&kernel,
                           {extent(kernel.threadgroups[0].evaluate(env), what, 0),
                            extent(kernel.threadgroups[1].evaluate(env), what, 0),
                            extent(kernel.threadgroups[2].evaluate(env), what, 0)}});
  }
  for (const BufferTemplate& buffer : pass.buffers) {
    EvaluatedBuffer b{&buffer, {}, {}, {}, 0};
    for (const SizeExpression& e : buffer.shape) {
      const std::int64_t n = e.evaluate(env);
      if (n < 0) throw ArgumentError("buffer '" + buffer.name + "' has a negative extent");
      b.shape.push_back(n);
    }
    const std::size_t item = dtype_bytes(buffer.dtype);
    bool empty = false;
    std::uint64_t count = 1;
    for (std::int64_t n : b.shape) {
      empty = empty || n == 0;
      if (__builtin_mul_overflow(count, std::uint64_t(n), &count))
        throw ArgumentError("buffer '" + buffer.name + "' is too large");
    }
    if (buffer.caller()) {
      std::uint64_t span = 1;
      for (std::size_t i = 0; i < b.shape.size(); ++i) {
        const std::int64_t stride = b.shape[i] == 1 ? 0 : buffer.strides[i].evaluate(env);
        if (stride < 0) throw ArgumentError(buffer.role + " '" + buffer.name + "' has a negative stride");
        b.strides.push_back(stride);
        if (b.shape[i] > 1) span += std::uint64_t(b.shape[i] - 1) * std::uint64_t(stride);
      }
      b.nbytes = empty ? 0 : std::size_t(span * item);
    } else if (buffer.role == "constant") {
      for (const SizeExpression& e : buffer.value) {
        const std::int64_t w = e.evaluate(env);
        if (w < 0 || w > std::int64_t(std::numeric_limits<std::uint32_t>::max()))
          throw ArgumentError("buffer '" + buffer.name + "': " + std::to_string(w) + " does not fit in 32 bits");
        b.value.push_back(std::uint32_t(w));
      }
      b.nbytes = 4 * b.value.size();
    } else {
      b.nbytes = std::size_t(count * item);
    }
    out.buffers.push_back(std::move(b));
  }
  return out;
}

}  // namespace mfa
