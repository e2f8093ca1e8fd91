"""One candidate row on one problem: does it fit the device, is its result right (against the
float64 reference), and how long does each of its kernels take (warm, best of `repeats`: each
dispatch's GPU timestamps on Metal, its wall time on the cpu backend; kernels.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from ml_dtypes import bfloat16

import mfa_native

from .. import codegen
from ..codegen.kernel.tables import built_in_row, forced_rows
from ..reference import attention_backward_reference, attention_reference
from ..runtime.devices import Device, tuned_as, tuning_facts
from .kernels import seconds_by_kernel
from .problems import TuningProblem

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}
# Relative L2 error a candidate may have (forward; the backward's gradients get 10 times it).
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-2}
ELEMENT_BYTES = {"float": 4, "half": 2, "bfloat": 2, "int": 4, "uint": 4, "short": 2, "ushort": 2, "char": 1, "uchar": 1}


@dataclass(frozen=True)
class Outcome:
    """A candidate's result on a problem: relative L2 error against the reference, whether it
    passed, and each kernel's best time in seconds (kernels.KERNEL_COLUMNS; None when not timed)."""

    error: float
    passed: bool
    seconds: dict[str, float] | None


def range_end(problem: TuningProblem, family: str) -> int:
    """The max_head_dim of the built-in row `problem` uses (its dtype's table): the range a
    candidate replaces."""
    return built_in_row(problem.direction, family, problem.dtype,
                        max(problem.head_dim, problem.value_dim)).max_head_dim


def _codegen_problem(p: TuningProblem) -> codegen.AttentionProblem:
    return codegen.AttentionProblem(p.batch, p.q_heads, p.kv_heads, p.q_len, p.kv_len, p.head_dim, p.value_dim,
                                    dtype=p.dtype, causal="lower_right" if p.causal else "none",
                                    aligned=codegen.ALLOCATED)   # the trials' arrays are allocated


def threadgroup_bytes(source: str) -> int:
    """Bytes of the threadgroup arrays a kernel's MSL declares."""
    return sum(ELEMENT_BYTES[t] * int(n) for t, n in re.findall(r"threadgroup (\w+) \w+\[(\d+)\];", source))


def pass_of(problem: TuningProblem, row, family: str):
    """The pass description `problem` gets with `row` in its table."""
    with forced_rows(family, **{problem.direction: row}) as forced:
        forward = _codegen_problem(problem)
        if problem.direction == "forward":
            return codegen.attention_pass(forward, family=forced)
        return codegen.attention_backward_pass(codegen.AttentionBackwardProblem(forward), family=forced)


def fits(problem: TuningProblem, row, device: Device) -> bool:
    """Whether every kernel of the pass `row` gives `problem` fits the device's threadgroup memory."""
    limit = device.limits["max_threadgroup_memory"]
    description = pass_of(problem, row, tuning_facts(device).family)
    return all(threadgroup_bytes(kernel.source) <= limit for kernel in description.kernels)


def _relative_l2(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if not np.all(np.isfinite(actual)):
        return float("inf")
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-300))


def _arrays(p: TuningProblem, rng: np.random.Generator) -> dict[str, np.ndarray]:
    dtype = NUMPY_DTYPES[p.dtype]
    shapes = {"q": (p.batch, p.q_heads, p.q_len, p.head_dim), "k": (p.batch, p.kv_heads, p.kv_len, p.head_dim),
              "v": (p.batch, p.kv_heads, p.kv_len, p.value_dim), "do": (p.batch, p.q_heads, p.q_len, p.value_dim)}
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in shapes.items()}


def _call(p: TuningProblem, x: dict[str, np.ndarray], device: Device):
    """The op under trial and what it needs computed first (the forward's o and lse for the backward)."""
    if p.direction == "forward":
        return lambda: [mfa_native.attention(x["q"], x["k"], x["v"], causal=p.causal, device=device)]
    o, lse = mfa_native.attention(x["q"], x["k"], x["v"], causal=p.causal, return_lse=True, device=device)
    return lambda: list(mfa_native.attention_backward(x["q"], x["k"], x["v"], o, lse, x["do"], causal=p.causal,
                                                      device=device)), o


def _reference(p: TuningProblem, x: dict[str, np.ndarray], o=None) -> list[np.ndarray]:
    if p.direction == "forward":
        return [attention_reference(x["q"], x["k"], x["v"], causal=p.causal)]
    return list(attention_backward_reference(x["q"], x["k"], x["v"], x["do"], causal=p.causal, out=o))


def _timed(call, direction: str) -> dict[str, float]:
    """Seconds of one call per kernel: its dispatches' own (profile() times every dispatch)."""
    with mfa_native.profile() as profiled:
        call()
    return seconds_by_kernel(direction, profiled.records)


def run(problem: TuningProblem, row, device: Device, rng: np.random.Generator, repeats: int = 0) -> Outcome:
    """Run `problem` once with `row` in its table and check it; with `repeats`, then time it
    warm, each kernel's best of `repeats`. Fresh random inputs each call."""
    family = tuning_facts(device).family
    x = _arrays(problem, rng)
    with forced_rows(family, **{problem.direction: row}) as forced, tuned_as(device, family=forced):
        made = _call(problem, x, device)
        call, o = (made, None) if problem.direction == "forward" else made
        results = call()
        times = [_timed(call, problem.direction) for _ in range(repeats)]
    tolerance = TOLERANCE[problem.dtype] * (1 if problem.direction == "forward" else 10)
    error = max(_relative_l2(actual, expected) for actual, expected in zip(results, _reference(problem, x, o)))
    best = {kernel: min(t[kernel] for t in times) for kernel in times[0]} if times else None
    return Outcome(error, error <= tolerance, best)
