"""Sparse-indexed attention (per-query token lists) against a float64 gather + dense reference:
every invalid-index form anywhere in a list, duplicates, all-invalid rows, topk larger than C,
topk_length, sinks, GQA ratios below and above 8, both layouts, non-contiguous and broadcast
index tensors, D != Dv, the shared-K/V (MLA) form, R = 1 decode. Outputs are poisoned."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from test_attention import DTYPES, TOLERANCE, make_inputs

import mfa_native
from mfa_native.reference import sparse_attention_backward_reference, sparse_attention_reference, sparse_topk_reference

INVALID = (-1, -2**31, "C", "C+5", 2**31 - 1)


def lists(rng, B, Hkv, R, topk, C, layout="bhsd", invalid_share=0.25):
    """Random token lists with duplicates and every invalid form sprinkled anywhere."""
    shape = (B, Hkv, R, topk) if layout == "bhsd" else (B, R, Hkv, topk)
    indices = rng.integers(0, C, shape)
    bad = rng.random(shape) < invalid_share
    forms = np.array([C if f == "C" else C + 5 if f == "C+5" else f for f in INVALID], dtype=np.int64)
    indices[bad] = forms[rng.integers(0, len(forms), bad.sum())]
    return indices.astype(np.int32)


def check(q, k, v, indices, tolerance, **kwargs):
    out, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True, **kwargs)
    expected, expected_lse = sparse_attention_reference(q, k, v, indices, return_lse=True, **kwargs)
    assert out.dtype == q.dtype and out.shape == expected.shape and lse.dtype == np.float32
    assert relative_l2(out, expected) < tolerance
    empty = np.isneginf(expected_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], expected_lse[~empty], rtol=tolerance, atol=tolerance)
    return out, lse


CASES = [
    dict(dims=dict(Hq=4, Hkv=2, R=9, C=70, D=16), topk=20),
    dict(dims=dict(B=2, Hq=12, Hkv=1, R=3, C=50, D=24, Dv=8), topk=13, kwargs=dict(sinks=True)),   # 12 heads: 2 simdgroups
    dict(dims=dict(Hq=2, Hkv=2, R=1, C=300, D=32, dtype="float16"), topk=64),                       # decode
    dict(dims=dict(Hq=8, Hkv=1, R=6, C=40, D=16, dtype="bfloat16", layout="bshd"), topk=17,
         kwargs=dict(layout="bshd", sinks=True)),
    dict(dims=dict(Hq=3, Hkv=1, R=5, C=10, D=8), topk=40, lengths=True),                           # topk > C
]


def arguments(rng, case):
    """(q, k, v, indices, kwargs) of a CASES entry: fresh inputs; row 0 of the first list has no
    valid entry; sinks and topk_length (some above topk) where the case asks for them."""
    dims = case["dims"]
    q, k, v = make_inputs(rng, **dims)
    kwargs = dict(case.get("kwargs", {}))
    B, Hq, Hkv, R, C = dims.get("B", 1), dims["Hq"], dims["Hkv"], dims["R"], dims["C"]
    if kwargs.get("sinks"):
        kwargs["sinks"] = rng.standard_normal(Hq).astype(np.float32)
    if case.get("lengths"):
        kwargs["topk_length"] = rng.integers(0, case["topk"] + 10, (B, R)).astype(np.int32)
    indices = lists(rng, B, Hkv, R, case["topk"], C, kwargs.get("layout", "bhsd"))
    indices[0, 0, 0] = -1
    return q, k, v, indices, kwargs


def tolerance_of(x) -> float:
    return TOLERANCE[{np.dtype(t): n for n, t in DTYPES.items()}[x.dtype]]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c['dims']['Hq']}/{c['dims']['Hkv']}-topk{c['topk']}")
def test_matches_gather_then_dense(rng, case):
    q, k, v, indices, kwargs = arguments(rng, case)
    out, lse = check(q, k, v, indices, tolerance_of(q), **kwargs)
    if "sinks" not in kwargs and "topk_length" not in kwargs:   # the row with no valid entry
        assert (out[0, 0, 0].astype(np.float32) == 0).all()


def test_strided_broadcast_and_shared_kv_lists(rng):
    """A list shared by every kv head through stride 0, a non-contiguous index view, and MLA's
    shared latent: v is k's first Dv features, used in place."""
    B, Hq, Hkv, R, C, D, Dv = 1, 4, 2, 7, 64, 32, 16
    q, k, _ = make_inputs(rng, B=B, Hq=Hq, Hkv=Hkv, R=R, C=C, D=D)
    v = k[..., :Dv]
    shared = np.broadcast_to(lists(rng, B, 1, R, 24, C), (B, Hkv, R, 24))      # stride 0 on the kv heads
    check(q, k, v, shared, 1e-4)
    wide = lists(rng, B, Hkv, R * 2, 48, C)[:, :, ::2, ::2]                      # gaps on rows and slots
    check(q, k, v, wide, 1e-4)
    for indices in (wide, shared):   # the backward takes the same lists in place
        o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True)
        do = rng.standard_normal(o.shape).astype(np.float32)
        grads = mfa_native.sparse_attention_backward(q, k, v, indices, o, lse, do)
        expected = sparse_attention_backward_reference(q, k, np.ascontiguousarray(v), do, indices, out=o)
        for grad, reference in zip(grads, expected):
            assert relative_l2(grad, reference) < 1e-4
    check(q, k, v, lists(rng, B, 1, R, 24, C), 1e-4)                             # a size-1 kv-head axis


