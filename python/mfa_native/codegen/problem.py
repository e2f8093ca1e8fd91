"""AttentionProblem: everything about one attention call that a kernel may depend on.

Shapes, dtypes, strides (in elements) and flags, with no arrays attached. The
public `attention` function builds one from its arguments; `emit` builds one
from command-line flags. Strides are given per logical axis, in the order
(batch, head, sequence, feature) for q, k, v and (batch, head, query, key) for
the mask, whatever the memory layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .quant_format import QuantFormat

DTYPES = ("float32", "float16", "bfloat16")
LAYOUTS = ("bhsd", "bshd")
CAUSAL = ("none", "lower_right", "upper_left")
MASKS = ("none", "bool", "additive")

Strides = tuple[int, int, int, int]


def memory_order(layout: str) -> tuple[int, int, int, int]:
    """Logical axes (0 batch, 1 head, 2 sequence, 3 feature) from outermost to innermost in memory."""
    return (0, 1, 2, 3) if layout == "bhsd" else (0, 2, 1, 3)


def physical(values: tuple, layout: str) -> tuple:
    """Logical (batch, head, sequence, feature) order -> memory order of `layout`, and back
    (the swap is its own inverse)."""
    return tuple(values) if layout == "bhsd" else (values[0], values[2], values[1], values[3])


def contiguous_strides(layout: str, shape: tuple[int, int, int, int]) -> Strides:
    """Strides (elements, logical axis order) of a C-contiguous tensor of logical `shape` in `layout`."""
    strides = [0, 0, 0, 0]
    running = 1
    for axis in reversed(memory_order(layout)):
        strides[axis] = running
        running *= shape[axis]
    return tuple(strides)  # type: ignore[return-value]


@dataclass(frozen=True)
class BlockLists:
    """Block-sparse attention's lists (the tensors of FlexAttention's BlockMask), as far as a
    kernel depends on them. The lists are (B|1, H|1, blocks[, width]) int32, C-contiguous;
    `widths` are the last-axis lengths of kv_indices, full_kv_indices, q_indices and
    full_q_indices, None where that list is absent (the transposed lists are then built on
    the device from the kv lists, when a backward pass needs them)."""

    q_block: int
    k_block: int
    batch_broadcast: bool   # the lists' batch axis has size 1
    head_broadcast: bool    # their head axis has size 1 (else it is Hq)
    width: int
    full_width: int | None = None
    q_width: int | None = None
    full_q_width: int | None = None

    def __post_init__(self) -> None:
        for name in ("q_block", "k_block"):
            size = getattr(self, name)
            if size < 8 or size % 8:
                raise ValueError(f"block sizes must be positive multiples of 8, got {name}={size}")

    @property
    def full(self) -> bool:
        return self.full_width is not None

    @property
    def transposed_given(self) -> bool:
        return self.q_width is not None


@dataclass(frozen=True)
class TokenLists:
    """Sparse-indexed attention's per-query key lists (DeepSeek sparse attention): `indices`
    (B, Hkv|1, R, topk) int32 in logical order with these element strides (the slot axis
    contiguous; a kv-head stride of 0 shares one list among the kv heads), and optionally
    `topk_length` (B, R) int32 with its strides."""

    topk: int
    index_strides: tuple[int, int, int, int]
    length_strides: tuple[int, int] | None = None
    shared_kv: bool = False   # v is k's first Dv features (MLA's latent): one staged row serves both


@dataclass(frozen=True)
class QuantizedStorage:
    """How a quantized k or v is stored (a QuantizedTensor, as far as a kernel depends on it):
    its format, the dtype of its affine scales and biases, and the element strides of each
    field in logical (batch, head, sequence, -) order; the last axis of every field is
    contiguous."""

    format: QuantFormat
    data_strides: Strides
    scale_dtype: str | None = None        # affine only
    scale_strides: Strides | None = None
    bias_strides: Strides | None = None


@dataclass(frozen=True)
class AttentionProblem:
    """One attention forward problem. Dimensions follow the issue's names:
    q is (B, Hq, R, D), k is (B, Hkv, C, D), v is (B, Hkv, C, Dv) in logical order."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    dtype: str = "float32"
    layout: str = "bhsd"
    q_strides: Strides | None = None      # None: contiguous in `layout`
    k_strides: Strides | None = None
    v_strides: Strides | None = None
    causal: str = "none"
    window: tuple[int, int] | None = None  # (left, right), -1 = unbounded
    mask: str = "none"
    mask_dtype: str | None = None          # "bool" or a float dtype
    mask_strides: Strides | None = None    # logical (B, Hq, R, C) order; 0 on broadcast axes
    sinks: bool = False
    scale: float | None = None             # None: 1 / sqrt(D)
    return_lse: bool = False
    blocks: BlockLists | None = None       # block-sparse attention: only the listed key blocks
    tokens: TokenLists | None = None       # sparse-indexed attention: only the listed keys
    k_quant: QuantizedStorage | None = None  # k is read quantized (k_strides are then unused)
    v_quant: QuantizedStorage | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.causal not in CAUSAL:
            raise ValueError(f"causal must be one of {CAUSAL}, got {self.causal!r}")
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        if self.mask != "none" and self.mask_dtype is None:
            object.__setattr__(self, "mask_dtype", "bool" if self.mask == "bool" else "float32")
        if self.kv_heads == 0 and self.q_heads or self.kv_heads and self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")
        for name, shape in (("q", self.q_shape), ("k", self.k_shape), ("v", self.v_shape)):
            if getattr(self, f"{name}_strides") is None:
                object.__setattr__(self, f"{name}_strides", contiguous_strides(self.layout, shape))
        if self.mask != "none" and self.mask_strides is None:
            object.__setattr__(self, "mask_strides", contiguous_strides("bhsd", self.mask_shape))

    # Logical shapes, (batch, head, sequence, feature) / (batch, head, query, key).
    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.q_heads, self.q_len, self.head_dim)

    @property
    def k_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.kv_len, self.head_dim)

    @property
    def v_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.kv_len, self.value_dim)

    @property
    def o_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.q_heads, self.q_len, self.value_dim)

    @property
    def mask_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.q_heads, self.q_len, self.kv_len)

    @property
    def packs_heads(self) -> bool:
        """Whether a threadgroup's rows are the query heads of one kv head (at its queries),
        staging K/V rows in threadgroup memory for all of them: so with quantized K/V, whose
        every byte a threadgroup then reads once per kv head."""
        return self.k_quant is not None or self.v_quant is not None

    @property
    def gqa_ratio(self) -> int:
        return self.q_heads // self.kv_heads if self.kv_heads else 1

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else float(self.scale)


@dataclass(frozen=True)
class AttentionBackwardProblem:
    """One attention backward problem: the forward problem it differentiates (its
    `return_lse` is irrelevant), and the strides of the forward output o and of the
    output gradient dO (`dout`), logical (batch, head, sequence, feature) order; None: contiguous."""

    forward: AttentionProblem
    o_strides: Strides | None = None
    dout_strides: Strides | None = None

    def __post_init__(self) -> None:
        for name in ("o_strides", "dout_strides"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, contiguous_strides(self.forward.layout, self.forward.o_shape))
