"""Split-KV over a KV cache: long caches with few (batch, kv head) threadgroups cut the cache's
logical positions across threadgroups (attention_partial) and merge them (attention_combine),
with paging, quantized caches, the append (one dispatch before every split), packed heads,
sinks, windows and lse, against the float64 reference per batch. The split is forced with a
device tuned as 64 parallel threadgroups at the smallest capacity that splits (512 keys: two
splits of 256)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from test_kvcache import QUANT_FORMATS, rows_at

import mfa_native
from mfa_native import codegen
from mfa_native.reference import attention_with_kvcache_reference
from mfa_native.runtime.devices import tuned_as

CAPACITY, HKV = 512, 2
SPLIT = ["append_k", "append_v", codegen.PARTIAL_KERNEL_NAME, codegen.COMBINE_KERNEL_NAME]


def cache_of(rng, lengths, page, d, dtype=np.float32):
    """k and v caches of CAPACITY positions per batch, NaN wherever no valid row is (paged:
    pages in random order among unused ones), and the block table (None: contiguous)."""
    B = len(lengths)
    if page is None:
        shape, table = (B, CAPACITY), None
    else:
        blocks = B * CAPACITY // page + 3
        shape, table = (blocks, page), rng.permutation(blocks)[:B * CAPACITY // page].reshape(B, -1).astype(np.int32)
    k_cache, v_cache = (np.full((*shape, HKV, d), np.nan, dtype) for _ in "kv")
    for b, n in enumerate(lengths):
        at = rows_at(k_cache, [0] * B, n, table, page)
        k_cache[at[0][b], at[1][b]] = rng.standard_normal((n, HKV, d))
        v_cache[at[0][b], at[1][b]] = rng.standard_normal((n, HKV, d))
    return k_cache, v_cache, table


def split_call(q, k_cache, v_cache, lengths, k, v, table, **options):
    """The call on a device tuned to split, and its kernels."""
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=64), mfa_native.profile() as prof:
        out, lse = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v,
                                                     block_table=table, return_lse=True, **options)
    return out, lse, [r.kernel for r in prof.records], prof


@pytest.mark.parametrize("page", [None, 8, 64], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("R, Hq", [(1, 8), (4, 8), (32, 8), (3, 2)], ids=["decode", "R4", "R32", "MHA"])
@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=True, window=(300, -1), sinks=True)],
                         ids=["causal", "window-sinks"])
def test_split_cache_matches_the_reference_and_appends_exactly(rng, page, R, Hq, options):
    lengths = np.array([CAPACITY - 5, 0, 200], np.int32)   # a split past batch 2's keys visits none
    B, D, appended = len(lengths), 16, 5
    k_cache, v_cache, table = cache_of(rng, lengths, page, D)
    q = rng.standard_normal((B, R, Hq, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, appended, HKV, D)).astype(np.float32) for _ in "kv")
    options = dict(options, sinks=rng.standard_normal(Hq).astype(np.float32) if options.get("sinks") else None)
    expected = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, k, v, table, return_lse=True, **options)
    before = k_cache.copy(), v_cache.copy()
    out, lse, kernels, _ = split_call(q, k_cache, v_cache, lengths, k, v, table, **options)
    assert kernels == SPLIT
    assert relative_l2(out, expected[0]) < 1e-4
    finite = np.isfinite(expected[1])
    assert np.array_equal(np.isfinite(lse), finite) and np.allclose(lse[finite], expected[1][finite], atol=1e-4)
    at = rows_at(k_cache, lengths, appended, table, page)
    for cache, new, old in zip((k_cache, v_cache), (k, v), before):
        assert cache[at].tobytes() == new.tobytes()
        written = np.zeros(cache.shape[:2], bool)
        written[at] = True
        assert cache[~written].tobytes() == old[~written].tobytes()


@pytest.mark.parametrize("page", [None, 64], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("fmt", QUANT_FORMATS[1:3], ids=lambda f: "-".join(map(str, f.values())))
def test_split_quantized_cache(rng, fmt, page):
    """The splits read the stored integers the append wrote (quantize's), nothing else changed."""
    lengths, d, appended, Hq = np.array([CAPACITY - 3, 100], np.int32), 64, 3, 8
    k_plain, v_plain, table = cache_of(rng, lengths, page, d)
    k_cache, v_cache = (mfa_native.quantize(np.nan_to_num(x), **fmt) for x in (k_plain, v_plain))
    q = rng.standard_normal((2, 1, Hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((2, appended, HKV, d)).astype(np.float32) for _ in "kv")
    out, lse, kernels, _ = split_call(q, k_cache, v_cache, lengths, k, v, table, causal=True)
    assert kernels == SPLIT
    for cache, new in ((k_cache, k), (v_cache, v)):
        for name, x in cache.arrays().items():
            assert x[rows_at(x, lengths, appended, table, page)].tobytes() == \
                mfa_native.quantize(new, **fmt).arrays()[name].tobytes(), name
    expected = attention_with_kvcache_reference(q, k_cache.dequantize(), v_cache.dequantize(), lengths + appended,
                                                block_table=table, causal=True, return_lse=True)
    assert relative_l2(out, expected[0]) < 1e-4 and np.allclose(lse, expected[1], atol=1e-4)


@pytest.mark.parametrize("page", [None, 16, 1], ids=lambda p: f"page{p}")
def test_split_packed_decode_reads_each_cached_row_once_per_kv_head(rng, page):
    lengths, D, Hq = np.array([CAPACITY, 300], np.int32), 32, 16     # 8 query heads per kv head
    k_cache, v_cache, table = cache_of(rng, lengths, page, D, np.float16)
    q = rng.standard_normal((2, 1, Hq, D)).astype(np.float16)
    out, _, kernels, prof = split_call(q, k_cache, v_cache, lengths, None, None, table)
    assert kernels == SPLIT[2:]
    attended = int(lengths.sum()) * HKV * D * 2
    assert prof.bytes_read["k"] <= 1.05 * attended and prof.bytes_read["v"] <= 1.05 * attended
    assert relative_l2(out, attention_with_kvcache_reference(q, k_cache, v_cache, lengths, block_table=table)) < 2e-3


def test_the_split_cuts_the_capacity_and_the_append_precedes_every_split():
    """A template of the paged problem decides per call from the block table's width (Wt *
    page_size keys), and the append kernels write k and v before the partial kernel reads them."""
    from dataclasses import replace

    from mfa_native.codegen import AttentionProblem, CacheKeys
    from mfa_native.runtime.templates import evaluate

    def problem(width):
        return replace(AttentionProblem(batch=1, q_heads=8, kv_heads=2, q_len=1, kv_len=4096, head_dim=16,
                                        value_dim=16, layout="bshd"), keys=CacheKeys(1, 64, width))

    template = codegen.attention_template(problem(8), parallel_threadgroups=64)
    split = evaluate(template, codegen.call_sizes(problem(8), 64))
    assert [k.entry for k in split.kernels] == SPLIT
    for name, writer in (("k", 0), ("v", 1)):
        assert split.buffer(name).writers == (writer,) and 2 in split.buffer(name).readers
    with pytest.raises(ValueError, match="SPLIT"):   # 4 pages of 64: 256 keys, too few to split
        evaluate(template, codegen.call_sizes(problem(4), 64))
