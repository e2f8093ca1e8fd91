"""flash_attn_with_kvcache's cache_batch_idx and cache_leftpad (issue "Serving 2", item 2) and its
rotary embedding (item 1), with flash-attn's rules, against an independent float64 reference
written from them: batch element b uses cache row cache_batch_idx[b]; its keys are positions
cache_leftpad[b] .. cache_seqlens[b] - 1 of that row, then the new rows, appended at
cache_seqlens[b]; causal and the window count from its first key; q and the new k are rotated
at their absolute positions. The caches are checked byte for byte after the call (only the new
rows written), and every bad argument raises before anything is written."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mfa_native.reference import attention_reference  # noqa: E402
from mfa_native.torch import flash_attn_with_kvcache  # noqa: E402

CMAX, HKV, HQ, D = 24, 2, 4, 32


def expected(q, k_rows, v_rows, lengths, index, start, k, v, **options) -> np.ndarray:
    """Batch b attends positions start[b] .. lengths[b] - 1 of cache row index[b], then its new rows."""
    out = []
    for b in range(q.shape[0]):
        keys = np.concatenate([k_rows[index[b], start[b]:lengths[b]], k[b]])
        values = np.concatenate([v_rows[index[b], start[b]:lengths[b]], v[b]])
        out.append(attention_reference(q[b:b + 1].astype(np.float64), keys[None].astype(np.float64),
                                       values[None].astype(np.float64), layout="bshd", **options))
    return np.concatenate(out)


def caches(rows: int, sliced: bool = False):
    """k and v caches (rows, CMAX, HKV, D), and the tensors they view: whole tensors, or slices
    of longer rows (rows CMAX + 5 positions apart), as a server's preallocated cache may be."""
    memory = [torch.randn(rows, CMAX + 5 if sliced else CMAX, HKV, D) for _ in "kv"]
    return [x[:, :CMAX] for x in memory], memory


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
@pytest.mark.parametrize("index, start", [(None, [3, 0, 7]), ([2, 0, 3], None), ([3, 1, 0], [5, 2, 0])],
                         ids=["leftpad", "batch_idx", "both"])
def test_batch_idx_and_leftpad_equal_the_reference_and_append_in_place(index, start, sliced):
    torch.manual_seed(0)
    B, appended = 3, 2
    (k_cache, v_cache), memory = caches(4 if index else B, sliced)
    lengths = torch.tensor([10, 5, 20], dtype=torch.int32)
    q = torch.randn(B, 3, HQ, D)
    k, v = torch.randn(B, appended, HKV, D), torch.randn(B, appended, HKV, D)
    before = [x.clone() for x in memory]
    rows = [x.numpy().copy() for x in (k_cache, v_cache)]
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=lengths, causal=True, window_size=(6, -1),
        cache_batch_idx=None if index is None else torch.tensor(index, dtype=torch.int32),
        cache_leftpad=None if start is None else torch.tensor(start, dtype=torch.int32), return_softmax_lse=True)
    index, start = index or list(range(B)), start or [0] * B
    want = expected(q.numpy(), *rows, lengths.numpy(), index, start, k.numpy(), v.numpy(), causal=True,
                    window=(6, -1))
    assert np.linalg.norm(out.numpy() - want) <= 1e-5 * np.linalg.norm(want)
    assert lse.shape == (B, HQ, 3) and np.isfinite(lse.numpy()).all()
    for whole, old, new in zip(memory, before, (k, v)):
        written = old.clone()
        for b in range(B):
            written[index[b], int(lengths[b]):int(lengths[b]) + appended] = new[b]
        assert torch.equal(whole, written)   # every other byte as before


def test_leftpad_without_an_append_reads_up_to_the_lengths():
    torch.manual_seed(1)
    (k_cache, v_cache), _ = caches(2)
    q = torch.randn(2, 1, HQ, D)
    start, lengths = torch.tensor([4, 9], dtype=torch.int32), torch.tensor([4 + 6, 24], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_leftpad=start)
    want = expected(q.numpy(), k_cache.numpy(), v_cache.numpy(), lengths.numpy(), [0, 1], start.numpy(),
                    np.zeros((2, 0, HKV, D), np.float32), np.zeros((2, 0, HKV, D), np.float32))
    assert np.linalg.norm(out.numpy() - want) <= 1e-5 * np.linalg.norm(want)


