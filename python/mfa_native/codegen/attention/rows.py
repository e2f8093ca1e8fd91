"""How rows map to tiles: the rows facet.

Every attention kernel gives each simdgroup 8 rows. `PER_HEAD`: a threadgroup's rows are
queries of one (batch, query head). `PACKED_HEADS`: they are the (query, head) pairs of the
query heads that read one kv head, staging each step's K/V rows once in threadgroup memory
for all of them, so a threadgroup reads every K/V byte once per kv head: always for quantized
K/V, and for plain (float) K/V where the PACKING table (kernel/packing.py) says so, decode and
speculative-decode verification with grouped queries (`dense_rows`). A case answers how many rows a threadgroup holds and how many keys a step takes
(from the tile tables), the grid's row and head axes, the MSL that defines a simdgroup's
rows, and the last query a threadgroup's key range must cover.
"""

from __future__ import annotations

from ..kernel.plan import GridAxis
from ..kernel.sizes import Extent
from ..kernel.products import SIMDGROUP_MATRIX, TENSOR_OPS
from ..kernel.packing import packing_condition, packs_plain_heads
from ..kernel.tables import backward_tile_row, tile_row
from ..kernel.tiles import lane_layout
from .stage_sizes import ITEM_BYTES, PAIRS_STAGE_BYTES, stage_rows, staged_width, stages_blocks, uses_tensor_ops

PACKED_ROWS = 128   # (query, head) pairs per packed-heads threadgroup: every head of a kv head, up to MQA's 128


def shrunk(rows: int, length: int) -> int:
    """`rows` per threadgroup, halved (down to 8) while half of them still cover `length`."""
    while rows > 8 and rows // 2 >= length:
        rows //= 2
    return rows


def shrunk_guards(length: str, rows: int, table: int) -> tuple[str, ...]:
    """The conditions on `length` under which shrunk(table, length) == rows."""
    return ((f"{length} > {rows // 2}",) if rows > 8 else ()) + ((f"{length} <= {rows}",) if rows < table else ())


def threadgroup_span(first: str, rows: int, end: str, staged: bool) -> dict[str, str]:
    """key_range's (or query_range's) `first` and `last` for a `staged` threadgroup of `rows` rows
    whose simdgroup s holds the 8 rows from `first` (q_first, key_first) = the threadgroup's first
    + 8 s: the whole threadgroup's rows, the last clamped below `end`, so every simdgroup visits
    the same blocks (and reaches the same barriers); unstaged, none (each its own 8 rows).
    Reads simd_index."""
    if not staged:
        return {}
    start = f"({first} - simd_index * 8)"
    return {"first": start, "last": f"int(min({start} + {rows - 1}, {end} - 1))"}


def query_rows_geometry(query_rows: int, gqa_ratio: int, batch: list[str], first: str | None = None) -> list[str]:
    """The simdgroup's 8 query rows of (batch b, query head h = group.y) and the kv head h_kv
    they read. `batch` defines b; `first` is the first row (default: threadgroup x's
    `query_rows` rows, KeyWalk.first). Reads group, simd_index, lane, R. Defines h, h_kv,
    q_first, tr, tc, row (the lane's row) and row_read (clamped, for loads)."""
    return [
        "// This simdgroup's 8 query rows, of one (batch, query head), and the kv head they read.",
        *batch,
        "const uint h = group.y;",
        f"const uint h_kv = h / {gqa_ratio};" if gqa_ratio > 1 else "const uint h_kv = h;",
        f"const uint q_first = {first or f'group.x * {query_rows} + simd_index * 8'};",
        *lane_layout(),
        "const uint row = q_first + tr;",
        "const uint row_read = min(row, R - 1);  // rows past R compute on a valid row and are never stored",
    ]


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


