"""BlockMask.from_mask's pass, declared as an op: the dense rules classified block by block on
the device."""

from __future__ import annotations

import numbers

from .. import codegen
from ..runtime.devices import Device, tuning_facts
from . import arguments as check
from .block_mask import PAIRS, BlockMask, block_size_pair
from .declaration import Arg, Call, Op, Out
from .warm import Checked, PreparedCall, prepared_call, same_memory

LISTS = tuple(name for pair in PAIRS for name in pair)


def _size(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 1 <= value < 2**31:
        raise ValueError(f"{name} must be in 1..2**31 - 1, got {value}")
    return int(value)


def _sizes(call: Call) -> tuple[int, int, int, int]:
    return tuple(_size(getattr(call, n), n) for n in ("R", "C", "B", "H"))  # type: ignore[return-value]


def _prepare(call: Call, device: Device) -> tuple[PreparedCall, list]:
    R, C, B, H = _sizes(call)
    q_block, k_block = block_size_pair(call.block_size)
    kind, dtype, strides, bound, converts = "none", None, None, {}, {}
    if call.mask is not None:
        def convert(m):
            return check.mask_array(m, (B, H, R, C))[0]

        array, kind, dtype = check.mask_array(call.mask, (B, H, R, C))
        strides, bound["mask"] = check.element_strides(array), array
        converts["mask"] = None if same_memory(call.mask, array) else convert
    rows, cols = -(-R // q_block), -(-C // k_block)
    lists = codegen.BlockLists(q_block, k_block, False, False, cols, cols, rows, rows)
    problem = codegen.AttentionProblem(B, H, H, R, C, 8, 8, causal=check.causal_mode(call.causal),
                                       window=check.window_sides(call.window, R, C), mask=kind, mask_dtype=dtype,
                                       mask_strides=strides, keys=lists)
    description = codegen.block_mask_pass(problem, family=tuning_facts(device).family)
    return prepared_call(description, device, Checked(bound, converts), call.op.array_names, LISTS)


def _block_mask(lists: tuple, call: Call) -> BlockMask:
    R, C, _, _ = _sizes(call)
    return BlockMask(**dict(zip(LISTS, lists)), block_size=block_size_pair(call.block_size), shape=(R, C))


FROM_MASK = Op(
    "block_mask_from_mask",
    "The block mask of dense rules, classified on the device.",
    arguments=(
        Arg("mask", "array", default=None, leading=True, keyword=False, doc="""
            None, or a boolean (True = attend) or additive mask broadcastable to (B, H, R, C),
            as `attention` takes it (additive values of -inf or <= -1e30 remove the pair). Pass
            the same mask, causal and window to block_sparse_attention."""),
        Arg("causal", "option", default=False, doc="as in `attention`."),
        Arg("window", "option", default=None, doc="as in `attention`."),
        Arg("R", "option", doc="the query length."),
        Arg("C", "option", doc="the key length."),
        Arg("block_size", "option", default=128, doc="Qb or (Qb, Kb), multiples of 8."),
        Arg("B", "option", default=1, doc="the batch the lists cover (1: the same for all)."),
        Arg("H", "option", default=1, doc="the query heads the lists cover (1: the same for all)."),
    ),
    outputs=tuple(Out(name, "a block list") for name in LISTS),
    prepare=_prepare,
    wrap=_block_mask,
    no_backward="a block mask is a structure: it has no gradient",
    details="""
    A block with no allowed pair is left out, a block whose pairs are all allowed is full,
    the rest are partial. Edge blocks cut short by R or C are judged on the pairs that exist.

    Returns:
        A BlockMask with all eight lists, ordered as FlexAttention orders them (the listed
        blocks ascending, then the others ascending as padding), and shape (R, C).
    """)
from_mask = FROM_MASK.function
