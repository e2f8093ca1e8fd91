"""BlockMask.from_mask's pass: the dense rules classified block by block on the device."""

from __future__ import annotations

import numbers

from .. import codegen
from ..runtime.devices import resolve_device, tuning_facts
from ..runtime.runner import PreparedPass
from . import arguments as check


def _size(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 1 <= value < 2**31:
        raise ValueError(f"{name} must be in 1..2**31 - 1, got {value}")
    return int(value)


def from_mask(cls, mask, *, causal, window, R, C, block_size: tuple[int, int], B, H, device):
    """See BlockMask.from_mask."""
    R, C, B, H = (_size(v, n) for v, n in ((R, "R"), (C, "C"), (B, "B"), (H, "H")))
    device = resolve_device(device)
    inputs, kind, dtype, strides = [], "none", None, None
    if mask is not None:
        array, kind, dtype = check.mask_array(mask, (B, H, R, C))
        strides, inputs = check.element_strides(array), [array]
    q_block, k_block = block_size
    rows, cols = -(-R // q_block), -(-C // k_block)
    lists = codegen.BlockLists(q_block, k_block, False, False, cols, cols, rows, rows)
    problem = codegen.AttentionProblem(B, H, H, R, C, 8, 8, causal=check.causal_mode(causal),
                                       window=check.window_sides(window, R, C), mask=kind, mask_dtype=dtype,
                                       mask_strides=strides, keys=lists)
    prepared = PreparedPass(codegen.block_mask_pass(problem, family=tuning_facts(device).family), device)
    outputs = dict(zip(prepared.output_names, prepared.run(inputs)))
    return cls(**outputs, block_size=block_size, shape=(R, C))
