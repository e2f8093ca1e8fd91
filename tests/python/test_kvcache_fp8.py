"""attention_with_kvcache over float8 caches (float8_e4m3fn, float8_e5m2) with flash-attn 3's
descales: contiguous and paged (page sizes 1 and more), GQA, causal, per-head and per-tensor
descales, K and V stored differently, against the float64 reference of the dequantized cache;
the append bit-exact to the reference quantizer (and torch's `.to()`); each decode reading
the stored bytes once; a FlashMLA-style FP8 decode; bad descales refused before any write."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import relative_l2

import mfa_native
from mfa_native.quantized import QuantizedTensor
from mfa_native.reference import attention_with_kvcache_reference, float8_quantize_reference
from mfa_native.runtime.devices import tuned_as

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
B, R, HQ, HKV, D = 2, 2, 4, 2, 32
NAN_BYTE = 0x7F   # NaN in both formats: the garbage no call may read


def float8_cache(rng, shape, fmt, valid):
    """A cache of NaN bytes with random values where `valid` (index tuples) says."""
    cache = np.full(shape, NAN_BYTE, np.uint8).view(fmt)
    for at in valid:
        cache[at] = rng.standard_normal(cache[at].shape).astype(fmt)
    return cache


def descale(rng, kind):
    return (rng.uniform(0.25, 4.0, (B, HKV)).astype(np.float32) if kind == "per_head"
            else np.array([rng.uniform(0.25, 4.0)], np.float32))


def check_call(q, k_cache, v_cache, lengths, k, v, table, **options):
    """The call against the reference (computed first, on the caches before the call); the
    appended bytes are the reference quantizer's, every other byte unchanged."""
    expected = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, k, v, table, return_lse=True, **options)
    before = [np.array(c, copy=True) for c in (k_cache, v_cache)]
    out, lse = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v,
                                                 block_table=table, return_lse=True, **options)
    assert relative_l2(out, expected[0]) < 2e-3
    assert relative_l2(lse, expected[1]) < 1e-3
    positions = lengths[:, None] + np.arange(k.shape[1])[None, :]
    rows = (np.arange(B)[:, None].repeat(k.shape[1], 1), positions) if table is None else \
        (np.take_along_axis(table, positions // k_cache.shape[1], axis=1), positions % k_cache.shape[1])
    for cache, was, new, factor in ((k_cache, before[0], k, options.get("k_descale")),
                                    (v_cache, before[1], v, options.get("v_descale"))):
        factor = np.ones(1, np.float32) if factor is None else factor
        factor = np.broadcast_to(factor.reshape(1, 1) if factor.size == 1 else factor, (B, HKV))[:, None, :, None]
        assert np.array_equal(cache[rows].view(np.uint8), float8_quantize_reference(new, factor, cache.dtype))
        was[rows] = cache[rows]
        assert np.array_equal(cache.view(np.uint8), was.view(np.uint8))   # nothing else written


@pytest.mark.parametrize("k_fmt, v_fmt", [(E4M3, E4M3), (E5M2, E5M2), (E4M3, E5M2)], ids=["e4m3", "e5m2", "mixed"])
@pytest.mark.parametrize("page", [None, 1, 16])
@pytest.mark.parametrize("scales", ["per_head", "per_tensor"])
def test_decode_and_append_match_the_dequantized_reference(rng, k_fmt, v_fmt, page, scales):
    lengths, appended = np.array([13, 30], np.int32), 2
    q = rng.standard_normal((B, R, HQ, D)).astype(np.float16)
    k, v = (rng.standard_normal((B, appended, HKV, D)).astype(np.float16) * 3 for _ in range(2))
    if page is None:
        table, shape, valid = None, (B, 40, HKV, D), [(b, slice(0, n)) for b, n in enumerate(lengths)]
    else:
        width = 40 // page
        table = rng.permutation(B * width + 3)[:B * width].reshape(B, width).astype(np.int32)
        shape = (B * width + 3, page, HKV, D)
        valid = [(table[b, p // page], p % page) for b, n in enumerate(lengths) for p in range(n)]
    k_cache, v_cache = float8_cache(rng, shape, k_fmt, valid), float8_cache(rng, shape, v_fmt, valid)
    check_call(q, k_cache, v_cache, lengths, k, v, table, causal=True, q_descale=descale(rng, scales),
               k_descale=descale(rng, scales), v_descale=descale(rng, "per_head"))


@pytest.mark.parametrize("other", ["q8_0", "float16"])
def test_a_float8_k_beside_other_v_storage(rng, other):
    """K float8 with its descale, V a GGUF QuantizedTensor or q's float16: each read as stored
    and appended its own way (the reference reads the caches after the append)."""
    lengths = np.array([9, 21], np.int32)
    q = rng.standard_normal((B, 1, HQ, D)).astype(np.float16)
    k, v = (rng.standard_normal((B, 1, HKV, D)).astype(np.float16) for _ in range(2))
    k_cache = float8_cache(rng, (B, 24, HKV, D), E4M3, [(b, slice(0, n)) for b, n in enumerate(lengths)])
    v_plain = rng.standard_normal((B, 24, HKV, D)).astype(np.float16)
    v_cache = mfa_native.quantize(v_plain, "q8_0") if other == "q8_0" else v_plain
    k_descale = descale(rng, "per_head")
    out = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v, k_descale=k_descale)
    rows = (np.arange(B), lengths)
    assert np.array_equal(k_cache[rows].view(np.uint8), float8_quantize_reference(k[:, 0], k_descale[:, :, None], E4M3))
    values = v_cache.dequantize() if isinstance(v_cache, QuantizedTensor) else v_cache
    expected = attention_with_kvcache_reference(q, k_cache, values, lengths + 1, k_descale=k_descale)
    assert relative_l2(out, expected) < 2e-3


def test_warm_calls_read_each_calls_descales(rng):
    """Calls of one signature (the warm path) bind each call's own descales: (B, Hkv) arrays, a
    reversed view (negative strides: read from a copy), and flash-attn 3's expanded view of one
    factor (strides 0)."""
    lengths = np.array([5, 9], np.int32)
    k_cache = float8_cache(rng, (B, 16, HKV, D), E4M3, [(b, slice(0, 16)) for b in range(B)])
    v_cache = float8_cache(rng, (B, 16, HKV, D), E5M2, [(b, slice(0, 16)) for b in range(B)])
    q = rng.standard_normal((B, 1, HQ, D)).astype(np.float32)
    for _ in range(2):
        factors = {"q_descale": descale(rng, "per_head"), "k_descale": descale(rng, "per_head")[::-1, ::-1],
                   "v_descale": np.broadcast_to(descale(rng, "per_tensor"), (B, HKV))}
        out = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, **factors)
        expected = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, **factors)
        assert relative_l2(out, expected) < 1e-5


def edge_values(fmt) -> np.ndarray:
    """float32 values around every float8 value: the values, the halfway points between
    neighbours (ties) and the floats next to them, subnormals, the largest value and beyond
    it, +-inf, NaN, +-0, and random bits."""
    finite = np.arange(256, dtype=np.uint8).view(fmt).astype(np.float32)
    finite = np.unique(finite[np.isfinite(finite)])
    middles = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    big = float(finite.max())
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, big * 1.03, -big * 1.1, big * 1.2, 1e30,
                         float(finite[finite > 0].min()) / 2, 1e-30, -1e-45], np.float32)
    rng = np.random.default_rng(8)
    random = (rng.integers(0, 2**32, 2048, dtype=np.uint64).astype(np.uint32) & 0xC7FFFFFF).view(np.float32)
    return np.concatenate([finite, middles, np.nextafter(middles, np.inf), np.nextafter(middles, -np.inf),
                           specials, random])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("factor", [0.5, 0.37])
