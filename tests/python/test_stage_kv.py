"""K/V staged in threadgroup memory by the per-head kernels (tile column stage_kv; backward
stage_kv for the dQ kernel's K/V blocks, stage_q_dout for the dK/dV kernel's Q/dO blocks),
forced through `tables.forced_rows` and checked on the cpu backend: against the float64
references (float32, float16, bfloat16, odd head dims, causal, window, masks whose whole-block
skips differ between simdgroups, sinks, GQA, layouts, split-KV decode, a paged KV cache), under
the race detector, and with the traffic counters: K and V are read once per threadgroup instead
of once per simdgroup, and a skipped block is not read at all. Outputs start poisoned (conftest)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from test_attention import make_inputs
from test_attention import check as check_forward
from test_attention_backward import check as check_backward
from test_head_dims import feature_arguments
from test_tile_choices import backward_row, forced, forward_row

import mfa_native
from mfa_native import codegen
from mfa_native.codegen.attention.descriptor import describe, describe_backward
from mfa_native.codegen.attention.sequences import SequenceRanges
from mfa_native.codegen.kernel.tables import CPU_FAMILY, forced_rows
from mfa_native.codegen.storage import staging
from mfa_native.reference import attention_with_kvcache_reference

DTYPE_NAMES = ("float32", "float16", "bfloat16")


def block_mask(rng, R: int, C: int) -> np.ndarray:
    """A bool mask that removes whole 32-key blocks for some rows only, so the simdgroups of a
    threadgroup disagree on which blocks they see (the vote), and a block for every row."""
    mask = rng.random((R, C)) > 0.3
    mask[: R // 2, 32:64] = False     # the first rows' simdgroups skip this block, the others do not
    mask[:, 64:96] = False            # every simdgroup skips this one
    return mask


# (D, Dv, Hq, Hkv, R, C, layout, keyword arguments), cycled over the dtypes: 32 query rows
# (4 simdgroups) per threadgroup, so each step's block is shared four ways.
FORWARD_SHAPES = [
    (33, 17, 4, 2, 37, 53, "bhsd", dict(causal=True)),
    (8, 8, 4, 2, 29, 40, "bshd", dict(window=(5, 3))),
    (300, 264, 2, 1, 19, 30, "bhsd", dict(sinks=True)),
    (64, 40, 2, 2, 45, 120, "bhsd", dict(mask="blocks")),
    (20, 20, 2, 2, 26, 30, "bshd", dict(mask="additive", causal="upper_left")),
    (40, 24, 3, 1, 40, 100, "bhsd", dict(mask="blocks", causal=True, sinks=True)),
]
FORWARD_CASES = [(dtype, apart, FORWARD_SHAPES[i % len(FORWARD_SHAPES)])
                 for i, (dtype, apart) in enumerate(itertools.product(DTYPE_NAMES, (False, True)))]


def arguments(rng, Hq: int, R: int, C: int, kwargs: dict) -> dict:
    """feature_arguments, with mask="blocks" made by block_mask."""
    if kwargs.get("mask") == "blocks":
        return {**feature_arguments(rng, Hq, R, C, {k: v for k, v in kwargs.items() if k != "mask"}),
                "mask": block_mask(rng, R, C)}
    return feature_arguments(rng, Hq, R, C, kwargs)


def staged_forward_row(**columns):
    return forward_row(query_rows=32, stage_kv=True, **columns)


@pytest.mark.parametrize("case", FORWARD_CASES, ids=[f"{t}-apart{int(a)}-D{s[0]}" for t, a, s in FORWARD_CASES])
def test_forward_staged(rng, case):
    dtype, apart, (D, Dv, Hq, Hkv, R, C, layout, kwargs) = case
    q, k, v = make_inputs(rng, Hq=Hq, Hkv=Hkv, R=R, C=C, D=D, Dv=Dv, dtype=dtype, layout=layout)
    with forced(forward=staged_forward_row(stage_apart=apart, cache_q=D < 256)):
        check_forward(q, k, v, layout=layout, **arguments(rng, Hq, R, C, kwargs))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_split_kv_decode_stages_each_split(rng, dtype):
    """16 queries of a head split over the keys: the partial kernel's threadgroup (2 simdgroups)
    stages its split's blocks."""
    q, k, v = make_inputs(rng, Hq=2, Hkv=2, R=16, C=700, D=72, Dv=40, dtype=dtype)
    with forced(forward=forward_row(query_rows=16, stage_kv=True), parallel_threadgroups=64) as family:
        with mfa_native.profile() as prof:
            check_forward(q, k, v, sinks=rng.standard_normal(2).astype(np.float32))
        problem = codegen.AttentionProblem(1, 2, 2, 16, 700, 72, 40, dtype=dtype, sinks=True)
        source = codegen.attention_pass(problem, family=family, parallel_threadgroups=64).kernels[0].source
    assert [r.kernel for r in prof.records] == [codegen.PARTIAL_KERNEL_NAME, codegen.COMBINE_KERNEL_NAME]
    assert "kv_stage[" in source   # stage_apart: K then V in one buffer


