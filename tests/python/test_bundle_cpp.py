"""The C++ side of bundles against Python, through _core's test hooks: size expressions and
template evaluation give Python's values; mfa::attention / attention_backward on the cpu
backend give Python's results bit for bit (strided, packed and broadcast views, runtime
windows, head dims past 256 included, and with compiled Metal libraries in the bundle, which
the cpu device ignores); damaged bundles and metallibs, missing entries and bad views raise
naming what is wrong."""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import asdict
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mfa_native
from mfa_native import _core, reference
from mfa_native.bundle import entries_of, metallib
from mfa_native.bundle.file import FORMAT_VERSION, pack, unpack
from mfa_native.bundle.writer import build_payload, declarations
from mfa_native.runtime import expressions
from mfa_native.runtime.templates import PassTemplate, evaluate

from conftest import poison

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
BASE = {"op": "attention", "family": ["apple9"], "window": [False], "backward": True}
FAMILIES = [
    {**BASE, "dtype": ["float32"], "head_dim": [16], "gqa_ratio": [2], "causal": ["lower_right"], "mask": ["none"],
     "sinks": [True], "layout": ["bhsd"]},
    {**BASE, "dtype": ["float32"], "head_dim": [8], "causal": ["upper_left"], "mask": ["bool"], "sinks": [False],
     "window": [True], "layout": ["bshd"]},
    {**BASE, "dtype": ["float32"], "head_dim": [16], "value_dim": [8], "causal": ["none"], "mask": ["additive"],
     "mask_dtype": ["float32"], "sinks": [False], "layout": ["bhsd"]},
    {**BASE, "dtype": ["float16"], "head_dim": [8], "causal": ["none"], "mask": ["none"], "sinks": [False],
     "layout": ["bhsd"], "backward": False},
    {**BASE, "dtype": ["float32"], "head_dim": [8], "causal": ["lower_right"], "mask": ["none"], "sinks": [False],
     "window": [True], "layout": ["bhsd"]},
    {**BASE, "dtype": ["float32"], "head_dim": [320], "value_dim": [256], "causal": ["lower_right"], "mask": ["none"],
     "sinks": [False], "layout": ["bhsd"]},
]
WINDOWED, WIDE = 4, 5   # FAMILIES indices: runtime windows (and views), D 320 / Dv 256


@pytest.fixture(scope="module")
def payload():
    return build_payload(entries_of({"families": FAMILIES}))


@pytest.fixture(scope="module")
def bundle(payload):
    return _core._Bundle.from_bytes(pack(payload))


