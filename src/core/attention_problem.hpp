// The problem an attention call makes, the bundle entry it needs: its sizes
// and dtype as the binder bound them from the op's declaration, and the
// options only attention has (scale, causal, window, softcap, the mask's kind,
// the ALiBi table's kind, score_mod and its tensors), checked here with
// Python's messages (python/mfa_native/ops/arguments.py, score_mod.py).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "binder.hpp"
#include "mfa/attention.hpp"

namespace mfa::attention_problem {

constexpr std::int64_t kMaxIndex = 2147483647;  // sizes held in 32-bit signed integers

// A tensor a score_mod reads, as an entry bakes it: "float" (float32) or "int" (int32), and its shape.
struct ScoreModTensor {
  std::string dtype;
  std::vector<std::int64_t> shape;
  bool operator==(const ScoreModTensor& other) const { return dtype == other.dtype && shape == other.shape; }
};

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
  bool batch_invariant = false;  // deterministic="batch_invariant"
  bool empty() const { return B * Hq * R * C == 0; }
};

const char* layout_name(Layout layout);
const char* causal_name(Causal causal);

// A call's arrays by their declared names: `arrays`, then the arrays `options` carries (mask,
// sinks, alibi_slopes; null when not given).
std::map<std::string, const TensorView*> with_option_arrays(std::map<std::string, const TensorView*> arrays,
                                                            const AttentionOptions& options);

// Every check of a call, in Python's order: `binder`'s sizes (its declaration's binding arrays),
// the scale, softcap and window, the declaration's other arrays and its own ones, then `own`
// (an op's checks in code between attention's and score_mod's: block_sparse_attention's block
// mask, varlen's sequences), then score_mod and its tensors.
Problem checked_problem(Binder& binder, const AttentionOptions& options,
                        const std::function<void(const Problem&)>& own = {});

}  // namespace mfa::attention_problem
