"""The KV cache call's rotary embedding on the device (issue "Serving 2", item 1): q and the
appended k turned by rotation kernels first in the attention pass, with flash-attn's rules,
against the float64 reference (reference.rotary_reference, written from those rules); the
cache holds the turned keys (quantized caches: quantized after turning), v as given, every
other byte unchanged; bad tables and positions raise before anything is written."""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from conftest import relative_l2

import mfa_native
from mfa_native import codegen
from mfa_native.codegen import AttentionProblem, CacheKeys
from mfa_native.codegen.attention.rotary import Rotary
from mfa_native.reference import attention_with_kvcache_reference, rotary_reference

B, R, HQ, HKV, D, CMAX, RN = 2, 3, 4, 2, 32, 24, 3
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def tables(rng, dim: int, positions: int = CMAX, dtype=np.float32):
    """cos and sin (positions, dim / 2) of random frequencies."""
    angles = np.outer(np.arange(positions), rng.uniform(0.01, 1.0, dim // 2))
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def problem(rng, dtype, page: int | None):
    """Random q, new k and v, and caches (contiguous, or pages of `page` rows in shuffled order)."""
    t = DTYPES[dtype]
    q = rng.standard_normal((B, R, HQ, D)).astype(t)
    k, v = (rng.standard_normal((B, RN, HKV, D)).astype(t) for _ in "kv")
    if page is None:
        shape, table = (B, CMAX, HKV, D), None
    else:
        blocks = B * CMAX // page
        shape, table = (blocks, page, HKV, D), rng.permutation(blocks).reshape(B, -1).astype(np.int32)
    k_cache, v_cache = (rng.standard_normal(shape).astype(t) for _ in "kv")
    return q, k, v, k_cache, v_cache, table


def written_rows(lengths, table, page):
    """The index arrays (B, Rn) of the appended rows in a cache's first two axes."""
    positions = lengths.astype(np.int64)[:, None] + np.arange(RN)
    if table is None:
        return np.arange(B)[:, None], positions
    return np.take_along_axis(table, positions // page, axis=1), positions % page


@pytest.mark.parametrize("dtype, interleaved, dim, options, page, starts", [
    ("float32", True, D, dict(causal=True), None, None),
    ("float32", False, D // 2, dict(), 3, None),
    ("float16", False, D, dict(window=(4, 0)), None, [2, 5]),
    ("bfloat16", True, D // 2, dict(causal=True), 1, [7, 0]),
], ids=["f32-gptj-causal", "f32-neox-half-paged3", "f16-neox-window-starts", "bf16-gptj-half-paged1-starts"])
def test_rotation_on_the_device_equals_flash_attn_rules(rng, dtype, interleaved, dim, options, page, starts):
    q, k, v, k_cache, v_cache, table = problem(rng, dtype, page)
    cos, sin = tables(rng, dim, dtype=DTYPES[dtype])
    lengths = np.array([6, 13], np.int32)
    rotary_seqlens = None if starts is None else np.array(starts, np.int32)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    want = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, k, v, table, cos, sin, rotary_seqlens,
                                            interleaved, return_lse=True, **options)
    out, lse = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v,
                                                 block_table=table, rotary_cos=cos, rotary_sin=sin,
                                                 rotary_seqlens=rotary_seqlens, rotary_interleaved=interleaved,
                                                 return_lse=True, device="cpu", **options)
    assert relative_l2(out, want[0]) < TOLERANCE[dtype]
    assert np.allclose(lse, want[1], atol=10 * TOLERANCE[dtype])
    at = written_rows(lengths, table, page)
    start = lengths if starts is None else rotary_seqlens
    turned = rotary_reference(k, cos, sin, start.astype(np.int64)[:, None] + np.arange(RN), interleaved)
    assert relative_l2(k_cache[at].astype(np.float64), turned) < TOLERANCE[dtype]   # the cache holds k turned
    assert np.array_equal(k_cache[at][..., dim:], k[..., dim:])                      # features past dim as given
    assert v_cache[at].tobytes() == v.tobytes()                                       # v never turned
    kept = np.ones(k_cache.shape[:2], bool)
    kept[at] = False
    assert k_cache[kept].tobytes() == before_k[kept].tobytes() and v_cache[kept].tobytes() == before_v[kept].tobytes()


def test_q_rows_sit_at_one_position_without_causal_or_window(rng):
    """Neither causal nor a window: every q row of batch b turns at its start (flash-attn's rule),
    so equal q rows give equal outputs; with causal, they turn at consecutive positions."""
    q, k, v, k_cache, v_cache, _ = problem(rng, "float32", None)
    q[:, 1:] = q[:, :1]
    cos, sin = tables(rng, D)
    lengths = np.array([4, 9], np.int32)
    for causal in (False, True):
        out = mfa_native.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(), cache_seqlens=lengths, k=k, v=v,
                                                rotary_cos=cos, rotary_sin=sin, causal=causal, device="cpu")
        assert np.array_equal(out[:, 0], out[:, 1]) != causal


def test_the_rotation_kernels_run_first_in_the_pass_on_the_callers_rows():
    """rotate_q and rotate_k read the caller's q and k (q_unrotated, k_new_unrotated) and write
    the intermediates the append and attention kernels read under their usual names."""
    p = replace(AttentionProblem(batch=B, q_heads=HQ, kv_heads=HKV, q_len=R, kv_len=CMAX, head_dim=D, value_dim=D,
                                 dtype="float32", layout="bshd"), keys=CacheKeys(RN, rotary=Rotary(16, True, True),
                                                                                 rotary_positions=CMAX))
    description = codegen.attention_pass(p)
    names = [k.entry for k in description.kernels]
    assert names[:4] == ["rotate_q", "rotate_k", "append_k", "append_v"]
    assert description.buffer("q").role == "intermediate" and description.buffer("q").writers == (0,)
    assert description.buffer("k_new").role == "intermediate" and description.buffer("k_new").writers == (1,)
    assert {description.buffer(n).role for n in ("q_unrotated", "k_new_unrotated", "rotary_cos")} == {"input"}
    assert len(names) - 1 in description.buffer("q").readers


def test_a_quantized_cache_stores_the_turned_rows_quantized(rng):
    """q8_0: the appended rows are the turned rows (as a plain cache gets them) quantized, byte
    for byte `quantize`'s."""
    q, k, v, k_plain, v_plain, _ = problem(rng, "float32", None)
    cos, sin = tables(rng, D)
    lengths = np.array([5, 11], np.int32)
    k_cache, v_cache = (mfa_native.quantize(x, format="q8_0") for x in (k_plain, v_plain))
    mfa_native.attention_with_kvcache(q, k_plain, v_plain, cache_seqlens=lengths, k=k, v=v, rotary_cos=cos,
                                      rotary_sin=sin, device="cpu")
    mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v, rotary_cos=cos,
                                      rotary_sin=sin, device="cpu")
    at = written_rows(lengths, None, None)
    assert k_cache.data[at].tobytes() == mfa_native.quantize(k_plain[at], format="q8_0").data.tobytes()
    assert v_cache.data[at].tobytes() == mfa_native.quantize(v, format="q8_0").data.tobytes()


def test_warm_calls_read_the_positions_of_each_call(rng):
    """The positions are runtime values: a second call of the same signature turns at its own."""
    q, k, v, k_cache, v_cache, _ = problem(rng, "float32", None)
    cos, sin = tables(rng, D)
    for lengths in ([3, 8], [10, 1]):
        lengths = np.array(lengths, np.int32)
        want = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, k, v, None, cos, sin, causal=True)
        out = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v, rotary_cos=cos,
                                                rotary_sin=sin, causal=True, device="cpu")
        assert relative_l2(out, want) < 1e-5