def test_append_quantizes_bit_exactly(fmt, factor):
    """Every appended byte is the reference quantizer's (float32 x / descale, nearest even; e4m3fn
    saturating, e5m2 to inf), and torch's `.to()` of the same quotient; ml_dtypes' astype
    agrees wherever the quotient is neither NaN nor (e4m3fn) beyond 464."""
    values = edge_values(fmt) * np.float32(factor)    # x / 0.5 is exact: the ties stay ties
    width = -(-values.size // (HKV * D))
    x = np.resize(values, width * HKV * D).reshape(1, width, HKV, D)
    k_cache = np.zeros((1, width, HKV, D), np.uint8).view(fmt)
    v_cache = np.zeros((1, width, HKV, D), np.float32)
    factors = np.full((1, HKV), factor, np.float32)
    q = np.random.default_rng(1).standard_normal((1, 1, HKV, D)).astype(np.float32)
    mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.zeros(1, np.int32), k=x,
                                      v=np.ones_like(x), k_descale=factors)
    stored = k_cache.view(np.uint8)
    quotient = x / np.float32(factor)
    assert np.array_equal(stored, float8_quantize_reference(x, factors[:, None, :, None], fmt))
    plain = ~np.isnan(quotient) & ((fmt is E5M2) | (np.abs(quotient) < 464))
    assert np.array_equal(stored[plain], quotient[plain].astype(fmt).view(np.uint8))
    torch = pytest.importorskip("torch")
    by_torch = torch.from_numpy(quotient).to(getattr(torch, np.dtype(fmt).name)).view(torch.uint8).numpy()
    assert np.array_equal(stored, by_torch)


