"""What happens to a score: the score facet's base class, its registry, and the MSL that runs a
problem's chain of score transforms.

A score transform maps the logit x of one (query, key) pair, in the log2 domain the kernels
use (x = scale * q.k * log2(e)), to a new logit, before masks and sinks (the bias adds them
after). A problem holds a chain of them (`AttentionProblem.scores`), applied in order:
flash-attn's is softcap, then ALiBi, then a score_mod. Every kernel that computes logits runs
the chain (`softmax.logits`); the backward kernels keep each element's derivative of the
chain with respect to x and multiply dS by it (`softmax.gradient_of_scores`), so dq and dk
are the gradients through the transformed scores.

A case sees where the element lies (`Element`: its query and key, in the kernel's global
positions, the diagonal that lines the sequences' last query and key up, its head and batch)
and may read buffers of its own (`catalog`, bound from the op's arguments, `inputs`).

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
from ..kernel.sizes import Extent

SCORE_TRANSFORMS = Cases("score transform")
"""The registered score transforms, by name."""


@dataclass(frozen=True)
class Element:
    """Where an element lies, as MSL expressions a transform may read: its `query` and `key`
    (ints, the kernel's global positions), `diagonal` (an int: key j lines up with query
    j - diagonal, the sequences' last query with their last key), its head `h` and `batch`
    (uints), and where its sequence's position 0 lies among the kernel's queries and keys
    (`first_query`, `first_key`: ints; a packed sequence's start, or for queries that end the
    sequence -diagonal), so that query - first_query is the query's position in its sequence."""

    query: str
    key: str
    diagonal: str
    batch: str = "b"
    head: str = "h"
    first_query: str = "0"
    first_key: str = "0"


class ScoreTransform(ABC):
    """One case of the score facet: a map of a pair's logit, with its derivative."""

    catalog: dict[str, tuple[str, str]] = {}
    """Its buffers: name -> (MSL element type, what it holds)."""

    positional: bool = False
    """Whether it reads the element's positions (a kernel that gives none refuses it)."""

    def inputs(self, spec, batches: str) -> dict:
        """The pass inputs of its buffers: name -> `spec(dtype, shape, strides, logical=False)`;
        `batches` is the runtime size counting the batches (B, or packed sequences)."""
        return {}

    def setup(self, name: str, head: str, batch: str) -> list[str]:
        """MSL a kernel runs once per (lane, query head `head` of batch `batch`) before its walk:
        the values of its buffers for the lane's rows."""
        return []

    @abstractmethod
    def apply(self, x: str, name: str, at: Element) -> tuple[list[str], str, str | None]:
        """MSL lines transforming the logit `x` (a float expression, log2 domain) of the lane's
        element at `at`, the transformed logit (an expression), and its derivative with respect
        to `x` (an expression; None: 1). `name` is unique in the chain: a prefix for the case's
        locals."""

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

    def apply(self, x: str, name: str, at: Element) -> tuple[list[str], str, str | None]:
        # In the log2 domain the cap is cap * log2(e): log2(e) * cap * tanh(s / cap) of x = s * log2(e).
        cap = float(np.float32(self.cap * np.log2(np.e)))
        lines = [f"const float {name} = precise::tanh({x} * {float_literal(1.0 / cap)});  // softcap: cap * tanh(s / cap)"]
        return lines, f"{float_literal(cap)} * {name}", f"(1.0f - {name} * {name})"

    def describe(self) -> str:
        return f"softcap {self.cap:g}"


@SCORE_TRANSFORMS.register
@dataclass(frozen=True)
class Alibi(ScoreTransform):
    """flash-attn's ALiBi: s -> s - slope[h] * |i + C - R - j| for query i, key j of a sequence
    of R queries and C keys (the diagonal causal=True uses); slopes (Hq,), or (batches, Hq)
    when `per_batch`, float32."""

    per_batch: bool = False

    positional = True
    catalog = {"alibi_slopes": ("float", "(Hq,) or (batches, Hq) the ALiBi slope of each head")}

    def inputs(self, spec, batches: str) -> dict:
        shape = ((Extent(1, (batches,)),) if self.per_batch else ()) + (Extent(1, ("Hq",)),)
        strides = ((Extent(1, ("Hq",)),) if self.per_batch else ()) + (Extent(1),)
        return {"alibi_slopes": spec("float32", shape, strides, logical=False)}

    def setup(self, name: str, head: str, batch: str) -> list[str]:
        row = f"ulong({batch}) * Hq + {head}" if self.per_batch else head
        return [f"const float {name}_slope = alibi_slopes[{row}] * LOG2E;  // ALiBi, in the log2 domain"]

    def apply(self, x: str, name: str, at: Element) -> tuple[list[str], str, str | None]:
        distance = f"abs(float({at.query} + {at.diagonal} - ({at.key})))"
        return [], f"{x} - {name}_slope * {distance}", None

    def describe(self) -> str:
        return "ALiBi" + (" per batch" if self.per_batch else "")


def setup(d) -> list[str]:
    """Every transform's lines a kernel of descriptor `d` runs once per (lane, query head h),
    before it walks the keys or queries."""
    return [line for index, t in enumerate(d.scores) for line in t.setup(f"score_{index}", "h", d.keys.batch_index)]


def chain(transforms: Sequence[ScoreTransform], x: str, at: Element | None = None) -> tuple[list[str], str, str | None]:
    """The chain applied to logit `x` of the element at `at`: its lines, the final logit and
    the product of the derivatives (None: 1, no transform has one). ValueError where a
    transform reads positions the kernel does not give (`at` None)."""
    lines, slope = [], None
    for index, transform in enumerate(transforms):
        if at is None and transform.positional:
            raise ValueError(f"score transform {transform.describe()} reads each element's positions, which this "
                             "kernel does not give")
        step, x, derivative = transform.apply(x, f"score_{index}", at)
        lines += step
        if derivative is not None:
            slope = derivative if slope is None else f"{slope} * {derivative}"
    return lines, x, slope


def has_slope(transforms: Sequence[ScoreTransform]) -> bool:
    """Whether the chain's derivative is not 1 (the backward keeps it per element)."""
    return chain(transforms, "x", Element("i", "j", "0"))[2] is not None


def element(d, query: str, key: str) -> Element:
    """The positions of an element of a kernel of descriptor `d` whose query and key are the
    MSL ints `query` and `key`."""
    bounds = d.keys.bounds
    diagonal = f"(int({bounds.k_end}) - int({bounds.q_end}))"
    first_query = f"(-{diagonal})" if d.keys.queries_end_the_sequence else f"int({bounds.q_begin})"
    return Element(query, key, diagonal, d.keys.batch_index, first_query=first_query,
                   first_key=f"int({bounds.k_begin})")


def buffers(transforms: Sequence[ScoreTransform]) -> dict[str, tuple[str, str]]:
    """The buffers the chain reads: name -> (MSL element type, what it holds)."""
    return {name: entry for t in transforms for name, entry in t.catalog.items()}


def describe(transforms: Sequence[ScoreTransform]) -> str:
    """The chain for a kernel's header: "; scores: softcap 30, ..." or nothing."""
    return "; scores: " + ", ".join(t.describe() for t in transforms) if transforms else ""
