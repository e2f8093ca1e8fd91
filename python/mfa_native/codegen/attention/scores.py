"""What happens to a score: the score facet's base class, its registry, and the MSL that runs a
problem's chain of score transforms.

A score transform maps the logit x of one (query, key) pair, in the log2 domain the kernels
use (x = scale * q.k * log2(e)), to a new logit, before masks and sinks (the bias adds them
after). A problem holds a chain of them (`AttentionProblem.scores`), applied in order:
flash-attn's is softcap, then ALiBi, then a score_mod. Every kernel that computes logits runs
the chain (`softmax.logits`); the backward kernels keep each element's derivative of the
chain with respect to x and multiply dS by it (`softmax.gradient_of_scores`), so dq and dk
are the gradients through the transformed scores.

A new case is one module: a frozen dataclass deriving from `ScoreTransform`, registered with
`@SCORE_TRANSFORMS.register`. Its `apply` writes its MSL; what it bakes is its fields.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..kernel.facets import Cases
from ..kernel.msl import float_literal

SCORE_TRANSFORMS = Cases("score transform")
"""The registered score transforms, by name."""


class ScoreTransform(ABC):
    """One case of the score facet: a map of a pair's logit, with its derivative."""

    @abstractmethod
    def apply(self, x: str, name: str) -> tuple[list[str], str, str | None]:
        """MSL lines transforming the logit `x` (a float expression, log2 domain) of the lane's
        element, the transformed logit (an expression), and its derivative with respect to `x`
        (an expression; None: 1). `name` is unique in the chain: a prefix for the case's locals."""

    @abstractmethod
    def describe(self) -> str:
        """A few words for a kernel's header and a template's facts ("softcap 30")."""


@SCORE_TRANSFORMS.register
@dataclass(frozen=True)
class Softcap(ScoreTransform):
    """flash-attn's and Gemma's logit cap: s -> cap * tanh(s / cap) of the scaled score s."""

    cap: float

    def __post_init__(self) -> None:
        if not (isinstance(self.cap, float) and math.isfinite(self.cap) and self.cap > 0):
            raise ValueError(f"softcap must be a finite float above 0, got {self.cap!r}")

    def apply(self, x: str, name: str) -> tuple[list[str], str, str | None]:
        # In the log2 domain the cap is cap * log2(e): log2(e) * cap * tanh(s / cap) of x = s * log2(e).
        cap = float(np.float32(self.cap * np.log2(np.e)))
        lines = [f"const float {name} = precise::tanh({x} * {float_literal(1.0 / cap)});  // softcap: cap * tanh(s / cap)"]
        return lines, f"{float_literal(cap)} * {name}", f"(1.0f - {name} * {name})"

    def describe(self) -> str:
        return f"softcap {self.cap:g}"


def chain(transforms: Sequence[ScoreTransform], x: str) -> tuple[list[str], str, str | None]:
    """The chain applied to logit `x`: its lines, the final logit and the product of the
    derivatives (None: 1, no transform has one)."""
    lines, slope = [], None
    for index, transform in enumerate(transforms):
        step, x, derivative = transform.apply(x, f"score_{index}")
        lines += step
        if derivative is not None:
            slope = derivative if slope is None else f"{slope} * {derivative}"
    return lines, x, slope


def describe(transforms: Sequence[ScoreTransform]) -> str:
    """The chain for a kernel's header: "; scores: softcap 30, ..." or nothing."""
    return "; scores: " + ", ".join(t.describe() for t in transforms) if transforms else ""
