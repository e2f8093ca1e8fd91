// mpp::tensor_ops::matmul2d: destination (M x N) = left (M x K) * right (K x N),
// or += with mode::multiply_accumulate, run as a collective of the threads of
// its execution scope. Part of the shim's MetalPerformancePrimitives.
//
// - execution_simdgroups<1> (execution_simdgroup): the 32 lanes of the
//   caller's simdgroup, each simdgroup on its own. execution_simdgroups<N>,
//   N > 1: the whole threadgroup, which must have exactly N simdgroups (its
//   meeting counts in Counters::barriers). Every thread of the scope must
//   call run at the same place: a missing or diverging thread fails the
//   dispatch as a barrier does. run does not order memory: write operands,
//   threadgroup_barrier, then run (the race detector sees the difference).
// - Operands are tensors (mfa_tensor.h) or, with execution_simdgroup and a
//   static K, the op's input cooperative tensors; the destination is a tensor
//   or the op's destination cooperative tensor (mfa_cooperative_tensor.h). An
//   operand element outside its tensor's extents reads as 0; a destination
//   element outside them is not written. K is the descriptor's, or with
//   dynamic_length_v<int> (Apple's spelling of a K read from the operands)
//   the left operand's.
// - Each thread reads a share of the tensor operands' elements through their
//   pointers (counted once per run, bounds checked, recorded for the race
//   detector), then computes the destination elements it owns in the seeded
//   layout. With cooperative-tensor operands one lane gathers them from the
//   32 lanes and computes every lane's destination elements.
// - Products and sums are float (half, bfloat, float operands) or int32
//   (char/uchar operands, int destination), in order of k: exact for
//   integers. relaxed_precision changes nothing here.
// - Counters::simdgroup_matrix_ops counts a run as the 8x8x8 multiply-
//   accumulates it issues, ceil(M/8) * ceil(N/8) * ceil(K/8), once per scope.
#pragma once

namespace metal {

template <size_t Size>
struct execution_simdgroups {
  static_assert(Size != 0, "execution_simdgroups<0> is not an execution scope");
  static constexpr size_t static_size = Size;
  constexpr uint size() const { return uint(Size); }
};
using execution_simdgroup = execution_simdgroups<1>;

}  // namespace metal

namespace mfa_shim {

template <class Scope>
struct tensor_op_scope;
template <size_t Simdgroups>
struct tensor_op_scope<metal::execution_simdgroups<Simdgroups>> {
  static constexpr unsigned threads = unsigned(Simdgroups) * mfa_abi::kSimdWidth;

  // The caller's index among the scope's threads.
  static unsigned participant() {
    const mfa_abi::ThreadState* const state = mfa_abi::current_thread;
    return Simdgroups == 1 ? state->thread_index_in_simdgroup : state->thread_index_in_threadgroup;
  }

