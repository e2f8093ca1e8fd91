"""8x8 tiles of simdgroup matrices, as MSL lines: the building blocks every kernel that
multiplies shares (attention forward, dQ, dK/dV, the indexer's scores).

Each simdgroup owns 8 rows (queries, or keys in the dK/dV kernel) and walks the other
sequence in blocks of 8-column tiles:

- tile loads: a tensor's rows as an 8x8 tile (`HeadTensor.load_rows`), or its rows as the
  columns of a transposed tile (`HeadTensor.load_transposed`);
- `scores`: S = A B^T over the feature dimension (Q K^T, dO V^T, K Q^T, V dO^T);
- `accumulate`: C += P B, P being probabilities or their gradients;
- `block_loop`: the loop over blocks of the other sequence.

Every 8x8 tile is read and written lane-locally through thread_elements():
lane `lane` holds row tr = (lane / 16) * 4 + (lane / 2) % 4 and columns
tc, tc + 1 with tc = ((lane / 4) & 2) * 2 + (lane % 2) * 2, so the four lanes
of a row differ in lane bits 0 and 3 (row reductions: shuffle_xor 1 and 8).
A lane's two elements of a row tile are adjacent: with a `pair` type (half2, ...) they are
one vector access (`pair_at`), which the caller may ask for only where it is aligned
(tables.py's vector_access); otherwise two scalar accesses.

Each block's docstring says which MSL names it reads (besides its arguments)
and which it defines, so blocks compose without surprises.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .layouts import OperandLayout
from .msl import indent, loop, offset
from .sizes import Extent


def tiles(n: int) -> int:
    """8-wide tiles covering n."""
    return -(-n // 8)


def lane_layout() -> list[str]:
    """Defines tr, tc: the lane's row and first column in every 8x8 tile. Reads lane."""
    return ["// The lane's place in every 8x8 tile: row tr, columns tc and tc + 1.",
            "const uint tr = (lane / 16) * 4 + (lane / 2) % 4;",
            "const uint tc = ((lane / 4) & 2) * 2 + (lane % 2) * 2;"]


def element_offset(layout: OperandLayout, *axes: tuple[str, int]) -> str:
    """The sum of `index * stride` over (index expression, logical axis) pairs of an operand
    layout, 0 when every such axis is broadcast."""
    terms = [offset(index, layout.strides[axis]) for index, axis in axes]
    return " + ".join(t for t in terms if t) or "0"


def head_pointer(name: str, layout: OperandLayout, head: str, t: str, const: bool) -> str:
    """Defines `{name}_head`: the operand's first element of (batch b, head `head`). Reads b."""
    terms = [offset("ulong(b)", layout.strides[0]), offset(f"ulong({head})", layout.strides[1])]
    terms = [x for x in terms if x] or ["0"]
    qualifier = "device const" if const else "device"
    return f"{qualifier} {t}* {name}_head = {name} + ({' + '.join(terms)});"


def pair_at(pointer: str, at: str, pair: str, const: bool) -> str:
    """The `pair` vector (half2, bfloat2, float2) at element `at` of device `pointer`: one
    access, which must be aligned to the vector (the cpu backend's bounds checks enforce it)."""
    return f"*(device {'const ' if const else ''}{pair}*)({pointer} + {at})"


def index(row: str, row_stride: Extent, col: str) -> str:
    """Element index of (row, col) inside a head: row * stride + col, in 64 bits (a head may
    hold more than 2**32 elements)."""
    part = offset(f"ulong({row})", row_stride)
    return f"{part} + {col}" if part else col


def paged_row(page: str, position: str, page_size: int, page_rows: int) -> str:
    """The storage row of logical `position` of a paged KV cache whose pages hold `page_size`
    rows and start `page_rows` rows apart (page_size where they follow each other; more for
    pages interleaved with other data: FlashInfer's HND layout, K and V stacked per page):
    row position % page_size of page `page` (an MSL expression of its number)."""
    return f"uint({page}) * {page_rows}u + uint({position} % {page_size})"


