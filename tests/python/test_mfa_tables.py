"""The built-in tile tables are keyed by dtype and hold metal-flash-attention's published
parameters where they map: each MFA row below, probed at both ends of its range through the
lookup (tables.built_in_row), gives the row MFA's values say, by the mapping the tables'
comment states. MFA's rows are transcribed from metal-flash-attention,
Sources/FlashAttention/Attention/AttentionDescriptor/AttentionDescriptor+Parameters.swift
(forward / backwardQuery / backwardKeyValue for FP32, the *Mixed functions for 16-bit inputs;
apple9: its `supportsFamily(.apple9)` branch, apple7: the other), as
(maximum head dimension, parallelization, traversal, head block, cached operands)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from mfa_native.codegen.kernel import tables

MFA = {
    ("forward", "apple9", "float32"): [(8, 16, 128, 16, "Q O"), (16, 16, 64, 16, "Q O"), (48, 16, 32, 8, "Q O"),
                                       (192, 16, 64, 16, "O"), (384, 16, 128, 16, "")],
    ("forward", "apple7", "float32"): [(24, 32, 64, 24, "Q O"), (32, 32, 64, 32, "O"), (56, 32, 32, 56, "O"),
                                       (384, 32, 80, 16, "")],
    ("forward", "apple9", "16-bit"): [(32, 16, 128, 16, "Q O"), (96, 16, 128, 32, "Q O"), (160, 16, 128, 32, "O"),
                                      (224, 16, 128, 32, "Q"), (384, 16, 128, 32, "")],
    ("forward", "apple7", "16-bit"): [(96, 32, 128, 32, "Q O"), (128, 32, 128, 32, "Q"), (384, 32, 128, 32, "")],
    ("dq", "apple9", "float32"): [(16, 16, 64, 8, "Q dO dQ"), (32, 16, 64, 16, "Q dQ"), (192, 16, 64, 32, "Q dQ"),
                                  (384, 16, 128, 16, "")],
    ("dq", "apple7", "float32"): [(16, 32, 64, 16, "Q dQ"), (32, 32, 64, 32, "dQ"), (56, 32, 64, 24, "dQ"),
                                  (384, 32, 80, 16, "")],
    ("dq", "apple9", "16-bit"): [(80, 16, 64, 8, "Q dO dQ"), (192, 16, 64, 32, "Q dQ"), (384, 16, 128, 32, "")],
    ("dq", "apple7", "16-bit"): [(32, 32, 64, 32, "Q dQ"), (96, 32, 64, 32, "dQ"), (384, 32, 64, 32, "")],
    ("dkdv", "apple9", "float32"): [(16, 16, 64, 8, "K V dV dK"), (32, 16, 32, 16, "K V dV dK"),
                                    (64, 16, 32, 16, "V dV dK"), (128, 16, 128, 16, "dV dK"), (160, 16, 128, 16, "dV"),
                                    (384, 16, 128, 16, "")],
    ("dkdv", "apple7", "float32"): [(16, 32, 32, 16, "V dV dK"), (24, 32, 64, 24, "dV dK"), (56, 32, 80, 16, "dV"),
                                    (384, 32, 80, 16, "")],
    ("dkdv", "apple9", "16-bit"): [(56, 16, 64, 8, "K V dV dK"), (80, 16, 32, 16, "V dV dK"),
                                   (144, 16, 128, 16, "dV dK"), (224, 16, 128, 16, "dV"), (384, 16, 128, 32, "")],
    ("dkdv", "apple7", "16-bit"): [(16, 32, 64, 16, "V dV dK"), (32, 32, 64, 32, "dV dK"), (56, 32, 80, 32, "dV"),
                                   (96, 32, 64, 32, "dV"), (384, 32, 64, 32, "")],
}
# Each kernel's columns: parallelization, traversal, the cached row operands, the accumulators.
KERNELS = {
    "forward": ("query_rows", "key_block", {"Q": "cache_q"}, {"O": "o_block"}),
    "dq": ("query_rows", "key_block", {"Q": "cache_q", "dO": "cache_dout"}, {"dQ": "dq_block"}),
    "dkdv": ("key_rows", "query_block", {"K": "cache_k", "V": "cache_v"}, {"dK": "dk_block", "dV": "dv_block"}),
}
THREADGROUP_BYTES = 32 * 1024
DTYPES = {"float32": ("float32",), "16-bit": ("float16", "bfloat16")}


def _fitted(parallel: int, row, blocks: dict[str, str]) -> int:
    """MFA's parallelization, halved while the kernel's pages (threadgroup memory: each paged
    accumulator, float32 x max_head_dim per row) would exceed 32 KiB (MFA pages to device memory)."""
    paged = sum(1 for column in blocks.values() if getattr(row, column))
    while parallel > 8 and parallel * row.max_head_dim * 4 * paged > THREADGROUP_BYTES:
        parallel //= 2
    return parallel


CASES = [(kernel, family, precision, start, mfa_row)
         for (kernel, family, precision), rows in MFA.items()
         for start, mfa_row in zip([1] + [r[0] + 1 for r in rows], rows)]


def _rows(kernel: str, family: str, precision: str, start: int, end: int):
    """(head dim, the built-in row there) for every head dim of [start, end] and every dtype of `precision`."""
    direction = "forward" if kernel == "forward" else "backward"
    return [(d, tables.built_in_row(direction, family, dtype, d))
            for dtype in DTYPES[precision] for d in range(start, end + 1)]


@pytest.mark.parametrize("kernel, family, precision, start, mfa_row", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-D{c[3]}-{c[4][0]}" for c in CASES])
def test_the_rows_hold_mfa_values(kernel, family, precision, start, mfa_row):
    """At every head dimension of the MFA row's range, in each dtype's table."""
    end, parallel, traversal, head, cached = mfa_row
    rows_column, block_column, operands, accumulators = KERNELS[kernel]
    cached = cached.split()
    for head_dim, row in _rows(kernel, family, precision, start, end):
        assert getattr(row, block_column) == traversal, head_dim
        for operand, column in operands.items():
            assert getattr(row, column) == (operand in cached), (head_dim, column)
        for operand, column in accumulators.items():
            assert getattr(row, column) == (0 if operand in cached else head), (head_dim, column)
        assert getattr(row, rows_column) == _fitted(parallel, row, accumulators), head_dim


def test_the_halved_rows_are_the_ones_threadgroup_memory_forces():
    """The departures from MFA's parallelization (above) are few: apple7 past 256 in the
    forward and dQ kernels, and the dK/dV kernel's pairs of pages past 128 (apple7) or 256."""
    halved = set()
    for kernel, family, precision, start, (end, parallel, *_) in CASES:
        for _, row in _rows(kernel, family, precision, start, end):
            if getattr(row, KERNELS[kernel][0]) != parallel:
                halved.add((kernel, family, precision, row.max_head_dim))
    assert halved == {(kernel, "apple7", precision, 384) for kernel in ("forward", "dq")
                      for precision in DTYPES} | {
        ("dkdv", family, precision, end) for precision in DTYPES
        for family, end in (("apple7", 256), ("apple7", 384), ("apple9", 384))}


