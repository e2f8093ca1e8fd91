"""FlashInfer's logits_soft_cap cases through mfa_native's ops (issue "Score transforms"):
flashinfer-ai/flashinfer's tests/test_logits_cap.py (single_decode_with_kv_cache,
single_prefill_with_kv_cache) and the logits_soft_cap grids of tests/test_batch_decode_kernels.py
(BatchDecodeWithPagedKVCacheWrapper, one stacked K/V tensor or a tuple; split over threadgroups
too) and test_batch_prefill_kernels.py (BatchPrefillWithRaggedKVCacheWrapper, causal beside its
custom mask).

FlashInfer's conventions: the scale 1/sqrt(D) comes before the cap c * tanh(s / c), and a cap of 0.0
is no cap (`softcap=None`); causal lines the last query up with the last key (qo_len <= kv_len);
tensors are NHD (seq, heads, dim), unbatched for the single_* calls (`attention`'s "bshd" with a
batch of 1); paged caches are kv_indptr, kv_indices and kv_last_page_len over NHD or HND pages,
contiguous or strided, float16 or float8; GQA as theirs (4 kv heads, 4 or 32 query heads). Each case
is held to FlashInfer's tolerance (torch.testing.assert_close's rtol = atol) and to a relative L2
error against a float64 reference written from FlashInfer's attention_logits_soft_cap_torch. Their
randn inputs give scaled scores of about 1, where a cap of 30 or 50 moves a 729-key decode's output
by about 3e-3 or 1e-3 (their tolerance: 1e-3), so here q and k are scaled by sqrt(cap): the scores
reach the cap and a wrong cap fails (test_a_wrong_cap_fails).

The default run takes every value of every parameter at least once. The exhaustive ones run cross
products: the single grids without the sizes that take seconds on the cpu backend (33001 and 31111
keys, 987 queries, 32 heads in prefill), the batch decode grid's storage parameters at one size, the
ragged prefill grid at head_dim 128 (with lse). Outputs are poisoned (conftest). Not here:
pos_encoding_mode "ROPE_LLAMA" (FlashInfer turns the cached keys at their positions inside its
kernels; the KV-cache call turns only appended rows) and "ALIBI" (with a cap FlashInfer adds the
bias to s / c inside the tanh; mfa_native's ALiBi, flash-attn's, comes after the cap)."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from conftest import relative_l2

import mfa_native
from mfa_native import codegen
from mfa_native.runtime.devices import tuned_as

SOFT_CAPS = [1.0, 30.0, 50.0]   # test_logits_cap.py's; the batch tests' are 0.0 and 30.0
KV_DTYPES = {"float16": np.float16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
NUM_KV_HEADS = 4   # the batch tests' kv heads
L2 = 2e-3          # relative L2 error of a float16 output against float64


def softcap_of(logits_soft_cap: float) -> float | None:
    """FlashInfer's logits_soft_cap as the ops' softcap: its 0.0 is no cap."""
    return logits_soft_cap if logits_soft_cap > 0 else None


def flashinfer_reference(q, k, v, logits_soft_cap: float, causal: bool = False):
    """FlashInfer's attention in float64 for NHD q (qo_len, Hq, D), k and v (kv_len, Hkv, D): the
    scores scaled by 1/sqrt(D), then capped; query head h reads kv head h // (Hq // Hkv); causal
    keeps key j for query i when j <= i + kv_len - qo_len. The output (qo_len, Hq, D) and the
    natural-log lse (Hq, qo_len)."""
    q, k, v = (np.ascontiguousarray(np.asarray(x, np.float64).transpose(1, 0, 2)) for x in (q, k, v))   # (H, seq, D)
    k, v = (np.repeat(x, q.shape[0] // x.shape[0], axis=0) for x in (k, v))
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    if logits_soft_cap > 0:
        s = logits_soft_cap * np.tanh(s / logits_soft_cap)
    if causal:
        qo_len, kv_len = q.shape[1], k.shape[1]
        s = np.where(np.arange(kv_len) <= np.arange(qo_len)[:, None] + kv_len - qo_len, s, -np.inf)
    lse = np.logaddexp.reduce(s, axis=-1)
    return (np.exp(s - lse[..., None]) @ v).transpose(1, 0, 2), lse


def assert_close(got, want, tolerance: float) -> None:
    """FlashInfer's check (assert_close with rtol = atol = tolerance) and a relative L2 error
    under L2, against the float64 reference `want`."""
    got = np.asarray(got, np.float64)
    assert np.all(np.abs(got - want) <= tolerance * (1 + np.abs(want)))
    assert relative_l2(got, want) < L2


def spread_of(logits_soft_cap: float) -> float:
    """The scale of q and k that gives their scaled scores q . k / sqrt(D) a standard deviation
    of the cap (1: FlashInfer's randn, with no cap or a cap of 1)."""
    return max(logits_soft_cap, 1.0) ** 0.5


def randn(rng, shape, dtype, spread: float = 1.0) -> np.ndarray:
    """Standard normal values times `spread`, in `dtype`."""
    return (rng.standard_normal(shape, np.float32) * np.float32(spread)).astype(dtype)


def outputs(result, return_lse: bool):
    """(out, lse) of an op's result, lse None when it was not asked."""
    return result if return_lse else (result, None)


def single_inputs(rng, qo_len: int, kv_len: int, num_heads: int, head_dim: int, soft_cap: float):
    """float16 NHD q (qo_len, H, D), k and v (kv_len, H, D), as test_logits_cap.py's."""
    spread = spread_of(soft_cap)
    return (randn(rng, (qo_len, num_heads, head_dim), np.float16, spread),
            randn(rng, (kv_len, num_heads, head_dim), np.float16, spread),
            randn(rng, (kv_len, num_heads, head_dim), np.float16))


def single_with_kv_cache(q, k, v, softcap: float | None) -> np.ndarray:
    """single_decode_with_kv_cache (q's one row, its (H, D) unsqueezed as their reference does)
    and single_prefill_with_kv_cache: NHD tensors as attention's "bshd" with a batch of 1."""
    return mfa_native.attention(q[None], k[None], v[None], layout="bshd", softcap=softcap, device="cpu")[0]


def check_single(rng, qo_len, kv_len, num_heads, head_dim, soft_cap, tolerance) -> None:
    q, k, v = single_inputs(rng, qo_len, kv_len, num_heads, head_dim, soft_cap)
    o = single_with_kv_cache(q, k, v, softcap_of(soft_cap))
    assert_close(o, flashinfer_reference(q, k, v, soft_cap)[0], tolerance)


# seq_len, num_heads, head_dim, soft_cap: every value of test_single_decode_logits_soft_cap's grid
@pytest.mark.parametrize("seq_len, num_heads, head_dim, soft_cap", [
    (1, 4, 128, 1.0), (9, 8, 256, 30.0), (81, 32, 128, 50.0), (729, 8, 256, 1.0), (33001, 4, 128, 30.0)])
def test_single_decode(rng, seq_len, num_heads, head_dim, soft_cap):
    check_single(rng, 1, seq_len, num_heads, head_dim, soft_cap, tolerance=1e-3)


# q_len, kv_len, num_heads, head_dim, soft_cap: every value of test_single_prefill_logits_soft_cap's grid
@pytest.mark.parametrize("q_len, kv_len, num_heads, head_dim, soft_cap", [
    (1, 31111, 4, 128, 50.0), (17, 1, 8, 256, 1.0), (81, 81, 32, 128, 30.0), (987, 17, 4, 256, 30.0),
    (17, 987, 8, 128, 1.0)])
def test_single_prefill(rng, q_len, kv_len, num_heads, head_dim, soft_cap):
    check_single(rng, q_len, kv_len, num_heads, head_dim, soft_cap, tolerance=1e-2)


@pytest.mark.exhaustive
@pytest.mark.parametrize("seq_len, num_heads, head_dim, soft_cap",
                         list(itertools.product([1, 9, 81, 729], [4, 8, 32], [128, 256], SOFT_CAPS)))
def test_single_decode_grid(rng, seq_len, num_heads, head_dim, soft_cap):
    check_single(rng, 1, seq_len, num_heads, head_dim, soft_cap, tolerance=1e-3)


@pytest.mark.exhaustive
@pytest.mark.parametrize("q_len, kv_len, num_heads, head_dim, soft_cap",
                         list(itertools.product([1, 17, 81], [1, 17, 81, 987], [4, 8], [128, 256], SOFT_CAPS)))
def test_single_prefill_grid(rng, q_len, kv_len, num_heads, head_dim, soft_cap):
    check_single(rng, q_len, kv_len, num_heads, head_dim, soft_cap, tolerance=1e-2)


def flashinfer_page_table(rng, batch_size: int, kv_len: int, page_size: int):
    """FlashInfer's description of `batch_size` sequences of kv_len keys in pages: kv_indptr
    (each sequence's range of kv_indices), kv_indices (here a shuffle of the pages) and
    kv_last_page_len (the rows used of each sequence's last page)."""
    pages_per_sequence = -(-kv_len // page_size)
    kv_indptr = np.arange(batch_size + 1, dtype=np.int32) * pages_per_sequence
    kv_indices = rng.permutation(batch_size * pages_per_sequence).astype(np.int32)
    return kv_indptr, kv_indices, np.full(batch_size, (kv_len - 1) % page_size + 1, np.int32)


def block_table_of(kv_indptr, kv_indices, kv_last_page_len, page_size: int):
    """FlashInfer's page table as the KV-cache call's block_table (B, most pages; -1 past a
    sequence's pages) and cache_seqlens."""
    counts = np.diff(kv_indptr)
    block_table = np.full((len(counts), counts.max()), -1, np.int32)
    for b, (start, count) in enumerate(zip(kv_indptr[:-1], counts)):
        block_table[b, :count] = kv_indices[start:start + count]
    return block_table, ((counts - 1) * page_size + kv_last_page_len).astype(np.int32)


def flashinfer_sequence(pages, kv_indptr, kv_indices, kv_last_page_len, b: int) -> np.ndarray:
    """Sequence b's rows (kv_len, Hkv, D) of (pages, page_size, Hkv, D) as FlashInfer's test
    gathers them: its pages in order, of the last only the first kv_last_page_len[b] rows."""
    rows = pages[kv_indices[kv_indptr[b]:kv_indptr[b + 1]]]
    return rows.reshape(-1, *rows.shape[2:])[:(len(rows) - 1) * rows.shape[1] + kv_last_page_len[b]]


def kv_memory(shape, dtype, contiguous: bool) -> np.ndarray:
    """A NaN-filled array of `shape`; not contiguous, a view of memory twice as long on every
    axis after the first, NaN between its rows (FlashInfer's contiguous_kv=False: a 2 before
    each axis, index 1 of it)."""
    if contiguous:
        return np.full(shape, np.nan, dtype)
    padded = np.full((shape[0], *(n for size in shape[1:] for n in (2, size))), np.nan, dtype)
    return padded[(slice(None), *(1, slice(None)) * (len(shape) - 1))]


def paged_kv(rng, pages: int, page_size: int, head_dim: int, kv_layout: str, kv_dtype: str, contiguous: bool,
             stacked: bool, spread: float):
    """FlashInfer's paged K and V (k scaled by `spread`): one (pages, 2, ...) tensor or a tuple of
    two, of NHD (pages, page_size, Hkv, D) or HND (pages, Hkv, page_size, D) pages; returned as
    the KV-cache call's (pages, page_size, Hkv, D) views of that memory."""
    page = (NUM_KV_HEADS, page_size, head_dim) if kv_layout == "HND" else (page_size, NUM_KV_HEADS, head_dim)
    dtype = KV_DTYPES[kv_dtype]
    if stacked:
        both = kv_memory((pages, 2, *page), dtype, contiguous)
        k, v = both[:, 0], both[:, 1]
    else:
        k, v = (kv_memory((pages, *page), dtype, contiguous) for _ in "kv")
    k[...] = rng.standard_normal(k.shape) * spread
    v[...] = rng.standard_normal(v.shape)
    return (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)) if kv_layout == "HND" else (k, v)


def check_batch_decode(rng, batch_size, kv_len, page_size, num_qo_heads, head_dim, kv_layout, logits_soft_cap,
                       return_lse, kv_dtype, contiguous_kv, stacked) -> None:
    """BatchDecodeWithPagedKVCacheWrapper's case (q (B, Hq, D), one row per sequence) as
    attention_with_kvcache over the pages in place, every sequence against the reference."""
    spread = spread_of(logits_soft_cap)
    kv_indptr, kv_indices, kv_last_page_len = flashinfer_page_table(rng, batch_size, kv_len, page_size)
    k_pages, v_pages = paged_kv(rng, len(kv_indices), page_size, head_dim, kv_layout, kv_dtype, contiguous_kv, stacked,
                                spread)
    block_table, cache_seqlens = block_table_of(kv_indptr, kv_indices, kv_last_page_len, page_size)
    q = randn(rng, (batch_size, num_qo_heads, head_dim), np.float16, spread)
    o, lse = outputs(mfa_native.attention_with_kvcache(
        q[:, None], k_pages, v_pages, cache_seqlens=cache_seqlens, block_table=block_table,
        softcap=softcap_of(logits_soft_cap), return_lse=return_lse, device="cpu"), return_lse)
    for b in range(batch_size):
        k, v = (flashinfer_sequence(x, kv_indptr, kv_indices, kv_last_page_len, b) for x in (k_pages, v_pages))
        want, want_lse = flashinfer_reference(q[b, None], k, v, logits_soft_cap)
        assert_close(o[b], want, 1e-3)
        assert lse is None or np.allclose(lse[b], want_lse, atol=1e-3)


BATCH_DECODE = ("batch_size, kv_len, page_size, num_qo_heads, head_dim, kv_layout, logits_soft_cap, return_lse, "
                "kv_dtype, contiguous_kv, stacked")


# every value of test_batch_decode_with_paged_kv_cache's grid (stacked K/V) and of
# test_batch_decode_with_tuple_paged_kv_cache's (stacked=False)
@pytest.mark.parametrize(BATCH_DECODE, [
    (12, 54, 1, 4, 128, "HND", 30.0, True, "float16", True, True),
    (17, 97, 8, 32, 256, "NHD", 0.0, False, "float8_e4m3fn", False, False),
    (12, 512, 16, 32, 128, "NHD", 30.0, True, "float8_e5m2", False, True),
    (17, 512, 16, 4, 256, "HND", 30.0, False, "float16", True, False)])
def test_batch_decode_with_paged_kv_cache(rng, batch_size, kv_len, page_size, num_qo_heads, head_dim, kv_layout,
                                          logits_soft_cap, return_lse, kv_dtype, contiguous_kv, stacked):
    check_batch_decode(rng, batch_size, kv_len, page_size, num_qo_heads, head_dim, kv_layout, logits_soft_cap,
                       return_lse, kv_dtype, contiguous_kv, stacked)


def test_batch_decode_split_over_threadgroups(rng):
    """FlashInfer splits a long decode's keys over thread blocks; the KV-cache call does on a
    device tuned as 64 parallel threadgroups (an M-series GPU's size; the cpu device's 4 never
    split): a 512-key case, read from strided float8 HND pages by the partial and combine kernels."""
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=64), mfa_native.profile() as prof:
        check_batch_decode(rng, 12, 512, 16, 32, 128, "HND", 30.0, True, "float8_e4m3fn", False, False)
    assert [r.kernel for r in prof.records] == [codegen.PARTIAL_KERNEL_NAME, codegen.COMBINE_KERNEL_NAME]