@dataclass(frozen=True)
class Positions:
    """The sequence positions a tile loads: `first + offset` clamped below `end` (a visited
    range), or, with `listed`, the entries `listed[slot]` of a token list (slots clamped
    below `end`, the list's count). A listed position outside 0..C-1 loads 0: it is skipped
    and never read. With `kept`, an array of one flag per position, a position whose flag
    is 0 loads 0 (its values, even NaN, reach no product). With `pages` (a paged KV cache),
    logical position p is row p % page_size of page `pages`[p / page_size] (`paged_row`,
    pages `page_rows` rows apart)."""

    end: str
    listed: str | None = None
    kept: str | None = None
    pages: str | None = None
    page_size: int = 0
    page_rows: int = 0

    def declare(self, name: str, slot: str) -> list[str]:
        """Defines `name` (the position of `slot`) and, for listed positions, `name`_valid."""
        clamped = f"min({slot}, int({self.end}) - 1)"
        if self.pages is not None:
            page = f"{self.pages}[{name}_at / {self.page_size}]"
            return [f"const int {name}_at = {clamped};  // logical position: row {name}_at % page of its page",
                    f"const uint {name} = {paged_row(page, f'{name}_at', self.page_size, self.page_rows)};"]
        if self.listed is None:
            return [f"const uint {name} = uint({clamped});"]
        return [f"const int {name}_listed = {self.listed}[{clamped}];",
                f"const bool {name}_valid = uint({name}_listed) < C;  // negative entries are huge as uint",
                f"const uint {name} = {name}_valid ? uint({name}_listed) : 0u;"]

    def row(self, position: str) -> str:
        """The storage row of logical `position` (an int expression below `end`): the position
        itself, or with `pages` its page's row (the packed kernels' stage reads rows so)."""
        if self.pages is None:
            return position
        page = f"{self.pages}[({position}) / {self.page_size}]"
        return f"int({paged_row(page, f'({position})', self.page_size, self.page_rows)})"

    def valid(self, name: str) -> str | None:
        """The condition under which position `name` loads its values (None: always)."""
        terms = ([f"{name}_valid"] if self.listed else []) + ([f"{self.kept}[{name}] != 0"] if self.kept else [])
        return " && ".join(terms) or None


def tile_declaration(element: str) -> str:
    """The simdgroup matrix type of 8x8 tiles of `element` (float, half, bfloat)."""
    return f"simdgroup_{element}8x8"


