"""mfa_native.int8_attention against its three references (issue 9, section 3):

1. float64 attention on the original inputs (how close int8 attention is to attention);
2. the numpy emulation of the same quantized pipeline (that the kernels compute exactly it);
3. the numpy quantizer (that the quantizer kernels store exactly its integers and scales).

Outputs are poisoned (NaN) before every run (conftest), inputs fresh per test.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import relative_l2
from hypothesis import given, settings
from hypothesis import strategies as st
from ml_dtypes import bfloat16

import mfa_native
from mfa_native import codegen
from mfa_native.bench.int8_accuracy import INPUTS, metrics
from mfa_native.codegen import AttentionProblem, Int8Problem
from mfa_native.int8_reference import int8_attention_emulation, int8_quantized_reference
from mfa_native.ops.int8_attention import int8_quantized
from mfa_native.reference import attention_reference

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}
FLOAT_BOUND = {"int8": 0.05, "float": 0.02}   # relative L2 against float64 attention, by pv


def shapes(*, B=1, Hq=2, Hkv=None, R=19, C=37, D=32, Dv=None, layout="bhsd"):
    Hkv, Dv = Hkv or Hq, Dv or D
    logical = [(B, Hq, R, D), (B, Hkv, C, D), (B, Hkv, C, Dv)]
    return [s if layout == "bhsd" else (s[0], s[2], s[1], s[3]) for s in logical]


# ---------------------------------------------------------------------------
# 1. Against float64 attention on the original inputs.


@pytest.mark.parametrize("inputs, qk_scale, pv", list(itertools.product(INPUTS, ["token", "tile"], ["int8", "float"])))
def test_close_to_float_attention(rng, inputs, qk_scale, pv):
    q, k, v = INPUTS[inputs](rng, shapes(R=128, C=200, D=64))
    out = mfa_native.int8_attention(q, k, v, qk_scale=qk_scale, pv=pv)
    m = metrics(out, attention_reference(q, k, v))
    assert m["CosSim"] >= 0.999 and m["relative L2"] <= FLOAT_BOUND[pv], m


@pytest.mark.parametrize("pv", ["int8", "float"])
def test_biased_keys_need_smooth_k(rng, pv):
    """K biased by 10 sigma per channel (one channel by 100): without smooth_k its scale is
    spent on the bias, and the error is many times larger than the bound."""
    q, k, v = INPUTS["biased K"](rng, shapes(R=64, C=200, D=64))
    ref = attention_reference(q, k, v)
    smooth = relative_l2(mfa_native.int8_attention(q, k, v, pv=pv), ref)
    plain = relative_l2(mfa_native.int8_attention(q, k, v, pv=pv, smooth_k=False), ref)
    assert smooth <= FLOAT_BOUND[pv] < 2 * FLOAT_BOUND[pv] < plain, (smooth, plain)


@pytest.mark.parametrize("dtype, pv", list(itertools.product(["float16", "bfloat16"], ["int8", "float"])))
def test_half_precision_inputs(rng, dtype, pv):
    for inputs, make in INPUTS.items():
        q, k, v = (x.astype(DTYPES[dtype]) for x in make(rng, shapes(R=64, C=150, D=64, Hq=4, Hkv=2)))
        out, lse = mfa_native.int8_attention(q, k, v, pv=pv, causal=True, return_lse=True)
        assert out.dtype == q.dtype and lse.dtype == np.float32
        expected, expected_lse = attention_reference(q, k, v, causal=True, return_lse=True)
        m = metrics(out, expected)
        assert m["CosSim"] >= 0.999 and m["relative L2"] <= FLOAT_BOUND[pv], (inputs, m)
        np.testing.assert_allclose(lse, expected_lse, atol=0.05)


# ---------------------------------------------------------------------------
# 2. Against the numpy emulation of the same pipeline.

EMULATED = [
    dict(),
    dict(causal=True),
    dict(causal="upper_left", dims=dict(R=45, C=29)),
    dict(causal=True, dims=dict(R=29, C=150)),
    dict(mask="bool"),
    dict(mask="additive", dims=dict(R=21, C=140)),
    dict(window=(40, 10), dims=dict(R=70, C=160)),
    dict(sinks=True, causal=True),
    dict(dims=dict(Hq=6, Hkv=2)),
    dict(dims=dict(D=40, Dv=24)),
    dict(dims=dict(D=72, Dv=8, R=33, C=65)),
    dict(layout="bshd", dims=dict(Hq=4, Hkv=2)),
    dict(strided=True),
    dict(dims=dict(R=1, C=200)),
    dict(dims=dict(R=1, C=1)),
    dict(dims=dict(R=130, C=17, B=2)),
    dict(mask="additive", sinks=True, causal="upper_left", window=(-1, 3), layout="bshd",
         dims=dict(B=2, Hq=4, Hkv=1, R=40, C=129, D=48, Dv=40)),
]
OPTIONS = [dict(qk_scale=q, smooth_k=s, pv=p) for q, s, p in itertools.product(["token", "tile"], [True, False],
                                                                                  ["int8", "float"])]


def _case_ids(case) -> str:
    parts = [f"{k}={v}" for k, v in case.items() if k != "dims"]
    parts += [",".join(f"{k}{v}" for k, v in case["dims"].items())] if "dims" in case else []
    return "-".join(parts) or "plain"


def case_arguments(rng, case) -> tuple[tuple[np.ndarray, ...], dict]:
    """q, k, v and the keyword arguments of one case: fresh masks and sinks of its shape."""
    layout = case.get("layout", "bhsd")
    dims = {"R": 19, "C": 77, **case.get("dims", {})}
    q, k, v = INPUTS["gaussian"](rng, shapes(layout=layout, **dims))
    if case.get("strided"):   # every tensor a view with gaps between rows and heads
        q, k, v = (np.concatenate([x, x], axis=-1)[..., :x.shape[-1]] for x in (q, k, v))
        k = np.ascontiguousarray(np.swapaxes(k, 1, 2)).swapaxes(1, 2)   # C outermost in memory
    kwargs = {name: case[name] for name in ("causal", "window") if name in case}
    kwargs["layout"] = layout
    B, Hq, R, C = dims.get("B", 1), dims.get("Hq", 2), dims["R"], dims["C"]
    if case.get("mask") == "bool":
        kwargs["mask"] = rng.random((B, 1, R, C)) > 0.3
        kwargs["mask"][:, :, R // 2] = False   # a row with no key
    elif case.get("mask") == "additive":
        mask = rng.standard_normal((Hq, R, C)).astype(np.float32)
        mask[:, ::3, 5:] = -np.inf
        kwargs["mask"] = mask
    if case.get("sinks"):
        kwargs["sinks"] = rng.standard_normal(Hq).astype(np.float32)
    return (q, k, v), kwargs


@pytest.mark.parametrize("case", EMULATED, ids=[_case_ids(c) for c in EMULATED])
def test_computes_the_emulated_pipeline(rng, case):
    """Every feature, each case under two of the eight (qk_scale, smooth_k, pv) choices (all
    eight over the cases): output and lse as the numpy emulation's."""
    (q, k, v), kwargs = case_arguments(rng, case)
    index = EMULATED.index(case)
    for options in (OPTIONS[index % 8], OPTIONS[(index + 3) % 8]):
        out, lse = mfa_native.int8_attention(q, k, v, return_lse=True, **options, **kwargs)
        expected, expected_lse = int8_attention_emulation(q, k, v, return_lse=True, **options, **kwargs)
        assert out.shape == expected.shape and out.dtype == q.dtype
        assert relative_l2(out, expected) <= 1e-4 or not np.any(expected), options
        empty = np.isneginf(expected_lse)
        np.testing.assert_array_equal(np.isneginf(lse), empty)
        np.testing.assert_allclose(lse[~empty], expected_lse[~empty], rtol=1e-5, atol=1e-5)
        rows = out if kwargs["layout"] == "bhsd" else out.transpose(0, 2, 1, 3)
        assert np.all(rows[empty] == 0), "rows without keys give 0"