def test_duplicates_count_twice_and_all_invalid_rows_give_zero(rng):
    q, k, v = make_inputs(rng, Hq=2, Hkv=1, R=4, C=16, D=8)
    indices = np.array([[[[3, 3, 3, 9], [5, -1, 16, 2**31 - 1], [-2**31, -1, 16, 21], [0, 1, 2, 3]]]], np.int32)
    out, lse = check(q, k, v, indices, 1e-4)
    assert (out[:, :, 2] == 0).all() and np.isneginf(lse[:, :, 2]).all()
    sinks = np.array([0.5, -1.0], np.float32)
    out, lse = check(q, k, v, indices, 1e-4, sinks=sinks)
    np.testing.assert_allclose(lse[0, :, 2], sinks)  # the sink is the whole denominator


def test_work_and_traffic_follow_the_lists(rng):
    """8 query heads share one list: each listed K/V row is read once per kv head, and the
    issued matrix work is that of the listed slots, far below dense attention's."""
    Hq, R, C, D, topk = 8, 2, 4096, 16, 256
    q, k, v = make_inputs(rng, Hq=Hq, Hkv=1, R=R, C=C, D=D)
    indices = lists(rng, 1, 1, R, topk, C, invalid_share=0.0)
    with mfa_native.profile() as prof:
        mfa_native.sparse_attention(q, k, v, indices)
    (record,) = prof.records
    if record.bytes_read is None or record.simdgroup_matrix_ops is None:
        pytest.skip("this backend does not count")
    tiles = R * topk // 8                                     # one simdgroup of 8 heads per (r, kv head)
    assert record.simdgroup_matrix_ops == tiles * (D // 8 + D // 8)
    assert record.bytes_read["k"] == record.bytes_read["v"] == R * topk * D * 4   # each listed row once
    dense = mfa_native.profile()
    with dense as dense_prof:
        mfa_native.attention(q, k, v)
    assert record.simdgroup_matrix_ops <= dense_prof.simdgroup_matrix_ops / 16


def bad(message, exception=ValueError):
    return pytest.raises(exception, match=message)


def test_bad_lists_are_refused(rng):
    q, k, v = make_inputs(rng, Hq=2, Hkv=1, R=4, C=16, D=8)
    indices = lists(rng, 1, 1, 4, 5, 16)
    with bad("indices must be int32", TypeError):
        mfa_native.sparse_attention(q, k, v, indices.astype(np.int64))
    with bad("indices must have shape"):
        mfa_native.sparse_attention(q, k, v, indices[:, :, :3])
    with bad("4 dimensions"):
        mfa_native.sparse_attention(q, k, v, indices[0])
    with bad("topk_length must not be negative"):
        mfa_native.sparse_attention(q, k, v, indices, topk_length=np.array([[1, -1, 2, 3]], np.int32))
    with bad("topk_length must be int32", TypeError):
        mfa_native.sparse_attention(q, k, v, indices, topk_length=np.ones((1, 4)))
    with bad("topk_length must have shape"):
        mfa_native.sparse_attention(q, k, v, indices, topk_length=np.ones((1, 3), np.int32))
    lengths = np.ones((1, 4), np.int32)
    for _ in range(2):  # the second call is warm: the contents are checked again
        mfa_native.sparse_attention(q, k, v, indices, topk_length=lengths)
    lengths[0, 0] = -3
    with bad("topk_length must not be negative"):
        mfa_native.sparse_attention(q, k, v, indices, topk_length=lengths)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c['dims']['Hq']}/{c['dims']['Hkv']}-topk{c['topk']}")
