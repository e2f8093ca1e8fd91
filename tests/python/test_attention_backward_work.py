"""The work the backward kernels issue, seen through mfa_native.profile(): removed blocks are skipped
in both kernels, and each kernel issues exactly its products on the tiles it visits."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from test_attention import make_inputs

import mfa_native
from mfa_native.__main__ import main as cli_main
from mfa_native import codegen
from mfa_native.reference import allowed_keys, attention_backward_reference
from mfa_native.work import useful_backward_matrix_ops


def issued(rng, q, k, v, **kwargs):
    """(gradients, [dQ ops, dK/dV ops], the two dispatch records) of one backward call."""
    do = rng.standard_normal((*q.shape[:3], v.shape[3])).astype(q.dtype)
    o, lse = mfa_native.attention(q, k, v, return_lse=True, **kwargs)
    with mfa_native.profile() as prof:
        grads = mfa_native.attention_backward(q, k, v, o, lse, do, **kwargs)
    assert [r.kernel for r in prof.records] == [codegen.DQ_KERNEL_NAME, codegen.DKDV_KERNEL_NAME]
    ops = [r.simdgroup_matrix_ops for r in prof.records]
    if None in ops:
        pytest.skip("this backend does not count simdgroup_matrix operations")
    for grad, reference in zip(grads, attention_backward_reference(q, k, v, do, **kwargs)):
        assert relative_l2(grad, reference) < 1e-3
    return ops, prof.records


def test_dense_backward_issues_exactly_the_useful_products(rng):
    q, k, v = make_inputs(rng, B=2, Hq=4, Hkv=2, R=64, C=48, D=16, Dv=24)
    ops, records = issued(rng, q, k, v)
    tiles = 2 * 4 * 8 * 6  # B * Hq * (R / 8) * (C / 8)
    assert ops == [tiles * (2 * 2 + 3), tiles * (2 * 2 + 2 * 3)]  # D = 16: 2 tiles, Dv = 24: 3 tiles
    assert ops == list(useful_backward_matrix_ops(2, 4, 64, 48, 16, 24))
    problem = codegen.AttentionBackwardProblem(codegen.AttentionProblem(2, 4, 2, 64, 48, 16, 24))
    backward = codegen.attention_backward_pass(problem)
    for record, kernel in zip(records, backward.kernels):
        assert record.threadgroups == np.prod(kernel.threadgroups)
    dq_grid, dkdv_grid = (kernel.threadgroups for kernel in backward.kernels)
    assert dq_grid[1:] == (4, 2) and dkdv_grid[1:] == (2, 2)  # dK/dV: one threadgroup column per kv head


def test_causal_skips_the_blocks_above_the_diagonal_in_both_kernels(rng):
    q, k, v = make_inputs(rng, Hq=1, R=512, C=512, D=8)
    causal, _ = issued(rng, q, k, v, causal=True)
    dense, _ = issued(rng, q, k, v)
    assert dense == list(useful_backward_matrix_ops(1, 1, 512, 512, 8, 8))
    assert causal == list(useful_backward_matrix_ops(1, 1, 512, 512, 8, 8, causal=True))
    for kernel in range(2):
        assert causal[kernel] <= 0.55 * dense[kernel]


def query_tiles_from_first_visible(q_len: int, kv_len: int, causal) -> int:
    """For each group of 8 keys, the 8-query tiles from the first query that sees one of them
    to the last (the dK/dV kernel starts there, not on the 8-row grid)."""
    allowed = allowed_keys(q_len, kv_len, causal)
    total = 0
    for first_key in range(0, kv_len, 8):
        rows = np.flatnonzero(allowed[:, first_key:first_key + 8].any(axis=1))
        total += -(-(rows[-1] - rows[0] + 1) // 8) if rows.size else 0
    return total


@pytest.mark.parametrize("causal", ["lower_right", "upper_left"])
def test_causal_work_when_r_differs_from_c(rng, causal):
    for lengths in ((96, 164), (164, 96)):
        q, k, v = make_inputs(rng, Hq=1, R=lengths[0], C=lengths[1], D=8)
        (dq, dkdv), _ = issued(rng, q, k, v, causal=causal)
        useful_dq, useful_dkdv = useful_backward_matrix_ops(1, 1, *lengths, 8, 8, causal=causal)
        assert dq == useful_dq
        assert dkdv == 4 * query_tiles_from_first_visible(*lengths, causal) <= useful_dkdv


def test_window_visits_only_the_band(rng):
    q, k, v = make_inputs(rng, Hq=1, R=512, C=512, D=8)
    ops, _ = issued(rng, q, k, v, window=(16, 0))
    useful = useful_backward_matrix_ops(1, 1, 512, 512, 8, 8, window=(16, 0))
    dense = useful_backward_matrix_ops(1, 1, 512, 512, 8, 8)
    for kernel in range(2):
        assert ops[kernel] <= 1.1 * useful[kernel]
        assert ops[kernel] < 0.1 * dense[kernel]


def test_blocks_an_all_false_mask_removes_are_skipped(rng):
    q, k, v = make_inputs(rng, Hq=1, R=64, C=1024, D=8)
    mask = np.zeros((64, 1024), dtype=bool)
    mask[:, :8] = True      # the first block only
    mask[40:, 700] = True   # and one key for the last rows
    masked, _ = issued(rng, q, k, v, mask=mask)
    dense, _ = issued(rng, q, k, v, mask=np.ones((64, 1024), dtype=bool))
    assert dense == list(useful_backward_matrix_ops(1, 1, 64, 1024, 8, 8))
    for kernel in range(2):
        assert masked[kernel] <= 0.3 * dense[kernel]
    additive, _ = issued(rng, q, k, v, mask=np.where(mask, 0.0, -np.inf).astype(np.float32))
    assert additive == masked


def test_bench_attention_backward_prints_both_times_and_issued_against_useful_work(capsys):
    assert cli_main(["bench", "attention", "--backward", "--only", "D 192", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "config" in line)
    for column in ("fwd ms", "bwd ms", "bwd mma issued", "bwd mma useful", "issued/useful"):
        assert column in header
    row = next(line for line in out.splitlines() if line.strip().startswith("D 192 / Dv 128") and "B1" in line)
    assert row.split()[-1] == "1.000"  # a dense problem issues exactly the useful tiles
