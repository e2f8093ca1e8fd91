"""Int8Problem and Int8Descriptor: what int8 attention adds to an attention problem.

An Int8Problem is an AttentionProblem (shapes, dtypes, strides, masking rules, sinks,
lse) and the quantization choices:

- qk_scale: "token" (one float32 scale per row of q and of k) or "tile" (one per
  Q_TILE_ROWS query rows and per K_TILE_ROWS key rows, aligned from row 0 of each
  (batch, head)). Either way the quantizers store one scale per row, the rows of a tile
  sharing its value, so the attention kernel reads a row's scale the same way for both.
- smooth_k: K minus its mean over the keys (per batch, kv head and channel) is quantized.
- pv: "int8" (V minus its per-channel mean, int8 with one scale per channel; P int8 per
  aligned block of P_BLOCK keys) or "float" (V in the input dtype, P in float32).

The Int8Descriptor is the forward KernelDescriptor of the attention problem with keys
walked in blocks of exactly P_BLOCK (so P's blocks are the kernel's blocks, aligned from
key 0), and the three choices as the kernels bake them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..attention.descriptor import KernelDescriptor, describe
from ..attention.keys import DENSE
from ..attention.problem import AttentionProblem
from ..attention.rows import PER_HEAD
from ..kernel.tables import CPU_FAMILY
from ..storage.stored import PLAIN
from .products import P_BLOCK, check_exact

QK_SCALES = ("token", "tile")
PV_MODES = ("int8", "float")
Q_TILE_ROWS = 16   # query rows per scale with qk_scale="tile" (MFA 2.0's tiles)
K_TILE_ROWS = 64   # key rows per scale with qk_scale="tile"
INT8_MAX_HEAD_DIM = 256   # the int8 kernel holds Q in registers; its large-D form is not built (tested) yet


@dataclass(frozen=True)
class Int8Problem:
    attention: AttentionProblem
    qk_scale: str = "token"
    smooth_k: bool = True
    pv: str = "int8"

    def __post_init__(self) -> None:
        if self.qk_scale not in QK_SCALES:
            raise ValueError(f"qk_scale must be one of {QK_SCALES}, got {self.qk_scale!r}")
        if self.pv not in PV_MODES:
            raise ValueError(f"pv must be one of {PV_MODES}, got {self.pv!r}")
        if self.attention.keys is not DENSE:
            raise ValueError("int8 attention is dense: no block lists or token lists")
        if self.attention.k_storage is not PLAIN or self.attention.v_storage is not PLAIN:
            raise ValueError("int8 attention quantizes float k and v itself: no quantized K/V storage")


@dataclass(frozen=True)
class Int8Descriptor:
    attention: KernelDescriptor   # key_block == P_BLOCK
    q_rows_per_scale: int         # 1 (token) or Q_TILE_ROWS
    k_rows_per_scale: int         # 1 (token) or K_TILE_ROWS
    smooth_k: bool
    pv: str


def describe_int8(problem: Int8Problem, *, family: str = CPU_FAMILY, bake_lengths: bool = False) -> Int8Descriptor:
    """The descriptor of `problem`'s kernels; ValueError for a head dimension whose integer
    products could lose exactness (check_exact)."""
    p = problem.attention
    if max(p.head_dim, p.value_dim) > INT8_MAX_HEAD_DIM:
        raise ValueError(f"int8 attention supports head dimensions 1..{INT8_MAX_HEAD_DIM}, "
                         f"got D={p.head_dim}, Dv={p.value_dim}")
    check_exact(head_dim=p.head_dim, value_block=P_BLOCK)
    d = describe(p, family=family, bake_lengths=bake_lengths, rows=PER_HEAD)  # one query head per threadgroup
    tile = problem.qk_scale == "tile"
    # Its simdgroups read their K/V rows themselves, and its O stays in registers at every head
    # dim (the dense rows page O past D 160: int8's kernel has no pages).
    d = replace(d, key_block=P_BLOCK, stage_kv=False, o_block=0)
    return Int8Descriptor(d, Q_TILE_ROWS if tile else 1, K_TILE_ROWS if tile else 1,
                          problem.smooth_k, problem.pv)
