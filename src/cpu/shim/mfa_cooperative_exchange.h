// Cooperative tensors across the lanes of a simdgroup: the lane that
// computes a collective (synchronize_simdgroup) gathers the 32 lanes'
// elements into one matrix, and writes back into each lane's cooperative
// tensor. Each lane brings pointers to its own in its in[] slot. Part of the
// shim's MetalPerformancePrimitives.
#pragma once

namespace mfa_shim {

// The 32 lanes' elements of a cooperative tensor, as the matrix of its
// layout's rows and columns.
template <class Element, class Layout>
struct gathered_matrix {
  static_assert(Layout::rows * Layout::columns <= 64 * 64,
                "the cpu backend gathers cooperative tensors of at most 64 x 64 elements");
  Element values[Layout::rows][Layout::columns] = {};
};

// Fills `gathered` from the cooperative tensor each lane brings (lane l's at
// `operand(l)`); for the lane that computes a simdgroup collective.
template <class Element, class Layout, class LaneOperand>
void gather_matrix(gathered_matrix<Element, Layout>& gathered, LaneOperand operand) {
  for (unsigned lane = 0; lane < mfa_abi::kSimdWidth; ++lane) {
    for (unsigned slot = 0; slot < Layout::capacity; ++slot) {
      if (!Layout::is_valid(lane, slot)) continue;
      const unsigned e = Layout::element(lane, slot);
      gathered.values[Layout::row(e)][Layout::column(e)] = static_cast<Element>((*operand(lane))[slot]);
    }
  }
}

// Each lane's `target` gets the elements of the lanes' `source` that its
// layout gives it: one cooperative tensor redistributed as another of the
// same shape, a collective of the simdgroup.
template <class Target, class Source>
void redistribute(const char* op, const Source& source, Target& target, const call_site& at) {
  using SourceLayout = typename Source::layout_type;
  using TargetLayout = typename Target::layout_type;
  static_assert(SourceLayout::threads == mfa_abi::kSimdWidth && TargetLayout::threads == mfa_abi::kSimdWidth,
                "cooperative tensors convert within execution_simdgroup ops on the cpu backend");
  static_assert(SourceLayout::rows == TargetLayout::rows && SourceLayout::columns == TargetLayout::columns,
                "a cooperative tensor converts into one of the same rows and columns");
  struct lane_operands {
    const Source* source;
    Target* target;
  };
  mfa_abi::ThreadState* const state = mfa_abi::current_thread;
  write_slot(state->simd->in[state->thread_index_in_simdgroup], lane_operands{&source, &target});
  synchronize_simdgroup(op, at, /*full=*/1, [](mfa_abi::SimdGroup& simd, mfa_abi::ThreadState*) {
    using Element = typename Target::value_type;
    gathered_matrix<Element, SourceLayout> gathered;
    gather_matrix(gathered, [&simd](unsigned lane) { return read_slot<lane_operands>(simd.in[lane]).source; });
    for (unsigned lane = 0; lane < mfa_abi::kSimdWidth; ++lane) {
      Target& lane_target = *read_slot<lane_operands>(simd.in[lane]).target;
      for (unsigned slot = 0; slot < TargetLayout::capacity; ++slot) {
        if (!TargetLayout::is_valid(lane, slot)) continue;
        const unsigned e = TargetLayout::element(lane, slot);
        lane_target[slot] = gathered.values[TargetLayout::row(e)][TargetLayout::column(e)];
      }
    }
  });
}

}  // namespace mfa_shim