@pytest.mark.parametrize("family", ["apple7", "apple8", "apple9", "apple10"])
def test_every_dtype_has_its_rows(family):
    """float16 and bfloat16 share the 16-bit rows (MFA has one set for its low-precision
    inputs); float32 has its own; each covers 1..576; the 16-bit columns are on exactly for
    16-bit inputs; rows split where stage_apart starts (past 256)."""
    for direction in ("forward", "backward"):
        for head_dim in range(1, tables.MAX_HEAD_DIM + 1):
            rows = {dtype: tables.built_in_row(direction, family, dtype, head_dim)
                    for dtype in ("float32", "float16", "bfloat16")}
            assert rows["float16"] == rows["bfloat16"]
            assert rows["float32"].tiles16 == rows["float32"].p16 is False
            assert rows["float16"].tiles16 is rows["float16"].p16 is True
            if direction == "forward":
                assert all(row.stage_apart == (head_dim > 256) for row in rows.values())
    assert tables.precision("bfloat16") == "16-bit"
    with pytest.raises(ValueError, match="dtype must be one of"):
        tables.built_in_row("forward", family, "float64", 64)


def test_the_tables_differ_by_dtype_where_mfa_does():
    """Not one table under two names: at some head dimension each family's float32 and 16-bit
    rows differ in more than their 16-bit columns, both directions."""
    def choices(direction, family, dtype, d):
        return replace(tables.built_in_row(direction, family, dtype, d), max_head_dim=0, tiles16=False, p16=False)

    for family, direction in itertools.product(("apple7", "apple9"), ("forward", "backward")):
        differ = [d for d in range(1, 385)
                  if choices(direction, family, "float32", d) != choices(direction, family, "float16", d)]
        assert differ, (family, direction)
