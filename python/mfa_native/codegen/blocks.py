"""Building blocks shared by the attention kernels (forward, dQ, dK/dV). Each returns MSL lines.

Every kernel gives each simdgroup 8 rows (queries, or keys in the dK/dV kernel)
and walks the other sequence in blocks of 8-column tiles. The blocks here are
written once for both orientations:

- tile loads: a tensor's rows as an 8x8 tile (`HeadTensor.load_rows`), or
  its rows as the columns of a transposed tile (`HeadTensor.load_transposed`);
- `scores`: S = A B^T over the feature dimension (Q K^T, dO V^T, K Q^T, V dO^T);
- `accumulate`: C += P B, P being probabilities or their gradients;
- masking: the visible range of the other sequence (`key_range`,
  `query_range`), the allowed test of one (query, key) pair, and the additive
  mask in the log2 domain (`bias`), which also skips blocks a mask removes;
- the exp2-domain softmax: logits S * scale * log2(e) + bias (`logits`) and
  probabilities exp2(logit - reference) (`probabilities`).

Every 8x8 tile is read and written lane-locally through thread_elements():
lane `lane` holds row tr = (lane / 16) * 4 + (lane / 2) % 4 and columns
tc, tc + 1 with tc = ((lane / 4) & 2) * 2 + (lane % 2) * 2, so the four lanes
of a row differ in lane bits 0 and 3 (row reductions: shuffle_xor 1 and 8).

Each block's docstring says which MSL names it reads (besides its arguments)
and which it defines, so blocks compose without surprises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .descriptor import MaskRules, OperandLayout
from .sizes import Extent
from .msl import MSL_TYPES, float_literal, indent, loop, offset

MASKED_BELOW = "-1.0e30f"   # additive mask values at or below this remove the key (see reference.py)


def tiles(n: int) -> int:
    """8-wide tiles covering n."""
    return -(-n // 8)


def lane_layout() -> list[str]:
    """Defines tr, tc: the lane's row and first column in every 8x8 tile. Reads lane."""
    return ["// The lane's place in every 8x8 tile: row tr, columns tc and tc + 1.",
            "const uint tr = (lane / 16) * 4 + (lane / 2) % 4;",
            "const uint tc = ((lane / 4) & 2) * 2 + (lane % 2) * 2;"]


def query_rows_geometry(query_rows: int, gqa_ratio: int, batch: list[str]) -> list[str]:
    """The simdgroup's 8 query rows of (batch b, query head h = group.y) and the kv head h_kv
    they read. `batch` defines b. Reads group, simd_index, lane, R. Defines h, h_kv, q_first,
    tr, tc, row (the lane's row) and row_read (clamped, for loads)."""
    return [
        "// This simdgroup's 8 query rows, of one (batch, query head), and the kv head they read.",
        *batch,
        "const uint h = group.y;",
        f"const uint h_kv = h / {gqa_ratio};" if gqa_ratio > 1 else "const uint h_kv = h;",
        f"const uint q_first = group.x * {query_rows} + simd_index * 8;",
        *lane_layout(),
        "const uint row = q_first + tr;",
        "const uint row_read = min(row, R - 1);  // rows past R compute on a valid row and are never stored",
    ]


# The last query a packed-heads threadgroup holds (see packed_rows_geometry).
PACKED_LAST_QUERY = "int(min(q_last, R - 1))"


def packed_rows_geometry(query_rows: int, gqa_ratio: int, batch: list[str]) -> list[str]:
    """Packed heads: the threadgroup's rows are (query, head) pairs of kv head h_kv = group.y,
    pair = query * ratio + head slot, so the query heads that read one kv head are rows of one
    tile. `batch` defines b. Reads group, simd_index, lane, R. Defines h_kv, tr, tc, the lane's
    h, row (its query) and row_read (clamped, for loads), and q_first, q_last: the
    threadgroup's first and last query (the key range covers all of its rows)."""
    return [
        f"// This simdgroup's 8 rows: (query, head) pairs of the {gqa_ratio} query heads reading kv head h_kv.",
        *batch,
        "const uint h_kv = group.y;",
        *lane_layout(),
        f"const uint pair = group.x * {query_rows} + simd_index * 8 + tr;",
        f"const uint row = pair / {gqa_ratio};  // the lane's query",
        f"const uint h = h_kv * {gqa_ratio} + pair % {gqa_ratio};  // and its head",
        "const uint row_read = min(row, R - 1);  // rows past R compute on a valid row and are never stored",
        f"const uint q_first = group.x * {query_rows} / {gqa_ratio};",
        f"const uint q_last = (group.x * {query_rows} + {query_rows - 1}) / {gqa_ratio};",
    ]


