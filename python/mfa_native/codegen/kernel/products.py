"""The products facet: how a kernel computes its matrix products.

- `simdgroup_matrix` (every family): each simdgroup multiplies 8x8 tiles it holds
  lane-locally (tiles.py's `scores` and `accumulate`).
- `tensor_ops` (apple10, Apple M5 and later, Metal 4): the threadgroup multiplies with
  MetalPerformancePrimitives' `mpp::tensor_ops::matmul2d`, run by all its simdgroups
  together, over tensor views of device memory (the threadgroup's own rows) and of the
  stage its step filled (storage/staging.py: the walked rows, decoded and gathered by the
  storage and key-visit facets as for the simdgroup path). A product's destination is a
  cooperative tensor; the kernel touches it only through `store` into threadgroup memory,
  from where each lane reads the elements its 8x8 tiles hold (tiles.py's lane layout), so
  the softmax, masking and stores stay as they are. Which element of a cooperative tensor a
  thread holds is unpublished (and has changed between OS releases); the cpu backend's shim
  draws it from a seed, and the tests run several seeds.

Both operands of a tensor-op product are the inputs' own type (float, half, bfloat; the
weights P or dS rounded to it, as the simdgroup path's p16 does); products accumulate in
float32. relaxed_precision stays off.

Every operand is a tensor made at its product with exact extents (`RowsView.tensor`): both
operands of a product agree on K (Apple's header takes it from either), and no view reaches past
the rows it may read. Views are `dextents` with explicit strides over non-const pointers (MPP
refuses const element types), as public tensor-op kernels write them (llama.cpp's
ggml-metal.metal). Blocks here read simd_index, tr, tc and `tiles` (tiles.block_loop) and define
nothing outside their braces.
"""

from __future__ import annotations

from dataclasses import dataclass

from .accumulators import Accumulator
from .layouts import OperandLayout
from .msl import BARRIER, extent, indent, loop, offset
from .tiles import Rows, accumulate, scores, tiles

SIMDGROUP_MATRIX = "simdgroup_matrix"
TENSOR_OPS = "tensor_ops"

# The headers a tensor-op kernel includes beyond metal_stdlib (`libraries`).
LIBRARIES = ("metal_tensor", "MetalPerformancePrimitives/MetalPerformancePrimitives.h")

OUT = "product_out"          # threadgroup: a product's destination, stored for the lanes
WEIGHTS = "weights_stage"    # threadgroup: the weights (P, dS) as a product's left operand
CHUNK = 64                   # output features per product of the weights with a block of rows


@dataclass(frozen=True)
class RowsView:
    """Rows of a matrix a tensor-op product reads: `pointer` (an MSL name of a non-const pointer
    to its first row), `rows` of them (an MSL int: how many may be read), `width` features,
    `pitch` elements between rows and `step` between features (MSL ints)."""

    pointer: str
    rows: str
    width: int
    pitch: str
    step: str = "1"

    def tensor(self, rows: str, first: int = 0, features: int | str | None = None) -> str:
        """The MSL tensor of `rows` rows (an MSL int, at most self.rows) and `features` features
        (an int or MSL int; default: all) from feature `first`."""
        at = f" + {first} * {self.step}" if first else ""
        return (f"tensor({self.pointer}{at}, dextents<int32_t, 2>({features or self.width}, int({rows})), "
                f"array<int32_t, 2>{{int32_t({self.step}), int32_t({self.pitch})}})")


def device_rows(name: str, *, head: str, element: str, layout: OperandLayout, first: str, rows: str,
                width: int) -> tuple[list[str], RowsView]:
    """The lines that define `{name}` (a non-const pointer to row `first` of a head's rows in
    device memory, `head` pointing at the head) and `{name}_count` (`rows`), and its view."""
    at = offset(f"ulong({first})", layout.strides[2])
    lines = [f"device {element}* {name} = (device {element}*)({head}{f' + {at}' if at else ''});",
             f"const int {name}_count = {rows};"]
    return lines, RowsView(name, f"{name}_count", width, extent(layout.strides[2]), extent(layout.strides[3]))


