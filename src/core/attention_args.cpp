#include "attention_args.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace mfa {

const char* to_string(DType dtype) { return attention_args::dtype_name(dtype); }

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::float32: case DType::int32: return 4;
    case DType::float16: case DType::bfloat16: return 2;
    case DType::bool8: return 1;
  }
  return 0;
}

}  // namespace mfa

namespace mfa::attention_args {

namespace {

// float32 max / log2(e): the kernels scale logits by scale * log2(e) in float32.
const double kMaxScale = double(std::numeric_limits<float>::max()) / std::log2(std::exp(1.0));

bool is_float(DType d) { return d == DType::float32 || d == DType::float16 || d == DType::bfloat16; }

std::string axes(Layout layout) { return layout == Layout::bhsd ? "B, Hq, R, D" : "B, R, Hq, D"; }

std::string text_of(const std::vector<std::int64_t>& values) { return shape_text(values); }

// Python's format(value, ".<digits>g").
std::string general_float(double value, int digits) {
  char text[32];
  std::snprintf(text, sizeof text, "%.*g", digits, value);
  return text;
}

// A double as Python's repr prints it: the shortest text that reads back, "1.5", "2.0", "1e+39", "inf"
// (snprintf, since Apple's libc++ lacks floating-point to_chars before macOS 13.3).
std::string python_float(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  std::string out;
  for (int digits = 1; digits <= 17; ++digits) {
    out = general_float(value, digits);
    if (std::strtod(out.c_str(), nullptr) == value) break;
  }
  if (out.find_first_of(".e") == std::string::npos) out += ".0";
  return out;
}

}  // namespace

std::vector<std::int64_t> contiguous(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> strides(shape.size());
  std::int64_t running = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = running;
    running *= shape[i] > 0 ? shape[i] : 1;
  }
  return strides;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + (shape.size() == 1 ? ",)" : ")");
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::float32: return "float32";
    case DType::float16: return "float16";
    case DType::bfloat16: return "bfloat16";
    case DType::bool8: return "bool";
    case DType::int32: return "int32";
  }
  return "?";
}
const char* layout_name(Layout layout) { return layout == Layout::bhsd ? "bhsd" : "bshd"; }
const char* causal_name(Causal causal) {
  return causal == Causal::none ? "none" : causal == Causal::lower_right ? "lower_right" : "upper_left";
}

std::vector<std::int64_t> physical(std::vector<std::int64_t> values, Layout layout) {
  if (layout == Layout::bshd && values.size() == 4) std::swap(values[1], values[2]);
  return values;
}

Checked checked(const TensorView& view, const std::string& name) {
  Checked out{&view, name, view.shape, {}, 1, {}};
  for (std::int64_t n : view.shape) {
    if (n < 0) throw ArgumentError(name + " has a negative extent: shape " + text_of(view.shape));
    out.elements *= n;
  }
  if (view.strides.empty()) {
    out.strides = contiguous(view.shape);
  } else {
    if (view.strides.size() != view.shape.size())
      throw ArgumentError(name + " has " + std::to_string(view.strides.size()) + " strides for " +
                          std::to_string(view.shape.size()) + " dimensions");
    out.strides = view.strides;
  }
  for (std::size_t i = 0; i < view.shape.size(); ++i)
    if (view.shape[i] == 1) out.strides[i] = 0;
  if (out.elements > 0 && view.data == nullptr) throw ArgumentError(name + " has elements but its data is null");
  return out;
}

