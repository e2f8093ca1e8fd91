"""MLX score_mods (`mfa_native.mlx.attention(score_mod=fn)` and the other MLX ops): the MLX
function is traced into the same expression text torch traces from the same function written
with torch (test_score_mod.py checks those texts against float64 and torch's flex_attention),
runs with the bits of the text form, forward and through mx.grad, and what falls outside the
vocabulary is refused naming it, before a KV-cache append writes anything."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import relative_l2

mx = pytest.importorskip("mlx.core")
import mfa_native  # noqa: E402
import mfa_native.mlx as mm  # noqa: E402
from mfa_native.mlx_score_mod import trace  # noqa: E402

HQ, R, C = 4, 12, 16
PAIR = mx.array([1.0, 2.0])


def t5_buckets(relative, buckets=8, max_distance=24):
    """test_score_mod.t5_buckets, in MLX: a helper the traced function calls."""
    half = buckets // 2
    offset = (relative > 0).astype(mx.int32) * half
    distance = mx.abs(relative)
    exact = half // 2
    large = exact + (mx.log(distance.astype(mx.float32) / exact) / math.log(max_distance / exact)
                     * (half - exact)).astype(mx.int32)
    return offset + mx.where(distance < exact, distance, mx.clip(large, None, half - 1))


def mlx_score_mods(tables: dict):
    """test_score_mod.score_mods' examples written with MLX."""
    table, head_bias, slopes, documents = (mx.array(tables[n]) for n in ("table", "head_bias", "slopes", "documents"))
    return {
        "relative_position": lambda s, b, h, q, kv: s + (q - kv) * 0.05,
        "alibi": lambda s, b, h, q, kv: s - slopes[h] * mx.abs(q - kv),
        "softcap": lambda s, b, h, q, kv: 2.0 * mx.tanh(s / 2.0),
        "head_bias": lambda s, b, h, q, kv: s + head_bias[h],
        "t5": lambda s, b, h, q, kv: s + table[h, t5_buckets(q - kv)],
        "document_bias": lambda s, b, h, q, kv: mx.where(documents[q] == documents[kv], s, s - 1.5 + b),
        "two_tables": lambda s, b, h, q, kv: s + head_bias[h] * table[h, kv % 8],
    }


READS = {"relative_position": [], "softcap": [], "alibi": ["slopes"], "head_bias": ["head_bias"], "t5": ["table"],
         "document_bias": ["documents"], "two_tables": ["head_bias", "table"]}   # the arrays each reads, in order


def captured(rng) -> dict:
    return {"table": rng.standard_normal((HQ, 8)).astype(np.float32),
            "head_bias": rng.standard_normal(HQ).astype(np.float32),
            "slopes": np.array([2.0 ** (-8 * (h + 1) / HQ) for h in range(HQ)], np.float32),
            "documents": np.sort(rng.integers(0, 3, max(R, C))).astype(np.int32)}


NAMES = ["relative_position", "alibi", "softcap", "head_bias", "t5", "document_bias"]   # test_score_mod's


@pytest.mark.parametrize("name", NAMES)
def test_traced_as_torch_traces_the_same_function(rng, name):
    """The text does not depend on the captured values or shapes: torch's examples, with their
    own tables, give the same text; the arrays are the captured tables."""
    pytest.importorskip("torch")
    import test_score_mod
    from mfa_native.torch.score_mod import trace as torch_trace
    tables = captured(rng)
    text, arrays = trace(mlx_score_mods(tables)[name])
    assert text == torch_trace(test_score_mod.score_mods(rng)[name])[0]
    assert len(arrays) == len(READS[name])
    assert all(np.array_equal(np.array(a), tables[n]) for a, n in zip(arrays, READS[name]))


def test_the_arrays_come_in_the_order_the_text_numbers_them(rng):
    tables = captured(rng)
    text, arrays = trace(mlx_score_mods(tables)["two_tables"])
    assert "float read[0](2)" in text and "float read[1](2," in text
    assert [np.array(a).tolist() for a in arrays] == [tables[n].tolist() for n in READS["two_tables"]]