@dataclass(frozen=True)
class HeadTensor:
    """A (sequence, feature) tensor of the current head: its `{pointer}`, the stride
    between sequence positions, its feature width (D or Dv) and the element type of the
    tiles it loads into (`tile_type`: float, or the input's own half/bfloat, which loads
    without conversion). Features past the width read as 0, so a partial last tile adds
    nothing to a product."""

    pointer: str
    row_stride: Extent
    width: int
    tile_type: str = "float"
    pair: str | None = None   # a lane's two elements as one device vector of this type (None: two loads)

    @classmethod
    def of(cls, name: str, layout: OperandLayout, width: int, tile_type: str = "float",
           pair: str | None = None) -> HeadTensor:
        return cls(f"{name}_head", layout.strides[2], width, tile_type, pair)

    @property
    def tile(self) -> str:
        """The simdgroup matrix type of its tiles."""
        return tile_declaration(self.tile_type)

    def loading(self, tile_type: str) -> HeadTensor:
        """The same tensor loading `tile_type` tiles (the right operand of `accumulate`: float,
        or with p16 the input's 16-bit type)."""
        return replace(self, tile_type=tile_type)

    def _element(self, at: str, conditions: list[str]) -> str:
        """The value of element `at` of the pointer as the tile's type, 0 unless `conditions` hold."""
        if self.tile_type == "float":
            value, zero = f"float({self.pointer}[{at}])", "0.0f"
        else:
            value, zero = f"{self.tile_type}({self.pointer}[{at}])", f"{self.tile_type}(0.0f)"
        return f"{' && '.join(conditions)} ? {value} : {zero}" if conditions else value

    def _pair(self, at: str, valid: str | None) -> tuple[list[str], tuple[str, str]]:
        """Lines reading the lane's elements `at`, `at` + 1 (columns col, col + 1), and their
        values as the tile's type: 0 past the width or where `valid` is false. One vector
        load with `pair` (an even width: both columns are in or out together), else two."""
        def conditions(col: str) -> list[str]:
            return ([f"{col} < {self.width}"] if self.width % 8 else []) + ([valid] if valid else [])

        if self.pair is None:
            return [], (self._element(at, conditions("col")), self._element(f"{at} + 1", conditions("col + 1")))
        read, zero = pair_at(self.pointer, at, self.pair, const=True), f"{self.pair}({self.pair[:-1]}(0.0f))"
        if conditions("col"):
            read = f"{' && '.join(conditions('col'))} ? {read} : {zero}"
        return [f"const {self.pair} adjacent = {read};  // one vector load"], \
            (f"{self.tile_type}(adjacent.x)", f"{self.tile_type}(adjacent.y)")

    def load_rows(self, target: str, row: str, tile: str, valid: str | None = None) -> list[str]:
        """`target` = 8 rows x features [tile * 8, tile * 8 + 8); the lane reads row `row`
        (0 where `valid`, if given, is false)."""
        reads, values = self._pair(index(row, self.row_stride, "col"), valid)
        return ([f"const uint col = {tile} * 8 + tc;"] + reads
                + [f"{target}.thread_elements()[{e}] = {value};" for e, value in enumerate(values)])

    def load_transposed(self, target: str, position: str, first: str, positions: Positions, tile: str) -> list[str]:
        """`target` = features [tile * 8, + 8) x the sequence positions of slots [first, first + 8):
        the transposed rows, as the right operand of A B^T."""
        lines = [f"const uint dim = {tile} * 8 + tr;"]
        for e in (0, 1):
            lines += positions.declare(f"{position}{e}", f"{first} + int(tc) + {e}")
        for e in (0, 1):
            valid = positions.valid(f"{position}{e}")
            conditions = (["dim < " + str(self.width)] if self.width % 8 else []) + ([valid] if valid else [])
            value = self._element(index(f'{position}{e}', self.row_stride, 'dim'), conditions)
            lines.append(f"{target}.thread_elements()[{e}] = {value};")
        return lines


def zeroed(name: str, count: int, comment: str) -> list[str]:
    """`simdgroup_float8x8 name[count]`, all zero."""
    return ([f"simdgroup_float8x8 {name}[{count}];  // {comment}"]
            + loop(f"ushort t = 0; t < {count}; ++t",
                   [f"{name}[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);"]))


def cached_rows(kept: list[tuple[str, str, HeadTensor]], row: str, whose: str) -> list[str]:
    """The row operands (label, tile array, tensor) in `kept`: `whose` 8 rows of each, loaded
    once and held in registers (`in_registers`)."""
    if not kept:
        return []
    lines = ["", f"// {' and '.join(label for label, _, _ in kept)}{whose}, held in registers as 8x8 tiles."]
    for _, name, tensor in kept:
        lines += in_registers(name, tensor, row)
    return lines


def in_registers(name: str, tensor: HeadTensor, row: str) -> list[str]:
    """The lane's 8 rows of `tensor`, all features, held in registers as `name[tiles]`."""
    count = tiles(tensor.width)
    return ([f"{tensor.tile} {name}[{count}];"]
            + loop(f"ushort i = 0; i < {count}; ++i", tensor.load_rows(f"{name}[i]", row, "i")))


@dataclass(frozen=True)
class Rows:
    """The left operand of `scores`: 8 rows of a tensor, either held in registers
    (`cached` names the tile array) or re-read tile by tile from row `row`."""

    tensor: HeadTensor
    row: str
    cached: str | None
    name: str     # of the re-read tile

    def tile(self) -> str:
        return f"{self.cached}[i]" if self.cached else self.name

    def reread(self, why: str) -> list[str]:
        if self.cached:
            return []
        return [f"{self.tensor.tile} {self.name};  // {why}"] + self.tensor.load_rows(self.name, self.row, "i")