Problem forward_problem(const TensorView& q, const TensorView& k, const TensorView& v,
                        const AttentionOptions& options) {
  Problem p;
  p.layout = options.layout;
  if (!is_float(q.dtype))
    throw TypeError(std::string("q must be float32, float16 or bfloat16 (ml_dtypes), got ") + dtype_name(q.dtype));
  for (const auto& [x, name] : {std::pair<const TensorView*, const char*>{&k, "k"}, {&v, "v"}})
    if (x->dtype != q.dtype)
      throw TypeError(std::string(name) + " has dtype " + dtype_name(x->dtype) + " but q has " + dtype_name(q.dtype) +
                      "; q, k and v must share one dtype");
  p.dtype = q.dtype;
  for (const auto& [x, name] : {std::pair<const TensorView*, const char*>{&q, "q"}, {&k, "k"}, {&v, "v"}})
    if (x->shape.size() != 4)
      throw ArgumentError(std::string(name) + " must have 4 dimensions (" + axes(p.layout) + "), got shape " +
                          text_of(x->shape));
  const auto qs = physical(q.shape, p.layout), ks = physical(k.shape, p.layout), vs = physical(v.shape, p.layout);
  p.B = qs[0], p.Hq = qs[1], p.R = qs[2], p.D = qs[3];
  p.Hkv = ks[1], p.C = ks[2], p.Dv = vs[3];
  if (ks[0] != p.B || vs[0] != p.B)
    throw ArgumentError("q, k and v must share the batch size: q " + text_of(q.shape) + ", k " + text_of(k.shape) +
                        ", v " + text_of(v.shape));
  if (ks[3] != p.D)
    throw ArgumentError("k's head dimension (" + std::to_string(ks[3]) + ") must match q's (" + std::to_string(p.D) +
                        "): q " + text_of(q.shape) + ", k " + text_of(k.shape));
  if (vs[1] != p.Hkv || vs[2] != p.C)
    throw ArgumentError(std::string("v must have k's heads and length (") + layout_name(p.layout) + "): k " +
                        text_of(k.shape) + ", v " + text_of(v.shape));
  if ((p.Hkv == 0 && p.Hq != 0) || (p.Hkv && p.Hq % p.Hkv))
    throw ArgumentError("q's head count (" + std::to_string(p.Hq) + ") must be a multiple of k/v's (" +
                        std::to_string(p.Hkv) + ") (GQA/MQA)");
  for (const auto& [name, dim] : {std::pair<const char*, std::int64_t>{"D (q/k head dimension)", p.D},
                                  {"Dv (v head dimension)", p.Dv}})
    if (dim < 1 || dim > kMaxHeadDim)
      throw ArgumentError(std::string(name) + " is " + std::to_string(dim) + "; the kernels support 1.." +
                          std::to_string(kMaxHeadDim));
  for (const auto& [name, size] : {std::pair<const char*, std::int64_t>{"B (batch)", p.B}, {"Hq (query heads)", p.Hq},
                                   {"Hkv (key/value heads)", p.Hkv}, {"R (query length)", p.R},
                                   {"C (key length)", p.C}})
    if (size > kMaxIndex)
      throw ArgumentError(std::string(name) + " is " + std::to_string(size) +
                          "; the kernels index it with 32-bit integers, so it must be below 2**31");
  checked(q, "q"), checked(k, "k"), checked(v, "v");

  if (options.scale) {
    const double s = *options.scale;
    if (!std::isfinite(s)) throw ArgumentError("scale must be finite, got " + python_float(s));
    if (std::fabs(s) > kMaxScale)
      throw ArgumentError("scale is " + python_float(s) + "; the kernels take scale * log2(e) in float32, so "
                          "|scale| must be at most " + general_float(kMaxScale, 4));
    p.scale = s;
  } else {
    p.scale = 1.0 / std::sqrt(double(p.D));
  }
  p.causal = options.causal;
  if (options.window) {
    std::int64_t sides[2] = {options.window->first, options.window->second};
    const char* names[2] = {"left", "right"};
    for (int i = 0; i < 2; ++i)
      if (sides[i] < -1)
        throw ArgumentError(std::string("window ") + names[i] + " must be >= 0, or -1 for unbounded, got " +
                            std::to_string(sides[i]));
    if (sides[0] >= std::max<std::int64_t>(p.C, 1)) sides[0] = -1;
    if (sides[1] >= std::max<std::int64_t>(p.R, 1)) sides[1] = -1;
    if (sides[0] != -1 || sides[1] != -1) p.window = std::make_pair(sides[0], sides[1]);
  }
  if (options.mask) {
    const DType d = options.mask->dtype;
    if (d == DType::bool8) p.mask = "bool", p.mask_dtype = "bool";
    else if (is_float(d)) p.mask = "additive", p.mask_dtype = dtype_name(d);
    else
      throw TypeError(std::string("mask must be boolean (True = attend) or float (additive), got dtype ") +
                      dtype_name(d));
    mask_view(*options.mask, p);
  }
  if (options.sinks) {
    const TensorView& s = *options.sinks;
    if (s.dtype != DType::float32)
      throw TypeError(std::string("sinks must be float32, got dtype ") + dtype_name(s.dtype));
    if (s.shape != std::vector<std::int64_t>{p.Hq})
      throw ArgumentError("sinks must have shape (Hq,) = (" + std::to_string(p.Hq) + ",), got " + text_of(s.shape));
    checked(s, "sinks");
    p.sinks = true;
  }
  score_transforms(options, p);
  return p;
}

