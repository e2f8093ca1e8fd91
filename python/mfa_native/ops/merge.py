"""`mfa_native.merge_attention`: attention over a union of disjoint key sets, from its parts."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..codegen import physical
from ..runtime import runner
from . import arguments as check
from .given_kind import returns_given_kind


@returns_given_kind(("outputs", "lses"))
def merge_attention(outputs: Sequence, lses: Sequence, *, layout: str = "bhsd"):
    """The exact combination of attentions of the same queries over disjoint sets of keys.

    With lse = logsumexp over parts of lses[i], the result is
    output = sum_i exp(lses[i] - lse) * outputs[i], computed in float32; a part
    whose lse is -inf (a row that saw no key there) contributes nothing, and a row
    with lse -inf in every part gets output 0 and lse -inf, as `attention` gives.

    Args:
        outputs: what `attention` returned for each part: arrays of one kind (numpy,
            torch or MLX), dtype and shape, (B, Hq, R, Dv) for layout "bhsd",
            (B, R, Hq, Dv) for "bshd".
        lses: the parts' lse, (B, Hq, R) float32 (`attention(..., return_lse=True)`).
        layout: "bhsd" or "bshd", as passed to `attention`.

    Returns:
        (output, lse): output in the parts' dtype, layout and kind; lse (B, Hq, R) float32.

    Raises:
        TypeError, ValueError naming the argument that is wrong.
    """
    layout = check.layout_of(layout)
    if not isinstance(outputs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError("outputs and lses must be lists (or tuples) of arrays")
    if not outputs or len(outputs) != len(lses):
        raise ValueError(f"outputs and lses must be non-empty and of one length, got {len(outputs)} and {len(lses)}")
    parts = [check.as_array(o, f"outputs[{i}]") for i, o in enumerate(outputs)]
    first = parts[0]
    check.dtype_of(first, "outputs[0]")
    for i, part in enumerate(parts):
        if part.dtype != first.dtype or part.shape != first.shape or part.ndim != 4:
            raise ValueError(f"outputs must be 4-d arrays of one dtype and shape: outputs[0] is {first.dtype} "
                             f"{first.shape}, outputs[{i}] is {part.dtype} {part.shape}")
    B, Hq, R, _ = physical(first.shape, layout)
    logs = np.stack([check.lse_array(lse, (B, Hq, R)) for lse in lses])  # (parts, B, Hq, R)

    top = logs.max(axis=0)
    seen = top > -np.inf
    top = np.where(seen, top, np.float32(0))
    shares = np.exp(logs - top)  # exp(-inf) = 0: parts that saw no key
    total = shares.sum(axis=0)
    weights = shares / np.where(seen, total, np.float32(1))
    if layout == "bshd":
        weights = weights.transpose(0, 1, 3, 2)
    merged = np.einsum("pbhr,pbhrd->bhrd", weights, np.stack(parts).astype(np.float32, copy=False))

    output = runner.allocate(first.shape, first.dtype)
    output[...] = merged
    lse = runner.allocate((B, Hq, R), np.dtype(np.float32))
    lse[...] = np.where(seen, top + np.log(np.where(seen, total, np.float32(1))), np.float32(-np.inf))
    return output, lse