@pytest.mark.exhaustive
@pytest.mark.parametrize("page_size, kv_layout, logits_soft_cap, kv_dtype, contiguous_kv, stacked", list(
    itertools.product([1, 8, 16], ["HND", "NHD"], [0.0, 30.0], list(KV_DTYPES), [True, False], [True, False])))
def test_batch_decode_grid(rng, page_size, kv_layout, logits_soft_cap, kv_dtype, contiguous_kv, stacked):
    check_batch_decode(rng, 12, 97, page_size, 32, 128, kv_layout, logits_soft_cap, True, kv_dtype, contiguous_kv,
                       stacked)


def check_ragged_prefill(rng, batch_size, kv_len, qo_len, num_qo_heads, head_dim, logits_soft_cap,
                         return_lse) -> None:
    """BatchPrefillWithRaggedKVCacheWrapper's case: q, k and v packed by qo_indptr and kv_indptr
    (attention_varlen's cu_seqlens), causal; and its custom mask (per sequence, the lower
    triangle from diagonal kv_len - qo_len) as attention's bool mask over the batch; both against
    the reference (so against each other, as FlashInfer's test holds them)."""
    spread = spread_of(logits_soft_cap)
    q = randn(rng, (batch_size * qo_len, num_qo_heads, head_dim), np.float16, spread)
    k = randn(rng, (batch_size * kv_len, NUM_KV_HEADS, head_dim), np.float16, spread)
    v = randn(rng, (batch_size * kv_len, NUM_KV_HEADS, head_dim), np.float16)
    qo_indptr, kv_indptr = (np.arange(batch_size + 1, dtype=np.int32) * n for n in (qo_len, kv_len))
    options = dict(softcap=softcap_of(logits_soft_cap), return_lse=return_lse, device="cpu")
    o, lse = outputs(mfa_native.attention_varlen(q, k, v, qo_indptr, kv_indptr, causal=True, **options), return_lse)
    custom_mask = np.tril(np.ones((batch_size, 1, qo_len, kv_len), bool), kv_len - qo_len)
    batched = (x.reshape(batch_size, -1, *x.shape[1:]) for x in (q, k, v))
    masked_o, masked_lse = outputs(mfa_native.attention(*batched, mask=custom_mask, layout="bshd", **options),
                                   return_lse)
    for b in range(batch_size):
        rows, keys = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        want, want_lse = flashinfer_reference(q[rows], k[keys], v[keys], logits_soft_cap, causal=True)
        assert_close(o[rows], want, 1e-3)
        assert_close(masked_o[b], want, 1e-3)
        assert lse is None or (np.allclose(lse[:, rows], want_lse, atol=1e-3)
                               and np.allclose(masked_lse[b], want_lse, atol=1e-3))