def test_backward_matches_the_reference_and_repeats_bit_for_bit(rng, case):
    q, k, v, indices, kwargs = arguments(rng, case)
    o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True, **kwargs)
    do = rng.standard_normal(o.shape).astype(q.dtype)
    grads = mfa_native.sparse_attention_backward(q, k, v, indices, o, lse, do, **kwargs)
    expected = sparse_attention_backward_reference(q, k, v, do, indices, out=o, **kwargs)
    assert len(grads) == (4 if "sinks" in kwargs else 3)
    for grad, reference in zip(grads, expected):
        assert np.linalg.norm(grad.astype(np.float64) - reference) <= 10 * tolerance_of(q) * np.linalg.norm(reference) \
            + 1e-5
    again = mfa_native.sparse_attention_backward(q, k, v, indices, o, lse, do, **kwargs)
    for a, b in zip(grads, again):
        np.testing.assert_array_equal(a, b)   # no atomics: the same bits every run


def test_backward_agrees_with_finite_differences_of_the_forward(rng):
    q, k, v = make_inputs(rng, Hq=2, Hkv=1, R=3, C=12, D=8)
    q, k, v = (x.astype(np.float64).astype(np.float32) for x in (q, k, v))
    indices = lists(rng, 1, 1, 3, 10, 12, invalid_share=0.2)
    sinks = rng.standard_normal(2).astype(np.float32)
    o, lse = mfa_native.sparse_attention(q, k, v, indices, sinks=sinks, return_lse=True)
    do = rng.standard_normal(o.shape).astype(np.float32)
    grads = mfa_native.sparse_attention_backward(q, k, v, indices, o, lse, do, sinks=sinks)

    def loss(q, k, v, sinks):
        out = sparse_attention_reference(q, k, v, indices, sinks=sinks)
        return float((out * do).sum())

    arrays = [q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), sinks.astype(np.float64)]
    for which, grad in enumerate(grads):
        flat = arrays[which].reshape(-1)
        for position in rng.choice(flat.size, min(6, flat.size), replace=False):
            saved, h = flat[position], 1e-4
            flat[position] = saved + h
            up = loss(*arrays)
            flat[position] = saved - h
            down = loss(*arrays)
            flat[position] = saved
            assert abs(grad.reshape(-1)[position] - (up - down) / (2 * h)) < 1e-3


