"""Kernel generation: problem -> kernel descriptor (tiles from tables) -> MSL source + launch
plan -> pass description.

Generic pieces: sizes.py (extents, runtime sizes), plan.py (operands, grid), msl.py
(text helpers), kernel_source.py (assembling a kernel), passes.py (kernels -> pass
description). The attention family: problem.py, descriptor.py, tables.py, split.py,
operands.py, blocks.py, the generators attention_forward.py, attention_combine.py,
attention_backward.py, and attention_passes.py, which builds its passes. Int8 attention:
int8_problem.py, int8_operands.py, int8_products.py (the product step and its exactness
bound), the generators int8_quantize.py and int8_forward.py, and int8_passes.py.

>>> from mfa_native.codegen import AttentionProblem, attention_source
>>> print(attention_source(AttentionProblem(1, 8, 8, 128, 128, 64, 64, dtype="float16", causal="lower_right")))
"""

from __future__ import annotations

from .attention_backward import DKDV_KERNEL_NAME, DQ_KERNEL_NAME, DSINKS_KERNEL_NAME, generate_dkdv, generate_dq
from .attention_combine import KERNEL_NAME as COMBINE_KERNEL_NAME
from .attention_combine import generate_combine
from .attention_forward import KERNEL_NAME, PARTIAL_KERNEL_NAME, generate, generate_partial
from .attention_passes import BAKE_LENGTHS, attention_backward_pass, attention_pass, block_mask_pass
from .descriptor import BackwardDescriptor, KernelDescriptor, describe, describe_backward, sizes_of
from .int8_passes import int8_attention_pass, int8_quantizer_pass
from .int8_problem import Int8Problem
from .int8_products import check_exact as check_int8_exact
from .kernel_source import KernelSource
from .plan import GridAxis, LaunchPlan, Operand
from .problem import AttentionBackwardProblem, AttentionProblem, BlockLists, contiguous_strides, physical
from .sizes import Extent, RuntimeSizes
from .split import kv_split
from .tables import CPU_FAMILY, FAMILIES, MAX_HEAD_DIM


def attention_kernel(problem: AttentionProblem, *, family: str = CPU_FAMILY,
                     bake_lengths: bool = BAKE_LENGTHS) -> KernelSource:
    """Source and launch plan of the one-pass forward kernel for `problem` (cached per descriptor)."""
    return generate(describe(problem, family=family, bake_lengths=bake_lengths))


def attention_source(problem: AttentionProblem, *, family: str = CPU_FAMILY,
                     bake_lengths: bool = BAKE_LENGTHS) -> str:
    """The MSL text of the forward kernel for `problem`."""
    return attention_kernel(problem, family=family, bake_lengths=bake_lengths).source


__all__ = [
    "AttentionBackwardProblem",
    "AttentionProblem",
    "BAKE_LENGTHS",
    "BackwardDescriptor",
    "BlockLists",
    "COMBINE_KERNEL_NAME",
    "CPU_FAMILY",
    "DKDV_KERNEL_NAME",
    "DQ_KERNEL_NAME",
    "DSINKS_KERNEL_NAME",
    "Extent",
    "FAMILIES",
    "GridAxis",
    "Int8Problem",
    "KERNEL_NAME",
    "KernelDescriptor",
    "KernelSource",
    "LaunchPlan",
    "MAX_HEAD_DIM",
    "Operand",
    "PARTIAL_KERNEL_NAME",
    "RuntimeSizes",
    "attention_backward_pass",
    "attention_kernel",
    "attention_pass",
    "attention_source",
    "block_mask_pass",
    "check_int8_exact",
    "contiguous_strides",
    "describe",
    "describe_backward",
    "generate",
    "generate_combine",
    "generate_dkdv",
    "generate_dq",
    "generate_partial",
    "int8_attention_pass",
    "int8_quantizer_pass",
    "kv_split",
    "physical",
    "sizes_of",
]