@pytest.mark.parametrize("name", NAMES + ["two_tables"])
def test_runs_with_the_text_forms_bits_forward_and_backward(rng, name):
    score_mod = mlx_score_mods(captured(rng))[name]
    q = rng.standard_normal((2, HQ, R, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, C, 16)).astype(np.float32) for _ in "kv")
    text, arrays = trace(score_mod)
    numpy_arrays = [np.array(a) for a in arrays]
    want = mfa_native.attention(q, k, v, causal=True, score_mod=text, score_mod_tensors=numpy_arrays,
                                return_lse=True, device="cpu")
    got = mm.attention(mx.array(q), mx.array(k), mx.array(v), causal=True, score_mod=score_mod, return_lse=True)
    assert all(np.array(g).tobytes() == w.tobytes() for g, w in zip(got, want))
    plain = mfa_native.attention(q, k, v, causal=True, return_lse=True, device="cpu")
    assert relative_l2(want[1], plain[1]) > 1e-3   # it matters (a per-head bias only to the lse)

    def loss(q_, mod):
        extra = {} if callable(mod) else {"score_mod_tensors": arrays}
        return (mm.attention(q_, mx.array(k), mx.array(v), causal=True, score_mod=mod, **extra) ** 2).sum()
    assert np.array(mx.grad(loss)(mx.array(q), score_mod)).tobytes() == \
        np.array(mx.grad(loss)(mx.array(q), text)).tobytes()


@pytest.mark.parametrize("score_mod, message", [
    (lambda s, b, h, q, kv: mx.sin(s), r"mx\.sin"),
    (lambda s, b, h, q, kv: s if s > 0 else -s, "Python branching"),
    (lambda s, b, h, q, kv: s.astype(mx.float16), r"astype\(mlx\.core\.float16\)"),
    (lambda s, b, h, q, kv: s + (h & 1), "'and' of a non-boolean"),
    (lambda s, b, h, q, kv: s ** 0.5, r"\*\* 0\.5"),
    (lambda s, b, h, q, kv: s + PAIR[s], "indexed by a float"),
    (lambda s, b: s, "could not be traced"),
])
def test_what_it_cannot_compile_is_refused_by_name(score_mod, message):
    with pytest.raises(ValueError, match=message):
        trace(score_mod)


class _Model:
    bias = mx.array([0.5, -0.5, 1.0, 2.0])


def test_refused_before_a_cache_append_writes(rng):
    """An attribute's array is no captured array: tracing fails before the append."""
    q = mx.array(rng.standard_normal((1, 1, HQ, 16)).astype(np.float32))
    k_cache, v_cache = (mx.array(rng.standard_normal((1, 8, 2, 16)).astype(np.float32)) for _ in "kv")
    new = mx.array(rng.standard_normal((1, 1, 2, 16)).astype(np.float32))
    before = np.array(k_cache).copy()
    model = _Model()
    with pytest.raises(ValueError, match="could not be traced"):
        mm.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=mx.array([3], mx.int32), k=new, v=new,
                                  score_mod=lambda s, b, h, q_, kv: s + model.bias[h])
    assert np.array(k_cache).tobytes() == before.tobytes()
    with pytest.raises(ValueError, match="score_mod_tensors is given with a score_mod function"):
        mm.attention(q, k_cache, v_cache, score_mod=lambda s, b, h, q_, kv: s, score_mod_tensors=[k_cache])


def test_tracing_leaves_the_function_as_it_was():
    bias = mx.array([1.0, 2.0, 3.0, 4.0])
    def score_mod(s, b, h, q, kv):
        return mx.tanh(s) + bias[h]
    trace(score_mod)
    result = score_mod(mx.array(0.5), mx.array(0), mx.array(2), mx.array(0), mx.array(0))
    assert abs(float(result) - (math.tanh(0.5) + 3.0)) < 1e-6


