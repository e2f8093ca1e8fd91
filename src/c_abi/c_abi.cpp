// include/mfa/mfa.h over the C++ API: the opaque handles own C++ objects, every
// entry point turns an exception into its status code and a thread-local
// message, and a call's arguments are checked against its op's table
// (call_table.hpp) as they are set.
#include "mfa/mfa.h"

#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "call_table.hpp"
#include "mfa/attention.hpp"
#include "mfa/device.hpp"
#include "mfa/errors.hpp"

struct mfa_device {
  mfa::Device device;
  std::string name;
};

struct mfa_bundle {
  mfa::Bundle bundle;
  std::vector<std::string> entries;
};

struct mfa_call {
  mfa::Bundle bundle;
  const mfa::c_abi::Op* op;
  std::map<std::string, mfa::c_abi::Value> values;
};

struct mfa_event {
  std::shared_future<void> done;
};

namespace {

using mfa::c_abi::Kind;
using mfa::c_abi::Value;

thread_local std::string last_error;

mfa_status fail(mfa_status status, const char* message) noexcept {
  try {
    last_error = message;
  } catch (...) {
    last_error.clear();  // no memory for the message: the code alone
  }
  return status;
}

// Runs `body`, mapping what it throws to a status (the most derived class first).
template <class Body>
mfa_status guarded(Body&& body) noexcept {
  try {
    body();
    return MFA_OK;
  } catch (const mfa::NoBundleEntryError& e) {
    return fail(MFA_NO_BUNDLE_ENTRY_ERROR, e.what());
  } catch (const mfa::BundleError& e) {
    return fail(MFA_BUNDLE_ERROR, e.what());
  } catch (const mfa::CompileError& e) {
    return fail(MFA_COMPILE_ERROR, e.what());
  } catch (const mfa::DispatchError& e) {
    return fail(MFA_DISPATCH_ERROR, e.what());
  } catch (const mfa::TypeError& e) {
    return fail(MFA_TYPE_ERROR, e.what());
  } catch (const mfa::ArgumentError& e) {
    return fail(MFA_ARGUMENT_ERROR, e.what());
  } catch (const mfa::UnavailableError& e) {
    return fail(MFA_UNAVAILABLE_ERROR, e.what());
  } catch (const mfa::NotImplementedError& e) {
    return fail(MFA_NOT_IMPLEMENTED_ERROR, e.what());
  } catch (const mfa::Error& e) {
    return fail(MFA_ERROR, e.what());
  } catch (const std::bad_alloc&) {
    return fail(MFA_OUT_OF_MEMORY, "out of memory");
  } catch (const std::exception& e) {
    return fail(MFA_INTERNAL_ERROR, e.what());
  } catch (...) {
    return fail(MFA_INTERNAL_ERROR, "an unknown exception");
  }
}

void need(const void* pointer, const char* what) {
  if (!pointer) throw mfa::ArgumentError(std::string(what) + " is NULL");
}

// Hands a new handle to the caller: only once everything succeeded.
template <class Handle>
void hand_out(std::unique_ptr<Handle> handle, Handle** out) {
  *out = handle.release();
}

// A C enum's value as C passed it: in C++, reading an enum object that holds a value
// outside its enumerators' range is undefined, so the bytes are read as an int.
template <class Enum>
int code_of(const Enum& value) {
  static_assert(sizeof(Enum) == sizeof(int), "a C enum is int-sized");
  int code;
  std::memcpy(&code, &value, sizeof code);
  return code;
}

mfa::TensorView view_of(const mfa_tensor_view& v, const std::string& name) {
  const int dtype = code_of(v.dtype);
  if (dtype < MFA_FLOAT32 || dtype > MFA_FLOAT8_E5M2)
    throw mfa::TypeError(name + " has dtype " + std::to_string(dtype) + ", which is no mfa_dtype");
  if (v.ndim < 0) throw mfa::ArgumentError(name + " has ndim " + std::to_string(v.ndim));
  if (v.ndim > 0 && !v.shape) throw mfa::ArgumentError(name + " has ndim " + std::to_string(v.ndim) + " but no shape");
  static constexpr mfa::DType kDTypes[] = {mfa::DType::float32, mfa::DType::float16, mfa::DType::bfloat16,
                                           mfa::DType::bool8,   mfa::DType::int32,   mfa::DType::uint8,
                                           mfa::DType::uint32,  mfa::DType::float8_e4m3fn,
                                           mfa::DType::float8_e5m2};
  mfa::TensorView view{v.data, kDTypes[dtype], {}, {}};
  if (v.ndim > 0) view.shape.assign(v.shape, v.shape + v.ndim);
  if (v.ndim > 0 && v.strides) view.strides.assign(v.strides, v.strides + v.ndim);
  return view;
}

// The argument `name` of the call's op, which must take values through `kind`'s setter.
const mfa::c_abi::Param& param_for(const mfa_call* call, const char* name, Kind kind) {
  need(call, "call");
  need(name, "name");
  const mfa::c_abi::Param* p = call->op->param(name);
  if (!p) throw mfa::TypeError(std::string(call->op->name) + "() got an unexpected keyword argument '" + name + "'");
  if (!(p->kinds & mfa::c_abi::bit(kind))) {
    std::string takes;
    for (Kind k : mfa::c_abi::kKinds)
      if (p->kinds & mfa::c_abi::bit(k))
        takes += (takes.empty() ? "" : " or ") + std::string(mfa::c_abi::setter_name(k));
    throw mfa::TypeError(std::string(call->op->name) + "'s " + name + " is set with " + takes + ", not " +
                         mfa::c_abi::setter_name(kind));
  }
  return *p;
}

// TypeError listing the required arguments the call lacks, in Python's words:
// "attention() missing 2 required arguments: 'q' and 'out'" ('a', 'b', and 'c' for three).
void check_required(const mfa_call& call) {
  std::vector<std::string> missing;
  for (const mfa::c_abi::Param& p : call.op->params)
    if (p.required && !call.values.count(p.name)) missing.push_back("'" + std::string(p.name) + "'");
  if (missing.empty()) return;
  std::string list;
  for (std::size_t i = 0; i < missing.size(); ++i)
    list += (i == 0 ? "" : i + 1 < missing.size() ? ", " : missing.size() == 2 ? " and " : ", and ") + missing[i];
  throw mfa::TypeError(std::string(call.op->name) + "() missing " + std::to_string(missing.size()) +
                       " required argument" + (missing.size() == 1 ? "" : "s") + ": " + list);
}

// Checks and stores one argument: an option's value is tried on scratch options first,
// so a bad one is refused here, naming it.
mfa_status set(mfa_call* call, const char* name, Kind kind, const std::function<Value()>& make) {
  return guarded([&] {
    const mfa::c_abi::Param& p = param_for(call, name, kind);
    Value value = make();
    if (p.option) {
      mfa::AttentionOptions scratch;
      p.option(value, scratch);
    }
    call->values[p.name] = std::move(value);
  });
}

}  // namespace