@pytest.mark.parametrize("pv", ["int8", "float"])
def test_biased_keys_compute_the_emulated_pipeline(rng, pv):
    """K with a large mean per channel: centered on the exact mean (not a float32 one, which
    would move every value of such a channel and flip its integers), and the logits without
    the row's large shift, the kernel still computes the float64 emulation's pipeline."""
    q, k, v = INPUTS["biased K"](rng, shapes(Hq=4, Hkv=2, R=24, C=700, D=64))
    out, lse = mfa_native.int8_attention(q, k, v, pv=pv, return_lse=True)
    expected, expected_lse = int8_attention_emulation(q, k, v, pv=pv, return_lse=True)
    assert relative_l2(out, expected) <= 1e-4
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5, atol=1e-5)


@st.composite
def int8_problems(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    Hkv = draw(st.sampled_from([1, 2]))
    case = dict(dims=dict(R=draw(st.integers(1, 70)), C=draw(st.integers(1, 140)), D=20,   # D: the cases above
                          Hq=Hkv * draw(st.sampled_from([1, 2])), Hkv=Hkv),
                causal=draw(st.sampled_from([False, True, "upper_left"])),
                window=draw(st.sampled_from([None, (30, 5), (-1, 0)])), sinks=draw(st.booleans()),
                mask=draw(st.sampled_from([None, "bool", "additive"])))
    options = dict(qk_scale=draw(st.sampled_from(["token", "tile"])), smooth_k=draw(st.booleans()),
                   pv=draw(st.sampled_from(["int8", "float"])))
    return seed, case, options


@settings(max_examples=12, deadline=None)   # each example may compile new kernels: a cold run stays short
@given(int8_problems())
def test_random_problems_compute_the_emulated_pipeline(problem):
    seed, case, options = problem
    (q, k, v), kwargs = case_arguments(np.random.default_rng(seed), {n: x for n, x in case.items() if x is not None})
    out, lse = mfa_native.int8_attention(q, k, v, return_lse=True, **options, **kwargs)
    expected, expected_lse = int8_attention_emulation(q, k, v, return_lse=True, **options, **kwargs)
    assert np.linalg.norm(out - expected) <= 1e-4 * np.linalg.norm(expected) + 1e-6
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_give_zero_and_minus_infinity(rng):
    q, k, v = INPUTS["gaussian"](rng, shapes(R=16, C=70))
    mask = np.ones((16, 70), dtype=bool)
    mask[3] = False
    for pv in ("int8", "float"):
        out, lse = mfa_native.int8_attention(q, k, v, mask=mask, pv=pv, return_lse=True)
        assert np.all(out[:, :, 3] == 0) and np.all(np.isneginf(lse[:, :, 3]))
        assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[:, :, np.arange(16) != 3]))


