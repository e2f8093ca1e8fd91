"""attention_with_kvcache: contiguous and paged caches against the float64 reference per
batch; pages in random order beside garbage (NaN) pages; page sizes 1 to 256, FlashInfer's
HND and stacked K/V page layouts; the append
in place (exactly the new rows written, every other byte unchanged); checks before any write."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import relative_l2

import mfa_native
from mfa_native.quantized import QuantizedTensor
from mfa_native.reference import attention_with_kvcache_reference

B, R, HQ, HKV, D, DV = 3, 2, 4, 2, 16, 8


def caches(rng, shape_k, shape_v):
    """Caches full of NaN (garbage wherever no valid row is), to be filled where valid."""
    return np.full(shape_k, np.nan, np.float32), np.full(shape_v, np.nan, np.float32)


def fill(rng, k_cache, v_cache, positions):
    """Random values at the given (index tuples of) valid rows."""
    for at in positions:
        k_cache[at] = rng.standard_normal(k_cache[at].shape)
        v_cache[at] = rng.standard_normal(v_cache[at].shape)


def new_rows(rng, appended):
    return (rng.standard_normal((B, appended, HKV, D)).astype(np.float32),
            rng.standard_normal((B, appended, HKV, DV)).astype(np.float32))


def check_call(rng, q, k_cache, v_cache, seqlens, k=None, v=None, block_table=None, **options):
    """The call against the reference, and the caches after it: the new rows where they belong,
    every other byte as before."""
    expected = attention_with_kvcache_reference(q, k_cache, v_cache, seqlens, k, v, block_table, return_lse=True,
                                                **options)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    lengths = seqlens.copy()
    out, lse = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v,
                                                 block_table=block_table, return_lse=True, **options)
    assert out.shape == (B, R, HQ, v_cache.shape[-1]) and lse.shape == (B, HQ, R)
    assert relative_l2(out, expected[0]) < 1e-4
    assert np.allclose(lse, expected[1], atol=1e-4)
    assert np.array_equal(seqlens, lengths)
    written = np.zeros(k_cache.shape[:2], bool)
    for b in range(B):
        for i in range(0 if k is None else k.shape[1]):
            p = seqlens[b] + i
            at = (b, p) if block_table is None else (block_table[b, p // k_cache.shape[1]], p % k_cache.shape[1])
            assert np.array_equal(k_cache[at], k[b, i]) and np.array_equal(v_cache[at], v[b, i])
            written[at] = True
    for cache, before in ((k_cache, before_k), (v_cache, before_v)):
        assert cache[~written].tobytes() == before[~written].tobytes()


@pytest.mark.parametrize("appended", [0, 1, 5])
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(causal=True, window=(6, -1), sinks="yes")])
def test_contiguous_cache(rng, appended, options):
    options = dict(options)
    if options.pop("sinks", None):
        options["sinks"] = rng.standard_normal(HQ).astype(np.float32)
    k_cache, v_cache = caches(rng, (B, 48, HKV, D), (B, 48, HKV, DV))
    seqlens = np.array([0, 7, 48 - appended], np.int32)
    fill(rng, k_cache, v_cache, [(b, slice(0, n)) for b, n in enumerate(seqlens)])
    q = rng.standard_normal((B, R, HQ, D)).astype(np.float32)
    k, v = new_rows(rng, appended) if appended else (None, None)
    check_call(rng, q, k_cache, v_cache, seqlens, k, v, **options)


@pytest.mark.parametrize("page", [8, 16, 24, 64, 256])
def test_paged_cache_pages_in_random_order_among_garbage(rng, page):
    blocks, width, appended = 12, 3, 4
    k_cache, v_cache = caches(rng, (blocks, page, HKV, D), (blocks, page, HKV, DV))
    table = rng.permutation(blocks)[:B * width].reshape(B, width).astype(np.int32)
    seqlens = np.array([page - 2, 0, 2 * page + 3], np.int32)   # the first append crosses a page boundary
    rows = []
    for b, n in enumerate(seqlens):
        for p in range(n):
            rows.append((table[b, p // page], p % page))
    fill(rng, k_cache, v_cache, rows)
    table[1, 1:] = -7          # pages batch 1 never reads: out of range, not read
    q = rng.standard_normal((B, R, HQ, D)).astype(np.float32)
    k, v = new_rows(rng, appended)
    check_call(rng, q, k_cache, v_cache, seqlens, k, v, table, causal=True)


def paged_views(layout: str, blocks: int, page: int, heads: int, widths=(D, DV), dtype=np.float32):
    """k and v pages (blocks, page, heads, width) as views of one NaN-filled memory laid out as
    `layout`: "NHD" (flash-attn's, pages one after another), "HND" (FlashInfer's (num_pages,
    heads, page, width), transposed) or "stacked" (FlashInfer's single (num_pages, 2, page,
    heads, width) tensor, K and V on axis 1; widths equal)."""
    if layout == "NHD":
        return tuple(np.full((blocks, page, heads, w), np.nan, dtype) for w in widths)
    if layout == "HND":
        return tuple(np.full((blocks, heads, page, w), np.nan, dtype).transpose(0, 2, 1, 3) for w in widths)
    both = np.full((blocks, 2, page, heads, widths[0]), np.nan, dtype)
    return both[:, 0], both[:, 1]


@pytest.mark.parametrize("page, layout", [(1, "NHD"), (1, "HND"), (3, "stacked"), (5, "NHD"), (16, "HND"),
                                          (16, "stacked")])
def test_any_page_size_and_page_layout_read_and_appended_in_place(rng, page, layout):
    """Page sizes that are not a multiple of 8 (FlashInfer's and radix caches' 1), FlashInfer's
    HND pages and its stacked K/V tensor: read through their strides and appended in place,
    exactly the new rows written, every other byte (the other tensor's too) unchanged."""
    blocks, appended = 40, 3
    width = -(-(2 * page + 3 + appended) // page) + 1
    k_cache, v_cache = paged_views(layout, blocks, page, HKV, (D, D) if layout == "stacked" else (D, DV))
    table = rng.permutation(blocks)[:B * width].reshape(B, width).astype(np.int32)
    seqlens = np.array([max(page - 2, 0), 0, 2 * page + 3], np.int32)   # appends that cross page boundaries
    fill(rng, k_cache, v_cache, [(table[b, p // page], p % page) for b, n in enumerate(seqlens) for p in range(n)])
    q = rng.standard_normal((B, R, HQ, D)).astype(np.float32)
    k, v = rng.standard_normal((2, B, appended, HKV, D)).astype(np.float32)
    if layout != "stacked":
        v = v[..., :DV].copy()
    check_call(rng, q, k_cache, v_cache, seqlens, k, v, table, causal=True, window=(5, -1))


def test_paged_layouts_that_cannot_be_read_in_place_are_refused(rng):
    q = rng.standard_normal((B, 1, HQ, D)).astype(np.float32)
    lengths = np.array([3, 1, 2], np.int32)
    table = np.arange(6, dtype=np.int32).reshape(B, 2)
    memory = rng.standard_normal((6 * 4 * HKV * D + 8 * HKV * D,)).astype(np.float32)
    overlapping = np.lib.stride_tricks.as_strided(memory, (6, 8, HKV, D), (4 * HKV * D * 4, HKV * D * 4, D * 4, 4))
    k_cache, v_cache = paged_views("NHD", 6, 8, HKV)
    with pytest.raises(ValueError, match="k_cache's pages must be whole rows apart, without overlapping"):
        mfa_native.attention_with_kvcache(q, overlapping, v_cache, cache_seqlens=lengths, block_table=table)
    with pytest.raises(ValueError, match=r"k_cache's page_size \(axis 1 of \(num_blocks, page_size, Hkv, D\)\) must be at least 1"):
        mfa_native.attention_with_kvcache(q, k_cache[:, :0], v_cache[:, :0], cache_seqlens=lengths * 0,
                                          block_table=table)
    _, hnd_v = paged_views("HND", 6, 8, HKV)
    with pytest.raises(ValueError, match=r"v_cache's pages must be as many rows apart as k_cache's \(8\), got 16"):
        mfa_native.attention_with_kvcache(q, k_cache, hnd_v, cache_seqlens=lengths, block_table=table)


def test_stacked_halves_with_an_append_are_refused_on_metal_only(rng):
    """Metal stages host memory per binding and copies each staged range back whole, so the
    halves of one stacked tensor would overwrite each other's new rows there: refused on Metal
    (checked here through the check itself), taken by the cpu backend (the test above)."""
    from mfa_native.ops.kvcache import Cache

    k_cache, v_cache = paged_views("stacked", 6, 4, HKV, (D, D))
    q, new = rng.standard_normal((B, 1, HQ, D)).astype(np.float32), rng.standard_normal((B, 1, HKV, D)).astype(np.float32)
    cache = Cache({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": new, "v": new,
                   "cache_seqlens": np.zeros(B, np.int32), "block_table": np.zeros((B, 2), np.int32)})
    with pytest.raises(ValueError, match="v_cache shares memory with k_cache"):
        cache.apart_where_staged(k_cache, v_cache, "metal")
    cache.apart_where_staged(k_cache, v_cache, "cpu")
    separate = paged_views("NHD", 6, 4, HKV, (D, D))
    cache.apart_where_staged(*separate, "metal")


def test_a_quantized_cache_in_hnd_pages_of_odd_size(rng):
    """A q5_1 / q4_1 cache whose every field is laid out in HND pages of 3 rows: read in place
    and appended with quantize's bytes."""
    blocks, page, appended, d = 30, 3, 2, 32   # GGUF blocks hold 32 values
    fields = {}
    for name, fmt in (("k", "q5_1"), ("v", "q4_1")):
        stored = mfa_native.quantize(rng.standard_normal((blocks, HKV, page, d)).astype(np.float32), fmt)
        fields[name] = QuantizedTensor(stored.field("data").transpose(0, 2, 1, 3), format=fmt)
    width = 5
    table = rng.permutation(blocks)[:B * width].reshape(B, width).astype(np.int32)
    seqlens = np.array([4, 0, 7], np.int32)
    q = rng.standard_normal((B, 1, HQ, d)).astype(np.float32)
    k, v = rng.standard_normal((2, B, appended, HKV, d)).astype(np.float32)
    out = mfa_native.attention_with_kvcache(q, fields["k"], fields["v"], cache_seqlens=seqlens, k=k, v=v,
                                            block_table=table, causal=True)
    for name, new in (("k", k), ("v", v)):
        written = mfa_native.quantize(new, fields[name].format).field("data")
        for b in range(B):
            for i in range(appended):
                p = seqlens[b] + i
                assert np.array_equal(fields[name].field("data")[table[b, p // page], p % page], written[b, i])
    expected = attention_with_kvcache_reference(q, fields["k"].dequantize(), fields["v"].dequantize(), seqlens + appended,
                                                block_table=table, causal=True)
    assert relative_l2(out, expected) < 1e-4


def test_warm_calls_append_and_read_the_new_lengths(rng):
    k_cache, v_cache = caches(rng, (12, 8, HKV, D), (12, 8, HKV, DV))
    table = np.ascontiguousarray(np.arange(12, dtype=np.int32).reshape(B, 4)[:, ::-1])
    seqlens = np.array([6, 0, 9], np.int32)
    fill(rng, k_cache, v_cache, [(table[b, p // 8], p % 8) for b, n in enumerate(seqlens) for p in range(n)])
    q = rng.standard_normal((B, 1, HQ, D)).astype(np.float32)
    for step in range(3):   # decode steps: each a warm call of one signature, appending one row
        k, v = new_rows(rng, 1)
        out = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v,
                                                block_table=table, causal=True)
        seqlens += 1
        expected = attention_with_kvcache_reference(q, k_cache, v_cache, seqlens, block_table=table, causal=True)
        assert relative_l2(out, expected) < 1e-4


def test_bad_input_raises_before_any_write(rng):
    k_cache, v_cache = (rng.standard_normal((B, 10, HKV, d)).astype(np.float32) for d in (D, DV))
    q = rng.standard_normal((B, R, HQ, D)).astype(np.float32)
    k, v = new_rows(rng, 3)
    before = k_cache.copy()
    with pytest.raises(ValueError, match=r"batch 2 attends cache_seqlens \+ Rn = 11 keys, beyond the cache's capacity Cmax = 10"):
        mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array([0, 1, 8], np.int32), k=k, v=v)
    with pytest.raises(ValueError, match="cache_seqlens must be int32"):
        mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array([0, 1, 2]), k=k, v=v)
    pages_k, pages_v = (rng.standard_normal((4, 8, HKV, d)).astype(np.float32) for d in (D, DV))
    table = np.array([[0, 1], [2, 9], [3, 3]], np.int32)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 9 is not a page of k_cache"):
        mfa_native.attention_with_kvcache(q, pages_k, pages_v, cache_seqlens=np.array([0, 6, 0], np.int32), k=k, v=v,
                                          block_table=table)
    assert np.array_equal(k_cache, before)
    with pytest.raises(ValueError, match="k and v are appended together"):
        mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.zeros(B, np.int32), k=k)


def test_torch_flash_attn_with_kvcache_in_place_and_no_gradient(rng):
    torch = pytest.importorskip("torch")
    from mfa_native.torch import flash_attn_with_kvcache

    k_cache, v_cache = (torch.from_numpy(rng.standard_normal((B, 16, HKV, d)).astype(np.float32)) for d in (D, DV))
    q = torch.from_numpy(rng.standard_normal((B, R, HQ, D)).astype(np.float32))
    k, v = (torch.from_numpy(x) for x in new_rows(rng, 2))
    seqlens = torch.tensor([3, 0, 14], dtype=torch.int32)
    expected = attention_with_kvcache_reference(q.numpy(), k_cache.numpy(), v_cache.numpy(), seqlens.numpy(),
                                                k.numpy(), v.numpy(), causal=True, return_lse=True)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True,
                                       return_softmax_lse=True)
    assert isinstance(out, torch.Tensor) and relative_l2(out.numpy(), expected[0]) < 1e-4
    assert torch.equal(k_cache[2, 14:16], k[2]) and seqlens.tolist() == [3, 0, 14]
    q.requires_grad_()
    out = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    with pytest.raises(NotImplementedError, match="inference only"):
        out.sum().backward()


def test_the_append_is_device_kernels_first_in_the_pass_on_inout_caches():
    """The pass writes the caller's caches in place: k and v are "inout" (bound writable, never
    allocated), written by the append kernels, which run before the attention kernel reads them."""
    from dataclasses import replace

    from mfa_native import codegen
    from mfa_native.codegen import AttentionProblem, CacheKeys

    p = replace(AttentionProblem(batch=B, q_heads=HQ, kv_heads=HKV, q_len=R, kv_len=64, head_dim=D, value_dim=DV,
                                 dtype="float32", layout="bshd"), keys=CacheKeys(3, 16, 4))
    description = codegen.attention_pass(p)
    assert [k.entry for k in description.kernels][:2] == ["append_k", "append_v"]
    attention = len(description.kernels) - 1
    for name, writer in (("k", 0), ("v", 1)):
        buffer = description.buffer(name)
        assert buffer.role == "inout" and buffer.writers == (writer,) and attention in buffer.readers
        assert description.buffer(f"{name}_new").role == "input"
    assert all(b.role != "output" or b.name in ("o", "lse") for b in description.buffers)


def test_a_read_only_cache_raises_before_any_write(rng):
    k_cache, v_cache = (rng.standard_normal((B, 10, HKV, d)).astype(np.float32) for d in (D, DV))
    q = rng.standard_normal((B, R, HQ, D)).astype(np.float32)
    k, v = new_rows(rng, 2)
    before = v_cache.copy()
    k_cache.flags.writeable = False
    with pytest.raises(TypeError, match="k_cache is read-only here"):
        mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.zeros(B, np.int32), k=k, v=v)
    assert np.array_equal(v_cache, before)
    out = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.full(B, 4, np.int32))
    assert out.shape == (B, R, HQ, DV)    # no append: a read-only cache is read


QUANT_FORMATS = [dict(format="affine", bits=4, group_size=32), dict(format="affine", bits=8, group_size=64),
                 dict(format="q8_0"), dict(format="q4_0"), dict(format="q4_1"), dict(format="q5_0"), dict(format="q5_1")]


def rows_at(x: np.ndarray, lengths, appended: int, table, page: int | None):
    """The index arrays of the rows appended to cache field x: (B, Rn) each."""
    positions = np.asarray(lengths, np.int64)[:, None] + np.arange(appended)[None, :]
    if table is None:
        return np.arange(len(lengths))[:, None], positions
    return np.take_along_axis(table, positions // page, axis=1), positions % page


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("fmt", QUANT_FORMATS, ids=lambda f: "-".join(map(str, f.values())))
def test_quantized_cache_appended_on_the_device_as_quantize_does(rng, fmt, paged):
    """A QuantizedTensor cache: the new rows quantized in the pass into the tensor's own arrays,
    byte for byte `quantize(k_new)`'s, nothing else changed; the output is attention over the
    dequantized cache (float64 reference)."""
    d = 64
    page = 16 if paged else None
    shape = (10, page, HKV, d) if paged else (B, 40, HKV, d)
    table = rng.permutation(10)[:B * 3].reshape(B, 3).astype(np.int32) if paged else None
    k_cache, v_cache = (mfa_native.quantize(rng.standard_normal(shape).astype(np.float32), **fmt) for _ in "kv")
    seqlens = np.array([0, page - 2 if paged else 9, 30], np.int32)   # paged: batch 1's append crosses a page
    appended = 3
    q = rng.standard_normal((B, R, HQ, d)).astype(np.float32)
    k, v = (rng.standard_normal((B, appended, HKV, d)).astype(np.float32) for _ in "kv")
    before = [{name: x.copy() for name, x in t.arrays().items()} for t in (k_cache, v_cache)]
    out, lse = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v,
                                                 block_table=table, causal=True, return_lse=True)
    for cache, new, old in zip((k_cache, v_cache), (k, v), before):
        expected = mfa_native.quantize(new, **fmt).arrays()
        for name, x in cache.arrays().items():
            at = rows_at(x, seqlens, appended, table, page)
            assert x[at].tobytes() == expected[name].tobytes(), name
            written = np.zeros(x.shape[:2], bool)
            written[at] = True
            assert x[~written].tobytes() == old[name][~written].tobytes(), name
    assert np.array_equal(seqlens, [0, page - 2 if paged else 9, 30])
    reference = attention_with_kvcache_reference(q, k_cache.dequantize(), v_cache.dequantize(), seqlens + appended,
                                                 block_table=table, causal=True, return_lse=True)
    assert relative_l2(out, reference[0]) < 1e-4
    assert np.allclose(lse, reference[1], atol=1e-4)


@pytest.mark.parametrize("page, layout", [(None, None), (16, "NHD"), (1, "HND"), (4, "stacked")])
@pytest.mark.parametrize("stored", [np.float16, ml_dtypes.float8_e4m3fn], ids=["float16", "float8"])
def test_gqa_decode_reads_each_cached_row_once_per_kv_head(rng, page, layout, stored):
    """Heads packed as tile rows: a decode step reads every attended K/V row once (per kv head),
    not once per query head, contiguous or paged, whatever the page size and layout; a float8
    cache reads its stored bytes, one a value."""
    lengths = np.array([40, 3, 64], np.int32)
    if page is None:
        k_cache, v_cache = (np.full((B, 64, 2, D), np.nan, stored) for _ in range(2))
    else:
        k_cache, v_cache = paged_views(layout, B * 64 // page, page, 2, (D, D), stored)
    table = None if page is None else rng.permutation(B * 64 // page).reshape(B, 64 // page).astype(np.int32)
    for b, n in enumerate(lengths):
        for p in range(n):
            at = (b, p) if page is None else (table[b, p // page], p % page)
            k_cache[at], v_cache[at] = (rng.standard_normal((2, D)).astype(stored) for _ in range(2))
    q = rng.standard_normal((B, 1, 16, D)).astype(np.float16)      # 8 query heads per kv head
    with mfa_native.profile() as prof:
        out = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)
    attended = int(lengths.sum()) * 2 * D * np.dtype(stored).itemsize   # rows x kv heads x D x bytes, per cache
    assert prof.bytes_read["k"] <= 1.05 * attended and prof.bytes_read["v"] <= 1.05 * attended
    expected = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, block_table=table)
    assert relative_l2(out, expected) < 2e-3


def test_without_cache_seqlens_every_sequence_is_the_whole_cache(rng):
    """flash-attn's rule: no cache_seqlens attends the cache's capacity, Cmax or (paged)
    block_table's width times page_size, in numpy, the torch drop-in and MLX, cold and warm;
    with an append it is a ValueError naming cache_seqlens, before anything is written."""
    q = rng.standard_normal((B, R, HQ, D)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((B, 24, HKV, d)).astype(np.float32) for d in (D, DV))
    full = np.full(B, 24, np.int32)
    expected = attention_with_kvcache_reference(q, k_cache, v_cache, full, causal=True)
    for _ in range(2):   # the second call is warm
        out = mfa_native.attention_with_kvcache(q, k_cache, v_cache, causal=True)
        assert relative_l2(out, expected) < 1e-4
    pages_k, pages_v = (rng.standard_normal((7, 8, HKV, d)).astype(np.float32) for d in (D, DV))
    table = np.array([[6, 0, 3], [2, 2, 5], [1, 4, 0]], np.int32)
    out = mfa_native.attention_with_kvcache(q, pages_k, pages_v, block_table=table)
    paged = attention_with_kvcache_reference(q, pages_k, pages_v, np.full(B, 24, np.int32), block_table=table)
    assert relative_l2(out, paged) < 1e-4
    k, v = new_rows(rng, 1)
    before = k_cache.copy()
    with pytest.raises(ValueError, match="cache_seqlens is required with k and v"):
        mfa_native.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v)
    assert np.array_equal(k_cache, before)
    torch = pytest.importorskip("torch")
    from mfa_native.torch import flash_attn_with_kvcache
    out = flash_attn_with_kvcache(torch.from_numpy(q), torch.from_numpy(k_cache), torch.from_numpy(v_cache),
                                  causal=True)
    assert relative_l2(out.numpy(), expected) < 1e-4
    mx = pytest.importorskip("mlx.core")
    import mfa_native.mlx as mfa_mlx
    out = mfa_mlx.attention_with_kvcache(mx.array(q), mx.array(k_cache), mx.array(v_cache), causal=True)
    assert relative_l2(np.array(out), expected) < 1e-4
    with pytest.raises(ValueError, match="cache_seqlens is required"):
        mfa_mlx.attention_with_kvcache(mx.array(q), mx.array(k_cache), mx.array(v_cache), k=mx.array(k), v=mx.array(v))
