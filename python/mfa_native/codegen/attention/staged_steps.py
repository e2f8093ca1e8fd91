"""A kernel's block steps reading the walked rows from threadgroup memory: what the forward and
backward kernels share when they stage (packed heads always; per head where the tile table's
stage_kv / stage_q_dout says so, stage_sizes.stages_blocks).

Each step, the threadgroup fills the stage with the block's rows (storage/staging.py: one
barrier before, one after; with a mask, the first barrier takes the simdgroups' SkipVote on the
`block_seen` that masking.bias defines when it does not skip by itself), and the products read
stage rows 0 .. block - 1 instead of the tensors' own rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel.sizes import Extent
from ..kernel.tiles import HeadTensor, Positions
from ..storage import staging
from ..storage.staging import StagedTensor

LABELS = {"q": "Q", "k": "K", "v": "V", "dout": "dO"}


@dataclass(frozen=True)
class Step:
    """Where a step's products read the block's rows (`first` slot, `positions`), and the fills
    that load them: one per phase (K and V at once, or K then V: staging.phases), then an empty
    one. A step that stages nothing reads the rows in place and fills nothing."""

    fills: list[list[str]]
    first: str
    positions: Positions


def backward_staged(d, walks_keys: bool) -> list[StagedTensor]:
    """The rows a backward kernel's step stages, both at once (a BackwardDescriptor `d`): the dQ
    kernel (`walks_keys`) K and V under stage_kv, the dK/dV kernel Q and dO under stage_q_dout."""
    if walks_keys:
        names = (("k", d.head_dim, d.k), ("v", d.value_dim, d.v)) if d.stage_kv else ()
    else:
        names = (("q", d.head_dim, d.q), ("dout", d.value_dim, d.dout)) if d.stage_q_dout else ()
    return [StagedTensor(name, width, layout) for name, width, layout in names]


def read_from_stage(tensors: dict[str, HeadTensor], staged: list[StagedTensor]) -> dict[str, HeadTensor]:
    """`tensors`, the staged ones read from their stage (rows `width` apart, the tensor's own tiles)."""
    return tensors | {t.name: HeadTensor(t.stage, Extent(t.width), t.width, tensors[t.name].tile_type) for t in staged}


def voters(simdgroups: int, mask: str) -> int:
    """The simdgroups voting on each block's skip: all of them under a mask, else none."""
    return simdgroups if mask != "none" else 0


def declare(staged: list[StagedTensor], block: int, dtype: str, simdgroups: int, mask: str) -> list[str]:
    """The stage of `block` rows of each staged tensor (nothing when none is) and its votes."""
    if not staged:
        return []
    return staging.declare(staged, block, dtype, str(32 * simdgroups), voters(simdgroups, mask))


def step(staged: list[StagedTensor], *, block: int, dtype: str, start: str, end: str, positions: Positions,
         simdgroups: int, mask: str, shared_by: str = "every simdgroup of the threadgroup") -> Step:
    """The step of the block [start, start + block) (before `end`): its positions are `positions`
    (the tensors' own rows, a paged cache's included) until staged, then stage rows 0 ..
    block - 1. The first fill is labelled with the tensors it loads and who shares them."""
    if not staged:
        return Step([[], []], start, positions)
    fills = staging.step_fills(staged, block, dtype, start=start, end=end, stored_row=positions.row,
                               voters=voters(simdgroups, mask))
    names = " and ".join(LABELS[t.name] for t in staging.phases(staged)[0])
    fills[0] = ["", f"// The step's {names} rows, staged once for {shared_by}."] + fills[0]
    return Step(fills, "0", Positions(str(block)))
