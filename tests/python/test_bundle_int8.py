"""int8 attention from a bundle: mfa::int8_attention (through _core's test hook) on the cpu
backend gives Python's mfa_native.int8_attention bit for bit (GQA, both layouts, causal, masks,
a runtime window, sinks, softcap, ALiBi, every quantization choice), from entries whose
templates keep the sizes and the scale symbolic (for every length, the entry's first template
whose guards hold is codegen's); and the same bad calls raise the same exception with the same
message."""

from __future__ import annotations

import json
from dataclasses import asdict

import ml_dtypes
import numpy as np
import pytest

import mfa_native
from mfa_native import _core, codegen
from mfa_native.bundle import entries_of
from mfa_native.bundle.file import pack
from mfa_native.bundle.writer import build_payload, choose, forward_templates, int8_problem, problem

from conftest import poison
from test_bundle_cpp import view

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
BASE = {"op": "int8_attention", "family": ["apple9"], "head_dim": [32], "gqa_ratio": [2], "window": [False],
        "sinks": [False], "mask": ["none"]}
FAMILIES = [
    {**BASE, "dtype": ["float32"], "causal": ["lower_right"], "layout": ["bhsd"], "sinks": [True],
     "qk_scale": ["token"], "smooth_k": [True], "pv": ["int8"]},
    {**BASE, "dtype": ["float16"], "causal": ["none"], "layout": ["bshd"], "mask": ["additive"],
     "mask_dtype": ["float16"], "window": [True], "softcap": [30.0], "alibi": ["per_head"],
     "qk_scale": ["tile"], "smooth_k": [False], "pv": ["float"]},
    {**BASE, "dtype": ["bfloat16"], "causal": ["upper_left"], "layout": ["bhsd"], "mask": ["bool"],
     "qk_scale": ["token", "tile"], "smooth_k": [True, False], "pv": ["int8", "float"]},
    {**BASE, "dtype": ["float32"], "head_dim": [64], "value_dim": [48], "gqa_ratio": [1], "causal": ["none"],
     "layout": ["bshd"], "sinks": [True], "alibi": ["per_batch"], "softcap": [15.0], "qk_scale": ["tile"],
     "smooth_k": [True], "pv": ["int8"]},
]
B, HKV, D = 2, 2, 32
# (dtype, layout, causal, mask, R, C, options); the default run takes the first three (the third a call
# without a window, which the window entry serves: its unbounded sides remove no key and move no
# statistic), -m exhaustive every one.
QUANTIZATIONS = [(q, s, p) for q in ("token", "tile") for s in (True, False) for p in ("int8", "float")]
CASES = [
    pytest.param("float32", "bhsd", "lower_right", None, 5, 70, dict(sinks=True), id="float32-causal-sinks"),
    pytest.param("float16", "bshd", False, "additive", 17, 40,
                 dict(window=(9, 3), softcap=30.0, alibi=True, scale=0.2, qk_scale="tile", smooth_k=False,
                      pv="float"), id="float16-bshd-mask-window-softcap-alibi-tile-float"),
    pytest.param("float16", "bshd", False, "additive", 5, 33,
                 dict(softcap=30.0, alibi=True, qk_scale="tile", smooth_k=False, pv="float"),
                 id="float16-no-window-served-by-a-window-entry"),
    *(pytest.param("bfloat16", "bhsd", "upper_left", "bool", r, c, dict(qk_scale=q, smooth_k=s, pv=p),
                   marks=pytest.mark.exhaustive, id=f"bfloat16-bool-{q}-{s}-{p}-R{r}-C{c}")
      for q, s, p in QUANTIZATIONS for r, c in ((1, 1), (9, 130), (33, 65))),
    *(pytest.param("float32", "bshd", False, None, r, c, dict(sinks=True, alibi="per_batch", softcap=15.0,
                                                              qk_scale="tile", dims=(64, 48), ratio=1),
                   marks=pytest.mark.exhaustive, id=f"float32-D64-Dv48-mha-alibi-per-batch-R{r}-C{c}")
      for r, c in ((1, 7), (17, 200))),
]


@pytest.fixture(scope="module")
def bundle():
    return _core._Bundle.from_bytes(pack(build_payload(entries_of({"families": FAMILIES}))))


def _problem(rng, dtype, layout, mask, r, c, options):
    """q, k, v and int8_attention's keyword arguments for one call (numpy, as Python takes them)."""
    t = DTYPES[dtype]
    d, dv = options.get("dims", (D, D))
    hq = options.get("ratio", 2) * HKV

    def shaped(heads, length, width):
        return (B, length, heads, width) if layout == "bshd" else (B, heads, length, width)
    q = rng.standard_normal(shaped(hq, r, d)).astype(t)
    k, v = (rng.standard_normal(shaped(HKV, c, width)).astype(t) for width in (d, dv))
    args = {name: value for name, value in options.items() if name not in ("sinks", "alibi", "dims", "ratio")}
    args["layout"] = layout
    if mask == "bool":
        args["mask"] = rng.random((1, hq, r, c)) < 0.8
    elif mask == "additive":
        args["mask"] = np.where(rng.random((B, 1, r, c)) < 0.2, -np.inf, rng.standard_normal((B, 1, r, c))).astype(t)
    if options.get("sinks"):
        args["sinks"] = rng.standard_normal(hq).astype(np.float32)
    if options.get("alibi"):
        args["alibi_slopes"] = rng.random((B, hq) if options["alibi"] == "per_batch" else hq).astype(np.float32)
    return q, k, v, args


