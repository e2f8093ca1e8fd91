"""Tile sizes per GPU family and input precision, as readable tables: one row per range of head dimension.

A table is keyed by (family, precision): "float32" for float32 inputs, "16-bit" for
float16 and bfloat16 (`precision`). A row applies to problems whose larger head dimension,
max(D, Dv), is at most `max_head_dim`; the first row that fits wins.

- query_rows: query rows per threadgroup (one simdgroup per 8 rows).
- key_block:  keys per step of the online softmax (one max / rescale per step).
- cache_q:    Q stays in registers for the whole key loop; otherwise each step
              re-reads it tile by tile: S = Q K^T accumulates over D in 8-wide
              blocks of Q and K, trading loads for registers at large head dimension.
- stage_apart: kernels that stage K/V rows in threadgroup memory (packed heads,
              sparse-indexed) stage K's rows for S = Q K^T and then V's rows for
              O += P V, taking turns in one buffer max(D, Dv) wide, instead of both
              at once (D + Dv wide): at large head dimension both would not fit
              32 KiB even for 8 rows. (MLA's shared latent stages K's rows only.)
- o_block:    0: O stays in registers. Otherwise O is paged (MFA's cachedOperands
              false): it lives in threadgroup memory, and each step brings it into
              registers o_block features at a time around O += P V. Only the per-head
              kernels page (one simdgroup's 8 rows x Dv floats, 16 KiB at Dv 512); the
              packed-heads and sparse-indexed ones, many simdgroups of rows, keep O in
              registers.
- tiles16:    for float16/bfloat16 inputs, the operand tiles that meet another
              input in a product (Q, K in S = Q K^T; in the backward Q, K, dO, V in
              S = Q K^T, dP = dO V^T and their transposes, and the cached rows) are
              simdgroup_half8x8 / simdgroup_bfloat8x8 instead of simdgroup_float8x8
              (MFA's registerPrecisions: Q, K, V FP16; dO BF16 where bfloat is native).
              bfloat16 is widened to float tiles on families without native bfloat
              (apple7, apple8), as MFA does. The accumulators, S, dP and the softmax
              are float32 always. No effect on float32 inputs.
- p16:        for float16/bfloat16 inputs, the accumulated products' left operands are
              rounded to the input's 16-bit type and their right operands load as
              16-bit tiles (Metal multiplies two tiles of one type into a float
              accumulator): P and V in O += P V; dS and K in dQ += dS K, P^T and dO in
              dV += P^T dO, dS^T and Q in dK += dS^T Q (FlashAttention-2's and MFA's
              low-precision intermediates: registerPrecisions P FP16, dS BF16 on apple9).
              Otherwise P and dS stay float32 and their right operands load as float
              tiles. bfloat16 widens on families without native bfloat, as for tiles16;
              no effect on float32 inputs. The dense kernels (forward, dQ, dK/dV) read
              it; the sparse-indexed and int8 kernels keep float weights.
- stage_kv:   the per-head kernels' simdgroups share each key block through threadgroup
              memory (MFA's preferAsyncLoad): the threadgroup loads its K and V rows once,
              cooperatively, between two barriers (storage/staging.py, as packed heads always
              do; stage_apart applies; the block shrinks to fit 24 KiB), walking its rows' keys
              together; only for several simdgroups walking the same keys (dense, KV cache).
- vector_access: a lane's two adjacent elements of a row tile are one vector access
              (half2, bfloat2, float2) instead of two, in the row loads of Q, K, V, O,
              dO and the stores of O, dQ, dK, dV, where it is provably aligned (unit
              feature stride, even other strides and width, the array's first element
              aligned to two elements: AttentionProblem.aligned, which the ops take from
              the addresses). Else, and for transposed loads (two rows), two scalar
              accesses. Nothing wider fits: a lane's next elements are 8 columns on.
- tensor_ops: the products are Metal 4 tensor ops (products.py: matmul2d of the whole
              threadgroup over its rows and the staged block) instead of simdgroup
              matrices, on families that have them (apple10: Apple M5). The kernel then
              stages its key blocks (stage_kv) whatever that column says, reads Q in place
              or from a stage (cache_q has no effect), and its operands are the inputs' own
              type (tiles16 has no effect; the weights are rounded to it, as p16 does).
              Rows without the column say "no". On other families it has no effect.

The values up to head dimension 384 are metal-flash-attention's published tuning, mapped
onto these columns (the comment above the tables says how and where they depart from it).
They are data: retune them on hardware, row by row (`python -m mfa_native tune`).

The backward tables (BACKWARD_TABLES, see BackwardTileRow) have the same form:
the dQ kernel's query rows and key block, the dK/dV kernel's key rows and
query block, whether each of the row operands each simdgroup owns stays in
registers (cache_q and cache_dout in the dQ kernel, cache_k and cache_v in the
dK/dV kernel, each its own choice; otherwise it is re-read tile by tile per
block), tiles16, p16 and vector_access as in the forward, and, like
o_block, whether the accumulators dQ, dK and dV are paged (0: in registers; else
paged through threadgroup memory that many features at a time). dK and dV are not
both paged at D 576 / Dv 512: their pages would take 34 KiB; dV stays in registers.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

from .table_texts import BACKWARD_TEXT, FORWARD_TEXT
from .table_columns import BACKWARD_COLUMNS, FORWARD_COLUMNS, check_row

from . import tuned


@dataclass(frozen=True)
class TileRow:
    max_head_dim: int
    query_rows: int
    key_block: int
    cache_q: bool
    stage_apart: bool
    o_block: int
    tiles16: bool
    p16: bool
    stage_kv: bool
    vector_access: bool
    tensor_ops: bool = False


@dataclass(frozen=True)
class BackwardTileRow:
    max_head_dim: int
    query_rows: int    # dQ kernel: query rows per threadgroup (one simdgroup per 8)
    key_block: int     # dQ kernel: keys per step
    key_rows: int      # dK/dV kernel: keys per threadgroup (one simdgroup per 8)
    query_block: int   # dK/dV kernel: queries per step
    cache_q: bool      # dQ kernel: the simdgroup's 8 rows of Q stay in registers
    cache_dout: bool   # dQ kernel: its 8 rows of dO, the same
    cache_k: bool      # dK/dV kernel: the simdgroup's 8 rows of K stay in registers
    cache_v: bool      # dK/dV kernel: its 8 rows of V, the same
    dq_block: int      # dQ paged this many features at a time (0: in registers)
    dk_block: int      # dK, the same
    dv_block: int      # dV, the same
    tiles16: bool      # 16-bit operand tiles for 16-bit inputs (see TileRow)
    p16: bool          # P and dS rounded to the input's 16-bit type for the accumulated products (see TileRow)
    stage_kv: bool     # dQ kernel: each K/V block staged in threadgroup memory (see TileRow)
    stage_q_dout: bool  # dK/dV kernel: each Q/dO block staged, the same
    vector_access: bool  # a lane's two adjacent elements as one vector access (see TileRow)
    tensor_ops: bool = False  # both kernels: products as Metal 4 tensor ops, blocks staged (see TileRow)


# The values each column may take, by row type (table_columns.py): the tuner's candidate space.
DOMAINS: dict[type, dict[str, tuple]] = {TileRow: FORWARD_COLUMNS, BackwardTileRow: BACKWARD_COLUMNS}
DIRECTION_ROWS = {"forward": TileRow, "backward": BackwardTileRow}

# Families that share a table (the target's, for each table the family has none of).
_ALIASES = {"apple8": "apple7", "apple10": "apple9"}

# Families whose GPUs multiply with Metal 4 tensor ops (Apple M5 and later): the tensor_ops column.
_TENSOR_OPS = ("apple10",)

# Families whose GPUs convert bfloat natively (MFA's hasNativeBF16Casting: apple9 and later).
_NATIVE_BFLOAT = ("apple9", "apple10")

# The family the cpu backend reports (it runs the current generation's
# kernels), and codegen's default.
CPU_FAMILY = "apple9"
MAX_HEAD_DIM = 576   # DeepSeek's MLA: D 576 (latent 512 + rope 64), Dv 512


def parse_rows(text: str, row_type):
    """Rows of whitespace-separated columns in `row_type`'s field order; "yes"/"no" are bools."""
    rows = []
    for line in text.strip().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        rows.append(row_type(*(cell == "yes" if cell in ("yes", "no") else int(cell) for cell in line.split())))
    return tuple(rows)