def staged_rows(stage: str, *, width: int, rows: int) -> RowsView:
    """A stage's `rows` rows of `width` features, packed."""
    return RowsView(stage, str(rows), width, str(width))


def threadgroup_bytes(rows: int, block: int, operand_bytes: int) -> int:
    """The threadgroup memory ThreadgroupProducts of `rows` rows and blocks of `block` rows
    declare (0 without rows: no tensor-op products)."""
    return rows * max(block, CHUNK) * 4 + rows * block * operand_bytes if rows else 0


def libraries(body: str) -> list[str]:
    """The headers a kernel body needs beyond metal_stdlib: LIBRARIES when its products are tensor ops."""
    return list(LIBRARIES) if "mpp::tensor_ops::" in body else []


@dataclass(frozen=True)
class ThreadgroupProducts:
    """The tensor-op products of a threadgroup of `simdgroups` simdgroups, 8 rows each (the
    products' M), with blocks of at most `block` rows; `operand` is the operands' MSL type,
    `sums` their products' (float; int for char operands: exact int32 sums, read into the float
    tiles)."""

    simdgroups: int
    block: int
    operand: str
    sums: str = "float"

    @property
    def rows(self) -> int:
        return 8 * self.simdgroups

    def declare(self) -> list[str]:
        """The threadgroup memory the products use (at the kernel's top level)."""
        return ["", "// Tensor-op products: each destination is stored here for the lanes' 8x8 tiles,",
                "// and the weights are the left operand of their products.",
                f"threadgroup {self.sums} {OUT}[{self.rows * max(self.block, CHUNK)}];",
                f"threadgroup {self.operand} {WEIGHTS}[{self.rows * self.block}];"]

    def _run(self, *, n: int, lhs: str, rhs: str, transpose_rhs: bool) -> list[str]:
        """One matmul2d of the whole threadgroup: OUT (rows x n, packed) = lhs . rhs (or rhs^T),
        lhs and rhs MSL tensors agreeing on K, which the descriptor takes from them
        (dynamic_length_v: a static K must be a multiple of 32 since macOS 26.1, ccv's notes say)."""
        descriptor = (f"mpp::tensor_ops::matmul2d_descriptor({self.rows}, {n}, mpp::tensor_ops::dynamic_length_v<int>, "
                      f"false, {str(transpose_rhs).lower()}, false, "
                      "mpp::tensor_ops::matmul2d_descriptor::mode::multiply)")
        return ["{", *indent([
            f"auto left = {lhs};",
            f"auto right = {rhs};",
            f"mpp::tensor_ops::matmul2d<{descriptor}, execution_simdgroups<{self.simdgroups}>> product;",
            f"auto out = product.get_destination_cooperative_tensor<decltype(left), decltype(right), {self.sums}>();",
            "product.run(left, right, out);",
            f"out.store(tensor({OUT}, dextents<int32_t, 2>({n}, {self.rows})));  // by the API: no layout assumed"]),
            "}"]

    @staticmethod
    def _lane(pitch: str | int, column: str) -> str:
        """The lane's element of OUT (rows `pitch` apart) in its simdgroup's row tr at `column`."""
        return f"{OUT}[(simd_index * 8 + tr) * {pitch} + {column}]"

    def scores(self, result: str, *, lhs: RowsView, rhs: RowsView, count: int) -> list[str]:
        """result[j] (j < tiles, of `count`) = the lanes' tiles of lhs . rhs^T over their features:
        lhs the threadgroup's rows, rhs the step's rows. The product has the step's tiles * 8
        columns (one static shape per count: the simdgroup path's issued work)."""
        cases = []
        for n_tiles in range(1, count + 1):
            n = n_tiles * 8
            run = self._run(n=n, lhs=lhs.tensor(lhs.rows), rhs=rhs.tensor(f"min({n}, {rhs.rows})"), transpose_rhs=True)
            cases += [f"case {n_tiles}:"] + indent(run + ["break;"])
        read = loop("ushort e = 0; e < 2; ++e",
                    [f"{result}[j].thread_elements()[e] = {self._lane('tiles * 8', 'j * 8 + tc + e')};"])
        return (["switch (tiles) {  // the step's keys: a product of as many columns"] + indent(cases) + ["}", BARRIER]
                + loop(f"int j = 0; j < {count}; ++j", ["if (j < tiles) {"] + indent(read) + ["}"]) + [BARRIER])

    def _stage_weights(self, weights: str, count: int) -> list[str]:
        """The lanes' weight tiles j < tiles (of `count`), rounded to the operand type, into
        WEIGHTS (rows `block` apart)."""
        own = f"{WEIGHTS}[(simd_index * 8 + tr) * {self.block} + j * 8 + tc + e]"
        return (["// The weights as the left operand of the products: the step's tiles."]
                + loop(f"int j = 0; j < {count}; ++j", ["if (j < tiles) {"] + indent(loop(
                    "ushort e = 0; e < 2; ++e", [f"{own} = {self.operand}({weights}[j].thread_elements()[e]);"]))
                    + ["}"])
                + [BARRIER])

    def _accumulate(self, result: str, *, rhs: RowsView, keys: str, features: tuple[int, int]) -> list[str]:
        """result[t] += weights . rhs for the feature tiles `features` = (first, count) (result[t]
        holds tile first + t): one product per CHUNK features, over the `keys` rows (an MSL int)
        of both operands."""
        weights = RowsView(WEIGHTS, str(self.rows), self.block, str(self.block)).tensor(str(self.rows), features=keys)
        first_tile, tile_count = features
        lines = []
        for start in range(first_tile * 8, (first_tile + tile_count) * 8, CHUNK):
            n = min(CHUNK, (first_tile + tile_count) * 8 - start)
            lines += [f"{{  // features {start} .. {start + n - 1}"]
            lines += indent(self._run(n=n, lhs=weights, rhs=rhs.tensor(keys, first=start, features=n),
                                      transpose_rhs=False) + [BARRIER])
            column = f"t * 8{f' - {start - first_tile * 8}' if start > first_tile * 8 else ''} + tc + e"
            add = loop("ushort e = 0; e < 2; ++e", [f"{result}[t].thread_elements()[e] += {self._lane(n, column)};"])
            tiles_here = f"ushort t = {start // 8 - first_tile}; t < {(start + n) // 8 - first_tile}; ++t"
            lines += indent(loop(tiles_here, add) + [BARRIER]) + ["}"]
        return lines

    def weighted_sum(self, result: str, *, weights: str, count: int, rhs: RowsView,
                     accumulator: Accumulator) -> list[str]:
        """`accumulator` (`result`) += weights . rhs: the weights staged, then the products of each
        of the accumulator's blocks (all its tiles, or its pages in turn) over the step's keys
        (tiles * 8, or fewer where rhs has fewer rows), in braces of their own."""
        keys = f"min(tiles * 8, {rhs.rows})"
        body = self._stage_weights(weights, count) + accumulator.blocks(
            lambda features: self._accumulate(result, rhs=rhs, keys=keys,
                                              features=features or (0, tiles(accumulator.width))))
        return ["{"] + indent(body) + ["}"]


def scores_step(products: ThreadgroupProducts | None, result: str, *, views: tuple[RowsView, RowsView] | None,
                count: int, lhs: Rows, **simdgroup) -> list[str]:
    """result[j] = lhs . rhs^T: tensor-op `products` over the `views` (lhs, rhs), or, with
    None, tiles.scores with `lhs` and the `simdgroup` arguments."""
    if products is not None:
        return products.scores(result, lhs=views[0], rhs=views[1], count=count)
    return scores(result, count=count, lhs=lhs, **simdgroup)


def sum_step(products: ThreadgroupProducts | None, result: str, *, weights: str, count: int, view: RowsView | None,
             accumulator: Accumulator, **simdgroup) -> list[str]:
    """`accumulator` (`result`) += weights . rhs: tensor-op `products` with the rhs `view`, or,
    with None, tiles.accumulate with the `simdgroup` arguments, per block of the accumulator."""
    if products is not None:
        return products.weighted_sum(result, weights=weights, count=count, rhs=view, accumulator=accumulator)
    return accumulator.blocks(lambda features: accumulate(result, weights=weights, count=count, features=features,
                                                          **simdgroup))
