"""mfa_native.mlx.attention_with_kvcache: the append is MLX's own in-place update of the
caller's cache arrays (plain or QuantizedTensor fields, contiguous or paged), byte for byte
what the numpy call writes into copies of the same caches, and the output the numpy call's."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from test_kvcache import QUANT_FORMATS

import mfa_native
from mfa_native.quantized import QuantizedTensor

mx = pytest.importorskip("mlx.core")
mm = pytest.importorskip("mfa_native.mlx")

B, R, HQ, HKV, D = 2, 1, 8, 2, 32


def _problem(rng, page, fmt):
    """Numpy caches (plain, or quantized with fmt), lengths, new rows, queries and block table."""
    shape = (B, 48) if page is None else (9, page)
    table = None if page is None else rng.permutation(9)[:B * 48 // page].reshape(B, -1).astype(np.int32)
    k_cache, v_cache = (rng.standard_normal((*shape, HKV, D)).astype(np.float32) for _ in "kv")
    if fmt is not None:
        k_cache, v_cache = (mfa_native.quantize(x, **fmt) for x in (k_cache, v_cache))
    lengths = np.array([15, 40], np.int32)       # paged (16-row pages): batch 0's append crosses a page
    k, v = (rng.standard_normal((B, 3, HKV, D)).astype(np.float32) for _ in "kv")
    return k_cache, v_cache, lengths, k, v, rng.standard_normal((B, R, HQ, D)).astype(np.float32), table


def _mlx(x):
    if isinstance(x, QuantizedTensor):
        return x.with_fields(**{name: mx.array(f) for name, f in x.fields().items()})
    return None if x is None else mx.array(x)


def _fields(cache) -> dict[str, np.ndarray]:
    fields = cache.fields() if isinstance(cache, QuantizedTensor) else {"data": cache}
    return {name: np.array(x) for name, x in fields.items()}


@pytest.mark.parametrize("page", [None, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("fmt", [None, *QUANT_FORMATS[:1], *QUANT_FORMATS[2:3]],
                         ids=lambda f: "plain" if f is None else "-".join(map(str, f.values())))
def test_mlx_caches_are_appended_in_place_as_the_numpy_call_appends(rng, page, fmt):
    k_cache, v_cache, lengths, k, v, q, table = _problem(rng, page, fmt)
    mk, mv = _mlx(k_cache), _mlx(v_cache)
    objects = [id(x) for c in (mk, mv) for x in (c.fields().values() if fmt else [c])]
    before = _fields(mk)
    out, lse = mm.attention_with_kvcache(_mlx(q), mk, mv, cache_seqlens=mx.array(lengths), k=mx.array(k),
                                         v=mx.array(v), block_table=_mlx(table), causal=True, return_lse=True)
    expected = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v,
                                                 block_table=table, causal=True, return_lse=True)
    assert isinstance(out, mx.array) and [id(x) for c in (mk, mv) for x in
                                          (c.fields().values() if fmt else [c])] == objects
    for mine, theirs in ((mk, k_cache), (mv, v_cache)):
        for name, x in _fields(mine).items():
            assert x.tobytes() == _fields(theirs)[name].tobytes(), name
    assert any(x.tobytes() != _fields(mk)[n].tobytes() for n, x in before.items())   # the append wrote
    assert relative_l2(np.array(out), expected[0]) < 1e-5 and np.allclose(np.array(lse), expected[1], atol=1e-5)


def test_bad_input_raises_before_the_mlx_caches_change(rng):
    k_cache, v_cache, lengths, k, v, q, _ = _problem(rng, None, None)
    mk = mx.array(k_cache)
    with pytest.raises(ValueError, match=r"batch 1 attends cache_seqlens \+ Rn = 49 keys, beyond"):
        mm.attention_with_kvcache(mx.array(q), mk, mx.array(v_cache), cache_seqlens=mx.array([0, 46], mx.int32),
                                  k=mx.array(k), v=mx.array(v))
    assert np.array(mk).tobytes() == k_cache.tobytes()


def test_the_plain_op_on_mlx_caches_appends_through_mlx(rng):
    """mfa_native.attention_with_kvcache given MLX caches updates them as the MLX adapter does,
    by MLX's own indexed assignment: an array sharing the cache's memory (a reshape of it)
    keeps its values, which a write behind MLX's back would change."""
    k_cache, v_cache, lengths, k, v, q, table = _problem(rng, 16, None)
    base = mx.array(k_cache)
    mk, mv = base.reshape(base.shape), _mlx(v_cache)
    mx.eval(base, mk)
    out = mfa_native.attention_with_kvcache(_mlx(q), mk, mv, cache_seqlens=mx.array(lengths), k=mx.array(k),
                                            v=mx.array(v), block_table=_mlx(table), causal=True)
    expected = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v,
                                                 block_table=table, causal=True)
    assert isinstance(out, mx.array) and relative_l2(np.array(out), expected) < 1e-5
    assert np.array(mk).tobytes() == k_cache.tobytes() and np.array(mv).tobytes() == v_cache.tobytes()
    assert np.array(base).tobytes() != k_cache.tobytes()   # the numpy call appended into k_cache itself