def scores(result: str, *, count: int, lhs: Rows, rhs: HeadTensor, rhs_tile: str, rhs_comment: str,
           position: str, first: str, positions: Positions, reread: str) -> list[str]:
    """result[j] += lhs rows . rhs rows of slots [first + 8 j, + 8) over the shared feature
    dimension, for the tiles j < tiles (those past the visible range stay as they are).
    `position` names the loaded positions (`positions` says where they come from); `reread`
    says why lhs is re-read when it is not cached. Reads tiles, tr, tc. Defines nothing
    outside its loops. lhs and rhs load tiles of one type (Metal multiplies two tiles of one
    type into a float accumulator)."""
    if lhs.tensor.tile_type != rhs.tile_type:
        raise ValueError(f"scores: lhs tiles are {lhs.tensor.tile_type}, rhs tiles {rhs.tile_type}")
    per_tile = [f"{rhs.tile} {rhs_tile};  // {rhs_comment}"]
    per_tile += rhs.load_transposed(rhs_tile, position, f"{first} + j * 8", positions, "i")
    per_tile.append(f"simdgroup_multiply_accumulate({result}[j], {lhs.tile()}, {rhs_tile}, {result}[j]);")
    inner = lhs.reread(reread) + loop(f"int j = 0; j < {count}; ++j", ["if (j < tiles) {"] + indent(per_tile) + ["}"])
    return loop(f"ushort i = 0; i < {tiles(rhs.width)}; ++i", inner)


def accumulate(result: str, *, weights: str, count: int, rhs: HeadTensor, rhs_tile: str, rhs_comment: str,
               position: str, first: str, positions: Positions, features: tuple[int, int] | None = None) -> list[str]:
    """result[t] += weights[j] . rhs rows of slots [first + 8 j, + 8), features tile t, for
    tiles j < tiles; with `features` = (first tile, count), result[t] holds feature tile
    first tile + t (a block of a paged Accumulator). Reads tiles, tr, tc. Defines nothing
    outside its loops. The weights are float tiles; rhs's tile type decides the product's
    operands (Metal multiplies two tiles of one type): float, the weights as they are, or a
    16-bit type (p16), the weights rounded to it once per tile j."""
    first_tile, feature_tiles = features or (0, tiles(rhs.width))
    load = [f"{rhs.tile} {rhs_tile};  // {rhs_comment}"]
    load += rhs.load_rows(rhs_tile, position, f"({first_tile} + t)" if first_tile else "t", positions.valid(position))
    per_tile = positions.declare(position, f"{first} + j * 8 + int(tr)")
    left, rounded = rounded_weights(weights, rhs.tile_type)
    per_tile += rounded
    load.append(f"simdgroup_multiply_accumulate({result}[t], {left}, {rhs_tile}, {result}[t]);")
    per_tile += loop(f"ushort t = 0; t < {feature_tiles}; ++t", load)
    return loop(f"int j = 0; j < {count}; ++j", ["if (j < tiles) {"] + indent(per_tile) + ["}"])


def rounded_weights(weights: str, tile_type: str) -> tuple[str, list[str]]:
    """The left operand of a product of `weights`[j] with `tile_type` tiles, and the lines that
    make it: the float tile itself, or a copy rounded to the 16-bit `tile_type`. Reads j."""
    if tile_type == "float":
        return f"{weights}[j]", []
    name = f"{weights}_{tile_type}"
    return name, ([f"{tile_declaration(tile_type)} {name};  // {weights}[j] rounded to {tile_type} (p16)"]
                  + [f"{name}.thread_elements()[{e}] = {tile_type}({weights}[j].thread_elements()[{e}]);"
                     for e in (0, 1)])


def block_loop(start: str, begin: str, end: str, block: int, body: list[str]) -> list[str]:
    """for (start = begin; start < end; start += block); defines `tiles` inside: the block's
    8-wide tiles before `end`."""
    head = [f"const int tiles = min({block // 8}, ({end} - {start} + 7) / 8);  // 8-wide tiles before {end}"]
    return ["", f"for (int {start} = {begin}; {start} < {end}; {start} += {block}) {{"] + indent(head + body) + ["}"]