@pytest.mark.parametrize("where, qk_scale", [("q", "token"), ("k", "token"), ("v", "tile")])
def test_nan_propagates(rng, where, qk_scale):
    """A NaN never disappears: with token scales, a NaN in q makes its row NaN; one in k
    (smooth_k: through the mean) or v (through its channel's scale) reaches every row."""
    q, k, v = INPUTS["gaussian"](rng, shapes(R=16, C=70))
    {"q": q, "k": k, "v": v}[where][0, 1, 5, 3] = np.nan
    out = mfa_native.int8_attention(q, k, v, qk_scale=qk_scale)
    nan = np.isnan(out)
    if where == "q":
        assert nan[0, 1, 5].all() and nan.sum() == out.shape[-1]
    elif where == "k":
        assert nan[0, 1].all()
    else:
        assert nan[0, 1, :, 3].all()


def test_warm_calls_reuse_the_prepared_pass(rng):
    (q, k, v), kwargs = case_arguments(rng, dict(causal=True, sinks=True))
    first = mfa_native.int8_attention(q, k, v, **kwargs)
    with mfa_native.profile() as prof:
        again = mfa_native.int8_attention(q, k, v, **kwargs)
    np.testing.assert_array_equal(first, again)
    kernels = [r.kernel for r in prof.records]
    assert kernels == ["int8_key_mean", "int8_quantize_k", "int8_quantize_q", "int8_quantize_v",
                       "int8_attention_forward"], "one pass: quantizers, then attention"


def test_causal_skips_the_key_blocks_above_the_diagonal(rng):
    q, k, v = INPUTS["gaussian"](rng, shapes(R=256, C=256, D=16, Hq=1))
    ops = {}
    for causal in (False, True):
        with mfa_native.profile() as prof:
            mfa_native.int8_attention(q, k, v, causal=causal)
        ops[causal] = prof.records[-1].simdgroup_matrix_ops
    assert ops[True] < 0.65 * ops[False], ops   # about half, plus the diagonal blocks


def test_backward_through_attention_backward_with_int8_lse(rng):
    """No backward of its own: attention_backward with the float inputs and int8_attention's
    output and lse gives gradients close to attention's."""
    q, k, v = INPUTS["gaussian"](rng, shapes(R=40, C=90, D=32))
    do = rng.standard_normal(q.shape[:3] + (v.shape[-1],)).astype(np.float32)
    o_float, lse_float = mfa_native.attention(q, k, v, causal=True, return_lse=True)
    expected = mfa_native.attention_backward(q, k, v, o_float, lse_float, do, causal=True)
    for pv in ("int8", "float"):
        o, lse = mfa_native.int8_attention(q, k, v, causal=True, pv=pv, return_lse=True)
        grads = mfa_native.attention_backward(q, k, v, o, lse, do, causal=True)
        for got, want in zip(grads, expected):
            assert relative_l2(got, want) < 0.02, pv   # about 0.5 % measured


# ---------------------------------------------------------------------------
# 3. The quantizer kernels against the numpy quantizer.

QUANTIZER_CASES = [
    dict(qk_scale="token", smooth_k=True, pv="int8", dims=dict(R=37, C=150, D=40, Dv=24, Hq=4, Hkv=2)),
    dict(qk_scale="tile", smooth_k=True, pv="int8", dims=dict(R=37, C=150, D=72, Dv=33)),
    dict(qk_scale="tile", smooth_k=False, pv="float", dims=dict(R=16, C=64, D=16)),
    dict(qk_scale="token", smooth_k=False, pv="int8", layout="bshd", dims=dict(R=5, C=1, B=2)),
    dict(qk_scale="tile", smooth_k=True, pv="float", layout="bshd", dims=dict(R=80, C=200, Hq=3, Hkv=1)),
]