extern "C" {

const char* mfa_last_error(void) { return last_error.c_str(); }

const char* mfa_status_name(mfa_status status) {
  switch (code_of(status)) {
    case MFA_OK: return "MFA_OK";
    case MFA_ERROR: return "MFA_ERROR";
    case MFA_ARGUMENT_ERROR: return "MFA_ARGUMENT_ERROR";
    case MFA_TYPE_ERROR: return "MFA_TYPE_ERROR";
    case MFA_UNAVAILABLE_ERROR: return "MFA_UNAVAILABLE_ERROR";
    case MFA_COMPILE_ERROR: return "MFA_COMPILE_ERROR";
    case MFA_DISPATCH_ERROR: return "MFA_DISPATCH_ERROR";
    case MFA_BUNDLE_ERROR: return "MFA_BUNDLE_ERROR";
    case MFA_NO_BUNDLE_ENTRY_ERROR: return "MFA_NO_BUNDLE_ENTRY_ERROR";
    case MFA_OUT_OF_MEMORY: return "MFA_OUT_OF_MEMORY";
    case MFA_INTERNAL_ERROR: return "MFA_INTERNAL_ERROR";
    case MFA_NOT_IMPLEMENTED_ERROR: return "MFA_NOT_IMPLEMENTED_ERROR";
  }
  return "";
}

mfa_status mfa_device_default(mfa_device** device) {
  return guarded([&] {
    need(device, "device");
    const mfa::Device d = mfa::Device::default_device();
    hand_out(std::make_unique<mfa_device>(mfa_device{d, d.name()}), device);
  });
}

mfa_status mfa_device_get(const char* kind, mfa_device** device) {
  return guarded([&] {
    need(kind, "kind");
    need(device, "device");
    const mfa::Device d = mfa::Device::get(mfa::device_kind_from_string(kind));
    hand_out(std::make_unique<mfa_device>(mfa_device{d, d.name()}), device);
  });
}

const char* mfa_device_name(const mfa_device* device) { return device ? device->name.c_str() : ""; }

void mfa_device_free(mfa_device* device) { delete device; }

mfa_status mfa_bundle_load(const char* path, mfa_bundle** bundle) {
  return guarded([&] {
    need(path, "path");
    need(bundle, "bundle");
    mfa::Bundle b = mfa::Bundle::load(path);
    std::vector<std::string> entries = b.entries();
    hand_out(std::make_unique<mfa_bundle>(mfa_bundle{std::move(b), std::move(entries)}), bundle);
  });
}

mfa_status mfa_bundle_from_memory(const void* data, size_t size, mfa_bundle** bundle) {
  return guarded([&] {
    need(bundle, "bundle");
    mfa::Bundle b = mfa::Bundle::from_memory(data, size);
    std::vector<std::string> entries = b.entries();
    hand_out(std::make_unique<mfa_bundle>(mfa_bundle{std::move(b), std::move(entries)}), bundle);
  });
}

size_t mfa_bundle_entry_count(const mfa_bundle* bundle) { return bundle ? bundle->entries.size() : 0; }

const char* mfa_bundle_entry(const mfa_bundle* bundle, size_t index) {
  return bundle && index < bundle->entries.size() ? bundle->entries[index].c_str() : nullptr;
}

void mfa_bundle_free(mfa_bundle* bundle) { delete bundle; }

mfa_status mfa_call_new(const mfa_bundle* bundle, const char* op, mfa_call** call) {
  return guarded([&] {
    need(bundle, "bundle");
    need(op, "op");
    need(call, "call");
    const mfa::c_abi::Op* found = mfa::c_abi::find_op(op);
    if (!found)
      throw mfa::ArgumentError(std::string("no op named '") + op + "'; the C ABI runs " + mfa::c_abi::op_names());
    hand_out(std::make_unique<mfa_call>(mfa_call{bundle->bundle, found, {}}), call);
  });
}

mfa_status mfa_call_set_tensor(mfa_call* call, const char* name, const mfa_tensor_view* view) {
  return set(call, name, Kind::tensor, [&] {
    need(view, "view");
    return Value(view_of(*view, name));
  });
}

mfa_status mfa_call_set_quantized(mfa_call* call, const char* name, const char* format, const mfa_tensor_view* data) {
  return set(call, name, Kind::quantized, [&] {
    need(format, "format");
    need(data, "data");
    return Value(mfa::c_abi::Quantized{format, view_of(*data, std::string(name) + ".data")});
  });
}

mfa_status mfa_call_set_quantized_affine(mfa_call* call, const char* name, const mfa_tensor_view* data,
                                         const mfa_tensor_view* scales, const mfa_tensor_view* biases, int64_t bits,
                                         int64_t group_size) {
  return set(call, name, Kind::quantized, [&] {
    need(data, "data");
    need(scales, "scales");
    need(biases, "biases");
    const std::string field = std::string(name) + ".";
    return Value(mfa::c_abi::Quantized{"affine", view_of(*data, field + "data"), view_of(*scales, field + "scales"),
                                       view_of(*biases, field + "biases"), bits, group_size});
  });
}

mfa_status mfa_call_set_tensors(mfa_call* call, const char* name, const mfa_tensor_view* views, size_t count) {
  return set(call, name, Kind::tensors, [&] {
    if (count) need(views, "views");
    std::vector<mfa::TensorView> list;
    for (size_t i = 0; i < count; ++i)
      list.push_back(view_of(views[i], std::string(name) + "[" + std::to_string(i) + "]"));
    return Value(std::move(list));
  });
}

mfa_status mfa_call_set_float(mfa_call* call, const char* name, double value) {
  return set(call, name, Kind::real, [&] { return Value(value); });
}

mfa_status mfa_call_set_int(mfa_call* call, const char* name, int64_t value) {
  return set(call, name, Kind::integer, [&] { return Value(std::int64_t(value)); });
}

mfa_status mfa_call_set_bool(mfa_call* call, const char* name, bool value) {
  return set(call, name, Kind::boolean, [&] { return Value(value); });
}

mfa_status mfa_call_set_string(mfa_call* call, const char* name, const char* value) {
  return set(call, name, Kind::text, [&] {
    need(value, "value");
    return Value(std::string(value));
  });
}

mfa_status mfa_call_set_int_pair(mfa_call* call, const char* name, int64_t first, int64_t second) {
  return set(call, name, Kind::int_pair,
             [&] { return Value(std::make_pair(std::int64_t(first), std::int64_t(second))); });
}

mfa_status mfa_call_set_none(mfa_call* call, const char* name) {
  return guarded([&] {
    need(call, "call");
    need(name, "name");
    const mfa::c_abi::Param* p = call->op->param(name);
    if (!p) throw mfa::TypeError(std::string(call->op->name) + "() got an unexpected keyword argument '" + name + "'");
    call->values.erase(p->name);
  });
}

mfa_status mfa_call_run(mfa_call* call, const mfa_device* device) {
  return guarded([&] {
    need(call, "call");
    need(device, "device");
    check_required(*call);
    call->op->run(device->device, call->bundle, mfa::c_abi::Given(*call->op, call->values));
  });
}

void mfa_call_free(mfa_call* call) { delete call; }

mfa_status mfa_call_encode_metal(mfa_call* call, const mfa_device* device, void* command_buffer, mfa_event** done) {
  return guarded([&] {
    need(call, "call");
    need(device, "device");
    need(done, "done");
    check_required(*call);
    if (!call->op->encode_metal)  // every op has one where the Metal backend is built
      throw mfa::UnavailableError("mfa_call_encode_metal: this build has no Metal backend (macOS builds have it)");
    auto event = std::make_unique<mfa_event>();
    event->done = call->op->encode_metal(device->device, call->bundle, mfa::c_abi::Given(*call->op, call->values),
                                         command_buffer);
    hand_out(std::move(event), done);
  });
}

mfa_status mfa_event_wait(mfa_event* event) {
  return guarded([&] {
    need(event, "event");
    event->done.get();
  });
}

bool mfa_event_ready(const mfa_event* event) {
  return event && event->done.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

void mfa_event_free(mfa_event* event) { delete event; }

}  // extern "C"
