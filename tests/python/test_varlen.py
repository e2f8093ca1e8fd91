"""attention_varlen: packed sequences (flash-attn's varlen) against the float64 reference on
each sequence's slices, forward and backward; its checks of cu_seqlens; the work it issues
(per sequence, never B * max^2); torch (flash_attn_varlen_func, autograd) and MLX."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from ml_dtypes import bfloat16

import mfa_native
from mfa_native.reference import attention_varlen_backward_reference, attention_varlen_reference
from mfa_native.work import useful_matrix_ops

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-2}


def cu_of(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(rng, lengths_q, lengths_k, *, Hq=4, Hkv=2, D=16, Dv=None, dtype="float32"):
    """q, k, v packed along their rows and cu_seqlens_q, cu_seqlens_k."""
    cu_q, cu_k = cu_of(lengths_q), cu_of(lengths_k)
    t = DTYPES[dtype]
    q = rng.standard_normal((cu_q[-1], Hq, D)).astype(t)
    k = rng.standard_normal((cu_k[-1], Hkv, D)).astype(t)
    v = rng.standard_normal((cu_k[-1], Hkv, Dv or D)).astype(t)
    return q, k, v, cu_q, cu_k


def check_both_ways(rng, q, k, v, cu_q, cu_k, tolerance, **options):
    """Forward (output and lse) and backward against the reference, relative L2."""
    o, lse = mfa_native.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    expected_o, expected_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, return_lse=True, **options)
    assert o.shape == expected_o.shape and o.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    assert relative_l2(o, expected_o) < tolerance
    finite = np.isfinite(expected_lse)
    assert np.array_equal(np.isfinite(lse), finite) and np.allclose(lse[finite], expected_lse[finite], atol=1e-3)
    do = rng.standard_normal(o.shape).astype(q.dtype)
    grads = mfa_native.attention_varlen_backward(q, k, v, o, lse, do, cu_q, cu_k, **options)
    expected = attention_varlen_backward_reference(q, k, v, do, cu_q, cu_k, out=o, **options)
    assert len(grads) == len(expected)
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, expected):
        assert got.shape == want.shape, name
        assert relative_l2(got, want) < 4 * tolerance, name


CASES = [  # (lengths of q, lengths of k, options)
    ([1, 0, 7, 32, 5], [3, 4, 0, 32, 9], dict(causal=True)),
    ([13, 1, 40], [13, 29, 40], dict(causal="upper_left")),
    ([20, 0, 1, 9], [33, 2, 1, 18], dict(window=(5, 2))),
    ([17, 30, 2], [25, 30, 6], dict(causal=True, window=(6, -1))),
    ([0, 11, 0], [4, 0, 0], dict()),                                   # keyless rows and empty sequences
    ([70, 3], [90, 130], dict(causal=True)),                           # R per sequence above 64
]


@pytest.mark.parametrize("lengths_q, lengths_k, options", CASES)
@pytest.mark.parametrize("sinks", [False, True])
def test_each_sequence_is_attention_on_its_slices(rng, lengths_q, lengths_k, options, sinks):
    q, k, v, cu_q, cu_k = packed(rng, lengths_q, lengths_k)
    sink = rng.standard_normal(q.shape[1]).astype(np.float32) if sinks else None
    check_both_ways(rng, q, k, v, cu_q, cu_k, TOLERANCE["float32"], sinks=sink, **options)


@pytest.mark.parametrize("ratio", [1, 2, 3, 8])
def test_gqa_ratios(rng, ratio):
    q, k, v, cu_q, cu_k = packed(rng, [9, 1, 24], [9, 15, 40], Hq=ratio, Hkv=1, D=24, Dv=8)
    check_both_ways(rng, q, k, v, cu_q, cu_k, TOLERANCE["float32"], causal=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precisions(rng, dtype):
    q, k, v, cu_q, cu_k = packed(rng, [12, 0, 33], [12, 5, 40], dtype=dtype)
    check_both_ways(rng, q, k, v, cu_q, cu_k, TOLERANCE[dtype], causal=True, sinks=np.zeros(4, np.float32))


def test_random_lengths_1_to_32_and_beyond(rng):
    lengths_q = rng.choice([0, 1, 2, 5, 8, 9, 16, 31, 32, 33, 100], 9)
    lengths_k = lengths_q + rng.integers(0, 20, 9)
    q, k, v, cu_q, cu_k = packed(rng, lengths_q, lengths_k, Hq=2, Hkv=1, D=8)
    check_both_ways(rng, q, k, v, cu_q, cu_k, TOLERANCE["float32"], causal=True, scale=0.3)


def test_a_warm_call_with_other_lengths_of_the_same_totals(rng):
    q, k, v, cu_q, cu_k = packed(rng, [10, 20, 2], [30, 2, 8])
    first = mfa_native.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert relative_l2(first, attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True)) < 1e-4
    cu_q, cu_k = cu_of([1, 30, 1]), cu_of([1, 1, 38])
    again = mfa_native.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert relative_l2(again, attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True)) < 1e-4
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        mfa_native.attention_varlen(q, k, v, cu_q, np.array([0, 5, 3, 40], np.int32), causal=True)


def test_nothing_to_compute(rng):
    q, k, v, cu_q, cu_k = packed(rng, [3, 2], [0, 0])
    sinks = np.array([0.5, -1.0, 2.0, np.inf], np.float32)
    o, lse = mfa_native.attention_varlen(q, k, v, cu_q, cu_k, sinks=sinks, return_lse=True)
    assert o.shape == (5, 4, 16) and not o.any() and np.array_equal(lse, np.broadcast_to(sinks[:, None], (4, 5)))
    dq, dk, dv, dsinks = mfa_native.attention_varlen_backward(q, k, v, o, lse, o, cu_q, cu_k, sinks=sinks)
    assert dq.shape == q.shape and dk.shape == k.shape and not dq.any() and not dsinks.any()
    q, k, v, cu_q, cu_k = packed(rng, [], [])
    assert mfa_native.attention_varlen(q, k, v, cu_q, cu_k).shape == (0, 4, 16)


BAD = [  # (cu_seqlens_q, cu_seqlens_k, error, what it says)
    ([0, 5, 3, 9], [0, 4, 8, 12], ValueError, "cu_seqlens_q must be non-decreasing"),
    ([1, 5, 7, 9], [0, 4, 8, 12], ValueError, "cu_seqlens_q must start at 0"),
    ([0, 5, 7, 9], [0, 4, 8, 11], ValueError, "cu_seqlens_k must end at the total row count 12"),
    ([0, 5, 9], [0, 4, 8, 12], ValueError, "cu_seqlens_q and cu_seqlens_k must have one entry"),
    (np.array([0, 5, 7, 9], np.int64), [0, 4, 8, 12], ValueError, "cu_seqlens_q must be int32"),
    ([[0, 5, 7, 9]], [0, 4, 8, 12], ValueError, r"cu_seqlens_q must have shape \(B \+ 1,\)"),
]


@pytest.mark.parametrize("cu_q, cu_k, error, message", BAD)
def test_bad_cu_seqlens_raise_before_any_kernel(rng, cu_q, cu_k, error, message):
    q, k, v, _, _ = packed(rng, [5, 2, 2], [4, 4, 4])
    cu_q, cu_k = (np.asarray(x, np.int32) if isinstance(x, list) else x for x in (cu_q, cu_k))
    with mfa_native.profile() as prof, pytest.raises(error, match=message):
        mfa_native.attention_varlen(q, k, v, cu_q, cu_k)
    assert not prof.records


def test_bad_shapes_and_hints(rng):
    q, k, v, cu_q, cu_k = packed(rng, [5, 2, 2], [4, 4, 4])
    with pytest.raises(ValueError, match="max_seqlen_q is 4, but sequence 0 has 5 rows"):
        mfa_native.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=4)
    with pytest.raises(ValueError, match="max_seqlen_k is 3"):
        mfa_native.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=5, max_seqlen_k=3)
    assert mfa_native.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=64, max_seqlen_k=4).shape == q.shape
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        mfa_native.attention_varlen(q[None], k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="v must have k's rows and heads"):
        mfa_native.attention_varlen(q, k, v[:-1], cu_q, cu_k)
    o, lse = mfa_native.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    with pytest.raises(ValueError, match=r"lse must have shape \(Hq, total_q\)"):
        mfa_native.attention_varlen_backward(q, k, v, o, lse.T, o, cu_q, cu_k)


def test_work_is_the_sum_of_per_sequence_work(rng):
    lengths = [256, 8, 1, 8, 0, 8]
    q, k, v, cu_q, cu_k = packed(rng, lengths, lengths, Hq=2, Hkv=2, D=8)
    with mfa_native.profile() as prof:
        mfa_native.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    (record,) = prof.records
    if record.simdgroup_matrix_ops is None:
        pytest.skip("this backend does not count simdgroup_matrix operations")
    per_sequence = sum(useful_matrix_ops(1, 2, n, n, 8, 8, causal=True) for n in lengths)
    assert record.simdgroup_matrix_ops == per_sequence
    assert record.simdgroup_matrix_ops < 0.2 * useful_matrix_ops(len(lengths), 2, 256, 256, 8, 8, causal=True)


def test_torch_flash_attn_varlen_func_and_autograd(rng):
    torch = pytest.importorskip("torch")
    from mfa_native.torch import flash_attn_varlen_func

    arrays = packed(rng, [7, 0, 19, 1], [7, 3, 25, 6], Hq=4, Hkv=1)
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in arrays[:3])
    cu_q, cu_k = (torch.from_numpy(x) for x in arrays[3:])
    out, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 25, softmax_scale=0.5, causal=True,
                                               window_size=(4, -1), deterministic=True, return_attn_probs=True)
    options = dict(scale=0.5, causal=True, window=(4, -1))
    expected_o, expected_lse = attention_varlen_reference(*arrays, return_lse=True, **options)
    assert s_dmask is None and lse.shape == (4, 27) and lse.dtype == torch.float32
    assert relative_l2(out.detach().numpy(), expected_o) < 1e-4
    do = rng.standard_normal(out.shape).astype(np.float32)
    out.backward(torch.from_numpy(do))
    expected = attention_varlen_backward_reference(*arrays[:3], do, *arrays[3:], **options)
    for x, want in zip((q, k, v), expected):
        assert relative_l2(x.grad.numpy(), want) < 4e-4
    plain = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 25)
    assert isinstance(plain, torch.Tensor) and plain.grad_fn is not None   # routed through the custom op
    for name, value in (("dropout_p", 0.1),):
        with pytest.raises(NotImplementedError, match=name):
            flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 25, **{name: value})


def test_mlx_gradients(rng):
    mx = pytest.importorskip("mlx.core")
    import mfa_native.mlx as mfa_mlx

    arrays = packed(rng, [5, 12], [9, 12], Hq=2, Hkv=1, D=8)
    q, k, v = (mx.array(x) for x in arrays[:3])
    cu_q, cu_k = (mx.array(x) for x in arrays[3:])
    do = rng.standard_normal((17, 2, 8)).astype(np.float32)

    def loss(q, k, v):
        return (mfa_mlx.attention_varlen(q, k, v, cu_q, cu_k, causal=True) * mx.array(do)).sum()

    grads = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    expected = attention_varlen_backward_reference(*arrays[:3], do, *arrays[3:], causal=True)
    for got, want in zip(grads, expected):
        assert relative_l2(np.array(got), want) < 4e-4


@pytest.mark.parametrize("R", [1, 4])
@pytest.mark.parametrize("heads", [(8, 2), (16, 2)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
def test_decode_batches_pack_heads_and_read_each_kv_row_once(rng, heads, R):
    """R queries per sequence (max_seqlen_q = R) at GQA ratio 4 or 8: a unit is a sequence's R
    queries with every head of a kv head as tile rows, so K/V bytes read stay within 1.05x of
    the attended K/V and the issued ops are the packed bound, summed per sequence."""
    from mfa_native.work import packed_matrix_ops

    Hq, Hkv = heads
    lengths_k = [200, 1, 77, 0, 129]
    lengths_q = [R, R, R, 0, R]
    q, k, v, cu_q, cu_k = packed(rng, lengths_q, lengths_k, Hq=Hq, Hkv=Hkv, D=32, dtype="float16")
    with mfa_native.profile() as prof:
        o = mfa_native.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=R)
    assert relative_l2(o, attention_varlen_reference(q, k, v, cu_q, cu_k)) < TOLERANCE["float16"]
    (record,) = prof.records
    if record.bytes_read is None:
        pytest.skip("this backend does not count bytes")
    assert prof.bytes_read["k"] + prof.bytes_read["v"] <= 1.05 * (k.nbytes + v.nbytes)
    bound = sum(packed_matrix_ops(1, Hkv, Hq // Hkv, n, m, 32, 32) for n, m in zip(lengths_q, lengths_k) if n)
    assert prof.simdgroup_matrix_ops == bound
    assert prof.simdgroup_matrix_ops < useful_matrix_ops(1, Hq, R, sum(lengths_k), 32, 32)   # per head: ratio x


def test_a_huge_broadcast_cu_seqlens_is_refused_before_it_is_read(rng):
    """2**31 entries of stride 0 (one element of memory): refused by its length, not copied (the
    fuzzer's case took 10 s and 8 GB to be refused by its contents)."""
    q, k, v = (rng.standard_normal((n, 2, 16)).astype(np.float32) for n in (5, 9, 9))
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.int32), (2**31,), (0,))
    with pytest.raises(ValueError, match=r"cu_seqlens_k has 2147483648 entries: at most 2\*\*24 sequences"):
        mfa_native.attention_varlen(q, k, v, np.array([0, 5], np.int32), huge)