def test_paged_kv_cache_stages_pages(rng):
    """A paged cache (pages in random order among NaN garbage) read through the stage."""
    B, R, H, D, Dv, page = 2, 20, 2, 24, 16, 16
    k_cache = np.full((8, page, H, D), np.nan, np.float32)
    v_cache = np.full((8, page, H, Dv), np.nan, np.float32)
    table = rng.permutation(8)[:B * 3].reshape(B, 3).astype(np.int32)
    seqlens = np.array([37, 45], np.int32)
    for b, n in enumerate(seqlens):
        for p in range(n):
            k_cache[table[b, p // page], p % page] = rng.standard_normal(D)
            v_cache[table[b, p // page], p % page] = rng.standard_normal(Dv)
    q = rng.standard_normal((B, R, H, D)).astype(np.float32)
    expected = attention_with_kvcache_reference(q, k_cache, v_cache, seqlens, block_table=table, causal=True)
    with forced(forward=forward_row(query_rows=32, stage_kv=True)):
        out = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                                causal=True)
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < 1e-4


def test_packed_heads_with_a_mask_and_stage_apart_reach_the_same_barriers(rng):
    """Packed-heads decode always stages; with stage_apart and a mask that removes a block for
    some simdgroups only, the per-simdgroup skip used to pass the V fill's barriers by. The
    threadgroup's vote makes every thread reach them."""
    q, k, v = make_inputs(rng, Hq=8, Hkv=2, R=8, C=200, D=300, Dv=300, dtype="float16")
    mask = np.ones((1, 8, 8, 200), bool)
    mask[:, :, :4, 30:140] = False
    check_forward(q, k, v, mask=mask)


BACKWARD_SHAPES = [
    (33, 17, 2, 1, 37, 43, "bhsd", dict(causal=True)),
    (8, 8, 2, 2, 29, 37, "bshd", dict(window=(4, 2), sinks=True)),
    (264, 300, 1, 1, 19, 21, "bhsd", dict(mask="blocks")),
    (40, 24, 4, 2, 40, 100, "bhsd", dict(mask="additive")),
]
# Both kernels staged, or one of them: the dQ kernel's K/V, the dK/dV kernel's Q/dO.
STAGINGS = [(True, True), (True, False), (False, True)]
BACKWARD_CASES = [(dtype, staging_, BACKWARD_SHAPES[i % len(BACKWARD_SHAPES)])
                  for i, (dtype, staging_) in enumerate(itertools.product(DTYPE_NAMES, STAGINGS))]


@pytest.mark.parametrize("case", BACKWARD_CASES,
                         ids=[f"{t}-kv{int(s[0])}-qdo{int(s[1])}-D{x[0]}" for t, s, x in BACKWARD_CASES])
def test_backward_staged(rng, case):
    dtype, (stage_kv, stage_q_dout), (D, Dv, Hq, Hkv, R, C, layout, kwargs) = case
    q, k, v = make_inputs(rng, Hq=Hq, Hkv=Hkv, R=R, C=C, D=D, Dv=Dv, dtype=dtype, layout=layout)
    row = backward_row(rows=16, stage_kv=stage_kv, stage_q_dout=stage_q_dout, cache_q=D < 256, cache_k=D < 256)
    with forced(backward=row):
        check_backward(rng, q, k, v, layout=layout, **arguments(rng, Hq, R, C, kwargs))


# ---------------------------------------------------------------------------
# The generated MSL, the race detector, threadgroup memory.


def _sources(problem, forward=None, backward=None) -> list[str]:
    with forced_rows(CPU_FAMILY, forward=forward, backward=backward) as family:
        if backward is None:
            return [k.source for k in codegen.attention_pass(problem, family=family).kernels]
        return [k.source for k in codegen.attention_backward_pass(
            codegen.AttentionBackwardProblem(problem), family=family).kernels]


def test_msl_stages_exactly_where_the_row_says():
    problem = codegen.AttentionProblem(1, 2, 2, 64, 64, 40, 24, dtype="float16")
    (staged,) = _sources(problem, forward=staged_forward_row(stage_apart=False))
    (unstaged,) = _sources(problem, forward=forward_row(query_rows=32))
    assert "threadgroup half k_stage[1280];" in staged and "threadgroup half v_stage[768];" in staged
    assert staged.count(staging.BARRIER) == 2 and "k_stage" not in unstaged and "threadgroup_barrier" not in unstaged
    # One simdgroup has nothing to share: 8 query rows read K/V themselves.
    (single,) = _sources(problem, forward=forward_row(query_rows=8, stage_kv=True))
    assert "k_stage" not in single
    dq, dkdv = _sources(problem, backward=backward_row(stage_kv=True, stage_q_dout=False))
    assert "k_stage[" in dq and "v_stage[" in dq and "_stage[" not in dkdv
    dq, dkdv = _sources(problem, backward=backward_row(stage_kv=False, stage_q_dout=True))
    assert "_stage[" not in dq and "q_stage[" in dkdv and "dout_stage[" in dkdv


def test_varlen_and_block_sparse_do_not_stage():
    """Their simdgroups may walk different keys (sequences, lists), so they read K/V themselves."""
    dense = codegen.AttentionProblem(1, 2, 2, 64, 64, 40, 40)
    varlen = replace(dense, keys=SequenceRanges(2))
    blocks = replace(dense, keys=codegen.BlockLists(16, 16, False, False, 4))
    with forced_rows(CPU_FAMILY, forward=staged_forward_row(),
                     backward=backward_row(stage_kv=True, stage_q_dout=True)) as family:
        assert describe(dense, family=family).stage_kv
        backward = describe_backward(codegen.AttentionBackwardProblem(dense), family=family)
        assert backward.stage_kv and backward.stage_q_dout
        for problem in (varlen, blocks):
            assert not describe(problem, family=family).stage_kv
            backward = describe_backward(codegen.AttentionBackwardProblem(problem), family=family)
            assert not backward.stage_kv and not backward.stage_q_dout


def test_staged_kernels_are_race_free_and_the_detector_sees_the_stage(rng, monkeypatch):
    """Under the race detector the staged kernels (with the mask's vote) run clean; without the
    barrier after the fill, it reports the race on the stage."""
    monkeypatch.setenv("MFA_NATIVE_SANITIZE", "race")
    q, k, v = make_inputs(rng, Hq=2, Hkv=1, R=37, C=120, D=24, Dv=16, dtype="float16")
    kwargs = dict(mask=block_mask(rng, 37, 120), causal=True)
    row, brow = staged_forward_row(key_block=16), backward_row(rows=32, stage_kv=True, stage_q_dout=True)
    with forced(forward=row, backward=brow):   # rows of their own: kernels built under the detector
        check_backward(rng, q, k, v, **kwargs)
    filled = staging.fill
    monkeypatch.setattr(staging, "fill", lambda *args, **kw: filled(*args, **kw)[:-1])
    with forced(forward=staged_forward_row(key_block=64)), pytest.raises(mfa_native.DispatchError, match="data race"):
        mfa_native.attention(q, k, v, **kwargs)


def test_a_row_whose_stage_does_not_fit_is_reported_by_its_launch(rng):
    """K and V staged together at D 576 / Dv 512 in float32: 8 rows take 34 KiB, over 32 KiB."""
    q, k, v = make_inputs(rng, Hq=1, R=16, C=16, D=576, Dv=512)
    with forced(forward=forward_row(query_rows=16, stage_apart=False, stage_kv=True, cache_q=False)):
        with pytest.raises(mfa_native.DispatchError, match="threadgroup memory over 32 KiB"):
            mfa_native.attention(q, k, v)


# ---------------------------------------------------------------------------
# Device traffic.


def _traffic(q, k, v, row, **kwargs):
    """Output and bytes read per buffer of one forward call with `row` forced."""
    with forced(forward=row), mfa_native.profile() as prof:
        out = mfa_native.attention(q, k, v, **kwargs)
    return out, prof.bytes_read


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_staging_reads_k_and_v_once_per_threadgroup(rng, dtype):
    """The same output, and K and V read 4 times less: once per threadgroup of 4 simdgroups
    instead of once per simdgroup (R a multiple of the threadgroup's 32 rows, C of 8)."""
    q, k, v = make_inputs(rng, B=2, Hq=2, R=64, C=96, D=32, Dv=24, dtype=dtype)
    unstaged_out, unstaged = _traffic(q, k, v, forward_row(query_rows=32))
    staged_out, staged = _traffic(q, k, v, staged_forward_row())
    assert np.array_equal(staged_out.view(np.uint8), unstaged_out.view(np.uint8))
    assert staged["k"] == 2 * k.nbytes and staged["v"] == 2 * v.nbytes   # 2 threadgroups per head
    for name in "kv":
        assert unstaged[name] == 4 * staged[name], name
    assert staged["q"] == unstaged["q"]


def test_skipped_blocks_are_not_read(rng):
    """Causal blocks past the threadgroup's last row and blocks the mask removes for every row
    are never staged: exactly the keys each threadgroup visits are read, once."""
    R, C = 64, 128
    q, k, v = make_inputs(rng, B=2, Hq=2, R=R, C=C, D=32, Dv=24, dtype="float16")
    mask = rng.random((R, C)) > 0.2
    mask[:, 32:96] = False       # keys 32..95: two whole 32-key blocks removed for every row
    _, full = _traffic(q, k, v, staged_forward_row())
    _, masked = _traffic(q, k, v, staged_forward_row(), mask=mask)
    _, causal = _traffic(q, k, v, staged_forward_row(), causal="upper_left")
    row_bytes = 32 * 2   # D 32, float16
    threadgroups = 2 * 2 * (R // 32)
    assert full["k"] == threadgroups * C * row_bytes
    assert masked["k"] == threadgroups * (C - 64) * row_bytes
    # Upper-left causal: threadgroup x (rows 32 x .. 32 x + 31) sees keys up to 32 x + 31.
    assert causal["k"] == 2 * 2 * sum(32 * (x + 1) for x in range(R // 32)) * row_bytes


def test_staged_backward_reads_each_block_once_per_threadgroup(rng):
    """dQ kernel: V once per threadgroup of 4 simdgroups instead of once per simdgroup, K (read
    for S and for dQ += dS K) once instead of twice per simdgroup; the dK/dV kernel the same for
    dO and Q. Same gradients, bit for bit."""
    q, k, v = make_inputs(rng, B=2, Hq=2, R=64, C=96, D=32, Dv=24, dtype="float16")
    o, lse = mfa_native.attention(q, k, v, return_lse=True)
    do = rng.standard_normal(o.shape).astype(np.float16)
    runs = []
    for staged in (False, True):
        with forced(backward=backward_row(rows=32, stage_kv=staged, stage_q_dout=staged)), mfa_native.profile() as p:
            grads = mfa_native.attention_backward(q, k, v, o, lse, do)
        runs.append((grads, {r.kernel: r.bytes_read for r in p.records}))
    (plain, unstaged), (grads, staged) = runs
    for a, b in zip(plain, grads):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    dq, dkdv = codegen.DQ_KERNEL_NAME, codegen.DKDV_KERNEL_NAME
    assert staged[dq]["v"] == 2 * v.nbytes and unstaged[dq]["v"] == 4 * staged[dq]["v"]
    assert staged[dq]["k"] == 2 * k.nbytes and unstaged[dq]["k"] == 8 * staged[dq]["k"]
    for name in ("q", "dout"):
        assert unstaged[dkdv][name] == 8 * staged[dkdv][name], name
