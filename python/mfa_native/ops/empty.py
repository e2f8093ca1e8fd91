"""Calls with nothing to compute: no output rows (B, Hq or R = 0) or no keys (C = 0).

They give what PyTorch gives: an empty output; with no keys, output 0 and lse -inf (the
sink's logit with sinks, the sink then being the whole denominator); gradients of zeros.
No kernel runs: the PreparedCall's pass hands its inputs (q, and the sinks) to the finish.
"""

from __future__ import annotations

import numpy as np

from ..codegen import AttentionProblem, physical
from .warm import PreparedCall, pick


class _NoKernels:
    """Stands in for a prepared pass when nothing needs computing."""

    @staticmethod
    def run(inputs: list[np.ndarray]) -> list[np.ndarray]:
        return inputs


def empty_forward(p: AttentionProblem, arguments: tuple[str, ...], checked) -> tuple[PreparedCall, list[np.ndarray]]:
    """The forward of an empty problem, and this call's inputs (`checked`: bound and converts by name)."""
    names = ["q", "sinks"] if p.sinks else ["q"]

    def finish(inputs: list[np.ndarray]):
        out = np.zeros(physical(p.o_shape, p.layout), dtype=inputs[0].dtype)
        lse = np.full((p.batch, p.q_heads, p.q_len), -np.inf, dtype=np.float32)
        if p.sinks:
            lse[...] = inputs[1][None, :, None]
        return (out, lse) if p.return_lse else out

    return PreparedCall(_NoKernels, pick(names, arguments, checked.converts), finish), [checked.bound[n] for n in names]


def empty_backward(p: AttentionProblem, arguments: tuple[str, ...], checked) -> tuple[PreparedCall, list[np.ndarray]]:
    """The backward of an empty problem (zero gradients), and this call's inputs."""

    def finish(inputs: list[np.ndarray]):
        dtype = inputs[0].dtype
        grads = tuple(np.zeros(physical(s, p.layout), dtype=dtype) for s in (p.q_shape, p.k_shape, p.v_shape))
        return (*grads, np.zeros(p.q_heads, dtype=np.float32)) if p.sinks else grads

    return PreparedCall(_NoKernels, pick(["q"], arguments, checked.converts), finish), [checked.bound["q"]]
