// simdgroup_matrix<T, 8, 8>: an 8x8 matrix spread over the 32 lanes of a
// simdgroup, two elements per lane, in Apple's layout (MFA and MLX agree):
// lane l holds row (l / 16) * 4 + (l / 2) % 4, columns c and c + 1 with
// c = ((l / 4) & 2) * 2 + (l % 2) * 2. Loads and stores are lane-local;
// multiplies are collectives of the whole simdgroup. Part of the shim metal_stdlib.
#pragma once

namespace mfa_shim {

struct matrix_position {
  unsigned row;
  unsigned column;  // the first of the lane's two columns
};

constexpr matrix_position position_of_lane(unsigned lane) {
  return {(lane / 16) * 4 + (lane / 2) % 4, ((lane / 4) & 2) * 2 + (lane % 2) * 2};
}

inline unsigned current_lane() { return mfa_abi::current_thread->thread_index_in_simdgroup; }

// Index of matrix element (row, column) in memory, as simdgroup_load/store
// address it: the origin is (column, row) of the matrix; a transposed matrix
// is stored column by column.
inline size_t matrix_element_offset(unsigned row, unsigned column, size_t elements_per_row,
                                    metal::vec<ulong, 2> origin, bool transpose) {
  return transpose ? (origin.x + column) * elements_per_row + origin.y + row
                   : (origin.y + row) * elements_per_row + origin.x + column;
}

// sum += left * right for 8x8 float matrices. One out-of-line copy serves
// every element type (and keeps the optimizer's work per kernel small).
__attribute__((noinline)) inline void multiply_add_8x8(const float (&left)[8][8],
                                                      const float (&right)[8][8],
                                                      float (&sum)[8][8]) {
  for (unsigned row = 0; row < 8; ++row) {
    for (unsigned k = 0; k < 8; ++k) {
      for (unsigned column = 0; column < 8; ++column) {
        sum[row][column] += left[row][k] * right[k][column];
      }
    }
  }
}

template <class TA, class TB, class TC>
struct multiply_operands {
  metal::vec<TA, 2> a;
  metal::vec<TB, 2> b;
  metal::vec<TC, 2> c;
};

// D = A * B + C over the simdgroup: math in float, D rounded to TD. Counts
// one 8x8x8 product for the threadgroup.
template <class TD, class TA, class TB, class TC>
metal::vec<TD, 2> multiply_accumulate(const char* op, const call_site& at,
                                      const metal::vec<TA, 2>& a, const metal::vec<TB, 2>& b,
                                      const metal::vec<TC, 2>& c) {
  using Operands = multiply_operands<TA, TB, TC>;
  return collective<metal::vec<TD, 2>>(
      op, at, /*full=*/1, Operands{a, b, c},
      [](mfa_abi::SimdGroup& simd, mfa_abi::ThreadState* thread) {
        float left[8][8], right[8][8], sum[8][8];
        for (unsigned lane = 0; lane < mfa_abi::kSimdWidth; ++lane) {
          const Operands operands = read_slot<Operands>(simd.in[lane]);
          const matrix_position p = position_of_lane(lane);
          for (unsigned j = 0; j < 2; ++j) {
            left[p.row][p.column + j] = static_cast<float>(operands.a[j]);
            right[p.row][p.column + j] = static_cast<float>(operands.b[j]);
            sum[p.row][p.column + j] = static_cast<float>(operands.c[j]);
          }
        }
        multiply_add_8x8(left, right, sum);
        for (unsigned lane = 0; lane < mfa_abi::kSimdWidth; ++lane) {
          const matrix_position p = position_of_lane(lane);
          const metal::vec<TD, 2> result(static_cast<TD>(sum[p.row][p.column]),
                                         static_cast<TD>(sum[p.row][p.column + 1]));
          write_slot(simd.out[lane], result);
        }
        thread->group->counters->simdgroup_matrix_ops += 1;
      });
}

}  // namespace mfa_shim

