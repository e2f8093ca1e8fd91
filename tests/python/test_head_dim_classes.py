"""Every kernel family at every head-dimension class of the tile tables, against the float64
references: for each row of a table, its boundary (max_head_dim) and one odd value inside its
range, so a change to a table can never break a family at a head dim no test uses (int8 at
D >= 176 did: the dense rows page O there, the int8 kernel has no pages).

The forward families (dense forward, split-KV decode, sparse-indexed, block-sparse, int8) take
the forward table's classes, the backward ones (dense, sparse-indexed and block-sparse
backward) the backward table's. The default run takes the cpu device's GPU family (apple9)
and one dtype per precision group (float32; float16 for the 16-bit rows); -m exhaustive adds
the other families' tables (run here through tuned_as) and bfloat16, in a Latin square
(`cases`)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from test_attention import DTYPES, TOLERANCE, make_inputs
from test_attention import check as check_forward
from test_attention_backward import check as check_backward
from test_sparse import check as check_sparse
from test_sparse import lists

import mfa_native
from mfa_native.codegen.int8.problem import INT8_MAX_HEAD_DIM
from mfa_native.codegen.kernel.tables import BACKWARD_TABLES, TABLES
from mfa_native.int8_reference import int8_attention_emulation
from mfa_native.reference import (block_sparse_attention_backward_reference, block_sparse_attention_reference,
                                  sparse_attention_backward_reference)
from mfa_native.runtime.devices import tuned_as

CPU_FAMILY = "apple9"
PRECISIONS = {"float32": ("float32",), "16-bit": ("float16", "bfloat16")}


def classes(table: list) -> list[int]:
    """Each row's boundary and an odd head dim inside its range (above the previous row's)."""
    dims, low = [], 0
    for row in table:
        high = row.max_head_dim
        odd = low + 1 if (low + 1) % 2 else low + 2
        dims += [odd] if odd < high else []
        dims.append(high)
        low = high
    return dims


def cases(tables: dict, direction: str) -> list:
    """The default run: the cpu device's family, every class, the first dtype of each precision.
    -m exhaustive adds the other families, each class in one dtype of its precision (the two
    16-bit dtypes alternating over the classes, and from one family to the next, so every
    class runs in both and every family in both), and bfloat16 on every other apple9 class."""
    out, families = [], sorted({family for family, _ in tables})
    for (family, precision), table in sorted(tables.items()):
        dtypes = PRECISIONS[precision]
        for j, d in enumerate(classes(table)):
            if family == CPU_FAMILY:
                chosen = [(dtypes[0], False)] + ([(dtypes[1], True)] if len(dtypes) > 1 and j % 2 else [])
            else:
                chosen = [(dtypes[(j + families.index(family)) % len(dtypes)], True)]
            for dtype, exhaustive in chosen:
                marks = [pytest.mark.exhaustive] if exhaustive else []
                out.append(pytest.param(family, dtype, d, marks=marks, id=f"{family}-{dtype}-D{d}-{direction}"))
    return out


def _family(family: str):
    """The block in which the cpu device generates `family`'s kernels."""
    return tuned_as(mfa_native.default_device(), family=family, parallel_threadgroups=64)


def _dims(d: int) -> tuple[int, int]:
    """(D, Dv) for class d: Dv one narrower where it can be (D != Dv reaches both widths' code)."""
    return d, max(1, d - 1) if d % 2 == 0 else d


@pytest.mark.parametrize("family, dtype, d", cases(TABLES, "forward"))
def test_forward_families(rng, family, dtype, d):
    D, Dv = _dims(d)
    with _family(family):
        q, k, v = make_inputs(rng, Hq=2, Hkv=2, R=9, C=21, D=D, Dv=Dv, dtype=dtype)
        check_forward(q, k, v, causal=True)
        q1, k1, v1 = make_inputs(rng, Hq=2, Hkv=1, R=1, C=520, D=D, Dv=Dv, dtype=dtype)
        with mfa_native.profile() as decode:
            check_forward(q1, k1, v1)     # split-KV: 2 splits of 256 keys or more on a 64-threadgroup device
        assert len(decode.records) == 2
        check_sparse(q, k, v, lists(rng, 1, 2, 9, 8, 21), TOLERANCE[dtype])
        mask = mfa_native.BlockMask.from_mask(None, causal=True, R=9, C=21, block_size=(8, 16))
        out = mfa_native.block_sparse_attention(q, k, v, mask, causal=True)
        expected = block_sparse_attention_reference(q, k, v, mask, causal=True)
        assert relative_l2(out, expected) < TOLERANCE[dtype]
        if max(D, Dv) <= INT8_MAX_HEAD_DIM:
            out = mfa_native.int8_attention(q, k, v, causal=True)
            # bfloat16's 8-bit significand alone puts its rounded output ~2e-3 from the float64 emulation
            bound = 4e-3 if dtype == "bfloat16" else 1e-3
            assert relative_l2(out, int8_attention_emulation(q, k, v, causal=True)) <= bound


@pytest.mark.parametrize("family, dtype, d", cases(BACKWARD_TABLES, "backward"))
def test_backward_families(rng, family, dtype, d):
    D, Dv = _dims(d)
    tolerance = 10 * TOLERANCE[dtype]
    with _family(family):
        q, k, v = make_inputs(rng, Hq=2, Hkv=1, R=9, C=21, D=D, Dv=Dv, dtype=dtype)
        check_backward(rng, q, k, v, causal=True)
        do = rng.standard_normal((1, 2, 9, Dv)).astype(DTYPES[dtype])
        indices = lists(rng, 1, 1, 9, 8, 21)
        o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True)
        grads = mfa_native.sparse_attention_backward(q, k, v, indices, o, lse, do)
        expected = sparse_attention_backward_reference(q, k, v, do, indices, out=o)
        for grad, reference in zip(grads, expected):
            assert np.linalg.norm(grad.astype(np.float64) - reference) <= \
                tolerance * np.linalg.norm(reference) + 1e-5
        mask = mfa_native.BlockMask.from_mask(None, causal=True, R=9, C=21, block_size=(8, 16))
        o, lse = mfa_native.block_sparse_attention(q, k, v, mask, causal=True, return_lse=True)
        grads = mfa_native.block_sparse_attention_backward(q, k, v, o, lse, do, mask, causal=True)
        expected = block_sparse_attention_backward_reference(q, k, v, do, mask, causal=True, out=o)
        for grad, reference in zip(grads, expected):
            assert np.linalg.norm(grad.astype(np.float64) - reference) <= \
                tolerance * np.linalg.norm(reference) + 1e-5


def test_the_classes_hold_every_boundary_and_an_odd_value_per_row():
    for table in list(TABLES.values()) + list(BACKWARD_TABLES.values()):
        dims = classes(table)
        assert {row.max_head_dim for row in table} <= set(dims) and dims == sorted(dims)
        low = 0
        for row in table:
            inside = [d for d in dims if low < d < row.max_head_dim]
            assert len(inside) == (1 if row.max_head_dim - low > 1 else 0) and all(d % 2 for d in inside)
            low = row.max_head_dim
