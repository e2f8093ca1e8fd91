#include "attention_problem.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "score_expression.hpp"

namespace mfa::attention_problem {

namespace {

// float32 max / log2(e): the kernels scale logits by scale * log2(e) in float32.
const double kMaxScale = double(std::numeric_limits<float>::max()) / std::log2(std::exp(1.0));

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

// arguments.scale_value: finite, |scale * log2(e)| within float32; default 1 / sqrt(D).
double scale_of(const std::optional<double>& scale, std::int64_t D) {
  if (!scale) return 1.0 / std::sqrt(double(D));
  const double s = *scale;
  if (!std::isfinite(s)) throw ArgumentError("scale must be finite, got " + python_float(s));
  if (std::fabs(s) > kMaxScale)
    throw ArgumentError("scale is " + python_float(s) + "; the kernels take scale * log2(e) in float32, so "
                        "|scale| must be at most " + general_float(kMaxScale, 4));
  return s;
}

// arguments.softcap_value: none, or finite and above 0.
std::optional<double> softcap_of(const std::optional<double>& softcap) {
  if (softcap && !(std::isfinite(*softcap) && *softcap > 0))
    throw ArgumentError("softcap must be finite and above 0 (None: no cap), got " + python_float(*softcap));
  return softcap;
}

// arguments.window_sides: -1 for unbounded, as is a side too wide to remove any key.
std::optional<std::pair<std::int64_t, std::int64_t>> window_of(
    const std::optional<std::pair<std::int64_t, std::int64_t>>& window, std::int64_t R, std::int64_t C) {
  if (!window) return std::nullopt;
  std::int64_t sides[2] = {window->first, window->second};
  const char* names[2] = {"left", "right"};
  for (int i = 0; i < 2; ++i)
    if (sides[i] < -1)
      throw ArgumentError(std::string("window ") + names[i] + " must be >= 0, or -1 for unbounded, got " +
                          std::to_string(sides[i]));
  if (sides[0] >= std::max<std::int64_t>(C, 1)) sides[0] = -1;
  if (sides[1] >= std::max<std::int64_t>(R, 1)) sides[1] = -1;
  if (sides[0] == -1 && sides[1] == -1) return std::nullopt;
  return std::make_pair(sides[0], sides[1]);
}

// score_mod.with_score_mod: tensors only with a score_mod, each float32 or int32 with 1 to 2**31 - 1 elements.
std::vector<ScoreModTensor> score_mod_tensors_of(const AttentionOptions& options) {
  if (options.score_mod.empty() && !options.score_mod_tensors.empty())
    throw ArgumentError("score_mod_tensors given without a score_mod");
  std::vector<ScoreModTensor> out;
  for (std::size_t i = 0; i < options.score_mod_tensors.size(); ++i) {
    const TensorView& t = options.score_mod_tensors[i];
    const std::string name = "score_mod_tensors[" + std::to_string(i) + "]";
    if (t.dtype != DType::float32 && t.dtype != DType::int32)
      throw TypeError(name + " must be float32 or int32 (as the kernels read it), got dtype " + to_string(t.dtype));
    const Checked c = checked(t, name);
    if (c.elements == 0 || c.elements > kMaxIndex)
      throw ArgumentError(name + " has " + std::to_string(c.elements) + " elements (1 to 2**31 - 1 are read)");
    out.push_back({t.dtype == DType::float32 ? "float" : "int", t.shape});
  }
  return out;
}

// ScoreMod's check: the text is a list of terms of `operations`, and the call gives exactly the
// tensors it reads, each of its rank.
void check_reads(const std::string& text, const std::vector<ScoreModTensor>& tensors,
                 const std::map<std::string, int>& operations) {
  const std::vector<score_expression::Read> reads = score_expression::reads(text, operations);
  bool match = reads.size() == tensors.size();
  for (const score_expression::Read& read : reads)
    match &= std::size_t(read.tensor) < tensors.size() && tensors[std::size_t(read.tensor)].shape.size() == read.axes;
  if (match) return;
  std::string read_text = "{", shapes = "[";
  for (const score_expression::Read& read : reads)
    read_text += (read_text.size() > 1 ? ", " : "") + read.number + ": " + std::to_string(read.axes);
  for (const ScoreModTensor& t : tensors) shapes += (shapes.size() > 1 ? ", " : "") + shape_text(t.shape);
  throw ArgumentError("score_mod: the expression reads tensors " + read_text + "} (index: axes), the call gives " +
                      std::to_string(tensors.size()) + " of shapes " + shapes + "]");
}

// The last of checked_problem's checks: score_mod (its text read by the declaration's
// operations) and its tensors, into `p`.
void check_score_mod(Problem& p, const AttentionOptions& options, const Declaration& declaration) {
  p.score_mod = options.score_mod;
  p.score_mod_tensors = score_mod_tensors_of(options);
  if (!p.score_mod.empty()) check_reads(p.score_mod, p.score_mod_tensors, declaration.score_operations);
}

}  // namespace

std::map<std::string, const TensorView*> with_option_arrays(std::map<std::string, const TensorView*> arrays,
                                                            const AttentionOptions& options) {
  arrays["mask"] = options.mask ? &*options.mask : nullptr;
  arrays["sinks"] = options.sinks ? &*options.sinks : nullptr;
  arrays["alibi_slopes"] = options.alibi_slopes ? &*options.alibi_slopes : nullptr;
  return arrays;
}

const char* layout_name(Layout layout) { return layout == Layout::bhsd ? "bhsd" : "bshd"; }
const char* causal_name(Causal causal) {
  return causal == Causal::none ? "none" : causal == Causal::lower_right ? "lower_right" : "upper_left";
}

Problem checked_problem(Binder& binder, const AttentionOptions& options,
                        const std::function<void(const Problem&)>& own) {
  binder.bind_sizes();
  Problem p;
  p.B = binder.size("B"), p.Hq = binder.size("Hq"), p.Hkv = binder.size("Hkv"), p.R = binder.size("R");
  p.C = binder.size("C"), p.D = binder.size("D"), p.Dv = binder.size("Dv");
  p.dtype = binder.view("q").view->dtype;
  p.layout = options.layout;
  p.scale = scale_of(options.scale, p.D);
  p.softcap = softcap_of(options.softcap);
  p.causal = options.causal;
  p.window = window_of(options.window, p.R, p.C);
  p.batch_invariant = options.deterministic == Deterministic::batch_invariant;
  binder.check_others();
  if (options.mask) {
    const bool boolean = options.mask->dtype == DType::bool8;
    p.mask = boolean ? "bool" : "additive";
    p.mask_dtype = to_string(options.mask->dtype);
  }
  p.sinks = options.sinks.has_value();
  if (options.alibi_slopes) p.alibi = binder.shape_index("alibi_slopes") == 0 ? "per_head" : "per_batch";
  binder.check_own();
  if (own) own(p);
  check_score_mod(p, options, binder.declaration());
  return p;
}

}  // namespace mfa::attention_problem