void score_transforms(const AttentionOptions& options, Problem& p) {
  if (options.softcap) {
    const double cap = *options.softcap;
    if (!(std::isfinite(cap) && cap > 0))
      throw ArgumentError("softcap must be finite and above 0 (None: no cap), got " + python_float(cap));
    p.softcap = cap;
  }
  if (options.alibi_slopes) {
    const TensorView& s = *options.alibi_slopes;
    if (s.dtype != DType::float32)
      throw TypeError(std::string("alibi_slopes must be float32, got dtype ") + dtype_name(s.dtype));
    if (s.shape != std::vector<std::int64_t>{p.Hq} && s.shape != std::vector<std::int64_t>{p.B, p.Hq})
      throw ArgumentError("alibi_slopes must have shape (Hq,) = (" + std::to_string(p.Hq) + ",) or (B, Hq) = (" +
                          std::to_string(p.B) + ", " + std::to_string(p.Hq) + "), got " + text_of(s.shape));
    checked(s, "alibi_slopes");
    p.alibi = s.shape.size() == 1 ? "per_head" : "per_batch";
  }
  if (options.score_mod.empty() && !options.score_mod_tensors.empty())
    throw ArgumentError("score_mod_tensors given without a score_mod");
  p.score_mod = options.score_mod;
  for (std::size_t i = 0; i < options.score_mod_tensors.size(); ++i) {
    const TensorView& t = options.score_mod_tensors[i];
    const std::string name = "score_mod_tensors[" + std::to_string(i) + "]";
    if (t.dtype != DType::float32 && t.dtype != DType::int32)
      throw TypeError(name + " must be float32 or int32 (as the kernels read it), got dtype " + dtype_name(t.dtype));
    const Checked c = checked(t, name);
    if (c.elements == 0 || c.elements > kMaxIndex)
      throw ArgumentError(name + " has " + std::to_string(c.elements) + " elements (1 to 2**31 - 1 are read)");
    p.score_mod_tensors.push_back({t.dtype == DType::float32 ? "float" : "int", t.shape});
  }
}

Checked mask_view(const TensorView& mask, const Problem& p) {
  if (mask.shape.size() > 4)
    throw ArgumentError("mask of shape " + text_of(mask.shape) + " does not broadcast to (B, Hq, R, C) = " +
                        text_of({p.B, p.Hq, p.R, p.C}));
  return mask_view(checked(mask, "mask"), p);
}

Checked mask_view(const Checked& given, const Problem& p) {
  const TensorView& mask = *given.view;
  const std::vector<std::int64_t> target = {p.B, p.Hq, p.R, p.C};
  auto refuse = [&]() {
    return ArgumentError("mask of shape " + text_of(mask.shape) + " does not broadcast to (B, Hq, R, C) = " +
                         text_of(target));
  };
  if (mask.shape.size() > 4) throw refuse();
  Checked out{&mask, "mask", target, std::vector<std::int64_t>(4, 0), 1, given.packed};
  const std::size_t offset = 4 - mask.shape.size();
  for (std::size_t i = 0; i < 4; ++i) {
    out.elements *= target[i];
    if (i < offset) continue;
    const std::int64_t n = mask.shape[i - offset];
    if (n != target[i] && n != 1) throw refuse();
    out.strides[i] = (n == 1 || target[i] == 1) ? 0 : given.strides[i - offset];
  }
  return out;
}

Checked output(const TensorView& view, const std::string& name, DType dtype, const std::vector<std::int64_t>& shape,
               const std::string& shape_names) {
  if (view.dtype != dtype)
    throw TypeError(name + " has dtype " + dtype_name(view.dtype) + " but must be " + dtype_name(dtype));
  if (view.shape != shape)
    throw ArgumentError(name + " must have shape (" + shape_names + ") = " + text_of(shape) + ", got " +
                        text_of(view.shape));
  Checked c = checked(view, name);
  std::vector<std::int64_t> dense = contiguous(shape);
  for (std::size_t i = 0; i < shape.size(); ++i)
    if (shape[i] == 1) dense[i] = 0;
  if (c.strides != dense)
    throw ArgumentError(name + " must be contiguous (it is written in place), got strides " +
                        text_of(view.strides));
  return c;
}

Checked like_output(const TensorView& view, const std::string& name, const Problem& p) {
  const std::vector<std::int64_t> shape = physical({p.B, p.Hq, p.R, p.Dv}, p.layout);
  if (view.dtype != p.dtype)
    throw TypeError(name + " has dtype " + dtype_name(view.dtype) + " but q has " + dtype_name(p.dtype) + "; " + name +
                    " must have q's dtype, like attention's output");
  if (view.shape != shape) {
    std::string dims = axes(p.layout);
    dims.replace(dims.find('D'), 1, "Dv");
    throw ArgumentError(name + " must have attention's output shape (" + dims + ") = " + text_of(shape) + ", got " +
                        text_of(view.shape));
  }
  return checked(view, name);
}

Checked lse_input(const TensorView& view, const Problem& p) {
  const std::vector<std::int64_t> rows = {p.B, p.Hq, p.R};
  if (view.dtype != DType::float32)
    throw TypeError(std::string("lse must be float32, as attention(..., return_lse=True) returns it, got ") +
                    dtype_name(view.dtype));
  if (view.shape != rows)
    throw ArgumentError("lse must have shape (B, Hq, R) = " + text_of(rows) + ", got " + text_of(view.shape));
  return checked(view, "lse");
}

}  // namespace mfa::attention_args
