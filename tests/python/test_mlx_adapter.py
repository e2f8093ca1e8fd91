"""mfa_native.mlx: mx.fast.scaled_dot_product_attention's semantics, gradients, mx.compile."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from conftest import relative_l2

import mfa_native
from mfa_native.quantized import QuantizedTensor
from mfa_native.reference import attention_backward_reference, attention_reference

mx = pytest.importorskip("mlx.core")
mm = pytest.importorskip("mfa_native.mlx")

SCALE = 0.3


def _inputs(rng, dtype=np.float32):
    shapes = ((2, 4, 10, 16), (2, 2, 14, 16), (2, 2, 14, 8))
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _masks(rng):
    return {"none": None, "causal": "causal", "bool": rng.random((2, 1, 10, 14)) > 0.3,
            "additive": rng.standard_normal((10, 14)).astype(np.float32)}


def _reference_options(mask):
    if isinstance(mask, str):
        return dict(causal="lower_right")
    return dict(mask=mask)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
def test_sdpa_matches_mx_fast_and_float64(rng, mask_kind, sinks):
    q, k, v = _inputs(rng)
    s = rng.standard_normal(4).astype(np.float32) if sinks else None
    mask = _masks(rng)[mask_kind]
    args = [mx.array(x) for x in (q, k, v)]
    kwargs = dict(scale=SCALE, mask=mx.array(mask) if isinstance(mask, np.ndarray) else mask,
                  sinks=None if s is None else mx.array(s))
    ours = mm.scaled_dot_product_attention(*args, **kwargs)
    theirs = mx.fast.scaled_dot_product_attention(*args, **kwargs)
    expected = attention_reference(q, k, v, scale=SCALE, sinks=s, **_reference_options(mask))
    assert isinstance(ours, mx.array) and ours.dtype == mx.float32
    assert relative_l2(np.array(ours), expected) < 1e-5
    assert relative_l2(np.array(theirs), expected) < 1e-5

    do = rng.standard_normal(expected.shape).astype(np.float32)
    primals = args + ([kwargs["sinks"]] if sinks else [])
    del kwargs["sinks"]

    def loss(fn):
        def of(*arrays):
            return (fn(*arrays[:3], sinks=arrays[3] if sinks else None, **kwargs) * mx.array(do)).sum()
        return of

    argnums = tuple(range(len(primals)))
    ours = mx.grad(loss(mm.scaled_dot_product_attention), argnums=argnums)(*primals)
    theirs = mx.grad(loss(mx.fast.scaled_dot_product_attention), argnums=argnums)(*primals)
    expected = attention_backward_reference(q, k, v, do, scale=SCALE, sinks=s, **_reference_options(mask))
    for a, b, e in zip(ours, theirs, expected):
        assert relative_l2(np.array(a), e) < 1e-5
        assert relative_l2(np.array(b), e) < 1e-4


def test_vjp_and_bfloat16(rng):
    q, k, v = (mx.array(x).astype(mx.bfloat16) for x in _inputs(rng))
    out, (dq, dk, dv) = mx.vjp(lambda q, k, v: mm.attention(q, k, v, causal=True),
                               [q, k, v], [mx.ones((2, 4, 10, 8), dtype=mx.bfloat16)])
    assert out[0].dtype == mx.bfloat16 and dq.dtype == mx.bfloat16
    f32 = [np.array(x.astype(mx.float32)) for x in (q, k, v)]
    expected = attention_backward_reference(*f32, np.ones((2, 4, 10, 8)), causal=True)
    for a, e in zip((dq, dk, dv), expected):
        assert relative_l2(np.array(a.astype(mx.float32)), e) < 3e-2


def test_rows_without_keys_give_zero_where_mlx_gives_the_mean_of_v(rng):
    q, k, v = (mx.array(x) for x in _inputs(rng))
    mask = np.ones((10, 14), dtype=bool)
    mask[2] = False
    ours = mm.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mx.array(mask))
    assert np.array_equal(np.array(ours)[:, :, 2], np.zeros((2, 4, 8), np.float32))
    assert np.all(np.isfinite(np.array(ours)))


def test_lse_is_not_differentiable(rng):
    q, k, v = (mx.array(x) for x in _inputs(rng))
    grad = mx.grad(lambda q: mm.attention(q, k, v, return_lse=True)[1].sum())(q)
    assert not np.any(np.array(grad))


def test_compile_raises_a_clear_error(rng):
    q, k, v = (mx.array(x) for x in _inputs(rng))
    with pytest.raises(RuntimeError, match="mx.compile or mx.vmap"):
        mx.compile(lambda q, k, v: mm.scaled_dot_product_attention(q, k, v, scale=SCALE))(q, k, v)


def test_mask_string_must_be_causal(rng):
    q, k, v = (mx.array(x) for x in _inputs(rng))
    with pytest.raises(ValueError, match="'causal'"):
        mm.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="upper_left")


def _quantized_cache(rng):
    """Queries (2, 4, 10, 64) and an mlx-lm 4-bit cache of k and v (2, 2, 14, 64) (mlx-lm's
    function needs Dv = D): numpy q, the (wq, scales, biases) tuples, and the floats they hold."""
    q, k, v = (np.concatenate([x] * (64 // x.shape[-1]), axis=-1) for x in _inputs(rng))   # groups of 32
    q_keys, q_values = (mx.quantize(mx.array(x), group_size=32, bits=4) for x in (k, v))
    floats = [np.array(mx.dequantize(*fields, group_size=32, bits=4)) for fields in (q_keys, q_values)]
    return q, q_keys, q_values, floats


def test_quantized_sdpa_with_the_wrong_bits_names_bits(rng):
    q, q_keys, q_values, _ = _quantized_cache(rng)   # a 4-bit cache
    with pytest.raises(ValueError, match=r"^bits=8 does not fit q_keys: 8 words per row hold queries' D = 64 "
                                         r"values at 4 bits"):
        mm.quantized_scaled_dot_product_attention(mx.array(q), q_keys, q_values, scale=SCALE, group_size=32, bits=8)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool"])
def test_quantized_sdpa_over_an_mlx_lm_cache(rng, mask_kind):
    """mlx-lm's quantized_scaled_dot_product_attention: the cache's (wq, scales, biases) tuples,
    read in the kernel; equal to attention over what mx.dequantize gives, and differentiable in
    the queries as mlx-lm's own function is."""
    base = pytest.importorskip("mlx_lm.models.base")
    q, q_keys, q_values, (k_floats, v_floats) = _quantized_cache(rng)
    mask = _masks(rng)[mask_kind]
    options = dict(scale=SCALE, mask=mx.array(mask) if isinstance(mask, np.ndarray) else mask, group_size=32, bits=4)
    out = mm.quantized_scaled_dot_product_attention(mx.array(q), q_keys, q_values, **options)
    assert isinstance(out, mx.array) and out.shape == (2, 4, 10, 64)
    expected = attention_reference(q, k_floats, v_floats, scale=SCALE, **_reference_options(mask))
    assert relative_l2(np.array(out), expected) < 1e-4

    do = mx.array(rng.standard_normal((2, 4, 10, 64)).astype(np.float32))

    def dq(function):
        return np.array(mx.grad(lambda q: (function(q, q_keys, q_values, **options) * do).sum())(mx.array(q)))

    want, _, _ = attention_backward_reference(q, k_floats, v_floats, np.array(do), scale=SCALE,
                                              **_reference_options(mask))
    assert relative_l2(dq(mm.quantized_scaled_dot_product_attention), want) < 1e-4
    assert relative_l2(dq(base.quantized_scaled_dot_product_attention), want) < 1e-4
    # mlx-lm's positional call works unchanged: (queries, q_keys, q_values, scale, mask, group_size, bits)
    positional = mm.quantized_scaled_dot_product_attention(mx.array(q), q_keys, q_values, SCALE, options["mask"], 32, 4)
    assert np.array_equal(np.array(positional), np.array(out))
    theirs = list(inspect.signature(base.quantized_scaled_dot_product_attention).parameters)
    assert list(inspect.signature(mm.quantized_scaled_dot_product_attention).parameters)[:len(theirs)] == theirs


