// mpp::tensor_ops::reduce_rows / reduce_columns: a destination cooperative
// tensor folded along its rows or columns into the op's row- or column-
// reduction cooperative tensor (matmul2d's get_row_reduction_ /
// get_column_reduction_destination_cooperative_tensor). Part of the shim's
// MetalPerformancePrimitives.
//
// A reduction is a collective of its cooperative tensors' execution_simdgroup
// (the only scope the cpu backend reduces over): one lane gathers the 32
// lanes' source elements, folds each row (column) from `identity` in order
// of column (row), and writes every lane's destination elements. As in
// Metal, the default identity is 0 whatever the operation: pass
// reduction_operation_identity<T>::max_identity for max.
#pragma once

namespace mpp {
namespace tensor_ops {

enum class reduction_operation {
  sum,
  max,
  min,
};

template <typename ElementType>
struct reduction_operation_identity {
  static constexpr ElementType sum_identity = ElementType(0);
  static constexpr ElementType max_identity = metal::numeric_limits<ElementType>::lowest();
  static constexpr ElementType min_identity = metal::numeric_limits<ElementType>::max();
};

}  // namespace tensor_ops
}  // namespace mpp

namespace mfa_shim {

template <class ElementType>
ElementType reduced(mpp::tensor_ops::reduction_operation op, ElementType a, ElementType b) {
  switch (op) {
    case mpp::tensor_ops::reduction_operation::max: return b > a ? b : a;
    case mpp::tensor_ops::reduction_operation::min: return b < a ? b : a;
    case mpp::tensor_ops::reduction_operation::sum: break;
  }
  return ElementType(a + b);
}

// Folds `source` (Rows x Columns) along rows (AlongRows: one value per row)
// or columns into `destination` (Rows x 1 or 1 x Columns).
template <bool AlongRows, class ElementType, class SourceLayout, class DestinationLayout, class Source,
          class Destination>
void reduce_matrix(const char* op_name, Source& source, Destination& destination,
                   mpp::tensor_ops::reduction_operation op, ElementType identity, const call_site& at) {
  static_assert(SourceLayout::threads == mfa_abi::kSimdWidth && DestinationLayout::threads == mfa_abi::kSimdWidth,
                "reduce_rows / reduce_columns: the cpu backend reduces cooperative tensors of execution_simdgroup ops");
  constexpr int rows = SourceLayout::rows, columns = SourceLayout::columns;
  constexpr int results = AlongRows ? rows : columns;
  struct lane_operands {
    Source* source;
    Destination* destination;
  };
  mfa_abi::ThreadState* const state = mfa_abi::current_thread;
  write_slot(state->simd->in[state->thread_index_in_simdgroup], lane_operands{&source, &destination});
  synchronize_simdgroup(op_name, at, /*full=*/1, [&](mfa_abi::SimdGroup& simd, mfa_abi::ThreadState*) {
    gathered_matrix<ElementType, SourceLayout> gathered;
    gather_matrix(gathered, [&simd](unsigned lane) { return read_slot<lane_operands>(simd.in[lane]).source; });
    const auto& values = gathered.values;
    ElementType folded[results];
    for (int i = 0; i < results; ++i) {
      folded[i] = identity;
      for (int j = 0; j < (AlongRows ? columns : rows); ++j) {
        folded[i] = reduced(op, folded[i], AlongRows ? values[i][j] : values[j][i]);
      }
    }
    for (unsigned lane = 0; lane < mfa_abi::kSimdWidth; ++lane) {
      Destination& lane_destination = *read_slot<lane_operands>(simd.in[lane]).destination;
      for (unsigned slot = 0; slot < DestinationLayout::capacity; ++slot) {
        if (!DestinationLayout::is_valid(lane, slot)) continue;
        const unsigned e = DestinationLayout::element(lane, slot);
        lane_destination[slot] = folded[AlongRows ? DestinationLayout::row(e) : DestinationLayout::column(e)];
      }
    }
  });
}

}  // namespace mfa_shim

namespace mpp {
namespace tensor_ops {

template <class ElementType, class SrcExtents, class DstExtents, class SrcLayout, class DstLayout>
void reduce_rows(metal::cooperative_tensor<ElementType, SrcExtents, SrcLayout>& source,
                 metal::cooperative_tensor<ElementType, DstExtents, DstLayout>& destination,
                 reduction_operation op = reduction_operation::sum,
                 ElementType identity = reduction_operation_identity<ElementType>::sum_identity,
                 mfa_shim::call_site at = mfa_shim::call_site()) {
  static_assert(DstLayout::rows == SrcLayout::rows && DstLayout::columns == 1,
                "reduce_rows: the destination is the op's row-reduction cooperative tensor");
  mfa_shim::reduce_matrix<true, ElementType, SrcLayout, DstLayout>("reduce_rows", source, destination, op, identity,
                                                                   at);
}

template <class ElementType, class SrcExtents, class DstExtents, class SrcLayout, class DstLayout>
void reduce_columns(metal::cooperative_tensor<ElementType, SrcExtents, SrcLayout>& source,
                    metal::cooperative_tensor<ElementType, DstExtents, DstLayout>& destination,
                    reduction_operation op = reduction_operation::sum,
                    ElementType identity = reduction_operation_identity<ElementType>::sum_identity,
                    mfa_shim::call_site at = mfa_shim::call_site()) {
  static_assert(DstLayout::columns == SrcLayout::columns && DstLayout::rows == 1,
                "reduce_columns: the destination is the op's column-reduction cooperative tensor");
  mfa_shim::reduce_matrix<false, ElementType, SrcLayout, DstLayout>("reduce_columns", source, destination, op,
                                                                    identity, at);
}

}  // namespace tensor_ops
}  // namespace mpp