def test_shared_kv_gradients_come_back_separately(rng):
    """MLA's form, v = k[..., :Dv]: dk and dv are each the gradient through their own role."""
    q, k, _ = make_inputs(rng, Hq=4, Hkv=1, R=5, C=30, D=24)
    v = k[..., :8]
    indices = lists(rng, 1, 1, 5, 16, 30)
    o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True)
    do = rng.standard_normal(o.shape).astype(np.float32)
    dq, dk, dv = mfa_native.sparse_attention_backward(q, k, v, indices, o, lse, do)
    expected = sparse_attention_backward_reference(q, k, np.ascontiguousarray(v), do, indices, out=o)
    assert dk.shape == k.shape and dv.shape == v.shape
    for grad, reference in zip((dq, dk, dv), expected):
        assert relative_l2(grad, reference) < 1e-4


@pytest.mark.parametrize("layout,causal,dtype", [("bhsd", True, np.float32), ("bshd", False, np.float16),
                                                 ("bhsd", False, np.float32)])
def test_the_indexer_picks_the_top_keys_like_numpy(rng, layout, causal, dtype):
    B, Hi, R, C, Di, topk = 2, 11, 5, 45, 24, 16
    q = rng.standard_normal((B, Hi, R, Di) if layout == "bhsd" else (B, R, Hi, Di)).astype(dtype)
    k = rng.standard_normal((B, 1, C, Di) if layout == "bhsd" else (B, C, 1, Di)).astype(dtype)
    weights = rng.standard_normal((B, Hi, R) if layout == "bhsd" else (B, R, Hi)).astype(np.float32)
    indices, scores = mfa_native.sparse_topk(q, k, weights, topk, causal=causal, layout=layout, return_scores=True)
    expected, expected_scores = sparse_topk_reference(q, k, weights, topk, causal=causal, layout=layout,
                                                      return_scores=True)
    assert indices.dtype == np.int32 and indices.shape == expected.shape and scores.dtype == np.float32
    np.testing.assert_array_equal(indices, expected)
    np.testing.assert_array_equal(np.isneginf(scores), np.isneginf(expected_scores))
    finite = np.isfinite(expected_scores)
    np.testing.assert_allclose(scores[finite], expected_scores[finite], rtol=1e-4, atol=1e-4)


def test_the_indexer_breaks_ties_by_the_lower_key_and_pads(rng):
    """Small integer inputs make exact, tied scores; topk above the candidates pads with -1."""
    q = rng.integers(-2, 3, (1, 3, 4, 8)).astype(np.float32)
    k = rng.integers(-1, 2, (1, 1, 10, 8)).astype(np.float32)
    weights = rng.integers(1, 3, (1, 3, 4)).astype(np.float32)
    indices, scores = mfa_native.sparse_topk(q, k, weights, 12, return_scores=True)
    np.testing.assert_array_equal(indices, sparse_topk_reference(q, k, weights, 12))
    assert (indices[0, 0, 0, 7:] == -1).all() and np.isneginf(scores[0, 0, 0, 7:]).all()  # row 0 has 7 candidates


@pytest.mark.parametrize("causal", [False, True])
def test_the_indexer_ranks_nan_first_like_torch_topk(rng, causal):
    """A NaN score ranks above every number, the lower key first among NaNs: every slot is
    written (the outputs start poisoned), and the row is a permutation of its candidates."""
    q = rng.standard_normal((1, 2, 4, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 8, 16)).astype(np.float32)
    k[0, 0, 5] = np.nan
    k[0, 0, 2, 3] = np.nan
    weights = rng.random((1, 2, 4)).astype(np.float32) + 0.5
    indices, scores = mfa_native.sparse_topk(q, k, weights, 8, causal=causal, return_scores=True)
    expected, expected_scores = sparse_topk_reference(q, k, weights, 8, causal=causal, return_scores=True)
    np.testing.assert_array_equal(indices, expected)
    np.testing.assert_array_equal(np.isnan(scores), np.isnan(expected_scores))
    if not causal:
        assert (indices[0, 0, :, :2] == [2, 5]).all()
        assert all(sorted(row) == list(range(8)) for row in indices[0, 0])