def element_offset(layout: OperandLayout, *axes: tuple[str, int]) -> str:
    """The sum of `index * stride` over (index expression, logical axis) pairs of an operand
    layout, 0 when every such axis is broadcast."""
    terms = [offset(index, layout.strides[axis]) for index, axis in axes]
    return " + ".join(t for t in terms if t) or "0"


def row_index(row: str) -> str:
    """The index of query row `row` of (batch b, query head h) in a (B, Hq, R) array
    (lse, delta, sink_grad) as a ulong expression. Reads b, h, Hq, R."""
    return f"(ulong(b) * Hq + h) * R + {row}"


def head_pointer(name: str, layout: OperandLayout, head: str, t: str, const: bool) -> str:
    """Defines `{name}_head`: the operand's first element of (batch b, head `head`). Reads b."""
    terms = [offset("ulong(b)", layout.strides[0]), offset(f"ulong({head})", layout.strides[1])]
    terms = [x for x in terms if x] or ["0"]
    qualifier = "device const" if const else "device"
    return f"{qualifier} {t}* {name}_head = {name} + ({' + '.join(terms)});"


def index(row: str, row_stride: Extent, col: str) -> str:
    """Element index of (row, col) inside a head: row * stride + col, in 64 bits (a head may
    hold more than 2**32 elements)."""
    part = offset(f"ulong({row})", row_stride)
    return f"{part} + {col}" if part else col


@dataclass(frozen=True)
class Positions:
    """The sequence positions a tile loads: `first + offset` clamped below `end` (a visited
    range), or, with `listed`, the entries `listed[slot]` of a token list (slots clamped
    below `end`, the list's count). A listed position outside 0..C-1 loads 0: it is skipped
    and never read."""

    end: str
    listed: str | None = None

    def declare(self, name: str, slot: str) -> list[str]:
        """Defines `name` (the position of `slot`) and, for listed positions, `name`_valid."""
        clamped = f"min({slot}, int({self.end}) - 1)"
        if self.listed is None:
            return [f"const uint {name} = uint({clamped});"]
        return [f"const int {name}_listed = {self.listed}[{clamped}];",
                f"const bool {name}_valid = uint({name}_listed) < C;  // negative entries are huge as uint",
                f"const uint {name} = {name}_valid ? uint({name}_listed) : 0u;"]

    def valid(self, name: str) -> str | None:
        return None if self.listed is None else f"{name}_valid"


@dataclass(frozen=True)
class HeadTensor:
    """A (sequence, feature) tensor of the current head: its `{pointer}`, the stride
    between sequence positions and its feature width (D or Dv). Features past the
    width read as 0, so a partial last tile adds nothing to a product."""

    pointer: str
    row_stride: Extent
    width: int

    @classmethod
    def of(cls, name: str, layout: OperandLayout, width: int) -> HeadTensor:
        return cls(f"{name}_head", layout.strides[2], width)

    def load_rows(self, target: str, row: str, tile: str, valid: str | None = None) -> list[str]:
        """`target` = 8 rows x features [tile * 8, tile * 8 + 8); the lane reads row `row`
        (0 where `valid`, if given, is false)."""
        lines = [f"const uint col = {tile} * 8 + tc;"]
        for e in (0, 1):
            col = "col + 1" if e else "col"
            value = f"float({self.pointer}[{index(row, self.row_stride, 'col')}{' + 1' if e else ''}])"
            conditions = ([f"{col} < {self.width}"] if self.width % 8 else []) + ([valid] if valid else [])
            if conditions:
                value = f"{' && '.join(conditions)} ? {value} : 0.0f"
            lines.append(f"{target}.thread_elements()[{e}] = {value};")
        return lines

    def load_transposed(self, target: str, position: str, first: str, positions: Positions, tile: str) -> list[str]:
        """`target` = features [tile * 8, + 8) x the sequence positions of slots [first, first + 8):
        the transposed rows, as the right operand of A B^T."""
        lines = [f"const uint dim = {tile} * 8 + tr;"]
        for e in (0, 1):
            lines += positions.declare(f"{position}{e}", f"{first} + int(tc) + {e}")
        for e in (0, 1):
            value = f"float({self.pointer}[{index(f'{position}{e}', self.row_stride, 'dim')}])"
            conditions = (["dim < " + str(self.width)] if self.width % 8 else []) + \
                ([positions.valid(f"{position}{e}")] if positions.listed else [])
            if conditions:
                value = f"{' && '.join(conditions)} ? {value} : 0.0f"
            lines.append(f"{target}.thread_elements()[{e}] = {value};")
        return lines