class PerHead:
    """A threadgroup's rows are queries of one (batch, query head). `declined`: the PACKING
    table chose it over packed heads, so its templates hold only where the table declines."""

    packed = False
    last_query = None   # the simdgroup's own 8 rows bound its keys
    decode_max_rows = 16   # split-KV cuts the keys of problems of at most this many queries

    def __init__(self, declined: bool = False) -> None:
        self.declined = declined

    @staticmethod
    def table_rows(p, family: str) -> int:
        """The table's count; batch-invariant with O paged, half of it (at least 8): the merged
        splits' total is a second page (invariance.py), which must fit beside the first."""
        row = tile_row(family, p.dtype, max(p.head_dim, p.value_dim))
        return max(8, row.query_rows // 2) if p.batch_invariant and row.o_block else row.query_rows

    @staticmethod
    def query_rows(p, family: str) -> int:
        """The table's count, or fewer when the queries cannot fill it (decode)."""
        return shrunk(PerHead.table_rows(p, family), p.q_len)

    @staticmethod
    def products(p, family: str) -> str:
        """The forward kernel's products (kernel/products.py): tensor ops where the family's row
        asks and the threadgroup walks its blocks together (the products read its stage)."""
        row = tile_row(family, p.dtype, max(p.head_dim, p.value_dim))
        tensor = uses_tensor_ops(p, family, row, PerHead.query_rows(p, family), staged_width(p, family))
        return TENSOR_OPS if tensor else SIMDGROUP_MATRIX

    @staticmethod
    def stages(p, family: str) -> bool:
        """Whether the forward kernel stages its key blocks (stages_blocks; always, for tensor ops)."""
        return stages_blocks(p, tile_row(family, p.dtype, max(p.head_dim, p.value_dim)).stage_kv,
                             PerHead.query_rows(p, family), PerHead.products(p, family))

    @staticmethod
    def key_block(p, family: str) -> int:
        """The table's key block; staged, as many of its rows as the stage holds (stage_rows).
        Batch-invariant, always the staged count, packed heads' block: whether this problem's
        threadgroups stage or pack (which depends on R) never changes its blocks."""
        block = tile_row(family, p.dtype, max(p.head_dim, p.value_dim)).key_block
        staged = p.batch_invariant or PerHead.stages(p, family)
        products_rows = PerHead.query_rows(p, family) if PerHead.products(p, family) == TENSOR_OPS else 0
        return stage_rows(p, staged_width(p, family), block, products_rows) if staged else block

    @staticmethod
    def backward_query_rows(p, family: str) -> int:
        """The dQ kernel's rows: its table's count, or fewer for few queries."""
        return shrunk(backward_tile_row(family, p.dtype, max(p.head_dim, p.value_dim)).query_rows, p.q_len)

    @staticmethod
    def threadgroups_expression(p, family: str) -> str:
        """Threadgroups of the one-pass forward kernel (before any split of the keys)."""
        return f"B * Hq * cdiv(R, {PerHead.query_rows(p, family)})"

    def guards(self, p, family: str) -> tuple[str, ...]:
        """Where the table's rows, shrunk for few queries, are those of `p` (a guard each), and
        where the PACKING table declines to pack."""
        declined = (f"!({packing_condition(p.gqa_ratio)})",) if self.declined and p.gqa_ratio > 1 else ()
        return shrunk_guards("R", PerHead.query_rows(p, family), PerHead.table_rows(p, family)) + declined

    @staticmethod
    def backward_guards(p, family: str) -> tuple[str, ...]:
        row = backward_tile_row(family, p.dtype, max(p.head_dim, p.value_dim))
        return (shrunk_guards("R", PerHead.backward_query_rows(p, family), row.query_rows)
                + shrunk_guards("C", shrunk(row.key_rows, p.kv_len), row.key_rows))

    @staticmethod
    def grid(gqa_ratio: int, query_rows: int) -> tuple[GridAxis, GridAxis]:
        return GridAxis(Extent(1, ("R",)), query_rows), GridAxis(Extent(1, ("Hq",)))

    @staticmethod
    def geometry(query_rows: int, gqa_ratio: int, batch: list[str]) -> list[str]:
        return query_rows_geometry(query_rows, gqa_ratio, batch)


class PackedHeads:
    """A threadgroup's rows are (query, head) pairs of one kv head; K/V rows are staged.
    `chosen`: the PACKING table chose it for plain K/V, so its templates hold only where the
    table packs. The backward kernels stay per head (packing is the forward's choice)."""

    packed = True
    last_query = "int(min(q_last, R - 1))"   # the threadgroup's last query (see packed_rows_geometry)
    decode_max_rows = 32   # one threadgroup per kv head: split-KV pays for speculative decode too
    backward_query_rows = staticmethod(PerHead.backward_query_rows)
    backward_guards = staticmethod(PerHead.backward_guards)

    def __init__(self, chosen: bool = False) -> None:
        self.chosen = chosen

    @staticmethod
    def products(p, family: str) -> str:
        """Tensor ops where the family's row asks, the key walk is the same for every pair, and the
        pairs' Q rows, which a tensor-op product reads from a stage of their own (no strided view
        holds them), take at most PAIRS_STAGE_BYTES; else simdgroup matrices."""
        row, rows = tile_row(family, p.dtype, max(p.head_dim, p.value_dim)), PackedHeads.query_rows(p, family)
        pairs = rows * p.head_dim * ITEM_BYTES[p.dtype]
        tensor = pairs <= PAIRS_STAGE_BYTES and uses_tensor_ops(p, family, row, rows, staged_width(p, family), pairs)
        return TENSOR_OPS if tensor else SIMDGROUP_MATRIX

    @staticmethod
    def pairs_stage_bytes(p, family: str) -> int:
        """The threadgroup memory of the pairs' Q rows (tensor ops; else 0)."""
        if PackedHeads.products(p, family) != TENSOR_OPS:
            return 0
        return PackedHeads.query_rows(p, family) * p.head_dim * ITEM_BYTES[p.dtype]

    @staticmethod
    def query_rows(p, family: str) -> int:
        """Every (query, head) pair of the kv head, up to PACKED_ROWS, so decode reads each K/V
        byte once per kv head."""
        return min(8 * -(-p.q_len * p.gqa_ratio // 8), PACKED_ROWS)

    @staticmethod
    def key_block(p, family: str) -> int:
        """The staged rows: K's and V's (beside the tensor-op products and the pairs' Q rows)."""
        block = tile_row(family, p.dtype, max(p.head_dim, p.value_dim)).key_block
        tensor = PackedHeads.products(p, family) == TENSOR_OPS
        return stage_rows(p, staged_width(p, family), block, PackedHeads.query_rows(p, family) * tensor,
                          PackedHeads.pairs_stage_bytes(p, family))

    @staticmethod
    def threadgroups_expression(p, family: str) -> str:
        return f"B * Hkv * cdiv(R * {p.gqa_ratio}, {PackedHeads.query_rows(p, family)})"

    def guards(self, p, family: str) -> tuple[str, ...]:
        chosen = (packing_condition(p.gqa_ratio),) if self.chosen else ()
        return (f"min(8 * cdiv(R * {p.gqa_ratio}, 8), {PACKED_ROWS}) == {PackedHeads.query_rows(p, family)}",) + chosen

    @staticmethod
    def grid(gqa_ratio: int, query_rows: int) -> tuple[GridAxis, GridAxis]:
        return GridAxis(Extent(gqa_ratio, ("R",)), query_rows), GridAxis(Extent(1, ("Hkv",)))

    @staticmethod
    def geometry(query_rows: int, gqa_ratio: int, batch: list[str]) -> list[str]:
        return packed_rows_geometry(query_rows, gqa_ratio, batch)


PER_HEAD, PACKED_HEADS = PerHead(), PackedHeads()
DECLINED_PER_HEAD, CHOSEN_PACKED_HEADS = PerHead(declined=True), PackedHeads(chosen=True)


def dense_rows(p):
    """The rows facet of a problem whose keys form a range: packed heads when K/V storage asks
    (quantized), or for plain K/V where the PACKING table packs (GQA decode); else per head."""
    if p.k_storage.packs_heads or p.v_storage.packs_heads:
        return PACKED_HEADS
    return CHOSEN_PACKED_HEADS if packs_plain_heads(p.gqa_ratio, p.q_len) else DECLINED_PER_HEAD


def row_index(row: str) -> str:
    """The index of query row `row` of (batch b, query head h) in a (B, Hq, R) array
    (lse, delta, sink_grad) as a ulong expression. Reads b, h, Hq, R."""
    return f"(ulong(b) * Hq + h) * R + {row}"
