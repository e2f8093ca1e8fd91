"""The softmax scale in the kernels: a float32 literal, or, for a problem with `runtime_scale`
(bundle entries: one kernel serves every scale), two runtime sizes holding the float32 bits
of the scale and of scale * log2(e), computed on the host exactly as the literals are, so both
kernels compute the same bits."""

from __future__ import annotations

import numpy as np

from ..kernel.msl import float_literal
from .problem import AttentionProblem

SCALE_SIZE_DOCS = {"scale_bits": "the softmax scale's float32 bits",
                   "scale_log2e_bits": "the float32 bits of scale * log2(e)"}
SCALE_SIZE_NAMES = tuple(SCALE_SIZE_DOCS)


def scales(p: AttentionProblem) -> tuple[float, float]:
    """The softmax scale and scale * log2(e), as the float32 values the kernels use."""
    return float(np.float32(p.softmax_scale)), float(np.float32(p.softmax_scale * np.log2(np.e)))


def scale_sizes(p: AttentionProblem) -> dict[str, int]:
    """The runtime sizes of a `runtime_scale` problem: each value's float32 bits."""
    return {name: int(np.array(value, np.float32).view(np.uint32)) for name, value in zip(SCALE_SIZE_NAMES, scales(p))}


def scale_terms(p: AttentionProblem) -> tuple[str, str]:
    """The MSL of the scale and of scale * log2(e): literals, or the runtime sizes' bits read
    as floats."""
    if p.runtime_scale:
        return tuple(f"as_type<float>({name})" for name in SCALE_SIZE_NAMES)
    return tuple(float_literal(value) for value in scales(p))