def test_a_function_is_traced_once_while_what_it_sees_stays(rng, monkeypatch):
    """As torch's (test_score_mod): the captured array's values are read at each call; a
    rebound value it sees traces again."""
    from mfa_native import mlx_score_mod
    traces = []
    monkeypatch.setattr(mlx_score_mod.TRACES, "trace", lambda fn: traces.append(fn) or trace(fn))
    q = mx.array(rng.standard_normal((1, HQ, R, 16)).astype(np.float32))
    bias, scale = mx.zeros((HQ,)), [0.5]

    def shifted(s, b, h, i, j):
        return s * scale[0] + bias[h] * (i - j) * 0.1

    first = mm.attention(q, q, q, score_mod=shifted, return_lse=True)[1]
    bias[:] = 1.0   # in place: the same array, its new values read at the call
    second = mm.attention(q, q, q, score_mod=shifted, return_lse=True)[1]
    assert relative_l2(np.array(second), np.array(first)) > 0.01 and len(traces) == 1
    scale[0] = 2.0
    mm.attention(q, q, q, score_mod=shifted)
    assert len(traces) == 2


def test_the_plain_ops_trace_a_function_by_qs_framework(rng):
    """mfa_native.attention on MLX arrays traces an MLX function; on numpy arrays a function is
    refused (no framework to trace it), its text is taken."""
    score_mod = mlx_score_mods(captured(rng))["alibi"]
    q = rng.standard_normal((1, HQ, R, 16)).astype(np.float32)
    text, arrays = trace(score_mod)
    want = mfa_native.attention(q, q, q, score_mod=text, score_mod_tensors=[np.array(a) for a in arrays])
    assert np.array(mfa_native.attention(mx.array(q), mx.array(q), mx.array(q), score_mod=score_mod)).tobytes() \
        == want.tobytes()
    with pytest.raises(TypeError, match="score_mod is a function, which is traced by the framework of q's"):
        mfa_native.attention(q, q, q, score_mod=score_mod)


def test_a_gradient_of_a_captured_array_is_an_error_not_zeros(rng):
    """MLX would give the arrays a score_mod reads a zero gradient (they are no inputs of the
    custom function): asking for it raises, in the function form and the text form; q's
    gradient is unaffected."""
    q = mx.array(rng.standard_normal((1, 2, 8, 16)).astype(np.float32))
    text = trace(lambda s, b, h, i, j: s + PAIR[h] * (i - j))[0]
    forms = {"function": lambda bias: dict(score_mod=lambda s, b, h, i, j: s + bias[h] * (i - j)),
             "text": lambda bias: dict(score_mod=text, score_mod_tensors=[bias])}
    for form in forms.values():
        with pytest.raises(NotImplementedError, match="attention gives score_mod_tensors no gradient"):
            mx.grad(lambda bias: mm.attention(q, q, q, **form(bias)).sum())(PAIR)
        assert np.isfinite(np.array(mx.grad(lambda q_: mm.attention(q_, q, q, **form(PAIR)).sum())(q))).all()


def _even(n, flip=False):   # names _odd, which names it back
    return _odd(n) if flip else n % 2 == 0


def _odd(n):
    return ~_even(n)


def test_helpers_that_name_each_other_nested_functions_and_mx_constants(rng):
    """Helpers naming each other are copied once each; a function defined inside the
    score_mod sees the stand-ins too; mx.inf and mx.pi are numbers."""
    def score_mod(s, b, h, q, kv):
        def shifted(x):
            return x + mx.pi * 0.0 + mx.tanh(x) * 0.1
        return mx.where(_even(q - kv) | _even(q - kv, flip=True), shifted(s), -mx.inf)
    text, arrays = trace(score_mod)
    assert "tanh" in text and "-inf" in text and arrays == []
    q = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
    got = mm.attention(*(mx.array(q),) * 3, score_mod=score_mod)
    assert np.array(got).tobytes() == mfa_native.attention(q, q, q, score_mod=text).tobytes()