TABLES: dict[tuple[str, str], tuple[TileRow, ...]] = {
    key: parse_rows(text, TileRow) for key, text in FORWARD_TEXT.items()}
BACKWARD_TABLES: dict[tuple[str, str], tuple[BackwardTileRow, ...]] = {
    key: parse_rows(text, BackwardTileRow) for key, text in BACKWARD_TEXT.items()}
FAMILIES = tuple(sorted({family for family, _ in TABLES} | set(_ALIASES)))
# The tables' precision of each input dtype: MFA's FP32 rows, or its mixed (16-bit) ones.
PRECISIONS = {"float32": "float32", "float16": "16-bit", "bfloat16": "16-bit"}


def precision(dtype: str) -> str:
    """The precision whose tables serve `dtype` inputs (ValueError naming dtype if none does)."""
    if dtype not in PRECISIONS:
        raise ValueError(f"dtype must be one of {', '.join(PRECISIONS)} for the tile tables, got {dtype!r}")
    return PRECISIONS[dtype]

# Rows forced by forced_rows(): family name -> (base family, forward row, backward row), while
# some block forces them. A name is a function of its rows, so the same rows give the same
# kernel source (their cached kernels serve every run); `_FORCING` counts the blocks open on
# a name (nested or concurrent blocks of the same rows share it).
_FORCED: dict[str, tuple[str, TileRow | None, BackwardTileRow | None]] = {}
_FORCING: dict[str, int] = {}


