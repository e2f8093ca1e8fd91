"""The poison rule, for every declared op: outputs start poisoned (conftest), and a call on
finite inputs leaves no poison anywhere a value is due. Each op runs once with every optional
output asked for, on a problem with ragged sizes (tails in every tiled axis) and a row that
sees no key (where the rule says 0 and lse -inf, not "unwritten")."""

from __future__ import annotations

import numpy as np
import pytest

import mfa_native
from conftest import poison
from mfa_native.ops.declaration import OPS
from mfa_native.runtime import runner

B, HQ, HKV, R, C, D = 1, 4, 2, 13, 29, 24


def unwritten(array) -> np.ndarray:
    """Where `array` still holds the poison conftest fills outputs with."""
    array = np.asarray(array)
    if array.dtype.kind == "f" or array.dtype.name == "bfloat16":
        return np.isnan(array.astype(np.float32))
    return array == poison((), array.dtype)[()]


def _inputs(rng):
    q, k, v = (rng.standard_normal((B, h, n, D)).astype(np.float32) for h, n in ((HQ, R), (HKV, C), (HKV, C)))
    sinks = rng.standard_normal(HQ).astype(np.float32)
    return q, k, v, sinks


def _attention(rng):
    q, k, v, sinks = _inputs(rng)
    return mfa_native.attention(q, k, v, causal="upper_left", window=(20, 0), sinks=sinks, return_lse=True)


def _attention_backward(rng):
    q, k, v, sinks = _inputs(rng)
    o, lse = mfa_native.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    return mfa_native.attention_backward(q, k, v, o, lse, rng.standard_normal(o.shape).astype(np.float32),
                                         causal=True, sinks=sinks)


def _block_mask():
    return mfa_native.BlockMask.from_mask(causal=True, R=R, C=C, block_size=8)


def _block_sparse(rng):
    q, k, v, sinks = _inputs(rng)
    return mfa_native.block_sparse_attention(q, k, v, _block_mask(), sinks=sinks, return_lse=True)


def _block_sparse_backward(rng):
    q, k, v, sinks = _inputs(rng)
    o, lse = mfa_native.block_sparse_attention(q, k, v, _block_mask(), sinks=sinks, return_lse=True)
    return mfa_native.block_sparse_attention_backward(q, k, v, o, lse, rng.standard_normal(o.shape).astype(np.float32),
                                                      _block_mask(), sinks=sinks)


def _from_mask(rng):
    mask = rng.random((B, HQ, R, C)) < 0.3
    block_mask = mfa_native.BlockMask.from_mask(mask, R=R, C=C, block_size=8, B=B, H=HQ)
    return [getattr(block_mask, out.name) for out in OPS["block_mask_from_mask"].outputs]


def _indices(rng):
    indices = rng.integers(-1, C, (B, HKV, R, 16)).astype(np.int32)
    indices[0, 0, 3] = -1  # a row with no key
    return indices


def _sparse(rng):
    q, k, v, sinks = _inputs(rng)
    return mfa_native.sparse_attention(q, k, v, _indices(rng), sinks=sinks, return_lse=True)


def _sparse_backward(rng):
    q, k, v, sinks = _inputs(rng)
    indices = _indices(rng)
    o, lse = mfa_native.sparse_attention(q, k, v, indices, sinks=sinks, return_lse=True)
    return mfa_native.sparse_attention_backward(q, k, v, indices, o, lse,
                                                rng.standard_normal(o.shape).astype(np.float32), sinks=sinks)


def _varlen_inputs(rng):
    cu_q, cu_k = np.array([0, 5, 5, 13], np.int32), np.array([0, 0, 17, C], np.int32)  # an empty and a keyless sequence
    q, k, v = (rng.standard_normal((n, h, D)).astype(np.float32) for h, n in ((HQ, R), (HKV, C), (HKV, C)))
    return q, k, v, cu_q, cu_k, rng.standard_normal(HQ).astype(np.float32)