def store_rows(target: str, acc: str, width: int, cast: str | None = None, factor: str | None = None) -> list[str]:
    """target[col] = acc tiles (times `factor`, converted to `cast`) for the lane's row and
    columns < width; `target` points at the row."""
    store = ["const uint col = t * 8 + tc;"]
    for e in (0, 1):
        col = "col + 1" if e else "col"
        value = f"{acc}[t].thread_elements()[{e}]" + (f" * {factor}" if factor else "")
        write = f"{target}[{col}] = {f'{cast}({value})' if cast else value};"
        if width % 8:
            write = f"if ({col} < {width}) {{ {write} }}"
        store.append(write)
    return loop(f"ushort t = 0; t < {tiles(width)}; ++t", store)


def zeroed(name: str, count: int, comment: str) -> list[str]:
    """`simdgroup_float8x8 name[count]`, all zero."""
    return ([f"simdgroup_float8x8 {name}[{count}];  // {comment}"]
            + loop(f"ushort t = 0; t < {count}; ++t",
                   [f"{name}[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);"]))


def in_registers(name: str, tensor: HeadTensor, row: str) -> list[str]:
    """The lane's 8 rows of `tensor`, all features, held in registers as `name[tiles]`."""
    count = tiles(tensor.width)
    return ([f"simdgroup_float8x8 {name}[{count}];"]
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
        return [f"simdgroup_float8x8 {self.name};  // {why}"] + self.tensor.load_rows(self.name, self.row, "i")


def scores(result: str, *, count: int, lhs: Rows, rhs: HeadTensor, rhs_tile: str, rhs_comment: str,
           position: str, first: str, positions: Positions, reread: str) -> list[str]:
    """result[j] += lhs rows . rhs rows of slots [first + 8 j, + 8) over the shared feature
    dimension, for the tiles j < tiles (those past the visible range stay as they are).
    `position` names the loaded positions (`positions` says where they come from); `reread`
    says why lhs is re-read when it is not cached. Reads tiles, tr, tc. Defines nothing
    outside its loops."""
    per_tile = [f"simdgroup_float8x8 {rhs_tile};  // {rhs_comment}"]
    per_tile += rhs.load_transposed(rhs_tile, position, f"{first} + j * 8", positions, "i")
    per_tile.append(f"simdgroup_multiply_accumulate({result}[j], {lhs.tile()}, {rhs_tile}, {result}[j]);")
    inner = lhs.reread(reread) + loop(f"int j = 0; j < {count}; ++j", ["if (j < tiles) {"] + indent(per_tile) + ["}"])
    return loop(f"ushort i = 0; i < {tiles(rhs.width)}; ++i", inner)


def accumulate(result: str, *, weights: str, count: int, rhs: HeadTensor, rhs_tile: str, rhs_comment: str,
               position: str, first: str, positions: Positions) -> list[str]:
    """result[t] += weights[j] . rhs rows of slots [first + 8 j, + 8), features tile t, for
    tiles j < tiles. Reads tiles, tr, tc. Defines nothing outside its loops."""
    load = [f"simdgroup_float8x8 {rhs_tile};  // {rhs_comment}"]
    load += rhs.load_rows(rhs_tile, position, "t", positions.valid(position))
    load.append(f"simdgroup_multiply_accumulate({result}[t], {weights}[j], {rhs_tile}, {result}[t]);")
    per_tile = positions.declare(position, f"{first} + j * 8 + int(tr)")
    per_tile += loop(f"ushort t = 0; t < {tiles(rhs.width)}; ++t", load)
    return loop(f"int j = 0; j < {count}; ++j", ["if (j < tiles) {"] + indent(per_tile) + ["}"])


# ---------------------------------------------------------------------------
# Masking: which (query, key) pairs are allowed.


def key_range(rules: MaskRules, last: str | None = None) -> list[str]:
    """The keys any of the queries q_first..`last` may see (default: the simdgroup's 8 rows).
    Reads q_first, R, C. Defines key_begin, key_end (ints, narrowed further by callers that
    split the keys) and, where the rules need them, diagonal and row_last."""
    lines = ["", "// Keys any of these rows may see: [key_begin, key_end). Whole blocks outside are never visited."]
    if rules.uses_diagonal:
        lines.append("const int diagonal = int(C) - int(R);  // key j lines up with query j - diagonal (lower right)")
    left, right = rules.window_sides
    if rules.limits_keys_above:
        lines.append(f"const int row_last = {last or 'int(min(q_first + 7, R - 1))'};")
    lines += ["int key_begin = 0;", "int key_end = q_first < R ? int(C) : 0;"]
    if rules.causal == "lower_right":
        lines.append("key_end = min(key_end, row_last + diagonal + 1);  // causal, lower right")
    elif rules.causal == "upper_left":
        lines.append("key_end = min(key_end, row_last + 1);  // causal, upper left")
    if left is not None:
        lines.append(f"key_begin = max(key_begin, int(q_first) + diagonal - {left});  // window, left")
    if right is not None:
        lines.append(f"key_end = min(key_end, row_last + diagonal + {right + 1});  // window, right")
    return lines


def query_range(rules: MaskRules) -> list[str]:
    """The queries that may see any of the simdgroup's keys key_first.. (the mirror of
    key_range: key j is seen from query j - diagonal on). Reads key_first, R, C. Defines
    query_begin, query_end and, where needed, diagonal and key_last."""
    lines = ["", "// Queries that may see any of these keys: [query_begin, query_end). Blocks outside are skipped."]
    if rules.uses_diagonal:
        lines.append("const int diagonal = int(C) - int(R);  // key j lines up with query j - diagonal (lower right)")
    left, right = rules.window_sides
    if left is not None:
        lines.append("const int key_last = int(min(key_first + 7, C - 1));")
    lines += ["int query_begin = 0;", "int query_end = key_first < C ? int(R) : 0;"]
    if rules.causal == "lower_right":
        lines.append("query_begin = max(query_begin, int(key_first) - diagonal);  // causal, lower right")
    elif rules.causal == "upper_left":
        lines.append("query_begin = max(query_begin, int(key_first));  // causal, upper left")
    if left is not None:
        lines.append(f"query_end = min(query_end, key_last - diagonal + {left + 1});  // window, left")
    if right is not None:
        lines.append(f"query_begin = max(query_begin, int(key_first) - diagonal - {right});  // window, right")
    return lines


def allowed_terms(rules: MaskRules, query: str, key: str, bound: str) -> list[str]:
    """Conditions (ints) for `key` of `query` beyond the mask. `bound` keeps positions past
    the visible range (past C or R, or past a split's end) out of the last tile."""
    terms = [bound]
    if rules.causal == "lower_right":
        terms.append(f"{key} <= {query} + diagonal")
    elif rules.causal == "upper_left":
        terms.append(f"{key} <= {query}")
    left, right = rules.window_sides
    if left is not None:
        terms.append(f"{key} >= {query} + diagonal - {left}")
    if right is not None:
        terms.append(f"{key} <= {query} + diagonal + {right}")
    return terms


def bias(rules: MaskRules, count: int, position: str, first: str, allowed: list[str], mask_at: str | None
         ) -> list[str]:
    """s[j * 2 + e] = the additive term (log2 domain) of the lane's element (position
    `first` + j * 8 + tc + e), or MASKED where it is removed; `mask_at` is the element's
    mask value. With a mask, a block no lane may see is skipped (`continue`, taken by the
    whole simdgroup alike). Reads tc, diagonal (when the rules use it). Defines s[2 * count]."""
    body = [f"const int {position} = {first} + j * 8 + int(tc) + e;",
            f"bool allowed = {' && '.join(allowed)};"]
    value = "0.0f"
    if rules.mask != "none":
        body.append(f"const {MSL_TYPES[rules.mask_dtype]} mask_value = {mask_at};")
        if rules.mask == "bool":
            body.append("allowed = allowed && mask_value != 0;")
        else:
            body.append(f"allowed = allowed && !(float(mask_value) <= {MASKED_BELOW});  // NaN stays, to show")
            value = "float(mask_value) * LOG2E"
    body.append(f"s[j * 2 + e] = allowed ? {value} : MASKED;")
    lines = ["// Which of the lane's (query, key) pairs are allowed, and the additive mask (log2 domain).",
             f"float s[{2 * count}];"]
    lines += loop(f"int j = 0; j < {count}; ++j", loop("int e = 0; e < 2; ++e", body))
    if rules.mask != "none":
        lines += ["bool lane_sees_key = false;"]
        lines += loop(f"ushort i = 0; i < {2 * count}; ++i", ["lane_sees_key = lane_sees_key || s[i] != MASKED;"])
        lines += ["if (simd_max(uint(lane_sees_key)) == 0u) {",
                  "  continue;  // the mask removes this whole block for these rows",
                  "}"]
    return lines


def mask_row_pointer(rules: MaskRules) -> str:
    """Defines `mask_row`: the mask of the lane's query row (row_read) of head h. Reads b, h, row_read."""
    m = rules.mask_layout.strides
    terms = [x for x in (offset("ulong(b)", m[0]), offset("ulong(h)", m[1]), offset("ulong(row_read)", m[2])) if x]
    return f"device const {MSL_TYPES[rules.mask_dtype]}* mask_row = mask + ({' + '.join(terms) or '0'});"


def mask_key_pointer(rules: MaskRules) -> str:
    """Defines `mask_key`: the mask of the lane's key (key_read) for the queries of head h. Reads b, h, key_read."""
    m = rules.mask_layout.strides
    terms = [x for x in (offset("ulong(b)", m[0]), offset("ulong(h)", m[1]), offset("ulong(key_read)", m[3])) if x]
    return f"device const {MSL_TYPES[rules.mask_dtype]}* mask_key = mask + ({' + '.join(terms) or '0'});"


def bias_over_keys(rules: MaskRules, count: int, end: str = "key_end") -> list[str]:
    """`bias` for a query row per lane and the keys kb.. (before `end`) as elements (forward,
    dQ). Reads row, kb, `end`, mask_row."""
    at = None
    if rules.mask != "none":
        at = f"mask_row[{offset('ulong(min(key, int(C) - 1))', rules.mask_layout.strides[3]) or '0'}]"
    return bias(rules, count, "key", "kb", allowed_terms(rules, "int(row)", "key", f"key < {end}"), at)


def bias_over_queries(rules: MaskRules, count: int, end: str = "query_end") -> list[str]:
    """`bias` for a key row per lane and the queries qb.. (before `end`) as elements (dK/dV).
    Reads key_row, qb, `end`, mask_key."""
    at = None
    if rules.mask != "none":
        at = f"mask_key[{offset('ulong(min(query, int(R) - 1))', rules.mask_layout.strides[2]) or '0'}]"
    return bias(rules, count, "query", "qb", allowed_terms(rules, "query", "int(key_row)", f"query < {end}"), at)


# ---------------------------------------------------------------------------
# Softmax in the exp2 domain.


def logits(scale_log2e: float, count: int, scores_tile: str, also: Sequence[str] = ()) -> list[str]:
    """s[i] = score * scale * log2(e) + bias for allowed elements (MASKED stays MASKED), then `also`.
    Reads s (from `bias`)."""
    return loop(f"int j = 0; j < {count}; ++j", loop("int e = 0; e < 2; ++e", [
        "const int i = j * 2 + e;",
        f"s[i] = s[i] != MASKED ? {scores_tile}[j].thread_elements()[e] * {float_literal(scale_log2e)} + s[i] : MASKED;",
        *also,
    ]))


def probabilities(count: int, target: str, reference: str, also: Sequence[str] = ()) -> list[str]:
    """target[j] = exp2(s - reference) for allowed elements, 0 for removed ones, then `also`
    (with `p` the element's probability). Reads s."""
    return loop(f"int j = 0; j < {count}; ++j", loop("int e = 0; e < 2; ++e", [
        f"const float p = s[j * 2 + e] != MASKED ? exp2(s[j * 2 + e] - {reference}) : 0.0f;",
        f"{target}[j].thread_elements()[e] = p;",
        *also,
    ]))


def block_loop(start: str, begin: str, end: str, block: int, body: list[str]) -> list[str]:
    """for (start = begin; start < end; start += block); defines `tiles` inside: the block's
    8-wide tiles before `end`."""
    head = [f"const int tiles = min({block // 8}, ({end} - {start} + 7) / 8);  // 8-wide tiles before {end}"]
    return ["", f"for (int {start} = {begin}; {start} < {end}; {start} += {block}) {{"] + indent(head + body) + ["}"]