def _int32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("options, match", [
    (dict(cache_batch_idx=_int32([0, 4])), r"cache_batch_idx must name rows of k_cache \(0\.\.3\)"),
    (dict(cache_batch_idx=_int32([1, 1])), "cache_batch_idx repeats a cache row"),
    (dict(cache_batch_idx=torch.tensor([0, 1])), "cache_batch_idx must be an int32 tensor of shape"),
    (dict(cache_leftpad=_int32([0, 9])), r"cache_leftpad must lie in 0\.\.cache_seqlens\[b\]"),
    (dict(cache_leftpad=_int32([-1, 0])), r"cache_leftpad must lie in 0\.\.cache_seqlens\[b\]"),
    (dict(cache_leftpad=_int32([0, 0]), cache_seqlens=_int32([3, 23])), r"cache_seqlens\[1\] \+ Rn = 23 \+ 2 is beyond"),
    (dict(cache_leftpad=_int32([0, 0]), block_table=_int32([[0], [1]])), "for a contiguous cache"),
])
def test_bad_indices_raise_before_anything_is_written(options, match):
    (k_cache, v_cache), _ = caches(4)
    before = k_cache.clone(), v_cache.clone()
    q, k, v = torch.randn(2, 2, HQ, D), torch.randn(2, 2, HKV, D), torch.randn(2, 2, HKV, D)
    arguments = dict(cache_seqlens=_int32([3, 5]), cache_batch_idx=_int32([0, 1])) | options
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, **arguments)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


# Rotary embedding (item 1), against flash-attn's rules written out in float64.


def rotated(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray, interleaved: bool) -> np.ndarray:
    """x (B, S, H, D) with features [0, rotary_dim) of row (b, s) rotated by the angle of
    position positions[b, s]: pairs (2j, 2j + 1) (interleaved) or (j, j + rotary_dim / 2)."""
    out, half = x.astype(np.float64), cos.shape[1]
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            c, t = cos[positions[b, s]].astype(np.float64), sin[positions[b, s]].astype(np.float64)
            first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else \
                (slice(0, half), slice(half, 2 * half))
            x1, x2 = out[b, s, :, first].copy(), out[b, s, :, second].copy()
            out[b, s, :, first], out[b, s, :, second] = x1 * c - x2 * t, x1 * t + x2 * c
    return out


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary_embedding_of_q_and_the_new_rows(interleaved, fraction, causal):
    torch.manual_seed(2)
    B, R, appended = 2, 3, 3
    (k_cache, v_cache), _ = caches(B)
    lengths, start = torch.tensor([6, 13], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)
    q = torch.randn(B, R, HQ, D)
    k, v = torch.randn(B, appended, HKV, D), torch.randn(B, appended, HKV, D)
    angles = np.outer(np.arange(CMAX), 1.0 / 10000 ** (np.arange(0, int(D * fraction), 2) / (D * fraction)))
    cos, sin = (torch.from_numpy(f(angles)).float() for f in (np.cos, np.sin))
    rows = [x.numpy().copy() for x in (k_cache, v_cache)]
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                                  cache_seqlens=lengths, cache_leftpad=start, causal=causal,
                                  rotary_interleaved=interleaved)
    k_positions = lengths.numpy()[:, None] + np.arange(appended)          # absolute, the pad included
    q_positions = lengths.numpy()[:, None] + (np.arange(R) if causal else np.zeros(R, int))
    k_turned = rotated(k.numpy(), cos.numpy(), sin.numpy(), k_positions, interleaved)
    q_turned = rotated(q.numpy(), cos.numpy(), sin.numpy(), q_positions, interleaved)
    want = expected(q_turned, *rows, lengths.numpy(), [0, 1], start.numpy(), k_turned, v.numpy(), causal=causal)
    assert np.linalg.norm(out.numpy() - want) <= 1e-5 * np.linalg.norm(want)
    for b in range(B):   # the cache holds the rotated keys, v as given
        at = slice(int(lengths[b]), int(lengths[b]) + appended)
        assert np.allclose(k_cache[b, at].numpy(), k_turned[b], atol=1e-6)
        assert torch.equal(v_cache[b, at], v[b])


@pytest.mark.parametrize("tables, options, match", [
    ((CMAX, 8), dict(k=None, v=None), "rotary_cos needs k and v"),
    ((10, 8), {}, r"rotary_cos has 10 positions \(seqlen_ro\), too few: batch 1 needs 11"),
    ((CMAX, 20), {}, r"rotary_dim <= D = 32"),
    ((CMAX, 8), dict(dtype=torch.float16), "must have q's dtype"),
])
def test_bad_rotary_tables_raise_before_anything_is_written(tables, options, match):
    (k_cache, v_cache), _ = caches(2)
    before = k_cache.clone()
    dtype = options.pop("dtype", torch.float32)
    arguments = dict(k=torch.randn(2, 2, HKV, D), v=torch.randn(2, 2, HKV, D)) | options
    cos = sin = torch.ones(tables, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(torch.randn(2, 2, HQ, D), k_cache, v_cache, rotary_cos=cos, rotary_sin=sin,
                                cache_seqlens=_int32([3, 9]), causal=True, **arguments)
    assert torch.equal(k_cache, before)
