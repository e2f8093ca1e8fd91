"""The work a call issues, seen through mfa_native.profile(): skipped blocks are never computed."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from test_attention import make_inputs

import mfa_native
from mfa_native import codegen
from mfa_native.reference import attention_reference
from mfa_native.runtime.devices import tuned_as
from mfa_native.work import packed_matrix_ops, useful_matrix_ops


def issued(q, k, v, **kwargs):
    """(output, simdgroup_matrix_ops of the one dispatch, its record)."""
    with mfa_native.profile() as prof:
        out = mfa_native.attention(q, k, v, **kwargs)
    assert len(prof.records) == 1
    record = prof.records[0]
    assert record.kernel == codegen.KERNEL_NAME
    if record.simdgroup_matrix_ops is None:
        pytest.skip("this backend does not count simdgroup_matrix operations")
    return out, record.simdgroup_matrix_ops, record


def test_dense_attention_issues_exactly_the_useful_minimum(rng):
    q, k, v = make_inputs(rng, B=2, Hq=2, R=64, C=48, D=16, Dv=24)
    out, ops, record = issued(q, k, v)
    assert ops == useful_matrix_ops(2, 2, 64, 48, 16, 24) == 2 * 2 * 8 * 6 * (2 + 3)
    (kernel,) = codegen.attention_pass(codegen.AttentionProblem(2, 2, 2, 64, 48, 16, 24)).kernels
    assert record.threadgroups == np.prod(kernel.threadgroups)
    assert relative_l2(out, attention_reference(q, k, v)) < 1e-4


def test_causal_1024_skips_the_blocks_above_the_diagonal(rng):
    q, k, v = make_inputs(rng, Hq=1, R=1024, C=1024, D=8)
    out, causal_ops, _ = issued(q, k, v, causal=True)
    _, dense_ops, _ = issued(q, k, v)
    assert causal_ops <= 0.55 * dense_ops
    assert causal_ops == useful_matrix_ops(1, 1, 1024, 1024, 8, 8, causal=True)
    assert relative_l2(out, attention_reference(q, k, v, causal=True)) < 1e-4


@pytest.mark.parametrize("causal", ["lower_right", "upper_left"])
def test_causal_work_matches_the_useful_minimum_when_r_differs_from_c(rng, causal):
    q, k, v = make_inputs(rng, Hq=1, R=96, C=160, D=8)
    _, ops, _ = issued(q, k, v, causal=causal)
    assert ops == useful_matrix_ops(1, 1, 96, 160, 8, 8, causal=causal)


def test_window_visits_only_the_band(rng):
    q, k, v = make_inputs(rng, Hq=1, R=512, C=512, D=8)
    out, ops, _ = issued(q, k, v, window=(16, 0))
    assert ops <= 1.1 * useful_matrix_ops(1, 1, 512, 512, 8, 8, window=(16, 0))
    assert ops < 0.1 * useful_matrix_ops(1, 1, 512, 512, 8, 8)
    assert relative_l2(out, attention_reference(q, k, v, window=(16, 0))) < 1e-4


def test_blocks_an_all_false_mask_removes_are_skipped(rng):
    q, k, v = make_inputs(rng, Hq=1, R=64, C=1024, D=8)
    mask = np.zeros((64, 1024), dtype=bool)
    mask[:, :8] = True      # the first block only
    mask[40:, 700] = True   # and one key for the last rows
    out, masked_ops, _ = issued(q, k, v, mask=mask)
    _, dense_ops, _ = issued(q, k, v, mask=np.ones((64, 1024), dtype=bool))
    assert dense_ops == useful_matrix_ops(1, 1, 64, 1024, 8, 8)
    assert masked_ops <= 0.3 * dense_ops
    assert relative_l2(out, attention_reference(q, k, v, mask=mask)) < 1e-4
    additive = np.where(mask, 0.0, -np.inf).astype(np.float32)
    out, additive_ops, _ = issued(q, k, v, mask=additive)
    assert additive_ops == masked_ops
    assert relative_l2(out, attention_reference(q, k, v, mask=additive)) < 1e-4


def test_split_kv_issues_the_same_matrix_work_as_one_pass(rng):
    q, k, v = make_inputs(rng, Hq=2, Hkv=1, R=4, C=3000, D=16, Dv=8)
    device = mfa_native.default_device()
    with tuned_as(device, parallel_threadgroups=1):
        _, single, _ = issued(q, k, v, causal=True)
    with tuned_as(device, parallel_threadgroups=64), mfa_native.profile() as prof:
        out = mfa_native.attention(q, k, v, causal=True)
    partial, combine = prof.records
    # GQA decode packs the 2 heads' 4 queries into one tile of 8 rows (test_packed_decode.py)
    assert partial.simdgroup_matrix_ops == single == packed_matrix_ops(1, 1, 2, 4, 3000, 16, 8, causal=True)
    assert combine.simdgroup_matrix_ops == 0
    assert partial.threadgroups > 2  # the keys of each head run in several threadgroups
    assert relative_l2(out, attention_reference(q, k, v, causal=True)) < 1e-4
