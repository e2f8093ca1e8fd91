"""AttentionProblem: everything about one attention call that a kernel may depend on.

Shapes, dtypes, strides (in elements) and flags, with no arrays attached. The
public `attention` function builds one from its arguments; `emit` builds one
from command-line flags. Strides are given per logical axis, in the order
(batch, head, sequence, feature) for q, k, v and (batch, head, query, key) for
the mask, whatever the memory layout.

Three facets say what the dense fields cannot: `keys`, which keys a query visits (a
`visits.KeyVisit`: keys.py's DENSE, every key of the visible range; a KV cache, packed
sequences, the sparse wing's block and token lists), and `k_storage`, `v_storage`, how k and v
are stored (a `storage.facet.Storage`: plain strided, or quantized, when k_strides / v_strides
go unused).

The kernels bake the window's sides and the inputs' strides as literals (or dense products
of the sizes), unless `runtime_window` / `runtime_strides` ask for them as runtime sizes
(descriptor.py's `window_left`, `q_row_stride`, ...): then one kernel serves every window and
every view with a unit feature axis, as a bundle entry's must. The problem still holds this
call's window and strides: they are the values of those sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kernel.layouts import Strides, contiguous_strides
from ..storage.facet import Storage
from ..storage.stored import PLAIN
from .keys import DENSE
from .scores import ScoreTransform
from .visits import KeyVisit

DTYPES = ("float32", "float16", "bfloat16")
LAYOUTS = ("bhsd", "bshd")
CAUSAL = ("none", "lower_right", "upper_left")
MASKS = ("none", "bool", "additive")
# AttentionProblem.aligned of a problem whose arrays are allocated (numpy's, the pool's: aligned).
ALLOCATED = frozenset(("q", "k", "v", "o", "dout", "dq", "dk", "dv"))

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
    scores: tuple[ScoreTransform, ...] = ()   # the score facet (scores.py): transforms of each logit, in order
    keys: KeyVisit = DENSE                 # the key-visit facet (visits.py)
    k_storage: Storage = PLAIN             # the storage facets of k and v (storage/facet.py)
    v_storage: Storage = PLAIN
    runtime_window: bool = False           # the window's sides are runtime sizes (every window, one kernel)
    runtime_strides: bool = False          # the inputs' strides are runtime sizes (every view, one kernel)
    runtime_scale: bool = False            # the scale is a runtime value (its float32 bits as sizes: every scale)
    batch_invariant: bool = False          # deterministic="batch_invariant": a row's bits never depend on the call
    # The arrays (pass names: q, k, v, o, dout, dq, dk, dv) whose first element is aligned to two
    # elements, so even element indexes hold aligned vector pairs (tables.py's vector_access). The
    # ops know it from the addresses (their outputs are fresh pool memory); empty: nothing assumed.
    aligned: frozenset[str] = frozenset()

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
    def rows(self):
        """The rows facet: how query rows map to tiles (rows.py), the key facet's call."""
        return self.keys.rows(self)

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
