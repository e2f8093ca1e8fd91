"""Operands more than one attention kernel binds: the mask, the results and the
runtime sizes. Their names are the MSL identifiers; their order in a plan is the
buffer index."""

from __future__ import annotations

from typing import Mapping

from .msl import MSL_TYPES, SIZES_STRUCT
from .plan import Operand


def mask_operands(mask: str, mask_dtype: str | None) -> list[Operand]:
    """The mask, when the problem has one: bool (True = attend) or additive."""
    if mask == "none":
        return []
    kind = "True = attend" if mask == "bool" else "added to the logits"
    return [Operand("mask", f"device const {MSL_TYPES[mask_dtype]}*", f"mask, {kind}")]


def result_operands(dtype: str, return_lse: bool, sinks: bool) -> list[Operand]:
    """What the finishing kernel of a forward pass writes (o, lse) and reads last (sinks)."""
    operands = [Operand("o", f"device {MSL_TYPES[dtype]}*", "output, laid out like q")]
    if return_lse:
        operands.append(Operand("lse", "device float*", "(B, Hq, R) natural-log softmax denominators"))
    if sinks:
        operands.append(Operand("sinks", "device const float*", "(Hq,) extra logit per head, no value"))
    return operands


def sizes_operands(baked_sizes: Mapping[str, int] | None,
                   size_names: tuple[str, ...]) -> tuple[list[Operand], tuple[str, ...]]:
    """The runtime-sizes struct and its fields, unless the sizes are baked into the source."""
    if baked_sizes is not None:
        return [], ()
    return [Operand("sizes", f"constant {SIZES_STRUCT}&", "runtime sizes")], size_names