@contextmanager
def forced_rows(family: str, *, forward: TileRow | None = None,
                backward: BackwardTileRow | None = None) -> Iterator[str]:
    """Inside the block, the family name it yields uses `forward` and `backward` for every head
    dimension (None: `family`'s own rows); everything else (bfloat support) is `family`'s.
    Pass the name to codegen, or to `runtime.devices.tuned_as(device, family=name)` to make the
    ops use the rows (the warm path keys on the family, so forced calls never mix with others)."""
    _base(family)
    if forward is not None:
        check_row(forward, FORWARD_COLUMNS, "forward")
    if backward is not None:
        check_row(backward, BACKWARD_COLUMNS, "backward")
    rows = (family, forward, backward)
    name = f"{family}+forced-{hashlib.sha256(repr(rows).encode()).hexdigest()[:12]}"
    _FORCED[name] = rows
    _FORCING[name] = _FORCING.get(name, 0) + 1
    try:
        yield name
    finally:
        _FORCING[name] -= 1
        if not _FORCING[name]:
            del _FORCED[name], _FORCING[name]


def _unforced(family: str) -> str:
    """A forced family's base (a plain or device family: tuned.py), else `family` itself."""
    return _FORCED[family][0] if family in _FORCED else family


def _base(family: str) -> str:
    """The GPU family `family` names (of a forced family its base's, of a device family its own),
    checked: its tables are TABLES' (or an alias's target's)."""
    family = tuned.parts(_unforced(family))[0]
    if _ALIASES.get(family, family) not in FAMILIES:
        raise ValueError(f"unknown GPU family {family!r}; known: {', '.join(FAMILIES)}")
    return family


def native_bfloat(family: str) -> bool:
    """Whether `family`'s GPUs have native bfloat (bfloat tiles); else bfloat widens to float."""
    return _base(family) in _NATIVE_BFLOAT


def table_family(gpu_family: str, has_tensor_ops: bool) -> str:
    """The family whose tables a device of `gpu_family` runs: with Metal 4 tensor ops (an M5 on
    macOS 26.2 or later; the cpu device under MFA_NATIVE_TENSOR_OPS=on) the first family that
    has them; without (an M5 before 26.2, or MFA_NATIVE_TENSOR_OPS=off) a tensor-op family falls
    back to the tables its others alias (apple10: apple9's simdgroup rows)."""
    if has_tensor_ops:
        return gpu_family if gpu_family in _TENSOR_OPS else _TENSOR_OPS[0]
    return _ALIASES[gpu_family] if gpu_family in _TENSOR_OPS else gpu_family


def tensor_ops(family: str, row: TileRow | BackwardTileRow) -> bool:
    """Whether `row` of `family`'s forward or backward table makes tensor-op products (the
    tensor_ops column, on a family that has them)."""
    return row.tensor_ops and _base(family) in _TENSOR_OPS


def operand_tile_type(dtype: str, family: str, sixteen: bool) -> str:
    """The MSL element type of the tiles a 16-bit column (tiles16, p16 above) gives a kernel over
    `dtype` inputs when on (`sixteen`): the input's own 16-bit type, or float."""
    if not sixteen or dtype == "float32":
        return "float"
    if dtype == "float16":
        return "half"
    return "bfloat" if native_bfloat(family) else "float"


def built_in_row(direction: str, family: str, dtype: str, head_dim: int):
    """The built-in row of `family`'s `direction` ("forward", "backward") table for `dtype`
    inputs and a problem whose larger head dimension is `head_dim` (a forced family's: its
    base family's)."""
    family = _base(family)
    tables = TABLES if direction == "forward" else BACKWARD_TABLES
    key = (family, precision(dtype))
    for row in tables.get(key) or tables[(_ALIASES.get(family, family), key[1])]:
        if head_dim <= row.max_head_dim:
            return row
    raise ValueError(f"head dimension {head_dim} is beyond the largest supported ({MAX_HEAD_DIM})")


def _row(direction: str, family: str, dtype: str, head_dim: int):
    """A forced row (forced_rows), else the tuned row for `dtype` and the built-in row's range in
    the device's table (tuned.py; a plain family has none), else the built-in row."""
    row = built_in_row(direction, family, dtype, head_dim)
    forced = _FORCED.get(family, (None, None, None))[1 if direction == "forward" else 2]
    if forced is not None:
        return replace(forced, max_head_dim=MAX_HEAD_DIM)
    return tuned.tuned_row(_unforced(family), direction, dtype, row.max_head_dim, DIRECTION_ROWS[direction]) or row


def tile_row(family: str, dtype: str, head_dim: int) -> TileRow:
    """The row of `family`'s table for `dtype` inputs and a problem whose larger head dimension
    is `head_dim`."""
    return _row("forward", family, dtype, head_dim)


def backward_tile_row(family: str, dtype: str, head_dim: int) -> BackwardTileRow:
    """The row of `family`'s backward table for `dtype` inputs and a problem whose larger head
    dimension is `head_dim`."""
    return _row("backward", family, dtype, head_dim)
