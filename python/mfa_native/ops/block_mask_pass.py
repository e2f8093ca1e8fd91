"""BlockMask.from_mask's pass, declared as an op: the dense rules classified block by block on
the device."""

from __future__ import annotations

import numbers

import numpy as np

from .. import codegen
from ..runtime.devices import Device, tuning_facts
from . import arguments as check
from .attention_rules import CHECKS, MASK
from .block_mask import PAIRS, BlockMask, MaskRule, block_size_pair
from .declaration import Arg, Call, Op, Out
from .empty import empty_call, filled
from .rules import Binding
from .warm import Checked, PreparedCall, prepared_call, same_memory

LISTS = tuple(name for pair in PAIRS for name in pair)


# Block pairs (B * H * ceil(R / Qb) * ceil(C / Kb)) from_mask classifies: it runs 32 threads
# per pair with 32-bit grid positions, and writes five int32 arrays of that many entries (the
# block classes and the four index lists: 1.25 GiB at this limit).
MAX_BLOCK_PAIRS = 2**26


def _size(value, name: str, low: int) -> int:
    """A size argument, checked: an int in low..2**31 - 1 (what the kernels hold in 32 bits)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= check.MAX_INDEX:
        raise ValueError(f"{name} must be in {low}..2**31 - 1, got {value}")
    return int(value)


def _sizes(call: Call) -> tuple[int, int, int, int]:
    """(R, C, B, H), checked: lengths may be 0 (an empty problem), the batch and heads at least
    1, and the block pairs they give (with block_size) at most MAX_BLOCK_PAIRS."""
    R, C, B, H = (_size(getattr(call, n), n, 0 if n in "RC" else 1) for n in ("R", "C", "B", "H"))
    q_block, k_block = block_size_pair(call.block_size)
    pairs = B * H * -(-R // q_block) * -(-C // k_block)
    if pairs > MAX_BLOCK_PAIRS:
        raise ValueError(f"R, C, B, H = {R}, {C}, {B}, {H} with block_size {(q_block, k_block)} give {pairs} "
                         f"block pairs; from_mask classifies at most 2**26 (its lists would not fit the "
                         f"kernels' 32-bit grid, nor sensibly in memory): use larger blocks")
    return R, C, B, H


def _prepare(call: Call, device: Device) -> tuple[PreparedCall, list]:
    R, C, B, H = _sizes(call)
    q_block, k_block = block_size_pair(call.block_size)
    kind, dtype, strides, bound, converts = "none", None, None, {}, {}
    if call.mask is not None:
        binding = Binding({"mask": MASK}, CHECKS, "bhsd", {"B": B, "Hq": H, "R": R, "C": C})

        def convert(m):
            return check.mask_array(m, binding)[0]

        array, kind, dtype = check.mask_array(call.mask, binding)
        strides, bound["mask"] = check.element_strides(array), array
        converts["mask"] = None if same_memory(call.mask, array) else convert
    rows, cols = -(-R // q_block), -(-C // k_block)
    if rows * cols == 0:
        return _empty_lists(B, H, rows, cols, call.op.array_names)
    lists = codegen.BlockLists(q_block, k_block, False, False, cols, cols, rows, rows)
    problem = codegen.AttentionProblem(B, H, H, R, C, 8, 8, causal=check.causal_mode(call.causal),
                                       window=check.window_sides(call.window, R, C), mask=kind, mask_dtype=dtype,
                                       mask_strides=strides, keys=lists)
    description = codegen.block_mask_pass(problem, family=tuning_facts(device).family)
    return prepared_call(description, device, Checked(bound, converts), call.op.array_names, LISTS)


def _empty_lists(B: int, H: int, rows: int, cols: int, arguments: tuple[str, ...]) -> tuple[PreparedCall, list]:
    """No query or no key blocks (R or C is 0): every list empty or all counts 0; no kernel runs."""

    def shape(name: str) -> tuple[int, ...]:
        blocks, width = (cols, rows) if name.removeprefix("full_").startswith("q") else (rows, cols)
        return (B, H, blocks, width) if name.endswith("indices") else (B, H, blocks)

    return empty_call([], arguments, Checked({}, {}), lambda inputs: [filled(shape(n), np.int32, 0) for n in LISTS])


def _block_mask(lists: tuple, call: Call) -> BlockMask:
    # The call's signature was checked when it was prepared; the lists are the kernels' own.
    values = call.values   # read directly: the warm path's cost (Call's attributes look them up)
    window = values["window"]
    rule = MaskRule(check.causal_mode(values["causal"]), None if window is None else tuple(window), values["mask"])
    return BlockMask.built(dict(zip(LISTS, lists)), block_size_pair(values["block_size"]), (values["R"], values["C"]),
                           rule)


FROM_MASK = Op(
    "block_mask_from_mask",
    "The block mask of dense rules, classified on the device.",
    arguments=(
        Arg("mask", "array", default=None, leading=True, keyword=False, doc="""
            None, or a boolean (True = attend) or additive mask broadcastable to (B, H, R, C),
            as `attention` takes it (additive values of -inf or <= -1e30 remove the pair). The
            block mask keeps it, with causal and window (its rule): block-sparse calls apply
            them inside partial blocks without being given them again."""),
        Arg("causal", "option", default=False, doc="as in `attention`."),
        Arg("window", "option", default=None, doc="as in `attention`."),
        Arg("R", "option", doc="the query length (0 gives empty lists)."),
        Arg("C", "option", doc="the key length (0 gives empty lists)."),
        Arg("block_size", "option", default=128, doc="Qb or (Qb, Kb), positive ints."),
        Arg("B", "option", default=1, doc="the batch the lists cover (1: the same for all)."),
        Arg("H", "option", default=1, doc="the query heads the lists cover (1: the same for all)."),
    ),
    outputs=tuple(Out(name, "a block list") for name in LISTS),
    prepare=_prepare,
    wrap=_block_mask,
    no_backward="block_mask_from_mask builds a structure: a block mask has no gradient",
    details="""
    A block with no allowed pair is left out, a block whose pairs are all allowed is full,
    the rest are partial. Edge blocks cut short by R or C are judged on the pairs that exist.
    """,
    returns="""
    A BlockMask with all eight lists, ordered as FlexAttention orders them (the listed
    blocks ascending, then the others ascending as padding), and shape (R, C). With R or
    C = 0 the lists are empty or all counts 0, as the ops' empty problems take them.
    """,
    raises="""
    TypeError: R, C, B or H is not an int; block_size neither an int nor a pair of ints; a
        mask neither boolean nor float; causal or window as `attention` refuses them.
    ValueError: sizes outside 0..2**31 - 1 (B and H from 1), non-positive block sizes, more
        than `2**26` block pairs B * H * ceil(R / Qb) * ceil(C / Kb), a mask that does not
        broadcast to (B, H, R, C); causal or window as `attention` refuses them.
    """)
from_mask = FROM_MASK.function
BlockMask.from_mask.__func__.__doc__ = FROM_MASK.docstring()   # the method's reference: the declaration's
