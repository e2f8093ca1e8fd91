"""Kernel generation: problem -> kernel descriptor (tiles from tables) -> MSL source + launch plan.

Forward: attention_pass (one kernel, or the split-KV pair for decode). Backward:
attention_backward_pass (the dQ kernel, then the dK/dV kernel). Both are built
from the same blocks (blocks.py).

>>> from mfa_native.codegen import AttentionProblem, attention_source
>>> print(attention_source(AttentionProblem(1, 8, 8, 128, 128, 64, 64, dtype="float16", causal="lower_right")))
"""

from __future__ import annotations

from dataclasses import dataclass

from .attention_backward import DKDV_KERNEL_NAME, DQ_KERNEL_NAME, generate_dkdv, generate_dq
from .attention_combine import generate_combine
from .attention_forward import KERNEL_NAME, PARTIAL_KERNEL_NAME, KernelSource, generate
from .descriptor import BackwardDescriptor, KernelDescriptor, describe, describe_backward, sizes_of
from .plan import GridAxis, LaunchPlan, Operand
from .problem import AttentionBackwardProblem, AttentionProblem, contiguous_strides
from .split import kv_split
from .tables import CPU_FAMILY, FAMILIES, MAX_HEAD_DIM, family_of

# Sequence lengths and batch/head counts are runtime values by default: a new
# length reuses the compiled kernel (measured in docs/attention.md).
BAKE_LENGTHS = False


@dataclass(frozen=True)
class AttentionPass:
    """The kernels one attention call dispatches, in order, and the runtime sizes they read."""

    kernels: tuple[KernelSource, ...]
    sizes: dict[str, int]


def attention_pass(problem: AttentionProblem, *, family: str = CPU_FAMILY, bake_lengths: bool = BAKE_LENGTHS,
                   parallel_threadgroups: int | None = None) -> AttentionPass:
    """The forward kernel for `problem`, or, for decode shapes that would leave a device running
    `parallel_threadgroups` threadgroups at once idle, the split-KV partial and combine kernels."""
    split = kv_split(problem, family, parallel_threadgroups) if parallel_threadgroups else None
    descriptor = describe(problem, family=family, bake_lengths=bake_lengths, kv_split=split)
    kernels = (generate(descriptor),) if split is None else (generate(descriptor), generate_combine(descriptor))
    return AttentionPass(kernels, sizes_of(problem, split))


def attention_backward_pass(problem: AttentionBackwardProblem, *, family: str = CPU_FAMILY,
                            bake_lengths: bool = BAKE_LENGTHS) -> AttentionPass:
    """The backward kernels for `problem`, in order: dQ (which also stores D = rowsum(dO o O)),
    then dK/dV (which reads it)."""
    descriptor = describe_backward(problem, family=family, bake_lengths=bake_lengths)
    return AttentionPass((generate_dq(descriptor), generate_dkdv(descriptor)), sizes_of(problem.forward))


def attention_kernel(problem: AttentionProblem, *, family: str = CPU_FAMILY,
                     bake_lengths: bool = BAKE_LENGTHS) -> KernelSource:
    """Source and launch plan of the single forward kernel for `problem` (cached per descriptor)."""
    return generate(describe(problem, family=family, bake_lengths=bake_lengths))


def attention_source(problem: AttentionProblem, *, family: str = CPU_FAMILY,
                     bake_lengths: bool = BAKE_LENGTHS) -> str:
    """The MSL text of the forward kernel for `problem`."""
    return attention_kernel(problem, family=family, bake_lengths=bake_lengths).source


__all__ = [
    "AttentionBackwardProblem",
    "AttentionPass",
    "AttentionProblem",
    "BAKE_LENGTHS",
    "BackwardDescriptor",
    "CPU_FAMILY",
    "DKDV_KERNEL_NAME",
    "DQ_KERNEL_NAME",
    "FAMILIES",
    "GridAxis",
    "KERNEL_NAME",
    "KernelDescriptor",
    "KernelSource",
    "LaunchPlan",
    "MAX_HEAD_DIM",
    "Operand",
    "PARTIAL_KERNEL_NAME",
    "attention_backward_pass",
    "attention_kernel",
    "attention_pass",
    "attention_source",
    "contiguous_strides",
    "describe",
    "describe_backward",
    "family_of",
    "generate",
    "generate_combine",
    "generate_dkdv",
    "generate_dq",
    "kv_split",
    "sizes_of",
]