  // Waits for every thread of the scope at `op` (without ordering memory).
  static void meet(const char* op, const call_site& at) {
    if constexpr (Simdgroups == 1) {
      synchronize_simdgroup(op, at, /*full=*/1, [](mfa_abi::SimdGroup&, mfa_abi::ThreadState*) {});
    } else {
      mfa_abi::ThreadState* const state = mfa_abi::current_thread;
      const uint32_t* const size = state->dispatch->threads_per_threadgroup;
      if (size[0] * size[1] * size[2] != threads) {
        char message[200];
        std::snprintf(message, sizeof message,
                      "%s at %s:%d: execution_simdgroups<%zu> needs threadgroups of %u threads; these have %u",
                      op, at.file, at.line, Simdgroups, threads, size[0] * size[1] * size[2]);
        fail(state, message);
      }
      const mfa_abi::Site site{op, at.file, at.line, 0};
      state->dispatch->runtime->threadgroup_barrier(state, &site);
      mfa_abi::current_thread = state;
    }
  }
};

// Whether an operand is a tensor of const elements (Metal's matmul2d refuses them).
template <class Operand, class = void>
inline constexpr bool const_elements_v = false;
template <class Operand>
inline constexpr bool const_elements_v<Operand, std::void_t<typename Operand::element_type>> =
    std::is_const_v<typename Operand::element_type>;

// The accumulator of a product into Destination elements.
template <class Destination>
using accumulator_t = std::conditional_t<std::is_integral_v<Destination>, int32_t, float>;

template <class Left, class Right, class Destination>
constexpr void check_element_types() {
  constexpr bool integer_operands = std::is_integral_v<Left> && std::is_integral_v<Right>;
  static_assert(integer_operands || (!std::is_integral_v<Left> && !std::is_integral_v<Right>),
                "matmul2d: both operands are integers (char, uchar) or both floating point");
  static_assert(integer_operands == std::is_integral_v<Destination>,
                "matmul2d: integer operands accumulate into an int destination, floating point ones into float or half");
}

// Matrix element (row, column) of an operand stored as `t` (transposed or
// not), 0 outside the tensor; read from memory the sweep has checked.
template <class Accumulator, class Tensor>
Accumulator operand_value(const Tensor& t, bool transposed, long row, long column) {
  const long x = transposed ? row : column;
  const long y = transposed ? column : row;
  if (!tensor_access::contains(t, x, y)) return Accumulator(0);
  return static_cast<Accumulator>(*tensor_access::address(t, x, y));
}

// Reads this participant's share of a Rows x Columns operand through its
// pointer: every element inside the extents is read by one thread of the scope.
template <class Tensor>
void sweep_operand(const Tensor& t, bool transposed, long rows, long columns, unsigned participant,
                   unsigned threads, const call_site& at) {
  using Value = typename Tensor::value_type;
  for (long e = participant; e < rows * columns; e += threads) {
    const long row = e / columns, column = e % columns;
    const long x = transposed ? row : column;
    const long y = transposed ? column : row;
    if (tensor_access::contains(t, x, y)) static_cast<void>(static_cast<Value>(tensor_access::element(t, x, y, at)));
  }
}

// The stored shape of an operand whose other dimension is `outer` (M or N):
// `outer_first` for M x K (a left operand) and N x K (a transposed right one).
constexpr int stored_rows(bool outer_first, int outer, int k) { return outer_first ? outer : k; }
constexpr int stored_columns(bool outer_first, int outer, int k) { return outer_first ? k : outer; }

template <class Accumulator, class Layout>
Accumulator operand_value(const gathered_matrix<Accumulator, Layout>& gathered, bool transposed, long row,
                          long column) {
  return transposed ? gathered.values[column][row] : gathered.values[row][column];
}

}  // namespace mfa_shim

namespace mpp {
namespace tensor_ops {

// A descriptor's K taken from the left operand's extents (MPPTensorOpsTypes.h).
template <class T>
inline constexpr T dynamic_length_v = static_cast<T>(metal::dynamic_extent);

struct matmul2d_descriptor {
  enum class mode {
    multiply,
    multiply_accumulate,
  };

  int m, n, k;
  bool transpose_left, transpose_right;
  bool relaxed_precision;
  mode matmul_mode;

  constexpr matmul2d_descriptor(int m_, int n_, int k_ = dynamic_length_v<int>,
                                bool transpose_left_ = false, bool transpose_right_ = false,
                                bool relaxed_precision_ = false, mode matmul_mode_ = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(matmul_mode_) {}
};

template <matmul2d_descriptor Descriptor, class Scope>
class matmul2d {
  using scope_threads = mfa_shim::tensor_op_scope<Scope>;
  using layout = mfa_shim::seeded_layout<Descriptor.m, Descriptor.n, scope_threads::threads>;
  static_assert(Descriptor.m > 0 && Descriptor.n > 0, "matmul2d_descriptor: M and N are positive");

  template <bool OuterFirst, int Outer>
  using input_layout = mfa_shim::seeded_layout<mfa_shim::stored_rows(OuterFirst, Outer, Descriptor.k),
                                               mfa_shim::stored_columns(OuterFirst, Outer, Descriptor.k),
                                               scope_threads::threads>;
  using left_input_layout = input_layout<!Descriptor.transpose_left, Descriptor.m>;
  using right_input_layout = input_layout<Descriptor.transpose_right, Descriptor.n>;

  template <class Element, class CoordType, class Layout>
  using input_cooperative_tensor = metal::cooperative_tensor<
      Element, metal::extents<CoordType, size_t(Layout::columns), size_t(Layout::rows)>, Layout>;

 public:
  static constexpr matmul2d_descriptor descriptor = Descriptor;
  using scope = Scope;

  // Cooperative-tensor operands hold the matrix as a tensor would store it
  // (K x M for a transposed left operand), for execution_simdgroup only.
  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int>
  using cooperative_tensor_left_input_t =
      input_cooperative_tensor<LeftElementType, CoordType, left_input_layout>;

  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int>
  cooperative_tensor_left_input_t<LeftElementType, RightElementType, ElementType, CoordType>
  get_left_input_cooperative_tensor() const {
    return make_operand<cooperative_tensor_left_input_t<LeftElementType, RightElementType, ElementType, CoordType>>();
  }