@pytest.mark.parametrize("case", QUANTIZER_CASES, ids=[_case_ids(c) for c in QUANTIZER_CASES])
def test_quantizers_store_the_numpy_quantizers_integers(rng, case):
    layout = case.get("layout", "bhsd")
    options = {name: case[name] for name in ("qk_scale", "smooth_k", "pv")}
    q, k, v = INPUTS["biased K"](rng, shapes(layout=layout, **case["dims"]))
    got = int8_quantized(q, k, v, layout=layout, **options)
    expected = int8_quantized_reference(q, k, v, layout=layout, **options)
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert got[name].shape == want.shape, name
        if name.endswith("_int8"):
            assert got[name].dtype == np.int8
            np.testing.assert_array_equal(got[name], want, err_msg=name)   # random inputs: no exact ties
        elif name == "k_mean_low":   # with k_mean, the mean to float64's precision (the split may differ)
            total, exact = (x["k_mean"].astype(np.float64) + x[name] for x in (got, expected))
            np.testing.assert_allclose(total, exact, rtol=1e-10, atol=1e-10 * np.abs(exact).max())
        elif name == "q_shift":   # a float32 dot product against the float64 one
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        else:                     # scales and means: the same float32 operations
            np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=0, err_msg=name)


def test_tile_scales_are_shared_by_aligned_tiles(rng):
    q, k, v = INPUTS["gaussian"](rng, shapes(R=37, C=150))
    got = int8_quantized(q, k, v, qk_scale="tile")
    for name, rows, length in (("q_scale", 16, 37), ("k_scale", 64, 150)):
        scales = got[name][0, 0]
        for first in range(0, length, rows):
            assert np.all(scales[first:first + rows] == scales[first])
        assert len(np.unique(scales)) == -(-length // rows)


# ---------------------------------------------------------------------------
# 4. Errors.


@pytest.mark.parametrize("option, value, error", [
    ("qk_scale", "row", ValueError), ("qk_scale", None, ValueError), ("pv", "int4", ValueError),
    ("pv", 8, ValueError), ("smooth_k", 1, TypeError), ("smooth_k", "yes", TypeError)])
def test_bad_options_name_the_argument(rng, option, value, error):
    q, k, v = INPUTS["gaussian"](rng, shapes())
    with pytest.raises(error, match=option):
        mfa_native.int8_attention(q, k, v, **{option: value})


def test_attention_arguments_are_checked_as_in_attention(rng):
    q, k, v = INPUTS["gaussian"](rng, shapes())
    with pytest.raises(ValueError, match="causal"):
        mfa_native.int8_attention(q, k, v, causal="diagonal")
    with pytest.raises(TypeError, match="k has dtype"):
        mfa_native.int8_attention(q, k.astype(np.float16), v)
    with pytest.raises(ValueError, match="sinks must have shape"):
        mfa_native.int8_attention(q, k, v, sinks=np.zeros(q.shape[1] + 1, dtype=np.float32))
    with pytest.raises(TypeError, match="k is a QuantizedTensor: int8_attention quantizes float k and v itself"):
        mfa_native.int8_attention(q, mfa_native.quantize(k, "q8_0"), v)


def test_codegen_refuses_integer_sums_that_could_reach_2_to_the_24():
    codegen.check_int8_exact(head_dim=1040)            # 1040 * 127**2 < 2**24
    with pytest.raises(ValueError, match="2\\*\\*24"):
        codegen.check_int8_exact(head_dim=1041)
    with pytest.raises(ValueError, match="P V over a block of 1041 keys"):
        codegen.check_int8_exact(head_dim=64, value_block=1041)
    with pytest.raises(ValueError, match="qk_scale"):
        Int8Problem(AttentionProblem(1, 1, 1, 8, 8, 64, 64), qk_scale="row")


def test_empty_problems_run_no_kernel(rng):
    q, k, v = INPUTS["gaussian"](rng, shapes(C=0))
    out, lse = mfa_native.int8_attention(q, k, v, return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("framework", ["torch", "mlx.core"])
def test_framework_arrays_in_give_that_framework_out(rng, framework):
    module = pytest.importorskip(framework)
    convert = module.from_numpy if framework == "torch" else module.array
    q, k, v = (rng.standard_normal((1, 4, n, 32)).astype(np.float32) for n in (9, 70, 70))
    expected = mfa_native.int8_attention(q, k, v, causal=True)
    out = mfa_native.int8_attention(convert(q), convert(k), convert(v), causal=True)
    assert type(out).__module__.split(".")[0] == framework.split(".")[0]
    np.testing.assert_array_equal(np.asarray(out), expected)