def _cpp(bundle, q, k, v, args, causal, out, lse):
    views = {name: view(x) for name, x in args.items() if isinstance(x, np.ndarray)}
    options = {name: x for name, x in args.items() if not isinstance(x, np.ndarray)}
    _core._bundle_int8_attention("cpu", bundle, view(q), view(k), view(v), view(out), view(lse),
                                 causal=causal or "none", **views, **options)


@pytest.mark.parametrize("dtype, layout, causal, mask, r, c, options", CASES)
def test_matches_python_bit_for_bit(bundle, dtype, layout, causal, mask, r, c, options):
    rng = np.random.default_rng([r, c, len(options), ord(dtype[1])])
    q, k, v, args = _problem(rng, dtype, layout, mask, r, c, options)
    o, lse = mfa_native.int8_attention(q, k, v, causal=causal, return_lse=True, device="cpu", **args)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _cpp(bundle, q, k, v, args, causal, out, rows)
    assert not np.isnan(o.astype(np.float32)).all()
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows.view(np.uint32), lse.view(np.uint32))


def test_strided_views_and_no_lse(bundle):
    """Views the kernels read with runtime strides (a slice of a longer key axis) and no lse."""
    rng = np.random.default_rng(11)
    q, k, v, args = _problem(rng, "float32", "bhsd", None, 3, 50, dict(sinks=True))
    k, v = (np.concatenate([x, x], axis=2)[:, :, ::2] for x in (k, v))
    o = mfa_native.int8_attention(q, k, v, causal="lower_right", device="cpu", **args)
    out = poison(o.shape, o.dtype)
    views = {name: view(x) for name, x in args.items() if isinstance(x, np.ndarray)}
    _core._bundle_int8_attention("cpu", bundle, view(q), view(k), view(v), view(out), causal="lower_right",
                                 layout="bhsd", **views)
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))


def test_an_empty_problem_writes_what_python_returns(bundle):
    rng = np.random.default_rng(5)
    q, k, v, args = _problem(rng, "float32", "bhsd", None, 0, 8, dict(sinks=True))
    o, lse = mfa_native.int8_attention(q, k, v, causal="lower_right", return_lse=True, device="cpu", **args)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _cpp(bundle, q, k, v, args, "lower_right", out, rows)
    np.testing.assert_array_equal(out, o)
    np.testing.assert_array_equal(rows, lse)


BAD_CALLS = {   # what changes from a good float32 causal call with sinks
    "qk_scale": lambda q, k, v, a: (q, k, v, {**a, "qk_scale": "row"}),
    "pv": lambda q, k, v, a: (q, k, v, {**a, "pv": "int4"}),
    "k dtype": lambda q, k, v, a: (q, k.astype(np.float16), v, a),
    "q dimensions": lambda q, k, v, a: (q[0], k, v, a),
    "v length": lambda q, k, v, a: (q, k, v[:, :, :-1], a),
    "head dim beyond 256": lambda q, k, v, a: (*(np.zeros(x.shape[:-1] + (264,), np.float32) for x in (q, k, v)), a),
    "window": lambda q, k, v, a: (q, k, v, {**a, "window": (-3, 0)}),
    "sinks shape": lambda q, k, v, a: (q, k, v, {**a, "sinks": a["sinks"][:1]}),
    "softcap": lambda q, k, v, a: (q, k, v, {**a, "softcap": -1.0}),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_raise_pythons_message(bundle, case):
    rng = np.random.default_rng(7)
    q, k, v, args = BAD_CALLS[case](*_problem(rng, "float32", "bhsd", None, 3, 9, dict(sinks=True)))
    with pytest.raises((ValueError, TypeError)) as python:
        mfa_native.int8_attention(q, k, v, causal="lower_right", device="cpu", **args)
    out = poison(q.shape[:-1] + (v.shape[-1],), np.float32)
    with pytest.raises((ValueError, TypeError)) as cpp:
        _cpp(bundle, q, k, v, args, "lower_right", out, poison((B, 2 * HKV, 3), np.float32))
    assert (cpp.type, str(cpp.value)) == (python.type, str(python.value))


def test_a_call_the_bundle_lacks_lists_its_entries(bundle):
    rng = np.random.default_rng(3)
    q, k, v, args = _problem(rng, "float32", "bhsd", None, 2, 9, dict(sinks=True, pv="float"))
    out, rows = poison((B, 2 * HKV, 2, D), np.float32), poison((B, 2 * HKV, 2), np.float32)
    with pytest.raises(ValueError, match=r"(?s)no entry for int8_attention float32 .* qk_scale=token smooth_k=yes "
                                         r"pv=float family=.*it holds:\n  int8_attention float32 .* pv=int8 "):
        _cpp(bundle, q, k, v, args, "lower_right", out, rows)
    assert np.isnan(out).all() and np.isnan(rows).all()


def test_entry_lines_match_pythons(bundle):
    from mfa_native.bundle.writer import entry_line
    payload = build_payload(entries_of({"families": FAMILIES}))
    assert bundle.entries() == [entry_line(e["op"], e["facts"], len(e["forward"]), len(e["backward"]))
                                for e in payload["entries"]]


@pytest.mark.parametrize("facts", entries_of({"families": FAMILIES[:2]}))
def test_entry_templates_are_codegens_for_every_length(facts):
    """For lengths across every tile choice, the entry's first template whose guards hold is
    the template codegen generates for that call."""
    forward = forward_templates(facts)
    for r in (1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 300):
        for c in (1, 5, 64, 700, 20000):
            p = problem(facts, r, c, batch=2, kv_heads=2)
            expected = codegen.int8_attention_template(int8_problem(facts, p), family=facts.family)
            assert choose(forward, codegen.call_sizes(p)) == json.loads(json.dumps(asdict(expected))), (r, c)