  // `source` (another op's destination, say) as this op's left operand.
  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int,
            class SourceElement, class SourceExtents, class SourceLayout>
  cooperative_tensor_left_input_t<LeftElementType, RightElementType, ElementType, CoordType>
  get_left_input_cooperative_tensor(const metal::cooperative_tensor<SourceElement, SourceExtents, SourceLayout>& source,
                                    mfa_shim::call_site at = mfa_shim::call_site()) const {
    return converted("get_left_input_cooperative_tensor", source,
                     get_left_input_cooperative_tensor<LeftElementType, RightElementType, ElementType, CoordType>(), at);
  }

  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int>
  using cooperative_tensor_right_input_t =
      input_cooperative_tensor<RightElementType, CoordType, right_input_layout>;

  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int>
  cooperative_tensor_right_input_t<LeftElementType, RightElementType, ElementType, CoordType>
  get_right_input_cooperative_tensor() const {
    return make_operand<cooperative_tensor_right_input_t<LeftElementType, RightElementType, ElementType, CoordType>>();
  }

  // `source` (another op's destination, say) as this op's right operand.
  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int,
            class SourceElement, class SourceExtents, class SourceLayout>
  cooperative_tensor_right_input_t<LeftElementType, RightElementType, ElementType, CoordType>
  get_right_input_cooperative_tensor(const metal::cooperative_tensor<SourceElement, SourceExtents, SourceLayout>& source,
                                     mfa_shim::call_site at = mfa_shim::call_site()) const {
    return converted("get_right_input_cooperative_tensor", source,
                     get_right_input_cooperative_tensor<LeftElementType, RightElementType, ElementType, CoordType>(), at);
  }

  template <class LeftOperand, class RightOperand, class ElementType, class CoordType = int>
  using cooperative_tensor_destination_t =
      metal::cooperative_tensor<ElementType, metal::extents<CoordType, size_t(Descriptor.n), size_t(Descriptor.m)>,
                                layout>;

  template <class LeftOperand, class RightOperand, class ElementType, class CoordType = int>
  cooperative_tensor_destination_t<LeftOperand, RightOperand, ElementType, CoordType>
  get_destination_cooperative_tensor() const {
    return mfa_shim::cooperative_tensor_maker::make<
        cooperative_tensor_destination_t<LeftOperand, RightOperand, ElementType, CoordType>>(scope_threads::participant());
  }

  // One element per row (column) of the destination, for reduce_rows (reduce_columns).
  template <class LeftOperand, class RightOperand, class ElementType, class CoordType = int>
  using cooperative_tensor_row_reduction_destination_t =
      metal::cooperative_tensor<ElementType, metal::extents<CoordType, 1, size_t(Descriptor.m)>,
                                mfa_shim::seeded_layout<Descriptor.m, 1, scope_threads::threads>>;

  template <class LeftOperand, class RightOperand, class ElementType, class CoordType = int>
  cooperative_tensor_row_reduction_destination_t<LeftOperand, RightOperand, ElementType, CoordType>
  get_row_reduction_destination_cooperative_tensor() const {
    return mfa_shim::cooperative_tensor_maker::make<
        cooperative_tensor_row_reduction_destination_t<LeftOperand, RightOperand, ElementType, CoordType>>(
        scope_threads::participant());
  }

  template <class LeftOperand, class RightOperand, class ElementType, class CoordType = int>
  using cooperative_tensor_column_reduction_destination_t =
      metal::cooperative_tensor<ElementType, metal::extents<CoordType, size_t(Descriptor.n), 1>,
                                mfa_shim::seeded_layout<1, Descriptor.n, scope_threads::threads>>;

  template <class LeftOperand, class RightOperand, class ElementType, class CoordType = int>
  cooperative_tensor_column_reduction_destination_t<LeftOperand, RightOperand, ElementType, CoordType>
  get_column_reduction_destination_cooperative_tensor() const {
    return mfa_shim::cooperative_tensor_maker::make<
        cooperative_tensor_column_reduction_destination_t<LeftOperand, RightOperand, ElementType, CoordType>>(
        scope_threads::participant());
  }