@pytest.mark.parametrize("page", [None, 1, 8])
def test_decode_reads_the_stored_bytes_once(rng, page):
    """Packed heads: every attended float8 byte read once per kv head (1.000x), 8 query heads each."""
    lengths = np.array([40, 3], np.int32)
    q = rng.standard_normal((B, 1, 8 * HKV, D)).astype(np.float16)
    if page is None:
        table, shape, valid = None, (B, 48, HKV, D), [(b, slice(0, n)) for b, n in enumerate(lengths)]
    else:
        table = rng.permutation(B * 48 // page).reshape(B, 48 // page).astype(np.int32)
        shape, valid = (B * 48 // page, page, HKV, D), [(table[b, p // page], p % page)
                                                       for b, n in enumerate(lengths) for p in range(n)]
    k_cache, v_cache = float8_cache(rng, shape, E4M3, valid), float8_cache(rng, shape, E5M2, valid)
    with mfa_native.profile() as prof:
        out = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table,
                                                k_descale=descale(rng, "per_head"), v_descale=descale(rng, "per_head"))
    attended = int(lengths.sum()) * HKV * D    # one byte a value
    assert prof.bytes_read["k"] == attended and prof.bytes_read["v"] == attended
    assert np.isfinite(out).all()


def test_split_decode_reads_the_stored_bytes_once_and_matches(rng):
    """A decode split over the keys (two kernels): each split reads its float8 bytes once."""
    lengths = np.array([700, 1000], np.int32)
    q = rng.standard_normal((B, 1, 8 * HKV, D)).astype(np.float16)
    valid = [(b, slice(0, n)) for b, n in enumerate(lengths)]
    k_cache, v_cache = (float8_cache(rng, (B, 1024, HKV, D), fmt, valid) for fmt in (E5M2, E4M3))
    factors = {name: descale(rng, "per_head") for name in ("q_descale", "k_descale", "v_descale")}
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=64), mfa_native.profile() as prof:
        out = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, **factors)
    assert len(prof.records) == 2
    attended = int(lengths.sum()) * HKV * D
    assert prof.bytes_read["k"] == attended and prof.bytes_read["v"] == attended
    expected = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, **factors)
    assert relative_l2(out, expected) < 2e-3


