"""Calls with nothing to compute, one path for every op: a prepared call whose pass runs
no kernel and gives outputs computed from its inputs.

Attention's empty problems (no output rows: B, Hq or R = 0; or no keys: C = 0) give what
PyTorch gives: an empty output; with no keys, output 0 and lse -inf (the sink's logit with
sinks, the sink then being the whole denominator); gradients of zeros. Other ops say what
theirs give (an empty quantized tensor, the candidates of an indexer with no scores).
Outputs are allocated like every op's (runner.allocate: the caller's framework), in host
memory (no kernel writes them), then filled.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..codegen import AttentionProblem, physical
from ..runtime import runner
from .warm import PreparedCall, pick


class NoKernels:
    """Stands in for a prepared pass: `outputs(inputs)` gives the outputs, no kernel runs."""

    def __init__(self, outputs: Callable[[list[np.ndarray]], list[np.ndarray]]) -> None:
        self.outputs = outputs

    def run_unchecked(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """The outputs of `inputs` (PreparedPass.run_unchecked: the op checked them)."""
        return self.outputs(inputs)


def filled(shape: tuple[int, ...], dtype, value) -> np.ndarray:
    """An output of `shape`, allocated as ops allocate them, every element `value`."""
    out = runner.allocate(tuple(shape), np.dtype(dtype))
    out[...] = value
    return out


def empty_call(names: Sequence[str], arguments: Sequence[str], checked,
               outputs: Callable[[list[np.ndarray]], list[np.ndarray]],
               finish: Callable = tuple) -> tuple[PreparedCall, list[np.ndarray]]:
    """The prepared call of a call with nothing to compute, and this call's inputs: the pass
    inputs `names` (of `checked`, taken from `arguments` on warm calls) go to `outputs`,
    whose list `finish` turns into the op's result."""
    prepared = PreparedCall(NoKernels(outputs), pick(names, arguments, checked.converts, checked.sources), finish)
    return prepared, [checked.bound[n] for n in names]


def empty_forward(p: AttentionProblem, arguments: tuple[str, ...], checked) -> tuple[PreparedCall, list[np.ndarray]]:
    """The forward of an empty attention problem (`checked`: bound and converts by name)."""
    names = ["q", "sinks"] if p.sinks else ["q"]

    def outputs(inputs: list[np.ndarray]) -> list[np.ndarray]:
        lse = filled((p.batch, p.q_heads, p.q_len), np.float32, -np.inf)
        if p.sinks:
            lse[...] = inputs[1][None, :, None]
        return [filled(physical(p.o_shape, p.layout), inputs[0].dtype, 0), lse]

    return empty_call(names, arguments, checked, outputs, tuple if p.return_lse else (lambda out: out[0]))


def empty_backward(p: AttentionProblem, arguments: tuple[str, ...], checked) -> tuple[PreparedCall, list[np.ndarray]]:
    """The backward of an empty attention problem: zero gradients."""

    def outputs(inputs: list[np.ndarray]) -> list[np.ndarray]:
        grads = [filled(physical(s, p.layout), inputs[0].dtype, 0) for s in (p.q_shape, p.k_shape, p.v_shape)]
        return grads + ([filled((p.q_heads,), np.float32, 0)] if p.sinks else [])

    return empty_call(["q"], arguments, checked, outputs)