def _varlen(rng):
    q, k, v, cu_q, cu_k, sinks = _varlen_inputs(rng)
    return mfa_native.attention_varlen(q, k, v, cu_q, cu_k, causal=True, window=(6, -1), sinks=sinks, return_lse=True)


def _varlen_backward(rng):
    q, k, v, cu_q, cu_k, sinks = _varlen_inputs(rng)
    o, lse = mfa_native.attention_varlen(q, k, v, cu_q, cu_k, causal=True, sinks=sinks, return_lse=True)
    return mfa_native.attention_varlen_backward(q, k, v, o, lse, rng.standard_normal(o.shape).astype(np.float32),
                                                cu_q, cu_k, causal=True, sinks=sinks)


def _kvcache(rng):
    q = rng.standard_normal((3, 2, HQ, D)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((9, 8, HKV, D)).astype(np.float32) for _ in range(2))
    new = [rng.standard_normal((3, 3, HKV, D)).astype(np.float32) for _ in range(2)]
    table = rng.permutation(9)[:6].reshape(3, 2).astype(np.int32)
    cos, sin = (rng.standard_normal((16, D // 4)).astype(np.float32) for _ in range(2))   # half of D turns
    return mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array([0, 5, 13], np.int32),
                                             k=new[0], v=new[1], block_table=table, rotary_cos=cos, rotary_sin=sin,
                                             causal=True, return_lse=True)


def _topk(rng):
    q = rng.standard_normal((B, 3, R, 16)).astype(np.float32)
    k = rng.standard_normal((B, 1, C, 16)).astype(np.float32)
    return mfa_native.sparse_topk(q, k, rng.random((B, 3, R)).astype(np.float32), 40, return_scores=True)


def _int8(rng):
    q, k, v, sinks = _inputs(rng)
    return mfa_native.int8_attention(q, k, v, causal=True, sinks=sinks, return_lse=True)


def _int8_quantized(rng):
    q, k, v, _ = _inputs(rng)
    return list(OPS["int8_quantized"].function(q, k, v).values())


def _merge(rng):
    q, k, v, _ = _inputs(rng)
    parts = [mfa_native.attention(q, k[:, :, s], v[:, :, s], return_lse=True) for s in (slice(0, 11), slice(11, C))]
    return mfa_native.merge_attention([p[0] for p in parts], [p[1] for p in parts])


def _quantize(rng):
    x = rng.standard_normal((3, 5, 64)).astype(np.float16)
    quantized = mfa_native.quantize(x, "affine", bits=4, group_size=32)
    return [quantized.scales, quantized.biases, quantized.dequantize()]  # data: every uint32 value is valid


CALLS = {"attention": _attention, "attention_backward": _attention_backward, "block_sparse_attention": _block_sparse,
         "block_sparse_attention_backward": _block_sparse_backward, "block_mask_from_mask": _from_mask,
         "sparse_attention": _sparse, "sparse_attention_backward": _sparse_backward, "sparse_topk": _topk,
         "attention_varlen": _varlen, "attention_varlen_backward": _varlen_backward,
         "attention_with_kvcache": _kvcache, "int8_attention": _int8, "int8_quantized": _int8_quantized, "merge_attention": _merge, "quantize": _quantize}


def test_every_op_has_a_call():
    assert set(CALLS) == set(OPS)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_no_poison_survives_a_call(rng, name):
    assert getattr(runner._allocate, "poisons", False), "outputs are poisoned before every call"
    outputs = CALLS[name](rng)
    for index, out in enumerate(outputs):
        assert np.asarray(out).size > 0
        assert not unwritten(out).any(), f"{name}: output {index} has {int(unwritten(out).sum())} unwritten elements"


def test_the_rule_sees_an_unwritten_element():
    out = np.ones((3, 4), np.float32)
    out[1, 2] = poison((), np.float32)[()]
    assert unwritten(out).sum() == 1
    assert unwritten(poison((2,), np.int32)).all() and not unwritten(np.array([-1, 0], np.int32)).any()