def test_quantized_attention_gradients(rng):
    """attention over QuantizedTensors of MLX fields: dq and dsinks as over the dequantized
    K/V; a gradient asked of a quantized field raises, where a captured array would get 0."""
    q, q_keys, q_values, floats = _quantized_cache(rng)
    k, v = (QuantizedTensor.from_mlx(*fields, group_size=32, bits=4) for fields in (q_keys, q_values))
    sinks = rng.standard_normal(4).astype(np.float32)

    def loss(q, sinks):
        return mm.attention(q, k, v, causal=True, sinks=sinks).square().sum()

    dq, dsinks = mx.grad(loss, argnums=(0, 1))(mx.array(q), mx.array(sinks))
    out = attention_reference(q, *floats, causal=True, sinks=sinks)
    want = attention_backward_reference(q, *floats, 2 * out, causal=True, sinks=sinks)
    assert relative_l2(np.array(dq), want[0]) < 1e-4 and relative_l2(np.array(dsinks), want[3]) < 1e-4
    for field in ("scales", "biases"):
        def of_field(x, field=field):
            return mm.attention(mx.array(q), k.with_fields(**{field: x}), v).sum()

        with pytest.raises(NotImplementedError, match=f"k.{field} is a field of a QuantizedTensor"):
            mx.grad(of_field)(getattr(k, field))


def _counted(monkeypatch, name: str) -> list:
    """Counts the calls of mfa_native.mlx's function `name` (the patched path runs it)."""
    calls, function = [], getattr(mm, name)
    monkeypatch.setattr(mm, name, lambda *a, **kw: calls.append(1) or function(*a, **kw))
    return calls


