// merge_attention for C++ programs, without Python: Python's
// mfa_native.merge_attention run from a bundle whose spec has a
// "merge_attention" family.
//
//   mfa::merge_attention(device, bundle, {o1, o2}, {lse1, lse2}, out, lse);
//
// The exact combination of attentions of the same queries over disjoint key
// sets: with lse = logsumexp over parts of lses[i], out = sum_i exp(lses[i] -
// lse) * outputs[i], in float32 on the device. A part whose lse is -inf adds
// nothing; a row with -inf in every part gets 0 and -inf; a NaN lse makes its
// row NaN. Semantics and messages are Python's; on the cpu backend the results
// are bit-identical to Python's.
//
// What a bundle entry fixes (spec keys): the dtype, Dv, the number of parts and
// the layout. B, Hq and R are runtime values.
#pragma once

#include <vector>

#include "mfa/attention.hpp"

namespace mfa {

// outputs: what attention gave each part, one dtype (float32, float16, bfloat16) and shape,
// (B, Hq, R, Dv) for bhsd, (B, R, Hq, Dv) for bshd, any strides (copied to a contiguous
// pool buffer first where they are not contiguous, as Python copies them); lses: the parts'
// (B, Hq, R) float32 lse. out: the merged output, the parts' dtype and shape, and lse: the
// merged (B, Hq, R) float32 lse, both contiguous (written in place; Python returns them).
// Throws TypeError / ArgumentError (Python's message) or NoBundleEntryError before anything
// runs; DispatchError / CompileError from the device.
void merge_attention(const Device& device, const Bundle& bundle, const std::vector<TensorView>& outputs,
                     const std::vector<TensorView>& lses, const TensorView& out, const TensorView& lse,
                     Layout layout = Layout::bhsd);
// The same, encoded into the caller's batch (see attention's).
void merge_attention(CommandBatch& batch, const Bundle& bundle, const std::vector<TensorView>& outputs,
                     const std::vector<TensorView>& lses, const TensorView& out, const TensorView& lse,
                     Layout layout = Layout::bhsd);

}  // namespace mfa