def view(x: np.ndarray):
    return (x.ctypes.data, x.dtype.name, list(x.shape), [s // x.itemsize for s in x.strides])


# Size expressions: random trees over the grammar, C++ against Python (value or error).
NAMES = ("B", "R", "C")
leaf = st.one_of(st.integers(0, 50).map(str), st.sampled_from(NAMES))


def _combine(children):
    binary = st.tuples(children, st.sampled_from(["+", "-", "*", "/", "%", "==", "!=", "<", "<=", ">", ">=",
                                                  "&&", "||"]), children).map(lambda t: f"({t[0]} {t[1]} {t[2]})")
    unary = st.tuples(st.sampled_from(["-", "!"]), children).map(lambda t: f"{t[0]}{t[1]}")
    call = st.one_of(st.lists(children, min_size=1, max_size=3).map(lambda a: f"min({', '.join(a)})"),
                     st.lists(children, min_size=1, max_size=3).map(lambda a: f"max({', '.join(a)})"),
                     st.tuples(children, children).map(lambda t: f"cdiv({t[0]}, {t[1]})"))
    return st.one_of(binary, unary, call)


@given(st.recursive(leaf, _combine, max_leaves=12), st.fixed_dictionaries({n: st.integers(0, 1000) for n in NAMES}))
def test_size_expressions_match_python(text, sizes):
    try:
        expected = expressions.evaluate(text, sizes)
    except ValueError:
        with pytest.raises(ValueError):
            _core._evaluate_size(text, sizes)
        return
    assert _core._evaluate_size(text, sizes) == expected, text


@pytest.mark.parametrize("text", ["R +", "min()", "foo(1)", "cdiv(1)", "1 $ 2", "(R", "R R", "3a"])
def test_size_expression_errors_match_python(text):
    with pytest.raises(ValueError):
        expressions.evaluate(text, {"R": 1})
    with pytest.raises(ValueError, match="size expression"):
        _core._evaluate_size(text, {"R": 1})


def test_template_evaluation_matches_python(payload):
    rng = np.random.default_rng(5)
    checked = 0
    for record in payload["entries"]:
        for template in record["forward"] + record["backward"]:
            text = json.dumps(template)
            python_template = PassTemplate.from_json(text)
            for _ in range(6):
                sizes = {"B": int(rng.integers(1, 4)), "Hkv": int(rng.integers(1, 4)), "R": int(rng.integers(1, 300)),
                         "C": int(rng.integers(1, 5000)), "P": int(rng.choice([4, 64, 4096]))}
                sizes["Hq"] = sizes["Hkv"] * dict(python_template.valid_for)["gqa_ratio"]
                for name in python_template.sizes:   # strides and window sides
                    sizes.setdefault(name, int(rng.integers(0, 100)))
                try:
                    expected = evaluate(python_template, sizes)
                except ValueError:
                    with pytest.raises(ValueError, match="does not hold"):
                        _core._evaluate_template(text, sizes)
                    continue
                got = _core._evaluate_template(text, sizes)
                assert got["name"] == expected.name
                assert got["kernels"] == [(k.entry, tuple(k.threadgroups), list(k.buffers)) for k in expected.kernels]
                assert got["buffers"] == [{"name": b.name, "shape": list(b.shape), "nbytes": b.nbytes,
                                           "strides": None if b.strides is None else list(b.strides),
                                           "value": None if b.value is None else list(b.value)}
                                          for b in expected.buffers]
                checked += 1
    assert checked > 20


def test_reader_refuses_damaged_truncated_and_future_bundles(payload):
    data = pack({"format": "mfa_native.bundle", "template_schema": 1, "declarations": payload["declarations"],
                 "entries": payload["entries"][:1]})
    assert len(_core._Bundle.from_bytes(data).entries()) == 1
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0x20
    cases = {"sha256": bytes(damaged), "truncated": data[:-7], "shorter than": data[:20], "magic": b"?" + data[1:],
             "newer": data[:8] + struct.pack("<I", 7) + data[12:], "earlier": data[:8] + struct.pack("<I", 2) + data[12:],
             "empty": b""}
    for message, bad in cases.items():
        with pytest.raises(RuntimeError, match={"empty": "shorter than", "earlier": "write the bundle again"}.get(message, message)):
            _core._Bundle.from_bytes(bad)
    # A valid checksum over a payload that is not a bundle's: refused while reading, never a crash.
    for body in ({"format": "other"}, {"format": "mfa_native.bundle", "template_schema": 1, "entries": [{"op": 1}]},
                 {"format": "mfa_native.bundle", "template_schema": 9, "entries": []}):
        with pytest.raises(RuntimeError, match="bundle"):
            _core._Bundle.from_bytes(pack(body))
    body = b"[" * 100000
    import hashlib
    header = struct.pack("<8sIIQ32s", b"MFABNDL\0", FORMAT_VERSION, 0, len(body), hashlib.sha256(body).digest())
    with pytest.raises(RuntimeError, match="nesting"):
        _core._Bundle.from_bytes(header + body)
    with pytest.raises(RuntimeError, match="cannot open"):
        _core._Bundle.load("/nonexistent/bundle.mfab")


def test_cpp_tests_declarations_are_the_writers():
    """tests/cpp/test_bundle.cpp's bundles carry tests/cpp/declarations.json: the writer's data
    (regenerate it from mfa_native.bundle.writer.declarations() when a rule changes)."""
    path = Path(__file__).parents[1] / "cpp" / "declarations.json"
    assert json.loads(path.read_text()) == declarations()


def test_entries_are_the_cli_lines(bundle, payload):
    from mfa_native.bundle.writer import entry_line
    assert bundle.entries() == [entry_line(r["op"], r["facts"], len(r["forward"]), len(r["backward"]))
                                for r in payload["entries"]]


# Attention: C++ against Python, bit for bit, on the cpu backend.
CASES = [  # (family index, B, Hkv, R, C, kwargs); every entry serves every scale
    (0, 1, 1, 5, 37, {}),
    (0, 1, 1, 1, 600, {"scale": 0.171}),   # decode: the split-KV pair (P = 4 on the cpu device)
    (0, 2, 2, 20, 9, {"scale": -0.4}),
    (1, 2, 1, 13, 21, {}),
    (2, 1, 2, 9, 17, {"scale": 0.3}),
    (3, 1, 1, 12, 30, {}),
    (WIDE, 1, 1, 3, 5, {}),
]


def _inputs(rng, facts, B, Hkv, R, C, scale=None):
    dtype = DTYPES[facts["dtype"][0]]
    layout = facts["layout"][0]
    D, Dv = facts["head_dim"][0], facts.get("value_dim", facts["head_dim"])[0]
    Hq = Hkv * facts.get("gqa_ratio", [1])[0]

    def shaped(h, s, d):
        shape = (B, h, s, d) if layout == "bhsd" else (B, s, h, d)
        return rng.standard_normal(shape).astype(dtype)

    kwargs = dict(causal=facts["causal"][0], layout=layout, scale=scale)
    kwargs["window"] = (3, -1) if facts.get("window", [False])[0] else None
    mask = facts["mask"][0]
    kwargs["mask"] = (rng.random((B, Hq, R, C)) > 0.3 if mask == "bool" else
                      rng.standard_normal((B, Hq, R, C)).astype(np.float32) if mask == "additive" else None)
    kwargs["sinks"] = rng.standard_normal(Hq).astype(np.float32) if facts["sinks"][0] else None
    return shaped(Hq, R, D), shaped(Hkv, C, D), shaped(Hkv, C, Dv), kwargs


def cpp_options(options: dict) -> dict:
    """Python's keyword arguments as the C++ hooks take them: arrays as views (score_mod_tensors
    each), causal=True as "lower_right"."""
    converted = {name: view(value) if isinstance(value, np.ndarray) else value for name, value in options.items()}
    if "score_mod_tensors" in options:
        converted["score_mod_tensors"] = [view(t) for t in options["score_mod_tensors"]]
    if options.get("causal") is True:
        converted["causal"] = "lower_right"
    return converted


@pytest.mark.parametrize("case", CASES, ids=[f"family{c[0]}-R{c[3]}-C{c[4]}" for c in CASES])
def test_attention_matches_python_bit_for_bit(bundle, case, rng):
    _check_against_python(bundle, case, rng)


def _source_keys(payload) -> list[str]:
    return sorted({metallib.source_key(kernel["source"]) for record in payload["entries"]
                   for template in record["forward"] + record["backward"] for kernel in template["kernels"]})


def _with_metallibs(payload, metallibs: dict) -> bytes:
    return pack({**payload, "metallibs": metallibs})


@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=["family0-R5-C37", "family0-R1-C600"])
def test_a_bundle_with_metallibs_runs_its_source_on_the_cpu_device(payload, case, rng):
    """`bundle --metallib` bundles (random bytes stand in for the libraries, which only a Mac
    compiles): the cpu device ignores the libraries, compiles the sources, and still computes
    Python's results bit for bit."""
    keys = _source_keys(payload)
    libraries = {key: base64.b64encode(rng.bytes(int(rng.integers(1, 200)))).decode() for key in keys}
    _check_against_python(_core._Bundle.from_bytes(_with_metallibs(payload, libraries)), case, rng)


def test_damaged_or_orphan_metallibs_are_bundle_errors(payload):
    key = _source_keys(payload)[0]
    other = metallib.source_key("kernel void nowhere() {}")
    cases = {"not valid base64": {key: "Zm9vYmF"}, "is empty": {key: ""},
             "sha256 of no kernel source": {key: "Zm9v", other: "Zm9v"}}
    for message, libraries in cases.items():
        with pytest.raises(RuntimeError, match=message):
            _core._Bundle.from_bytes(_with_metallibs(payload, libraries))
    # A key for the source of an entry of an op this reader skips is no orphan.
    skipped = {"op": "later_op", "forward": [{"kernels": [{"source": "kernel void nowhere() {}"}]}], "backward": []}
    later = {**payload, "entries": payload["entries"] + [skipped]}
    assert _core._Bundle.from_bytes(_with_metallibs(later, {other: "Zm9v"})).entries() == \
        _core._Bundle.from_bytes(pack(payload)).entries()


def _check_against_python(bundle, case, rng):
    """mfa::attention (and, where the entry has it, attention_backward) on `bundle` against
    Python's on the same inputs: bit for bit, and within the dtype's tolerance of float64."""
    index, B, Hkv, R, C, options = case
    facts = FAMILIES[index]
    q, k, v, kwargs = _inputs(rng, facts, B, Hkv, R, C, **options)
    o, lse = mfa_native.attention(q, k, v, return_lse=True, device="cpu", **kwargs)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _core._bundle_attention("cpu", bundle, view(q), view(k), view(v), view(out), view(rows), **cpp_options(kwargs))
    assert out.tobytes() == o.tobytes() and rows.tobytes() == lse.tobytes()
    out_only = poison(o.shape, o.dtype)   # without lse: an intermediate takes it, the output is the same
    _core._bundle_attention("cpu", bundle, view(q), view(k), view(v), view(out_only), **cpp_options(kwargs))
    assert out_only.tobytes() == o.tobytes()
    expected = reference.attention_reference(q, k, v, **{**kwargs, "causal": kwargs["causal"] != "none" and
                                                        kwargs["causal"]})
    tolerance = 1e-5 if facts["dtype"][0] == "float32" else 2e-2
    assert np.abs(out.astype(np.float64) - expected).max() <= tolerance * max(1.0, np.abs(expected).max())

    if not facts["backward"]:
        return
    do = rng.standard_normal(o.shape).astype(o.dtype)
    grads = mfa_native.attention_backward(q, k, v, o, lse, do, device="cpu", **kwargs)
    mine = [poison(x.shape, x.dtype) for x in grads]
    dsinks = view(mine[3]) if kwargs["sinks"] is not None else None
    _core._bundle_attention_backward("cpu", bundle, view(q), view(k), view(v), view(o), view(lse), view(do),
                                     view(mine[0]), view(mine[1]), view(mine[2]), dsinks, **cpp_options(kwargs))
    for ours, theirs in zip(mine, grads):
        assert ours.tobytes() == theirs.tobytes()


def _call(bundle, q, k, v, out, **options):
    defaults = dict(scale=None, causal="none", window=None, mask=None, sinks=None, layout="bhsd")
    _core._bundle_attention("cpu", bundle, view(q), view(k), view(v), view(out), None, **{**defaults, **options})


def test_a_problem_the_bundle_lacks_lists_its_entries(bundle, rng):
    q = rng.standard_normal((1, 2, 4, 16)).astype(np.float32)
    out = np.zeros_like(q)
    with pytest.raises(ValueError, match="no entry for attention float32 D=16 Dv=16 gqa=1 causal=none") as error:
        _call(bundle, q, q, q, out)
    assert all(line in str(error.value) for line in bundle.entries())
    k = rng.standard_normal((1, 1, 4, 16)).astype(np.float32)
    q16, k16 = q.astype(np.float16), k.astype(np.float16)
    with pytest.raises(ValueError, match="no entry for attention_backward"):
        o = np.zeros((1, 2, 4, 16), np.float16)
        lse = np.zeros((1, 2, 4), np.float32)
        q8, k8 = q16[..., :8].copy(), k16[..., :8].copy()
        o8 = o[..., :8].copy()
        _core._bundle_attention_backward("cpu", bundle, view(q8), view(k8), view(k8), view(o8), view(lse), view(o8),
                                         view(np.zeros_like(q8)), view(np.zeros_like(k8)), view(np.zeros_like(k8)))


def test_bad_views_name_the_argument(bundle, rng):
    """Checked before anything runs, with Python's messages where they exist."""
    q = rng.standard_normal((1, 2, 4, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 4, 16)).astype(np.float32)
    out = np.zeros_like(q)
    ok = dict(causal="lower_right", sinks=view(np.zeros(2, np.float32)))
    with pytest.raises(TypeError, match="k has dtype float16 but q has float32"):
        _call(bundle, q, k.astype(np.float16), k, out, **ok)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        _call(bundle, q[0], k, k, out, **ok)
    with pytest.raises(ValueError, match="k's head dimension"):
        _call(bundle, q, k[..., :8].copy(), k, out, **ok)
    with pytest.raises(ValueError, match=r"q's head count \(2\) must be a multiple"):
        _call(bundle, q, np.zeros((1, 3, 4, 16), np.float32), np.zeros((1, 3, 4, 16), np.float32), out, **ok)
    with pytest.raises(ValueError, match="out must have shape"):
        _call(bundle, q, k, k, out[:, :, :2].copy(), **ok)
    with pytest.raises(TypeError, match="out has dtype float16"):
        _call(bundle, q, k, k, out.astype(np.float16), **ok)
    with pytest.raises(ValueError, match="out must be contiguous"):
        wide = np.zeros((1, 2, 4, 32), np.float32)[..., :16]
        _call(bundle, q, k, k, wide, **ok)
    with pytest.raises(ValueError, match="sinks must have shape"):
        _call(bundle, q, k, k, out, causal="lower_right", sinks=view(np.zeros(3, np.float32)))
    with pytest.raises(TypeError, match="sinks must be float32"):
        _call(bundle, q, k, k, out, causal="lower_right", sinks=view(np.zeros(2, np.float16)))
    with pytest.raises(ValueError, match="window left must be >= 0"):
        _call(bundle, q, k, k, out, window=(-3, 0), **ok)
    with pytest.raises(ValueError, match="scale must be finite"):
        _call(bundle, q, k, k, out, scale=float("inf"), **ok)
    with pytest.raises(ValueError, match="mask of shape"):
        _call(bundle, q, k, k, out, mask=view(np.ones((3, 4), bool)), **ok)
    with pytest.raises(TypeError, match="mask must be boolean"):
        _call(bundle, q, k, k, out, mask=view(np.ones((4, 4), np.int32)), **ok)
    with pytest.raises(ValueError, match=r"D \(q/k head dimension\) is 600; the kernels support 1\.\.576"):
        wide = np.zeros((1, 1, 1, 600), np.float32)
        _call(bundle, wide, wide, wide, wide.copy())
    with pytest.raises(ValueError, match=r"Dv \(v head dimension\) is 577; the kernels support 1\.\.576"):
        _call(bundle, q, k, np.zeros((1, 1, 4, 577), np.float32), np.zeros((1, 2, 4, 577), np.float32), **ok)
    # A window entry computes positions up to R + C in 32-bit ints: longer calls are refused before anything is
    # read (the views' addresses are never touched, so they point at one element).
    one = np.zeros(1, np.float32)
    fake = lambda shape: (one.ctypes.data, "float32", list(shape), [])
    with pytest.raises(ValueError, match=r"R \+ C .* must be below 2\*\*31"):
        _core._bundle_attention("cpu", bundle, fake((1, 1, 2**30, 8)), fake((1, 1, 2**30, 8)),
                                fake((1, 1, 2**30, 8)), fake((1, 1, 2**30, 8)), None, scale=None,
                                causal="lower_right", window=(5, 0), mask=None, sinks=None, layout="bhsd")


def test_empty_problems_need_no_entry(rng):
    empty_bundle = _core._Bundle.from_bytes(pack({"format": "mfa_native.bundle", "template_schema": 1,
                                                  "declarations": declarations(), "entries": []}))
    q = rng.standard_normal((1, 2, 3, 16)).astype(np.float32)
    k = np.zeros((1, 2, 0, 16), np.float32)
    out, lse = poison(q.shape, np.float32), poison((1, 2, 3), np.float32)
    sinks = np.array([0.5, -1.0], np.float32)
    _core._bundle_attention("cpu", empty_bundle, view(q), view(k), view(k), view(out), view(lse), sinks=view(sinks))
    expected_o, expected_lse = mfa_native.attention(q, k, k, sinks=sinks, return_lse=True, device="cpu")
    assert out.tobytes() == expected_o.tobytes() and lse.tobytes() == expected_lse.tobytes()


def _both_ways(bundle, q, k, v, rng, **kwargs):
    """mfa::attention and attention_backward on these views against Python's on the same
    views, byte for byte (float32, cpu); then the forward against the float64 reference."""
    options = {**dict(scale=None, causal="none", window=None, mask=None, sinks=None, layout="bhsd"), **kwargs}
    python = {**options, "mask": kwargs.get("mask")}
    cpp = {**options, "mask": None if python["mask"] is None else view(python["mask"])}
    o, lse = mfa_native.attention(q, k, v, return_lse=True, device="cpu", **python)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _core._bundle_attention("cpu", bundle, view(q), view(k), view(v), view(out), view(rows), **cpp)
    assert out.tobytes() == o.tobytes() and rows.tobytes() == lse.tobytes()
    reference_kwargs = {**python, "causal": python["causal"] != "none" and python["causal"]}
    expected = reference.attention_reference(q, k, v, **reference_kwargs)
    assert np.linalg.norm(out - expected) <= 1e-5 * max(np.linalg.norm(expected), 1e-30)
    do = rng.standard_normal(o.shape).astype(np.float32)
    do_view = np.flip(do, axis=2).copy()[:, :, ::-1]   # a negative stride: packed by both
    lse_view = np.stack([lse, lse], axis=-1)[..., 1]    # not contiguous: packed by both
    grads = mfa_native.attention_backward(q, k, v, o, lse_view, do_view, device="cpu", **python)
    mine = [poison(x.shape, x.dtype) for x in grads[:3]]
    _core._bundle_attention_backward("cpu", bundle, view(q), view(k), view(v), view(o), view(lse_view), view(do_view),
                                     *map(view, mine), None, **cpp)
    for ours, theirs in zip(mine, grads):
        assert ours.tobytes() == theirs.tobytes()


def _strided_views(rng, B, H, Hkv, R, C, D):
    """q a bhsd view of bshd memory, k a slice of a wider buffer (rows and features), v a view
    with a negative stride and v2 one with a non-unit feature stride (both packed)."""
    q = rng.standard_normal((B, R, H, D)).astype(np.float32).transpose(0, 2, 1, 3)
    k = rng.standard_normal((B, Hkv + 1, 2 * C + 3, D + 5)).astype(np.float32)[:, 1:, 3::2, 2:D + 2]
    v = rng.standard_normal((B, Hkv, C, D)).astype(np.float32)[:, :, ::-1]
    v2 = rng.standard_normal((B, Hkv, C, 2 * D)).astype(np.float32)[..., ::2]
    return q, k, v, v2


@pytest.mark.parametrize("window", [(3, -1), (-1, 2), (0, 0), (0, -1), (40, 1), (2, 50), (-1, -1), None])
def test_runtime_windows_match_python(bundle, window, rng):
    """One window entry serves every window: one side unbounded, left 0, sides beyond C and R,
    both unbounded and no window (which the entry serves too, the bundle holding no other)."""
    B, H, R, C, D = 2, 2, 9, 13, 8
    q, k, v, _ = _strided_views(rng, B, H, H, R, C, D)
    _both_ways(bundle, q, k, v, rng, causal="lower_right", window=window)


def test_a_spec_that_omits_window_serves_calls_with_and_without_one(rng):
    family = {**FAMILIES[WINDOWED]}
    del family["window"]
    entries = entries_of({"families": [family]})
    assert [e.window for e in entries] == [False, True]
    bundle = _core._Bundle.from_bytes(pack(build_payload(entries)))
    q, k, v, _ = _strided_views(rng, 1, 2, 2, 9, 13, 8)
    for window in (None, (3, 1)):
        _both_ways(bundle, q, k, v, rng, causal="lower_right", window=window)


def test_strided_and_packed_views_match_python(bundle, rng):
    """Views the kernels read in place (transposed memory, slices of a bigger buffer, GQA's k
    broadcast over nothing) and views packed first (negative and non-unit feature strides)."""
    q, k, v, v2 = _strided_views(rng, 1, 2, 2, 7, 11, 8)
    assert k.strides[-1] == 4 and not k.flags.c_contiguous and v.strides[2] < 0 and v2.strides[-1] == 8
    _both_ways(bundle, q, k, v, rng, causal="lower_right", window=(2, 0))
    _both_ways(bundle, q, k, v2, rng, causal="lower_right", window=(2, 0))
    # bshd entries read bshd views whose heads are strided (family 1: bool mask, upper left, window).
    qb = rng.standard_normal((2, 6, 3, 8)).astype(np.float32)[:, :, 1:2]
    kb = rng.standard_normal((2, 9, 1, 16)).astype(np.float32)[..., 8:]
    mask = rng.random((2, 1, 6, 9)) > 0.4
    o, lse = mfa_native.attention(qb, kb, kb, causal="upper_left", window=(1, 2), mask=mask, layout="bshd",
                                  return_lse=True, device="cpu")
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _core._bundle_attention("cpu", bundle, view(qb), view(kb), view(kb), view(out), view(rows), scale=None,
                            causal="upper_left", window=(1, 2), mask=view(mask), sinks=None, layout="bshd")
    assert out.tobytes() == o.tobytes() and rows.tobytes() == lse.tobytes()


@pytest.mark.parametrize("shape", [(6, 9), (1, 1, 6, 9), (2, 1, 1, 9), (6, 1), (2, 2, 6, 9), (1, 9)])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_broadcast_masks_match_python(bundle, shape, kind, rng):
    """A mask broadcast to (B, Hq, R, C) is read with stride 0 on its broadcast axes, no copy;
    a transposed (strided) one in place too."""
    B, R, C = 2, 6, 9
    if kind == "bool":   # family 1: bshd, D 8, upper left, window entry
        q = rng.standard_normal((B, R, 2, 8)).astype(np.float32)
        k = rng.standard_normal((B, C, 2, 8)).astype(np.float32)
        mask = rng.random(shape) > 0.3
        o, lse = mfa_native.attention(q, k, k, causal="upper_left", window=(4, -1), mask=mask, layout="bshd",
                                      return_lse=True, device="cpu")
        out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
        _core._bundle_attention("cpu", bundle, view(q), view(k), view(k), view(out), view(rows), scale=None,
                                causal="upper_left", window=(4, -1), mask=view(mask), sinks=None, layout="bshd")
        assert out.tobytes() == o.tobytes() and rows.tobytes() == lse.tobytes()
        return
    # family 2: bhsd, D 16 / Dv 8, additive float32 mask, scale 0.3; the mask transposed in memory
    q = rng.standard_normal((B, 2, R, 16)).astype(np.float32)
    k = rng.standard_normal((B, 2, C, 16)).astype(np.float32)
    v = rng.standard_normal((B, 2, C, 8)).astype(np.float32)
    mask = np.ascontiguousarray(rng.standard_normal(shape[::-1]).astype(np.float32)).T
    if len(shape) == 4:
        mask = np.ascontiguousarray(rng.standard_normal(shape).astype(np.float32).transpose(0, 1, 3, 2)).transpose(
            0, 1, 3, 2)
    _both_ways(bundle, q, k, v, rng, mask=mask, scale=0.3)


def test_templates_with_inout_buffers_load(rng):
    """A template whose kernel writes a caller buffer in place ("inout", as the KV cache's
    append declares it) loads in C++, which evaluates its strides and extent as Python does."""
    source = ("#include <metal_stdlib>\nusing namespace metal;\n"
              "kernel void bump(device float* cache [[buffer(0)]], device const float* rows [[buffer(1)]], "
              "uint i [[thread_position_in_grid]]) { cache[i * 2] += rows[i]; }\n")
    template = {"schema": 1, "name": "bump", "sizes": ["N"], "derived": [], "guards": [], "valid_for": [],
                "compile_options": [],
                "kernels": [{"entry": "bump", "source": source, "threadgroups": ["cdiv(N, 32)", "1", "1"],
                             "threads_per_threadgroup": [32, 1, 1], "buffers": ["cache", "rows"]}],
                "buffers": [{"name": "cache", "role": "inout", "dtype": "float32", "shape": ["N"], "readers": [],
                             "writers": [0], "strides": ["2"], "value": None},
                            {"name": "rows", "role": "input", "dtype": "float32", "shape": ["N"], "readers": [0],
                             "writers": [], "strides": ["1"], "value": None}]}
    text = json.dumps(template)
    for n in (1, 5, int(rng.integers(6, 100))):
        expected = evaluate(PassTemplate.from_json(text), {"N": n})
        got = _core._evaluate_template(text, {"N": n})
        assert [b["strides"] for b in got["buffers"]] == [list(b.strides) for b in expected.buffers]
        assert [b["nbytes"] for b in got["buffers"]] == [b.nbytes for b in expected.buffers] == [4 * (2 * n - 1),
                                                                                                4 * n]
    with pytest.raises(ValueError, match="inout 'cache' has no strides"):
        template["buffers"][0]["strides"] = None
        _core._evaluate_template(json.dumps(template), {"N": 3})


def test_a_batch_invariant_entry_serves_batch_invariant_calls_with_pythons_bits():
    """deterministic="batch_invariant" is a fact an entry bakes (its kernels split keys the same
    way whatever the call): C++ asking for it gets Python's bits; a run_to_run call is not
    served by such an entry, and the entry's line says what it is."""
    family = {"op": "attention", "family": ["apple9"], "dtype": ["float32"], "head_dim": [16], "causal": ["none"],
              "mask": ["none"], "window": [False], "sinks": [False], "layout": ["bhsd"],
              "deterministic": ["batch_invariant"]}
    invariant = _core._Bundle.from_bytes(pack(build_payload(entries_of({"families": [family]}))))
    assert "layout=bhsd deterministic=batch_invariant family=apple9" in invariant.entries()[0]
    rng = np.random.default_rng(17)
    q = rng.standard_normal((3, 2, 1, 16)).astype(np.float32)
    k, v = (rng.standard_normal((3, 2, 700, 16)).astype(np.float32) for _ in "kv")
    o, lse = mfa_native.attention(q, k, v, return_lse=True, deterministic="batch_invariant", device="cpu")
    out, rows = poison(o.shape, np.float32), poison(lse.shape, np.float32)
    _core._bundle_attention("cpu", invariant, view(q), view(k), view(v), view(out), view(rows), batch_invariant=True)
    np.testing.assert_array_equal(out, o)
    np.testing.assert_array_equal(rows, lse)
    out = poison(o.shape, np.float32)
    with pytest.raises(ValueError, match="no entry for attention .* layout=bhsd family=apple9"):
        _core._bundle_attention("cpu", invariant, view(q), view(k), view(v), view(out))
    assert np.isnan(out).all()
