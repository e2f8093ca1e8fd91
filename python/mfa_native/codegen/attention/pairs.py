"""Which operands' row pairs are vector accesses (tables.py's vector_access): a lane's two
adjacent elements of a row tile as one half2 / bfloat2 / float2 load or store, only where the
alignment is provable from the problem (layouts.pairs_align)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..kernel.layouts import OperandLayout, pairs_align
from ..kernel.msl import MSL_TYPES
from ..storage.stored import PLAIN
from .problem import AttentionProblem

if TYPE_CHECKING:
    from .descriptor import BackwardDescriptor, KernelDescriptor


def pair_type(d: KernelDescriptor | BackwardDescriptor, name: str) -> str | None:
    """The vector type of operand `name`'s row pairs in `d`'s kernels (the device element's
    two-vector), None when they are scalar accesses."""
    return f"{MSL_TYPES[d.dtype]}2" if name in d.vector_pairs else None


def vector_pairs(p: AttentionProblem, on: bool, operands: dict[str, tuple[OperandLayout, int]]) -> frozenset[str]:
    """The operands (name -> layout, width) whose row pairs may be one vector access: with the
    row's vector_access `on`, those whose pairs provably align (layouts.pairs_align; the
    problem's `aligned` arrays, plain k and v only). o_partial, pool memory, is aligned."""
    if not on:
        return frozenset()
    stored = {"k": p.k_storage, "v": p.v_storage}
    first_aligned = {name: (name in p.aligned or name == "o_partial") and stored.get(name, PLAIN) is PLAIN
                     for name in operands}
    return frozenset(name for name, (layout, width) in operands.items()
                     if pairs_align(layout, width, first_aligned[name]))