def test_patch_routes_falls_back_and_restores(rng, monkeypatch):
    calls = _counted(monkeypatch, "scaled_dot_product_attention")
    original = mx.fast.scaled_dot_product_attention
    q, k, v = (mx.array(x) for x in _inputs(rng))
    empty_row = np.ones((10, 14), dtype=bool)
    empty_row[3] = False

    @mm.patch()
    def attend(**kwargs):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, **kwargs)

    ours = attend(mask="causal")
    assert len(calls) == 1 and mx.fast.scaled_dot_product_attention is original
    expected = attention_reference(*(np.array(x) for x in (q, k, v)), scale=SCALE, causal="lower_right")
    assert relative_l2(np.array(ours), expected) < 1e-5
    for kwargs in (dict(mask=mx.array(empty_row)), dict(stream=mx.cpu)):
        fallback = attend(**kwargs)   # MLX's own: the mean of v over a row without keys; its stream
        theirs = original(q, k, v, scale=SCALE, **kwargs)
        assert relative_l2(np.array(fallback), np.array(theirs)) < 1e-6
    with pytest.raises(ValueError, match=r"^\[scaled_dot_product_attention\] invalid mask"):
        attend(mask="upper_left")     # MLX's own error
    with pytest.raises(KeyError), mm.patch():
        assert mx.fast.scaled_dot_product_attention is not original
        raise KeyError
    assert mx.fast.scaled_dot_product_attention is original


def test_patch_runs_every_mask_rank_mlx_broadcasts_and_falls_back_only_on_unsupported(rng, monkeypatch):
    """0-d and 1-d masks (a scalar bool or additive value, a per-key vector) broadcast as MLX
    does and run in mfa_native (its IndexError escaped the pre-check, 11 cases of MLX's own
    test_fast_sdpa.py); a mask with an empty row falls back; an internal error is not taken for
    a refusal."""
    calls = _counted(monkeypatch, "scaled_dot_product_attention")
    original = mx.fast.scaled_dot_product_attention
    q, k, v = (mx.array(x) for x in _inputs(rng))
    masks = [mx.array(True), mx.array(0.5, dtype=mx.float32), mx.array(rng.random(14) > 0.3),
             mx.array(rng.standard_normal(14).astype(np.float32)), mx.array(rng.random((10, 1)) > -1),
             mx.array(rng.standard_normal((1, 4, 1, 14)).astype(np.float32))]
    with mm.patch():
        for mask in masks:
            before = len(calls)
            ours = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)
            assert len(calls) == before + 1, mask.shape
            theirs = original(q, k, v, scale=SCALE, mask=mask)
            assert relative_l2(np.array(ours), np.array(theirs)) < 1e-5, mask.shape
        before = len(calls)
        fallback = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mx.array(False))
        assert relative_l2(np.array(fallback), np.array(original(q, k, v, scale=SCALE, mask=mx.array(False)))) < 1e-6
        with pytest.raises(mfa_native.Unsupported):
            mm._fast_sdpa(q, k, v, scale=SCALE, mask=mx.array(False))

    def broken(*args, **kwargs):
        raise IndexError("a bug, not a refusal")

    monkeypatch.setattr(mm, "scaled_dot_product_attention", broken)
    with mm.patch(), pytest.raises(IndexError, match="a bug"):
        mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE)


def _tiny_llama(rng):
    """A random mlx-lm Llama (GQA, head dim 32) small enough to generate with in a test."""
    llama = pytest.importorskip("mlx_lm.models.llama")
    mx.random.seed(int(rng.integers(1 << 31)))
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
                           vocab_size=101)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _generated(model, prompt, kv_bits) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and their log-probabilities from mlx-lm's generate_step (the prompt through
    a causal mask, then one token at a time; a 4-bit KV cache from the start with kv_bits=4)."""
    from mlx_lm.generate import generate_step

    steps = list(generate_step(mx.array(prompt), model, max_tokens=5, kv_bits=kv_bits, kv_group_size=32,
                               quantized_kv_start=0))
    return [int(token) for token, _ in steps], np.stack([np.array(logprobs) for _, logprobs in steps])


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_patch_runs_an_mlx_lm_model(rng, monkeypatch, kv_bits):
    """A tiny random mlx-lm Llama generates the same tokens and log-probabilities with and
    without the patch, with a plain and a 4-bit KV cache, and the patched run used mfa_native."""
    model = _tiny_llama(rng)
    prompt = rng.integers(0, 101, size=12).tolist()
    plain, quantized = (_counted(monkeypatch, name) for name in
                        ("scaled_dot_product_attention", "quantized_scaled_dot_product_attention"))
    tokens, logprobs = _generated(model, prompt, kv_bits)
    assert not plain and not quantized
    with mm.patch():
        patched_tokens, patched_logprobs = _generated(model, prompt, kv_bits)
    assert patched_tokens == tokens
    assert relative_l2(patched_logprobs, logprobs) < 1e-5
    assert len(quantized if kv_bits else plain) >= 2 * 5   # every layer, every step