  template <class Left, class Right, class Destination>
  void run(Left& left, Right& right, Destination& destination, mfa_shim::call_site at = mfa_shim::call_site()) const {
    static_assert((mfa_shim::is_tensor_v<Left> || mfa_shim::is_cooperative_tensor_v<Left>) &&
                      (mfa_shim::is_tensor_v<Right> || mfa_shim::is_cooperative_tensor_v<Right>),
                  "matmul2d::run: the operands are tensors or the op's input cooperative tensors");
    static_assert(!mfa_shim::const_elements_v<Left> && !mfa_shim::const_elements_v<Right>,
                  "matmul2d::run: MetalPerformancePrimitives refuses tensors of const elements; "
                  "view a non-const pointer (device T*)");
    check_cooperative_operand<Left, left_input_layout>();
    check_cooperative_operand<Right, right_input_layout>();
    using Element = typename Destination::value_type;
    using Accumulator = mfa_shim::accumulator_t<Element>;
    mfa_shim::check_element_types<typename Left::value_type, typename Right::value_type, Element>();
    const long k = reduction_length(left);
    const unsigned participant = scope_threads::participant();
    sweep(left, Descriptor.transpose_left, Descriptor.m, k, participant, at);
    sweep(right, Descriptor.transpose_right, k, Descriptor.n, participant, at);

    if constexpr (mfa_shim::is_cooperative_tensor_v<Left> || mfa_shim::is_cooperative_tensor_v<Right>) {
      run_on_one_lane<Accumulator>(left, right, destination, k, at);
    } else {
      scope_threads::meet("matmul2d::run", at);
      for (unsigned slot = 0; slot < layout::capacity; ++slot) {
        if (!layout::is_valid(participant, slot)) continue;
        const unsigned e = layout::element(participant, slot);
        accumulate(destination, slot, layout::column(e), layout::row(e),
                   product<Accumulator>(left, right, layout::row(e), layout::column(e), k), at);
      }
    }
    if (participant == 0) {
      const auto blocks = [](long extent) { return uint64_t((extent + 7) / 8); };
      mfa_abi::current_thread->group->counters->simdgroup_matrix_ops +=
          blocks(Descriptor.m) * blocks(Descriptor.n) * blocks(k);
    }
  }

 private:
  // `target`, a new operand cooperative tensor of this op, holding `source`'s matrix (a collective).
  template <class Source, class Target>
  static Target converted(const char* op, const Source& source, Target target, const mfa_shim::call_site& at) {
    mfa_shim::redistribute(op, source, target, at);
    return target;
  }

  static constexpr void check_cooperative_operands_allowed() {
    static_assert(scope_threads::threads == mfa_abi::kSimdWidth,
                  "matmul2d: cooperative-tensor operands need execution_simdgroup on the cpu backend");
    static_assert(Descriptor.k != dynamic_length_v<int>,
                  "matmul2d: cooperative-tensor operands need a static K in the descriptor");
  }

  // A cooperative-tensor operand must be this op's (get_*_input_cooperative_tensor).
  template <class Operand, class ExpectedLayout>
  static constexpr void check_cooperative_operand() {
    if constexpr (mfa_shim::is_cooperative_tensor_v<Operand>) {
      check_cooperative_operands_allowed();
      static_assert(std::is_same_v<typename Operand::layout_type, ExpectedLayout>,
                    "matmul2d::run: a cooperative-tensor operand is this op's input cooperative tensor "
                    "(convert others with get_left_input_ / get_right_input_cooperative_tensor(source))");
    }
  }

  template <class CooperativeTensor>
  static CooperativeTensor make_operand() {
    check_cooperative_operands_allowed();
    return mfa_shim::cooperative_tensor_maker::make<CooperativeTensor>(scope_threads::participant());
  }

  // K: the descriptor's, or with dynamic_length_v the left tensor's.
  template <class Left>
  static long reduction_length(const Left& left) {
    if constexpr (mfa_shim::is_tensor_v<Left>) {
      if (Descriptor.k == dynamic_length_v<int>) {
        return mfa_shim::tensor_access::extent(left, Descriptor.transpose_left ? 1 : 0);
      }
    }
    return Descriptor.k;
  }

  template <class Operand>
  static void sweep(const Operand& operand, bool transposed, long rows, long columns, unsigned participant,
                    const mfa_shim::call_site& at) {
    if constexpr (mfa_shim::is_tensor_v<Operand>) {
      mfa_shim::sweep_operand(operand, transposed, rows, columns, participant, scope_threads::threads, at);
    }
  }

