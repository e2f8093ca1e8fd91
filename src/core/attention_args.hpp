// The argument checks of mfa::attention and attention_backward: the C++ twin of
// python/mfa_native/ops/arguments.py (the same checks, in the same order, with
// the same messages where they can be), each naming the argument it rejects.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mfa/attention.hpp"
#include "mfa/buffer.hpp"

namespace mfa::attention_args {

constexpr std::int64_t kMaxIndex = 2147483647;  // sizes held in 32-bit signed integers
constexpr int kMaxHeadDim = 576;  // python/mfa_native/codegen/kernel/tables.py MAX_HEAD_DIM

std::string shape_text(const std::vector<std::int64_t>& shape);
// The element strides of a C-contiguous tensor of `shape`.
std::vector<std::int64_t> contiguous(const std::vector<std::int64_t>& shape);

// A view made ready to bind: its element strides (given or contiguous), 0 on
// axes of extent 1, in memory order; once packed (view_packing.hpp), the
// contiguous copy the kernels read instead, and its strides.
struct Checked {
  const TensorView* view = nullptr;
  std::string name;
  std::vector<std::int64_t> shape;    // as the kernels read it: a mask's broadcast to (B, Hq, R, C)
  std::vector<std::int64_t> strides;
  std::int64_t elements = 0;
  Buffer packed;  // empty: the kernels read view->data in place
};

// Strides of `view` (ArgumentError naming `name`: wrong count, or data null
// while the view has elements). Negative strides are allowed: such a view is packed.
Checked checked(const TensorView& view, const std::string& name);

// A tensor a score_mod reads, as an entry bakes it: "float" (float32) or "int" (int32), and its shape.
struct ScoreModTensor {
  std::string dtype;
  std::vector<std::int64_t> shape;
  bool operator==(const ScoreModTensor& other) const { return dtype == other.dtype && shape == other.shape; }
};

// What a call's arguments make: the problem an entry must serve.
struct Problem {
  std::int64_t B = 0, Hq = 0, Hkv = 0, R = 0, C = 0, D = 0, Dv = 0;
  DType dtype = DType::float32;
  Layout layout = Layout::bhsd;
  Causal causal = Causal::none;
  std::optional<std::pair<std::int64_t, std::int64_t>> window;  // normalized; none when both sides unbounded
  std::string mask = "none";     // none, bool, additive
  std::string mask_dtype;        // "", "bool", float dtype name
  bool sinks = false;
  double scale = 0;              // the softmax scale (the kernels read its float32 bits and scale * log2(e)'s)
  std::optional<double> softcap;
  std::string alibi = "none";    // none, per_head, per_batch
  std::string score_mod;         // its text ("": none)
  std::vector<ScoreModTensor> score_mod_tensors;
  bool empty() const { return B * Hq * R * C == 0; }
};

const char* dtype_name(DType dtype);
const char* layout_name(Layout layout);
const char* causal_name(Causal causal);

// `values` in logical (batch, head, sequence, feature) order from memory order, and back.
std::vector<std::int64_t> physical(std::vector<std::int64_t> values, Layout layout);

// Every check of attention's q, k, v and options (mask, sinks, window, scale, score transforms).
Problem forward_problem(const TensorView& q, const TensorView& k, const TensorView& v,
                        const AttentionOptions& options);

// The score transforms of `options` (softcap, alibi_slopes, score_mod and its tensors), checked, into `p`.
void score_transforms(const AttentionOptions& options, Problem& p);

// An output view: `name` must have `dtype` (TypeError), `shape` (ArgumentError) and be contiguous.
Checked output(const TensorView& view, const std::string& name, DType dtype, const std::vector<std::int64_t>& shape,
               const std::string& shape_names);

// o or dout of the backward: q's dtype, the output's shape, any strides.
Checked like_output(const TensorView& view, const std::string& name, const Problem& p);

// lse of the backward: (B, Hq, R) float32, any strides.
Checked lse_input(const TensorView& view, const Problem& p);

// The mask broadcast to (B, Hq, R, C): strides 0 on broadcast axes (and axes of extent 1).
Checked mask_view(const TensorView& mask, const Problem& p);
// The same of the mask as `given` holds it (checked, perhaps packed).
Checked mask_view(const Checked& given, const Problem& p);

}  // namespace mfa::attention_args
