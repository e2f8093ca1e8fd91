"""attention_varlen over paged K/V (flash-attn's flash_attn_varlen_func(block_table=), chunked
prefill on a paged cache) and with seqused_k (flash-attn 3's): each sequence's keys written into
shuffled pages among NaN garbage, against the float64 reference over the same keys packed
contiguously; any page size and layout, GQA, causal and window, empty sequences, decode; the
checks of contents on every call; no gradient, anywhere it could be asked."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from test_varlen import DTYPES, TOLERANCE, cu_of

import mfa_native
from mfa_native.reference import allowed_keys, attention_varlen_reference

def empty_pages(layout: str, blocks: int, page: int, heads: int, width: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """k and v pages (blocks, page, heads, width) as views of NaN-filled memory laid out as
    `layout`: "NHD" (flash-attn's), "HND" (FlashInfer's (num_pages, heads, page, width),
    transposed) or "stacked" (FlashInfer's (num_pages, 2, page, heads, width))."""
    if layout == "NHD":
        return tuple(np.full((blocks, page, heads, width), np.nan, dtype) for _ in "kv")
    if layout == "HND":
        return tuple(np.full((blocks, heads, page, width), np.nan, dtype).transpose(0, 2, 1, 3) for _ in "kv")
    both = np.full((blocks, 2, page, heads, width), np.nan, dtype)
    return both[:, 0], both[:, 1]


def paged(rng, lengths_q, lengths_k, *, page, layout="NHD", Hq=4, Hkv=2, D=16, dtype="float32", spare=3):
    """Packed q, k, v and cu_seqlens, and the same k and v written into shuffled pages among
    NaN pages (`spare` more than needed): (q, k, v, cu_q, cu_k, k_pages, v_pages, block_table).
    Table entries past a sequence's pages are -1 (never read)."""
    t = DTYPES[dtype]
    cu_q, cu_k = cu_of(lengths_q), cu_of(lengths_k)
    q = rng.standard_normal((cu_q[-1], Hq, D)).astype(t)
    k, v = (rng.standard_normal((cu_k[-1], Hkv, D)).astype(t) for _ in "kv")
    needed = [-(-n // page) for n in lengths_k]
    width = max(needed + [1])
    blocks = sum(needed) + spare
    k_pages, v_pages = empty_pages(layout, blocks, page, Hkv, D, t)
    order = rng.permutation(blocks)
    table = np.full((len(lengths_k), width), -1, np.int32)
    for s, n in enumerate(lengths_k):
        table[s, :needed[s]] = order[sum(needed[:s]):sum(needed[:s + 1])]
        for p in range(n):
            k_pages[table[s, p // page], p % page] = k[cu_k[s] + p]
            v_pages[table[s, p // page], p % page] = v[cu_k[s] + p]
    return q, k, v, cu_q, cu_k, k_pages, v_pages, table


def check_paged(q, k, v, cu_q, cu_k, k_pages, v_pages, table, tolerance, max_seqlen_q=None, **options):
    """The paged call's output and lse against the reference over the packed keys."""
    o, lse = mfa_native.attention_varlen(q, k_pages, v_pages, cu_q, cu_k, block_table=table, return_lse=True,
                                         max_seqlen_q=max_seqlen_q, **options)
    expected_o, expected_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, return_lse=True, **options)
    assert o.shape == expected_o.shape and o.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    assert relative_l2(o, expected_o) < tolerance
    finite = np.isfinite(expected_lse)
    assert np.array_equal(np.isfinite(lse), finite) and np.allclose(lse[finite], expected_lse[finite], atol=1e-3)


CASES = [  # (page, layout, dtype, lengths of q, lengths of k, options)
    (1, "NHD", "float32", [3, 0, 9, 1], [7, 4, 9, 12], dict(causal=True)),
    (3, "stacked", "float16", [5, 11, 2], [20, 11, 2], dict(window=(4, 1))),
    (16, "HND", "bfloat16", [9, 1, 0, 24], [40, 17, 5, 24], dict(causal=True, window=(8, -1))),
    (5, "NHD", "float32", [0, 6, 4], [0, 0, 13], dict()),                  # empty sequences, keyless rows
    (16, "NHD", "float32", [70, 8], [90, 8], dict(causal=True)),           # R per sequence above 64
]


@pytest.mark.parametrize("page, layout, dtype, lengths_q, lengths_k, options", CASES)
def test_paged_keys_against_the_packed_reference(rng, page, layout, dtype, lengths_q, lengths_k, options):
    """Chunked prefill: each sequence's queries are its last (causal lines them up with its
    last key), its keys in pages of any size and layout, shuffled, among NaN pages."""
    arrays = paged(rng, lengths_q, lengths_k, page=page, layout=layout, dtype=dtype)
    check_paged(*arrays, TOLERANCE[dtype], **options)


def test_gqa_sinks_and_the_decode_of_packed_heads(rng):
    """One query per sequence with max_seqlen_q=1 packs the heads of a kv head (each page row
    read once per kv head); sinks and a scale per sequence as in attention."""
    arrays = paged(rng, [1, 1, 1], [33, 0, 7], page=16, layout="HND", Hq=8, Hkv=2, D=32)
    sinks = rng.standard_normal(8).astype(np.float32)
    check_paged(*arrays, 1e-4, max_seqlen_q=1, causal=True, sinks=sinks, scale=0.3)


def test_seqused_k_and_the_lengths_flash_attn_3_takes(rng):
    """seqused_k decides the lengths over cu_seqlens_k (paged: cu_seqlens_k may be None, as
    flash-attn 3 takes a page table; neither: every listed page); packed, each sequence uses
    its first seqused_k rows."""
    q, k, v, cu_q, cu_k, k_pages, v_pages, table = paged(rng, [4, 2, 6], [10, 3, 16], page=4)
    used = np.array([7, 0, 16], np.int32)
    expected = attention_varlen_reference(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used,
                                          causal=True)
    for cu in (cu_k, None):
        o = mfa_native.attention_varlen(q, k_pages, v_pages, cu_q, cu, block_table=table, seqused_k=used, causal=True)
        assert relative_l2(o, expected) < 1e-4
    assert relative_l2(expected, attention_varlen_reference(q, k, v, cu_q, cu_k, seqused_k=used, causal=True)) < 1e-12
    full = rng.permutation(12)[:9].reshape(3, 3).astype(np.int32)   # every listed page read
    pages = [rng.standard_normal((12, 4, 2, 16)).astype(np.float32) for _ in "kv"]
    o = mfa_native.attention_varlen(q, *pages, cu_q, None, block_table=full, causal=True)
    assert relative_l2(o, attention_varlen_reference(q, *pages, cu_q, None, block_table=full, causal=True)) < 1e-4
    o = mfa_native.attention_varlen(q, k, v, cu_q, cu_k, seqused_k=used, window=(2, 2))
    assert relative_l2(o, attention_varlen_reference(q, k, v, cu_q, cu_k, seqused_k=used, window=(2, 2))) < 1e-4


def test_warm_calls_check_the_contents_every_time(rng):
    """The table and lengths are contents, not the signature: a warm call reads new ones,
    and one naming a page outside k for a key it reads raises before anything runs."""
    first = paged(rng, [3, 5], [9, 14], page=4)
    check_paged(*first, 1e-4, causal=True)
    again = paged(rng, [3, 5], [9, 14], page=4)   # the same signature: other pages, another table
    check_paged(*again, 1e-4, causal=True)
    bad = again[-1].copy()
    bad[1, 3] = again[5].shape[0]
    with pytest.raises(ValueError, match=r"block_table\[1, 3\]"):
        mfa_native.attention_varlen(*again[0:1], *again[5:7], *again[3:5], block_table=bad, causal=True)


def bad_calls(q, k_pages, v_pages, cu_q, cu_k, table):
    """(argument named, call) for each kind of bad paged input."""
    blocks = k_pages.shape[0]
    past = table.copy()
    past[0, 0] = blocks

    def call(**changed):
        arguments = dict(q=q, k=k_pages, v=v_pages, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, block_table=table)
        arguments.update(changed)
        return lambda: mfa_native.attention_varlen(**arguments)
    return [
        ("block_table", call(block_table=past)),
        ("block_table", call(block_table=np.full_like(table, -1))),
        ("block_table", call(block_table=table.astype(np.int64))),
        ("block_table", call(block_table=table[:1])),
        ("seqused_k", call(seqused_k=np.array([1, table.shape[1] * k_pages.shape[1] + 1], np.int32))),
        ("seqused_k", call(seqused_k=np.array([1, 2], np.int64))),
        ("seqused_k", call(seqused_k=np.array([-1, 2], np.int32))),
        ("cu_seqlens_k", call(cu_seqlens_k=np.array([0, 1, table.shape[1] * k_pages.shape[1] + 2], np.int32))),
        ("cu_seqlens_k", call(cu_seqlens_k=np.array([0, 5, 3], np.int32))),
        ("k", call(k=k_pages[:, 0])),
        ("v", call(v=v_pages[:, :, :1])),
        ("cu_seqlens_k", call(block_table=None, k=k_pages[:, 0], v=v_pages[:, 0], cu_seqlens_k=None)),
    ]


def test_bad_input_names_the_argument(rng):
    q, k, v, cu_q, cu_k, k_pages, v_pages, table = paged(rng, [2, 3], [5, 6], page=4)
    for name, call in bad_calls(q, k_pages, v_pages, cu_q, cu_k, table):
        with pytest.raises(ValueError, match=name):
            call()
    with pytest.raises(ValueError, match="seqused_k"):   # packed: beyond the sequence's own rows
        mfa_native.attention_varlen(q, k, v, cu_q, cu_k, seqused_k=np.array([6, 1], np.int32))


def test_no_gradient_of_a_paged_call(rng):
    """flash-attn's paged varlen is forward only: attention_varlen_backward, torch autograd
    and MLX's vjp raise NotImplementedError naming the argument, never a zero gradient."""
    q, k, v, cu_q, cu_k, k_pages, v_pages, table = paged(rng, [2, 3], [5, 6], page=4)
    o, lse = mfa_native.attention_varlen(q, k_pages, v_pages, cu_q, cu_k, block_table=table, return_lse=True)
    for name, value in (("block_table", table), ("seqused_k", np.array([5, 6], np.int32))):
        with pytest.raises(NotImplementedError, match=name):
            mfa_native.attention_varlen_backward(q, k_pages, v_pages, o, lse, o, cu_q, cu_k, **{name: value})
    torch = pytest.importorskip("torch")
    from mfa_native.torch import flash_attn_varlen_func
    tq = torch.from_numpy(q).requires_grad_()
    out = flash_attn_varlen_func(tq, *(torch.from_numpy(x) for x in (k_pages, v_pages, cu_q, cu_k)), 3, 6,
                                 block_table=torch.from_numpy(table))
    with pytest.raises(NotImplementedError, match="block_table"):
        out.sum().backward()


def low_precision_attention(torch, q, k, v, cu_q, cu_k, causal, window, alibi_slopes=None):
    """flash-attn's `attention_ref(..., upcast=False)` per sequence: products and softmax in the
    inputs' dtype (torch tensors), the baseline of its tolerance; with `alibi_slopes` ((sequences,
    H) float32) its ALiBi bias, computed in float32 as flash-attn's is."""
    out = torch.zeros_like(q)
    for s in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        qs, ks, vs = (x.transpose(0, 1) for x in (q[rows], k[keys], v[keys]))   # (H, S, D)
        ks, vs = (x.repeat_interleave(q.shape[1] // k.shape[1], 0) for x in (ks, vs))
        scores = (qs / qs.shape[-1] ** 0.5) @ ks.transpose(1, 2)
        if alibi_slopes is not None:
            R, C = scores.shape[1:]
            distance = (torch.arange(R)[:, None] + C - R - torch.arange(C)).abs()
            scores = (scores.float() - alibi_slopes[s][:, None, None] * distance).to(q.dtype)
        allowed = torch.from_numpy(allowed_keys(qs.shape[1], ks.shape[1], causal, window))
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        out[rows] = (weights @ vs).transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_flash_attn_varlen_func_with_block_table(rng, dtype):
    """flash-attn's test_flash_attn_varlen_causal with paged_kv_block_size, adapted: random
    lengths (queries at most the keys: chunked prefill), a shuffled block table, causal and a
    window, ALiBi (flash-attn's rand * 0.3 slopes), GQA; flash-attn's own tolerance (max error at most twice a low-precision PyTorch
    computation's, plus 1e-5) and relative L2 against float64."""
    torch = pytest.importorskip("torch")
    from mfa_native.torch import flash_attn_varlen_func

    lengths_k = rng.integers(1, 40, 4)
    lengths_q = np.minimum(rng.integers(1, 40, 4), lengths_k)
    q, k, v, cu_q, cu_k, k_pages, v_pages, table = paged(rng, lengths_q, lengths_k, page=16, Hq=6, Hkv=3,
                                                         dtype=dtype)
    t = {name: torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(x)
         for name, x in dict(q=q, k=k, v=v, k_pages=k_pages, v_pages=v_pages).items()}
    for window, slopes in (((-1, -1), None), ((7, 3), None), ((-1, -1), torch.rand(4, 6) * 0.3)):
        out = flash_attn_varlen_func(t["q"], t["k_pages"], t["v_pages"], torch.from_numpy(cu_q), torch.from_numpy(cu_k),
                                     int(lengths_q.max()), int(lengths_k.max()), causal=True, window_size=window,
                                     alibi_slopes=slopes, block_table=torch.from_numpy(table)).float().numpy()
        options = dict(causal=True, window=None if window == (-1, -1) else window)
        expected = attention_varlen_reference(q, k, v, cu_q, cu_k, **options,
                                              alibi_slopes=None if slopes is None else slopes.numpy())
        baseline = low_precision_attention(torch, t["q"], t["k"], t["v"], cu_q, cu_k, **options,
                                           alibi_slopes=slopes).float().numpy()
        assert np.abs(out - expected).max() <= 2 * np.abs(baseline - expected).max() + 1e-5
        assert relative_l2(out, expected) < TOLERANCE[dtype]


def test_mlx_paged_call_and_no_gradient(rng):
    mx = pytest.importorskip("mlx.core")
    import mfa_native.mlx as mfa_mlx

    q, k, v, cu_q, cu_k, k_pages, v_pages, table = paged(rng, [2, 3], [5, 6], page=4)
    arrays = [mx.array(x) for x in (q, k_pages, v_pages, cu_q, cu_k)]
    o = mfa_mlx.attention_varlen(*arrays, block_table=mx.array(table), causal=True)
    assert relative_l2(np.array(o), attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True)) < 1e-4
    with pytest.raises(NotImplementedError, match="block_table"):
        mx.grad(lambda x: mfa_mlx.attention_varlen(x, *arrays[1:], block_table=mx.array(table)).sum())(arrays[0])
