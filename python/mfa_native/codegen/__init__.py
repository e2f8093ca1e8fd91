"""Kernel generation: problem -> kernel descriptor (tiles from tables) -> MSL source + launch
plan -> pass description.

The folders are wings, each importing only the floors below it (a test checks the rule):

- kernel/: the ground floor: MSL text helpers, sizes and layouts, launch plans, 8x8 tiles,
  tile tables, assembling a kernel, pass descriptions;
- storage/: how an operand is read: quantized formats, the storage facet, staging;
- attention/: the dense family: problem, facets, descriptor, kernels and passes;
- sparse/: block lists and token lists (cases of the key-visit facet), the indexer;
- int8/: int8 attention.

This module is the face: it re-exports what the ops, the CLI and the tests use.

>>> from mfa_native.codegen import AttentionProblem, attention_source
>>> print(attention_source(AttentionProblem(1, 8, 8, 128, 128, 64, 64, dtype="float16", causal="lower_right")))
"""

from __future__ import annotations

from .attention.backward import DKDV_KERNEL_NAME, DQ_KERNEL_NAME, generate_dkdv, generate_dq
from .attention.combine import KERNEL_NAME as COMBINE_KERNEL_NAME
from .attention.combine import generate_combine
from .attention.descriptor import BackwardDescriptor, KernelDescriptor, describe, describe_backward, sizes_of
from .attention.dsinks import DSINKS_KERNEL_NAME
from .attention.forward import KERNEL_NAME, PARTIAL_KERNEL_NAME, generate, generate_partial
from .attention.keys import DENSE
from .attention.passes import (BAKE_LENGTHS, attention_backward_pass, attention_backward_template, attention_pass,
                               attention_template, call_sizes)
from .attention.cache import CacheKeys
from .attention.problem import ALLOCATED, AttentionBackwardProblem, AttentionProblem
from .attention.paged_sequences import PagedSequences
from .attention.sequences import SequenceRanges, unit_table
from .attention.split import kv_split
from .int8.passes import int8_attention_pass, int8_attention_template, int8_quantizer_pass
from .int8.problem import Int8Problem
from .int8.products import check_exact as check_int8_exact
from .kernel.layouts import contiguous_strides, physical
from .kernel.plan import GridAxis, LaunchPlan, Operand
from .kernel.packing import PACKING, packs_plain_heads
from .kernel.sizes import Extent, RuntimeSizes
from .kernel.source import KernelSource
from .kernel.tables import CPU_FAMILY, FAMILIES, MAX_HEAD_DIM
from .sparse.block_mask import block_mask_pass
from .sparse.block_transpose import DIFFER as Q_LISTS_DIFFER
from .sparse.block_visits import BlockLists
from .sparse.token_lists import TokenLists
from .storage.float8 import Float8Storage
from .storage.stored import PLAIN, QuantizedStorage


def attention_kernel(problem: AttentionProblem, *, family: str = CPU_FAMILY,
                     bake_lengths: bool = BAKE_LENGTHS) -> KernelSource:
    """Source and launch plan of the one-pass forward kernel for `problem` (cached per descriptor)."""
    return generate(describe(problem, family=family, bake_lengths=bake_lengths))


def attention_source(problem: AttentionProblem, *, family: str = CPU_FAMILY,
                     bake_lengths: bool = BAKE_LENGTHS) -> str:
    """The MSL text of the forward kernel for `problem`."""
    return attention_kernel(problem, family=family, bake_lengths=bake_lengths).source


__all__ = [
    "ALLOCATED",
    "AttentionBackwardProblem",
    "AttentionProblem",
    "BAKE_LENGTHS",
    "BackwardDescriptor",
    "BlockLists",
    "CacheKeys",
    "COMBINE_KERNEL_NAME",
    "CPU_FAMILY",
    "DENSE",
    "DKDV_KERNEL_NAME",
    "DQ_KERNEL_NAME",
    "DSINKS_KERNEL_NAME",
    "Extent",
    "FAMILIES",
    "Float8Storage",
    "GridAxis",
    "Int8Problem",
    "KERNEL_NAME",
    "KernelDescriptor",
    "KernelSource",
    "LaunchPlan",
    "MAX_HEAD_DIM",
    "Operand",
    "PARTIAL_KERNEL_NAME",
    "PLAIN",
    "PagedSequences",
    "Q_LISTS_DIFFER",
    "QuantizedStorage",
    "RuntimeSizes",
    "SequenceRanges",
    "TokenLists",
    "attention_backward_pass",
    "attention_backward_template",
    "attention_kernel",
    "attention_pass",
    "attention_template",
    "attention_source",
    "block_mask_pass",
    "call_sizes",
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
    "int8_attention_template",
    "int8_quantizer_pass",
    "kv_split",
    "physical",
    "sizes_of",
    "unit_table",
]