namespace metal {

template <class T, int Cols, int Rows>
class simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the cpu backend has 8x8 simdgroup matrices only");
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat>,
                "simdgroup_matrix elements are float, half or bfloat");

 public:
  simdgroup_matrix() = default;
  // A diagonal matrix, as in MSL.
  explicit simdgroup_matrix(T diagonal) {
    const mfa_shim::matrix_position p = mfa_shim::position_of_lane(mfa_shim::current_lane());
    for (unsigned j = 0; j < 2; ++j) elements_[j] = p.row == p.column + j ? diagonal : T(0);
  }

  vec<T, 2>& thread_elements() { return elements_; }
  const vec<T, 2>& thread_elements() const { return elements_; }

 private:
  vec<T, 2> elements_;
};

using simdgroup_float8x8 = simdgroup_matrix<float, 8, 8>;
using simdgroup_half8x8 = simdgroup_matrix<half, 8, 8>;
using simdgroup_bfloat8x8 = simdgroup_matrix<bfloat, 8, 8>;

template <class T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T value) {
  simdgroup_matrix<T, Cols, Rows> matrix;
  matrix.thread_elements() = vec<T, 2>(value);
  return matrix;
}

// `source` is a threadgroup pointer or a buffer_ptr (which counts the lane's
// elements); with the race detector, a threadgroup_ptr records them at `at`.
template <class T, class Pointer>
void simdgroup_load(simdgroup_matrix<T, 8, 8>& destination, Pointer source,
                    size_t elements_per_row = 8, vec<ulong, 2> matrix_origin = vec<ulong, 2>(0),
                    bool transpose_matrix = false, mfa_shim::call_site at = mfa_shim::call_site()) {
  static_assert(std::is_same_v<std::remove_cv_t<mfa_shim::pointee_t<Pointer>>, T>,
                "simdgroup_load: the pointer's element type must be the matrix's");
  const mfa_shim::matrix_position p = mfa_shim::position_of_lane(mfa_shim::current_lane());
  for (unsigned j = 0; j < 2; ++j) {
    destination.thread_elements()[j] = mfa_shim::element_at(
        source, mfa_shim::matrix_element_offset(p.row, p.column + j, elements_per_row, matrix_origin,
                                                transpose_matrix),
        at);
  }
}

template <class T, class Pointer>
void simdgroup_store(const simdgroup_matrix<T, 8, 8>& matrix, Pointer destination,
                     size_t elements_per_row = 8, vec<ulong, 2> matrix_origin = vec<ulong, 2>(0),
                     bool transpose_matrix = false, mfa_shim::call_site at = mfa_shim::call_site()) {
  static_assert(std::is_same_v<mfa_shim::pointee_t<Pointer>, T>,
                "simdgroup_store: the pointer's element type must be the matrix's");
  const mfa_shim::matrix_position p = mfa_shim::position_of_lane(mfa_shim::current_lane());
  for (unsigned j = 0; j < 2; ++j) {
    mfa_shim::element_at(destination,
                         mfa_shim::matrix_element_offset(p.row, p.column + j, elements_per_row,
                                                         matrix_origin, transpose_matrix),
                         at) = matrix.thread_elements()[j];
  }
}

// d = a * b + c; element types may differ (the math is float).
template <class TD, class TA, class TB, class TC>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d,
                                   const simdgroup_matrix<TA, 8, 8>& a,
                                   const simdgroup_matrix<TB, 8, 8>& b,
                                   const simdgroup_matrix<TC, 8, 8>& c,
                                   mfa_shim::call_site at = mfa_shim::call_site()) {
  d.thread_elements() = mfa_shim::multiply_accumulate<TD>(
      "simdgroup_multiply_accumulate", at, a.thread_elements(), b.thread_elements(),
      c.thread_elements());
}

// d = a * b.
template <class TD, class TA, class TB>
void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                        const simdgroup_matrix<TB, 8, 8>& b,
                        mfa_shim::call_site at = mfa_shim::call_site()) {
  d.thread_elements() = mfa_shim::multiply_accumulate<TD>(
      "simdgroup_multiply", at, a.thread_elements(), b.thread_elements(), vec<TD, 2>(0));
}

}  // namespace metal