# every value of test_batch_prefill_with_ragged_kv_cache_custom_mask's grid
@pytest.mark.parametrize("batch_size, kv_len, qo_len, num_qo_heads, head_dim, logits_soft_cap, return_lse", [
    (12, 54, 37, 32, 128, 30.0, True), (17, 97, 17, 4, 256, 0.0, False)])
def test_batch_prefill_with_ragged_kv_cache_custom_mask(rng, batch_size, kv_len, qo_len, num_qo_heads, head_dim,
                                                        logits_soft_cap, return_lse):
    check_ragged_prefill(rng, batch_size, kv_len, qo_len, num_qo_heads, head_dim, logits_soft_cap, return_lse)


@pytest.mark.exhaustive
@pytest.mark.parametrize("batch_size, kv_len, qo_len, num_qo_heads, logits_soft_cap", list(
    itertools.product([12, 17], [54, 97], [37, 17], [4, 32], [0.0, 30.0])))
def test_batch_prefill_grid(rng, batch_size, kv_len, qo_len, num_qo_heads, logits_soft_cap):
    check_ragged_prefill(rng, batch_size, kv_len, qo_len, num_qo_heads, 128, logits_soft_cap, True)


def test_a_wrong_cap_fails(rng):
    """The checks above tell a wrong cap: on a decode case with a cap of 30, the result without
    the cap, and the cap taken before the scale (scale * c * tanh(q . k / c), which is the
    reference's cap of c / sqrt(D)), each miss the reference by far more than the tolerances."""
    head_dim, soft_cap = 128, 30.0
    q, k, v = single_inputs(rng, 1, 729, 8, head_dim, soft_cap)
    want = flashinfer_reference(q, k, v, soft_cap)[0]
    assert_close(single_with_kv_cache(q, k, v, soft_cap), want, 1e-3)
    for wrong in (single_with_kv_cache(q, k, v, None), flashinfer_reference(q, k, v, soft_cap / head_dim ** 0.5)[0]):
        assert relative_l2(wrong, want) > 50 * L2
        assert np.mean(np.abs(wrong - want) > 1e-3 * (1 + np.abs(want))) > 0.5
