"""A KV cache call's rotary embedding (flash-attn's `rotary_cos`, `rotary_sin`): q and the
appended k rotated on the device, first in the pass, before the append kernels write k into
the cache and before the attention kernel reads q.

One kernel per tensor (q, then k), one thread per element of the (B, rows, H, D) rows,
contiguous. The caller's rows are bound as `{name}_unrotated` (the case's `rebinds`); the
kernel writes the rotated rows into the intermediate the other kernels read under the
tensor's own buffer name (q, k_new), so the append and attention kernels run unchanged.

flash-attn's rules: the first `dim` features of a row turn, the rest are copied; pairs are
features (2j, 2j + 1) (`interleaved`, GPT-J) or (j, j + dim / 2) (GPT-NeoX); a pair (x1, x2)
at position p becomes (x1 cos - x2 sin, x1 sin + x2 cos) with cos, sin = row p of the tables
(seqlen_ro, dim / 2), computed in float32 and rounded once to the dtype. Row i of batch b
sits at position starts[b] + i (starts: rotary_seqlens where given, else cache_seqlens); q's
rows all at starts[b] unless `per_row` (causal or a window). v is never rotated.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel.msl import BUILTINS_THREAD, MSL_TYPES
from ..kernel.plan import GridAxis, LaunchPlan, Operand
from ..kernel.sizes import SIZES_OPERAND, Extent
from ..kernel.source import KernelSource, assemble

THREADS = 64   # elements per threadgroup
TABLES = ("rotary_cos", "rotary_sin")
UNROTATED = "{}_unrotated"   # the pass input of the caller's rows of buffer q or k_new
# The rows each tensor's kernel rotates: its buffer, and its (rows, heads) sizes.
ROWS = {"q": ("q", "R", "Hq"), "k": ("k_new", "Rn", "Hkv")}


@dataclass(frozen=True)
class Rotary:
    """The rotation a KV cache call bakes: `dim` features turn (even, at most D); `interleaved`
    pairs; `per_row`: q's rows at consecutive positions (else all at the start); `starts`: the
    buffer holding each batch's first position (cache_seqlens or rotary_seqlens)."""

    dim: int
    interleaved: bool
    per_row: bool
    starts: str = "cache_seqlens"

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"the rotary dimension must be even and positive, got {self.dim}")

    def pairing(self) -> list[str]:
        """MSL naming feature f's partner, its pair's column of the tables, and which half it is."""
        half = self.dim // 2
        if self.interleaved:
            return ["const uint partner = f ^ 1u;   // features (2j, 2j + 1) turn together",
                    "const uint column = f / 2u;",
                    "const bool first = (f & 1u) == 0u;"]
        return [f"const bool first = f < {half}u;   // features (j, j + {half}) turn together",
                f"const uint partner = first ? f + {half}u : f - {half}u;",
                f"const uint column = first ? f : f - {half}u;"]

    def rebinds(self) -> dict[str, str]:
        """The pass inputs the rotation kernels read in place of the buffers they write."""
        return {buffer: UNROTATED.format(buffer) for buffer, _, _ in ROWS.values()}


def plan(d, name: str, rotary: Rotary) -> LaunchPlan:
    buffer, rows, heads = ROWS[name]
    t, width = MSL_TYPES[d.dtype], d.head_dim
    shape = f"(B, {rows}, {heads}, {width})"
    ops = [Operand(UNROTATED.format(buffer), f"device const {t}*", f"{shape} the caller's rows, contiguous")]
    ops += [Operand(table, f"device const {t}*", f"(seqlen_ro, {rotary.dim // 2}) the rotation's {table[7:]}")
            for table in TABLES]
    ops.append(Operand(rotary.starts, "device const int*", "(B,) each batch's first position"))
    ops.append(Operand(buffer, f"device {t}*", f"{shape} the rows rotated", Extent(width, ("B", rows, heads))))
    ops.append(Operand(SIZES_OPERAND, f"constant {d.sizes.struct}&", "runtime sizes"))
    grid = (GridAxis(Extent(width, ("B", rows, heads)), THREADS), GridAxis(Extent(1)), GridAxis(Extent(1)))
    return LaunchPlan(f"rotate_{name}", tuple(ops), grid, THREADS, d.sizes)


def generate_rotate(d, name: str, rotary: Rotary) -> KernelSource:
    """The rotation kernel of `name` ("q" or "k": the appended rows) for attention facts `d`."""
    buffer, rows, heads = ROWS[name]
    width, given = d.head_dim, UNROTATED.format(buffer)
    offset = "i" if name == "k" or rotary.per_row else "0u"
    body = [f"const ulong t = ulong(group.x) * {THREADS} + lane;   // element f of row (b, i, h)",
            f"if (t >= ulong(B) * {rows} * {heads} * {width}) {{",
            "  return;",
            "}",
            f"const uint f = uint(t % {width});",
            f"if (f >= {rotary.dim}u) {{",
            f"  {buffer}[t] = {given}[t];   // past the rotary dimension: as given",
            "  return;",
            "}",
            f"const ulong row = t / {width};",
            f"const uint i = uint(row / {heads} % {rows});",
            f"const uint b = uint(row / (ulong({heads}) * {rows}));",
            f"const ulong at = ulong(uint({rotary.starts}[b]) + {offset}) * {rotary.dim // 2};   // its position's row",
            *rotary.pairing(),
            "const float c = float(rotary_cos[at + column]);",
            "const float s = float(rotary_sin[at + column]);",
            f"const float x = float({given}[t]);",
            f"const float y = float({given}[t - f + partner]);",
            f"{buffer}[t] = {MSL_TYPES[d.dtype]}(first ? x * c - y * s : y * s + x * c);"]
    summary = [f"rotate_{name}: the rotary embedding of {'q' if name == 'q' else 'the appended k'} "
               f"({rotary.dim} of {width} features, {'interleaved' if rotary.interleaved else 'halves'} pairs)"]
    return assemble(plan(d, name, rotary), summary=summary, builtins=BUILTINS_THREAD, body=body)