def cosine_difference(x, y) -> float:
    """FlashMLA's test metric (its cal_diff): 1 - 2 x.y / (x.x + y.y), in float64."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return 1 - 2 * (x * y).sum() / max((x * x + y * y).sum(), 1e-12)


def test_flash_mla_style_fp8_decode(rng):
    """FlashMLA's FP8 decode test, smaller: one latent kv head (d 576, the values its first 512),
    16 query heads, pages of 64, varlen, causal, q and the cache e4m3fn with per-tensor descales;
    its tolerances (cosine difference below 1e-4 for the output, 1e-5 for lse), and relative L2
    errors."""
    b, h_q, d, dv, page = 2, 16, 576, 512, 64
    lengths = np.array([97, 150], np.int32)
    blocks = -(-int(lengths.max()) // page)
    table = rng.permutation(b * blocks).reshape(b, blocks).astype(np.int32)
    cache = (rng.standard_normal((b * blocks, page, 1, d)) * 4).astype(E4M3)
    q8 = (rng.standard_normal((b, 1, h_q, d)) * 4).astype(E4M3)
    q = q8.astype(ml_dtypes.bfloat16)             # exact: q's float8 values, as bfloat16
    factors = {"q_descale": np.array([0.25], np.float32), "k_descale": np.array([0.125], np.float32),
               "v_descale": np.array([0.125], np.float32)}   # FlashMLA's descale_k serves its values too
    out, lse = mfa_native.attention_with_kvcache(q, cache, cache[..., :dv], cache_seqlens=lengths, block_table=table,
                                                 causal=True, return_lse=True, **factors)
    expected, expected_lse = attention_with_kvcache_reference(q, cache, cache[..., :dv], lengths, block_table=table,
                                                              causal=True, return_lse=True, **factors)
    assert cosine_difference(out, expected) < 1e-4 and cosine_difference(lse, expected_lse) < 1e-5
    # Tighter than FlashMLA's (which a descale off by 1 % passes): bfloat16's output, exact lse.
    assert relative_l2(out, expected) < 4e-3 and relative_l2(lse, expected_lse) < 1e-5


def test_torch_drop_in_takes_float8_tensors_and_descales():
    torch = pytest.importorskip("torch")
    from mfa_native.torch import flash_attn_with_kvcache

    generator = torch.Generator().manual_seed(3)
    k_cache = torch.randn(B, 16, HKV, D, generator=generator).to(torch.float8_e4m3fn)
    v_cache = torch.randn(B, 16, HKV, D, generator=generator).to(torch.float8_e5m2)
    q = torch.randn(B, 1, HQ, D, generator=generator)
    k, v = (torch.randn(B, 1, HKV, D, generator=generator) for _ in range(2))
    k_descale, v_descale = torch.rand(B, HKV, generator=generator) + 0.5, torch.tensor([0.7])
    lengths = torch.tensor([4, 11], dtype=torch.int32)
    before = [c.view(torch.uint8).numpy().copy() for c in (k_cache, v_cache)]
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lengths, causal=True,
                                  k_descale=k_descale, v_descale=v_descale)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert torch.equal(k_cache[0, 4], (k[0, 0] / k_descale[0][:, None]).to(torch.float8_e4m3fn))   # in place
    caches = [np.where(np.arange(16)[None, :, None, None] == lengths.numpy()[:, None, None, None], c.view(
        torch.uint8).numpy(), was).view(fmt) for c, was, fmt in zip((k_cache, v_cache), before, (E4M3, E5M2))]
    expected = attention_with_kvcache_reference(q.numpy(), *caches, lengths.numpy() + 1, causal=True,
                                                k_descale=k_descale.numpy(), v_descale=v_descale.numpy())
    assert relative_l2(out.numpy(), expected) < 1e-4


@pytest.mark.parametrize("arguments, message", [
    ({"k_descale": np.ones((B, HKV + 1), np.float32)}, "k_descale must be"),
    ({"v_descale": np.ones((B, HKV), np.float64)}, "v_descale must be float32"),
    ({"q_descale": np.ones((HKV,), np.float32)}, "q_descale must be"),
])
def test_bad_descales_are_refused_before_any_write(rng, arguments, message):
    k_cache = float8_cache(rng, (B, 8, HKV, D), E4M3, [(b, slice(0, 8)) for b in range(B)])
    v_cache = float8_cache(rng, (B, 8, HKV, D), E5M2, [(b, slice(0, 8)) for b in range(B)])
    before = [c.view(np.uint8).copy() for c in (k_cache, v_cache)]
    q = rng.standard_normal((B, 1, HQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, 1, HKV, D)).astype(np.float32) for _ in range(2))
    with pytest.raises(ValueError, match=message):
        mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array([2, 5], np.int32), k=k, v=v,
                                          **arguments)
    assert all(np.array_equal(c.view(np.uint8), b) for c, b in zip((k_cache, v_cache), before))


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_a_descale_of_a_cache_that_is_not_float8_is_refused(rng, name):
    q = rng.standard_normal((B, 1, HQ, D)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((B, 8, HKV, D)).astype(np.float32) for _ in range(2))
    with pytest.raises(ValueError, match=f"{name} is for a float8"):
        mfa_native.attention_with_kvcache(q, k_cache, v_cache, **{name: np.ones(1, np.float32)})