@pytest.mark.parametrize("change, match", [
    (dict(rotary_sin=None), "rotary_cos and rotary_sin are given together"),
    (dict(rotary_cos=None, rotary_sin=None, rotary_seqlens=np.array([1, 2], np.int32)),
     "rotary_seqlens is given without rotary_cos"),
    (dict(k=None, v=None), "rotary_cos needs k and v"),
    (dict(k=np.zeros((B, 0, HKV, D), np.float32), v=np.zeros((B, 0, HKV, D), np.float32)),
     r"rotary_cos needs rows to turn: k and v append none \(Rn = 0\)"),
    (dict(rotary_seqlens=np.array([1, 2], np.int64)), "rotary_seqlens must be int32"),
    (dict(rotary_seqlens=np.array([-1, 2], np.int32)), "rotary_seqlens must not be negative"),
    (dict(rotary_seqlens=np.array([22, 2], np.int32)), r"too few: batch 0 needs 25 \(rotary_seqlens \+"),
    (dict(cache_seqlens=np.array([21, 2], np.int32)), r"too few: batch 0 needs 24 \(cache_seqlens \+"),
    (dict(rotary_cos=np.ones((CMAX, 17), np.float32)), r"with 0 < rotary_dim <= D = 32"),
    (dict(rotary_cos=np.ones((CMAX - 1, 8), np.float16)), "must have q's dtype float32"),
])
def test_bad_rotary_arguments_raise_before_any_write(rng, change, match):
    q, k, v, k_cache, v_cache, _ = problem(rng, "float32", None)
    cos, sin = tables(rng, 16, positions=CMAX - 1)
    arguments = dict(cache_seqlens=np.array([3, 9], np.int32), k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                     causal=True) | change
    if "cache_seqlens" in change:
        k_cache, v_cache = (np.concatenate([x, x[:, :4]], axis=1) for x in (k_cache, v_cache))
    before = k_cache.copy(), v_cache.copy()
    with pytest.raises(ValueError, match=match):
        mfa_native.attention_with_kvcache(q, k_cache, v_cache, device="cpu", **arguments)
    assert k_cache.tobytes() == before[0].tobytes() and v_cache.tobytes() == before[1].tobytes()