def test_the_indexer_feeds_sparse_attention(rng):
    B, Hq, Hkv, R, C, D = 1, 4, 2, 6, 64, 16
    q, k, v = make_inputs(rng, B=B, Hq=Hq, Hkv=Hkv, R=R, C=C, D=D)
    iq = rng.standard_normal((B, 3, R, 8)).astype(np.float32)
    ik = rng.standard_normal((B, 1, C, 8)).astype(np.float32)
    indices = mfa_native.sparse_topk(iq, ik, rng.random((B, 3, R)).astype(np.float32), 24)
    shared = np.broadcast_to(indices, (B, Hkv, R, 24))   # one indexer head for every kv head
    check(q, k, v, shared, 1e-4)


def test_the_indexer_refuses_bad_arguments(rng):
    q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    k = rng.standard_normal((1, 1, 5, 8)).astype(np.float32)
    w = np.ones((1, 2, 3), np.float32)
    with bad("topk must not be negative"):
        mfa_native.sparse_topk(q, k, w, -1)
    with bad("topk must be an int", TypeError):
        mfa_native.sparse_topk(q, k, w, 2.0)
    with bad("weights must be float32", TypeError):
        mfa_native.sparse_topk(q, k, w.astype(np.float16), 2)
    with bad("weights must have shape"):
        mfa_native.sparse_topk(q, k, w[:, :1], 2)
    with bad("k must have shape"):
        mfa_native.sparse_topk(q, np.concatenate([k, k], axis=1), w, 2)


def test_listed_rows_are_read_once_per_kv_head_and_once_for_a_shared_latent(rng):
    """16 heads (two simdgroups) share the staged rows; with v = k[..., :Dv] one staged row
    serves both products: v's memory is not read at all."""
    Hq, R, C, D, Dv, topk = 16, 3, 512, 32, 16, 64
    q, k, _ = make_inputs(rng, Hq=Hq, Hkv=1, R=R, C=C, D=D)
    v = k[..., :Dv]
    indices = lists(rng, 1, 1, R, topk, C, invalid_share=0.0)
    with mfa_native.profile() as prof:
        out = mfa_native.sparse_attention(q, k, v, indices)
    (record,) = prof.records
    if record.bytes_read is None:
        pytest.skip("this backend does not count traffic")
    assert record.bytes_read["k"] == R * topk * D * 4 and record.bytes_read["v"] == 0
    assert relative_l2(out, sparse_attention_reference(q, k, np.ascontiguousarray(v), indices)) < 1e-4
    separate = np.ascontiguousarray(v)                      # not a view: its own rows, read once too
    with mfa_native.profile() as prof:
        mfa_native.sparse_attention(q, k, separate, indices)
    assert prof.records[0].bytes_read["v"] == R * topk * Dv * 4


def test_sparse_ops_return_what_they_are_given():
    torch = pytest.importorskip("torch")
    q, k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 1, 30, 16), torch.randn(1, 1, 30, 16)
    indices = torch.randint(0, 30, (1, 1, 5, 8), dtype=torch.int32)
    out = mfa_native.sparse_attention(q, k, v, indices)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 2, 5, 16)
    expected = sparse_attention_reference(q.numpy(), k.numpy(), v.numpy(), indices.numpy())
    assert relative_l2(out.numpy(), expected) < 1e-4
    picked = mfa_native.sparse_topk(torch.randn(1, 2, 5, 8), torch.randn(1, 1, 30, 8), torch.rand(1, 2, 5), 4)
    assert isinstance(picked, torch.Tensor) and picked.dtype == torch.int32
    block_mask = mfa_native.BlockMask.from_mask(causal=True, R=5, C=30, block_size=8)
    out = mfa_native.block_sparse_attention(q, k, v, block_mask, causal=True)
    assert isinstance(out, torch.Tensor)
    assert relative_l2(out.numpy(), mfa_native.attention(q.numpy(), k.numpy(), v.numpy(), causal=True)) < 1e-5