  // Destination element (row, column): left row * right column over k.
  template <class Accumulator, class Left, class Right>
  static Accumulator product(const Left& left, const Right& right, long row, long column, long k) {
    Accumulator sum = 0;
    for (long i = 0; i < k; ++i) {
      sum += mfa_shim::operand_value<Accumulator>(left, Descriptor.transpose_left, row, i) *
             mfa_shim::operand_value<Accumulator>(right, Descriptor.transpose_right, i, column);
    }
    return sum;
  }

  // The operand as the computing lane reads it: a tensor as it is (every lane
  // brings the same view), a cooperative tensor gathered from the 32 lanes.
  template <class Accumulator, class Operand, class LaneOperand>
  static decltype(auto) lane_view(const Operand& own, LaneOperand lane_operand) {
    if constexpr (mfa_shim::is_cooperative_tensor_v<Operand>) {
      mfa_shim::gathered_matrix<Accumulator, typename Operand::layout_type> gathered;
      mfa_shim::gather_matrix(gathered, lane_operand);
      return gathered;
    } else {
      return (own);
    }
  }

  // With cooperative-tensor operands (execution_simdgroup): the simdgroup
  // meets, and one lane computes every lane's destination elements (and
  // writes all of a tensor destination).
  template <class Accumulator, class Left, class Right, class Destination>
  static void run_on_one_lane(Left& left, Right& right, Destination& destination, long k,
                              const mfa_shim::call_site& at) {
    struct lane_operands {
      Left* left;
      Right* right;
      Destination* destination;
    };
    mfa_abi::ThreadState* const state = mfa_abi::current_thread;
    mfa_shim::write_slot(state->simd->in[state->thread_index_in_simdgroup], lane_operands{&left, &right, &destination});
    mfa_shim::synchronize_simdgroup("matmul2d::run", at, /*full=*/1, [&](mfa_abi::SimdGroup& simd, mfa_abi::ThreadState*) {
      const auto operands_of = [&simd](unsigned lane) { return mfa_shim::read_slot<lane_operands>(simd.in[lane]); };
      decltype(auto) left_values = lane_view<Accumulator>(left, [&](unsigned lane) { return operands_of(lane).left; });
      decltype(auto) right_values =
          lane_view<Accumulator>(right, [&](unsigned lane) { return operands_of(lane).right; });
      if constexpr (mfa_shim::is_cooperative_tensor_v<Destination>) {
        for (unsigned lane = 0; lane < mfa_abi::kSimdWidth; ++lane) {
          Destination& lane_destination = *operands_of(lane).destination;
          for (unsigned slot = 0; slot < layout::capacity; ++slot) {
            if (!layout::is_valid(lane, slot)) continue;
            const unsigned e = layout::element(lane, slot);
            accumulate(lane_destination, slot, layout::column(e), layout::row(e),
                       product<Accumulator>(left_values, right_values, layout::row(e), layout::column(e), k), at);
          }
        }
      } else {
        for (long row = 0; row < Descriptor.m; ++row) {
          for (long column = 0; column < Descriptor.n; ++column) {
            accumulate(destination, 0, column, row, product<Accumulator>(left_values, right_values, row, column, k), at);
          }
        }
      }
    });
  }

  static constexpr bool accumulates = Descriptor.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;

  template <class Element, class Extents, class Layout, class Accumulator>
  static void accumulate(metal::cooperative_tensor<Element, Extents, Layout>& destination, unsigned slot, long,
                         long, Accumulator sum, const mfa_shim::call_site&) {
    static_assert(std::is_same_v<Layout, layout>, "matmul2d::run: the destination cooperative tensor is another op's");
    if (accumulates) sum += static_cast<Accumulator>(destination[slot]);
    destination[slot] = static_cast<Element>(sum);
  }

  template <class Tensor, class Accumulator>
  static void accumulate(Tensor& destination, unsigned, long column, long row, Accumulator sum,
                         const mfa_shim::call_site& at) {
    static_assert(mfa_shim::is_tensor_v<Tensor>, "matmul2d::run: the destination is a tensor or a cooperative tensor");
    using Element = typename Tensor::value_type;
    if (!mfa_shim::tensor_access::contains(destination, column, row)) return;
    decltype(auto) element = mfa_shim::tensor_access::element(destination, column, row, at);
    if (accumulates) sum += static_cast<Accumulator>(static_cast<Element>(element));
    element = static_cast<Element>(sum);
  }
};

}  // namespace tensor_ops
}  // namespace mpp
