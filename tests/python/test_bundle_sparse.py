"""Sparse attention and its indexer from a bundle: mfa::sparse_attention, sparse_attention_backward
and sparse_topk (through
_core's test hooks) on the cpu backend give Python's mfa_native.sparse_attention and
sparse_attention_backward bit for bit (lists shared by the kv heads or per kv head, entries
out of range, topk_length, strided lists, MLA's shared latent, sinks, softcap, ALiBi and a
score_mod, both layouts), from entries whose templates keep topk, the lists' strides and the
scale at run time; sparse_topk's indices and scores (causal or not, float or int8 scores,
strided views, padding) likewise; and the same bad calls raise the same exception with the same
message, in Python's order, before anything is written."""

from __future__ import annotations

import json
from dataclasses import asdict

import ml_dtypes
import numpy as np
import pytest

import mfa_native
from mfa_native import _core
from mfa_native.bundle import entries_of
from mfa_native.bundle.file import pack
from mfa_native.bundle.spec import SPARSE, TOPK
from mfa_native.bundle.writer import (backward_templates, build_payload, choose, entry_line, forward_templates,
                                      problem, token_lists, topk_descriptor)
from mfa_native.codegen.sparse import topk as topk_codegen

from conftest import SEEDS, poison
from test_bundle import assert_chosen_are_codegens
from test_bundle_cpp import cpp_options, view
from test_bundle_scores import DOCUMENT_BIAS, SCORE_MOD

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
BASE = {"op": SPARSE, "family": ["apple9"], "gqa_ratio": [2], "sinks": [False]}
FAMILIES = [
    {**BASE, "dtype": ["float32"], "head_dim": [32], "layout": ["bhsd"], "backward": True},
    {**BASE, "dtype": ["float16"], "head_dim": [32], "layout": ["bshd"], "sinks": [True], "softcap": [20.0],
     "topk_length": [False]},
    {**BASE, "dtype": ["bfloat16"], "head_dim": [64], "value_dim": [32], "layout": ["bshd"], "shared_latent": [True],
     "topk_length": [True]},
    {**BASE, "dtype": ["float32"], "head_dim": [8], "gqa_ratio": [1], "layout": ["bhsd"], "sinks": [True],
     "alibi": ["per_head"], "score_mod": [SCORE_MOD], "topk_length": [False], "backward": True},
]
B, HKV = 2, 2


@pytest.fixture(scope="module")
def bundle():
    return _core._Bundle.from_bytes(pack(build_payload(entries_of({"families": FAMILIES}))))


def _lists(rng, shape, c: int, topk: int, shared: bool, layout: str, strided: bool) -> np.ndarray:
    """int32 lists (B, Hkv or 1, R, topk) in `layout`'s order, with entries out of range (-1, C)
    and repeats; `strided`: a view of every other slot-pair of a wider array (rows not dense)."""
    b, kv_heads, r = shape
    heads = 1 if shared else kv_heads
    full = rng.integers(-2, c + 2, (b, heads, r, 2 * topk if strided else topk)).astype(np.int32)
    if layout == "bshd":
        full = np.ascontiguousarray(full.transpose(0, 2, 1, 3))
    return full[..., :topk] if strided else full


def _problem(rng, case: str):
    """One call's arguments (numpy, as Python takes them) for a named case."""
    layout = {"capped": "bshd", "latent": "bshd"}.get(case, "bhsd")
    dtype = {"capped": "float16", "latent": "bfloat16"}.get(case, "float32")
    t = DTYPES[dtype]
    ratio = 1 if case == "score_mod" else 2
    d, dv = (64, 32) if case == "latent" else (8, 8) if case == "score_mod" else (32, 32)
    r, c, topk = int(rng.integers(1, 12)), int(rng.integers(3, 20)), int(rng.integers(1, 11))

    def four(heads: int, rows: int, width: int) -> np.ndarray:
        shape = (B, heads, rows, width) if layout == "bhsd" else (B, rows, heads, width)
        return rng.standard_normal(shape).astype(t)
    q, k = four(ratio * HKV, r, d), four(HKV, c, d)
    v = k[..., :dv] if case.startswith("latent") else four(HKV, c, dv)
    args = dict(layout=layout)
    shared = case in ("lists", "latent", "latent-unshared", "score_mod")
    indices = _lists(rng, (B, HKV, r), c, topk, shared=shared, layout=layout, strided=case in ("per-head", "capped"))
    if case in ("lists", "per-head", "latent", "latent-unshared"):
        args["topk_length"] = rng.integers(0, topk + 3, (B, r)).astype(np.int32)
    if case == "capped":
        args.update(sinks=rng.standard_normal(ratio * HKV).astype(np.float32), softcap=20.0, scale=0.3)
    if case == "score_mod":
        args.update(sinks=rng.standard_normal(ratio * HKV).astype(np.float32),
                    alibi_slopes=rng.uniform(0.1, 1, ratio * HKV).astype(np.float32), score_mod=DOCUMENT_BIAS,
                    score_mod_tensors=[np.sort(rng.integers(0, 4, 20)).astype(np.int32),
                                       rng.standard_normal(4).astype(np.float32)])
    return q, k, v, indices, args


# latent-unshared: v is k (a view of all its features), served by an entry without shared_latent.
CASES = ["lists", "per-head", "capped", "latent", "latent-unshared", "score_mod"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_python_bit_for_bit(bundle, case, seed):
    rng = np.random.default_rng([CASES.index(case), seed])
    q, k, v, indices, args = _problem(rng, case)
    o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True, device="cpu", **args)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _core._bundle_sparse_attention("cpu", bundle, view(q), view(k), view(v), view(indices), view(out), view(rows),
                                   **cpp_options(args))
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows, lse)
    assert not np.isnan(rows).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", ["lists", "per-head", "latent-unshared", "score_mod"])
def test_backward_matches_python_bit_for_bit(bundle, case, seed):
    rng = np.random.default_rng([10 + CASES.index(case), seed])
    q, k, v, indices, args = _problem(rng, case)
    o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True, device="cpu", **args)
    dout = rng.standard_normal(o.shape).astype(o.dtype)
    grads = mfa_native.sparse_attention_backward(q, k, v, indices, o, lse, dout, device="cpu", **args)
    mine = [poison(g.shape, g.dtype) for g in grads]
    dsinks = view(mine[3]) if len(mine) == 4 else None
    _core._bundle_sparse_attention_backward("cpu", bundle, view(q), view(k), view(v), view(indices), view(o),
                                            view(lse), view(dout), *(view(g) for g in mine[:3]), dsinks=dsinks,
                                            **cpp_options(args))
    for got, expected in zip(mine, grads):
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_an_empty_problem_writes_zeros_and_the_sinks(bundle):
    rng = np.random.default_rng(4)
    q, k, v, indices, args = _problem(rng, "capped")
    k, v = k[:, :0], v[:, :0]   # no keys
    o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True, device="cpu", **args)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _core._bundle_sparse_attention("cpu", bundle, view(q), view(k), view(v), view(indices), view(out), view(rows),
                                   **cpp_options(args))
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows, lse)


BAD_CALLS = {   # what changes from a good "lists" call (bhsd, shared lists, topk_length)
    "indices dtype": dict(indices=lambda a: a["indices"].astype(np.float32)),
    "indices rank": dict(indices=lambda a: a["indices"][0]),
    "indices shape": dict(indices=lambda a: a["indices"][:, :, 1:]),
    "indices kv heads": dict(indices=lambda a: np.repeat(a["indices"], 3, axis=1)),
    "topk_length dtype": dict(topk_length=lambda a: a["topk_length"].astype(np.float32)),
    "topk_length shape": dict(topk_length=lambda a: a["topk_length"][:1]),
    "topk_length negative": dict(topk_length=lambda a: a["topk_length"] - 5),
    "q shape before the lists": dict(q=lambda a: a["q"][..., :16], indices=lambda a: a["indices"][0]),
    "indices before topk_length": dict(indices=lambda a: a["indices"][0], topk_length=lambda a: a["topk_length"] - 5),
    "lists before score_mod": dict(topk_length=lambda a: a["topk_length"] - 5,
                                   score_mod_tensors=lambda a: [np.zeros(3, np.float32)]),
    "scale": dict(scale=lambda a: float("inf")),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_raise_pythons_message(bundle, case):
    rng = np.random.default_rng(7)
    q, k, v, indices, args = _problem(rng, "lists")
    values = {"q": q, "indices": indices, **args}
    values.update({name: change(values) for name, change in BAD_CALLS[case].items()})
    q, indices = values.pop("q"), values.pop("indices")
    with pytest.raises((ValueError, TypeError)) as python:
        mfa_native.sparse_attention(q, k, v, indices, return_lse=True, device="cpu", **values)
    out = poison((B, 2 * HKV, q.shape[2], 32), np.float32)
    rows = poison((B, 2 * HKV, q.shape[2]), np.float32)
    with pytest.raises((ValueError, TypeError)) as cpp:
        _core._bundle_sparse_attention("cpu", bundle, view(q), view(k), view(v), view(indices), view(out),
                                       view(rows), **cpp_options(values))
    assert (cpp.type, str(cpp.value)) == (python.type, str(python.value))
    assert np.isnan(out).all() and np.isnan(rows).all()


def test_backward_bad_lists_raise_pythons_message(bundle):
    rng = np.random.default_rng(8)
    q, k, v, indices, args = _problem(rng, "lists")
    o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True, device="cpu", **args)
    args["topk_length"] = args["topk_length"] - 5
    with pytest.raises(ValueError) as python:
        mfa_native.sparse_attention_backward(q, k, v, indices, o, lse, o, device="cpu", **args)
    grads = [poison(x.shape, x.dtype) for x in (q, k, v)]
    with pytest.raises(ValueError) as cpp:
        _core._bundle_sparse_attention_backward("cpu", bundle, view(q), view(k), view(v), view(indices), view(o),
                                                view(lse), view(o), *(view(g) for g in grads), **cpp_options(args))
    assert str(cpp.value) == str(python.value)
    assert all(np.isnan(g).all() for g in grads)


def test_a_call_the_bundle_lacks_lists_its_entries(bundle):
    rng = np.random.default_rng(3)
    q, k, v, indices, args = _problem(rng, "capped")
    args["topk_length"] = np.zeros((B, q.shape[1]), np.int32)   # that family's entry takes none
    out, rows = poison((B, q.shape[1], 4, 32), np.float16), poison((B, 4, q.shape[1]), np.float32)
    with pytest.raises(ValueError, match=r"(?s)no entry for sparse_attention float16 .* topk_length=yes "
                                         r"shared_latent=no .*it holds:\n  sparse_attention float32"):
        _core._bundle_sparse_attention("cpu", bundle, view(q), view(k), view(v), view(indices), view(out),
                                       view(rows), **cpp_options(args))
    assert np.isnan(out).all() and np.isnan(rows).all()


def test_entry_lines_are_pythons(bundle):
    payload = build_payload(entries_of({"families": FAMILIES}))
    assert bundle.entries() == [entry_line(r["op"], r["facts"], len(r["forward"]), len(r["backward"]))
                                for r in payload["entries"]]
    assert "topk_length=yes shared_latent=yes" in bundle.entries()[-2]


@pytest.mark.parametrize("facts", entries_of({"families": FAMILIES[:3]}), ids=lambda f: f"{f.dtype}-{f.layout}")
def test_entry_templates_are_codegens_for_every_size(facts):
    """For query lengths, key lengths and list widths across their ranges, the entry's first
    template whose guards hold is the template codegen generates for that call."""
    forward, backward = forward_templates(facts), backward_templates(facts) if facts.backward else []
    for r in (1, 2, 9, 33, 300):
        for c in (1, 64, 5000):
            for topk in (1, 7, 64, 2048):
                p = token_lists(problem(facts, r, c, batch=2, kv_heads=2), facts, topk)
                assert_chosen_are_codegens(facts, p, forward, backward, (r, c, topk))


@pytest.mark.parametrize("family, message", [
    ({"op": SPARSE, "head_dim": [8], "causal": ["none"]}, "unknown keys"),
    ({"op": SPARSE, "head_dim": [8], "topk_length": [1]}, "'topk_length' values must be true or false"),
    ({"op": SPARSE, "head_dim": [8], "value_dim": [16], "shared_latent": [True]}, "at most head_dim"),
])
def test_sparse_spec_errors_name_the_key(family, message):
    with pytest.raises(ValueError, match=message):
        entries_of({"families": [family]})


@pytest.mark.parametrize("form", ["no slots", "reversed slots", "broadcast heads", "slot stride 2",
                                  "lengths transposed", "lengths broadcast"])
def test_odd_lists_match_python(bundle, form):
    """Lists the kernels cannot read in place are copied (reversed, strided slots), a kv-head
    axis broadcast with stride 0 is read in place, a width of 0 reads nothing; topk_length
    may be any view."""
    rng = np.random.default_rng([20, len(form)])
    q, k, v, indices, args = _problem(rng, "lists")
    full = rng.integers(-1, k.shape[2] + 1, (B, HKV, q.shape[2], 6)).astype(np.int32)
    indices = {"no slots": full[..., :0], "reversed slots": full[..., ::-1],
               "broadcast heads": np.broadcast_to(full[:, :1], full.shape), "slot stride 2": full[..., ::2]}.get(
        form, full)
    r = q.shape[2]
    lengths = {"lengths transposed": rng.integers(0, 8, (r, B)).T,
               "lengths broadcast": np.broadcast_to(rng.integers(0, 8, (1, r)), (B, r))}
    args["topk_length"] = lengths.get(form, rng.integers(0, 8, (B, r))).astype(np.int32, copy=False)
    o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True, device="cpu", **args)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _core._bundle_sparse_attention("cpu", bundle, view(q), view(k), view(v), view(indices), view(out), view(rows),
                                   **cpp_options(args))
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows, lse)


# sparse_topk, the indexer: one template per entry (its splits are derived from the sizes).
TOPK_FAMILIES = [
    {"op": TOPK, "dtype": ["float32"], "head_dim": [16], "layout": ["bhsd"]},
    {"op": TOPK, "dtype": ["float16"], "head_dim": [32], "layout": ["bshd"], "causal": [False]},
    {"op": TOPK, "dtype": ["bfloat16"], "head_dim": [16], "layout": ["bhsd"], "causal": [True],
     "precision": ["int8"]},
]
# (dtype, layout, causal, precision, strided views, return_scores)
TOPK_CASES = {"bhsd": ("float32", "bhsd", True, "float", False, True),
              "bhsd-noncausal-strided": ("float32", "bhsd", False, "float", True, False),
              "bshd-strided": ("float16", "bshd", False, "float", True, True),
              "int8": ("bfloat16", "bhsd", True, "int8", False, True)}


@pytest.fixture(scope="module")
def topk_bundle():
    return _core._Bundle.from_bytes(pack(build_payload(entries_of({"families": TOPK_FAMILIES}))))


def _topk_problem(rng, dtype: str, layout: str, strided: bool, b: int = 2, hi: int = 3, c: int | None = None):
    """q (B, Hi, R, Di), k (B, 1, C, Di), weights (B, Hi, R) in `layout`'s order; `strided`: views
    of bigger arrays (every other row of q, a transposed weights)."""
    t, d = DTYPES[dtype], 32 if dtype == "float16" else 16
    r, c = int(rng.integers(1, 20)), c or int(rng.integers(1, 40))

    def four(heads: int, rows: int) -> np.ndarray:
        shape = (b, heads, rows, d) if layout == "bhsd" else (b, rows, heads, d)
        return rng.standard_normal(shape).astype(t)
    q, k = four(hi, 2 * r if strided else r), four(1, c)
    if strided:
        q = q[:, :, ::2] if layout == "bhsd" else q[:, ::2]
    weights = rng.random((b, hi, r) if layout == "bhsd" else (b, r, hi), dtype=np.float32)
    if strided:
        weights = np.ascontiguousarray(weights.transpose(0, 2, 1)).transpose(0, 2, 1)
    return q, k, weights


def _topk_outputs(q, layout: str, topk: int):
    b, r = q.shape[0], q.shape[2] if layout == "bhsd" else q.shape[1]
    shape = (b, 1, r, topk) if layout == "bhsd" else (b, r, 1, topk)
    return poison(shape, np.int32), poison(shape, np.float32)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", TOPK_CASES)
def test_topk_matches_python_bit_for_bit(topk_bundle, case, seed):
    dtype, layout, causal, precision, strided, scores = TOPK_CASES[case]
    rng = np.random.default_rng([30 + list(TOPK_CASES).index(case), seed])
    q, k, weights = _topk_problem(rng, dtype, layout, strided)
    topk = int(rng.integers(1, 50))   # beyond C too: padding
    options = dict(causal=causal, layout=layout, precision=precision)
    result = mfa_native.sparse_topk(q, k, weights, topk, return_scores=scores, device="cpu", **options)
    expected, expected_scores = result if scores else (result, None)
    indices, topk_scores = _topk_outputs(q, layout, topk)
    _core._bundle_sparse_topk("cpu", topk_bundle, view(q), view(k), view(weights), topk, view(indices),
                              view(topk_scores) if scores else None, **options)
    np.testing.assert_array_equal(indices, expected)
    if scores:
        np.testing.assert_array_equal(topk_scores, expected_scores)
    assert (indices >= 0).any()


def test_topk_split_key_ranges_match_python(topk_bundle):
    """Thousands of keys for few rows: the key range splits (a run per split, then their merge)."""
    rng = np.random.default_rng(43)
    q, k, weights = _topk_problem(rng, "float32", "bhsd", False, b=1, c=3000)
    q, weights = q[:, :, :2], weights[:, :, :2]
    expected, expected_scores = mfa_native.sparse_topk(q, k, weights, 300, return_scores=True, device="cpu")
    indices, topk_scores = _topk_outputs(q, "bhsd", 300)
    _core._bundle_sparse_topk("cpu", topk_bundle, view(q), view(k), view(weights), 300, view(indices),
                              view(topk_scores))
    np.testing.assert_array_equal(indices, expected)
    np.testing.assert_array_equal(topk_scores, expected_scores)


@pytest.mark.parametrize("empty", ["no heads", "no slots", "no keys"])
def test_topk_without_scores_to_rank_matches_python(topk_bundle, empty):
    rng = np.random.default_rng(40)
    q, k, weights = _topk_problem(rng, "float32", "bhsd", False, hi=0 if empty == "no heads" else 3)
    if empty == "no keys":
        k = k[:, :, :0]
    topk = 0 if empty == "no slots" else 7
    expected, expected_scores = mfa_native.sparse_topk(q, k, weights, topk, return_scores=True, device="cpu")
    indices, topk_scores = _topk_outputs(q, "bhsd", topk)
    _core._bundle_sparse_topk("cpu", topk_bundle, view(q), view(k), view(weights), topk, view(indices),
                              view(topk_scores))
    np.testing.assert_array_equal(indices, expected)
    np.testing.assert_array_equal(topk_scores, expected_scores)


TOPK_BAD_CALLS = {   # what changes from a good float32 bhsd call (options first, then array by array)
    "q dtype": dict(q=lambda a: a["q"].astype(np.int32)),
    "k dtype": dict(k=lambda a: a["k"].astype(np.float16)),
    "weights dtype": dict(weights=lambda a: a["weights"].astype(np.float16)),
    "topk negative": dict(topk=lambda a: -1),
    "precision": dict(precision=lambda a: "half"),
    "q rank": dict(q=lambda a: a["q"][0]),
    "k heads": dict(k=lambda a: np.concatenate([a["k"], a["k"]], axis=1)),
    "weights shape": dict(weights=lambda a: a["weights"][:, :1]),
    "topk beyond the limit": dict(k=lambda a: np.zeros((2, 1, 2049, 16), np.float32), topk=lambda a: 2049),
    "arrays in order": dict(weights=lambda a: a["weights"][:, :1].astype(np.float16), q=lambda a: a["q"][0]),
}


TOPK_BSHD_BAD_CALLS = {   # the same from a good float32 bshd call: the layout orders weights' three axes too
    "weights in bhsd's order": dict(weights=lambda a: np.ascontiguousarray(np.swapaxes(a["weights"], 1, 2))),
    "k heads": dict(k=lambda a: np.concatenate([a["k"], a["k"]], axis=2)),
    "k rank": dict(k=lambda a: a["k"][0]),
}


def _topk_bad_call(topk_bundle, layout: str, changes: dict) -> None:
    """A bad call raises the same exception and message in Python and C++, which writes nothing."""
    rng = np.random.default_rng(41)
    q, k, weights = _topk_problem(rng, "float32", layout, False)
    values = {"q": q, "k": k, "weights": weights, "topk": 5, "precision": "float"}
    values.update({name: change(values) for name, change in changes.items()})
    with pytest.raises((ValueError, TypeError)) as python:
        mfa_native.sparse_topk(values["q"], values["k"], values["weights"], values["topk"],
                               precision=values["precision"], layout=layout, device="cpu")
    indices, scores = _topk_outputs(q, layout, 5)
    with pytest.raises((ValueError, TypeError)) as cpp:
        _core._bundle_sparse_topk("cpu", topk_bundle, view(values["q"]), view(values["k"]), view(values["weights"]),
                                  values["topk"], view(indices), view(scores), precision=values["precision"],
                                  layout=layout)
    assert (cpp.type, str(cpp.value)) == (python.type, str(python.value))
    assert (indices == np.iinfo(np.int32).min).all() and np.isnan(scores).all()


@pytest.mark.parametrize("case", TOPK_BAD_CALLS)
def test_topk_bad_calls_raise_pythons_message(topk_bundle, case):
    _topk_bad_call(topk_bundle, "bhsd", TOPK_BAD_CALLS[case])


@pytest.mark.parametrize("case", TOPK_BSHD_BAD_CALLS)
def test_topk_bshd_bad_calls_raise_pythons_message(topk_bundle, case):
    _topk_bad_call(topk_bundle, "bshd", TOPK_BSHD_BAD_CALLS[case])


def test_topk_int8_beyond_exact_products_raises_pythons_message(topk_bundle):
    q, k = np.ones((1, 1, 1, 1048), np.float32), np.ones((1, 1, 1, 1048), np.float32)
    weights = np.ones((1, 1, 1), np.float32)
    with pytest.raises(ValueError) as python:
        mfa_native.sparse_topk(q, k, weights, 1, precision="int8", device="cpu")
    indices = poison((1, 1, 1, 1), np.int32)
    with pytest.raises(ValueError) as cpp:
        _core._bundle_sparse_topk("cpu", topk_bundle, view(q), view(k), view(weights), 1, view(indices),
                                  precision="int8")
    assert str(cpp.value) == str(python.value)


def test_topk_outputs_are_checked_and_a_missing_entry_lists_the_bundle(topk_bundle):
    rng = np.random.default_rng(42)
    q, k, weights = _topk_problem(rng, "float32", "bhsd", False)
    indices, scores = _topk_outputs(q, "bhsd", 5)
    with pytest.raises(TypeError, match="indices must be int32, got float32"):
        _core._bundle_sparse_topk("cpu", topk_bundle, view(q), view(k), view(weights), 5, view(scores))
    with pytest.raises(ValueError, match=r"indices must have shape \(B, 1, R, topk\)"):
        _core._bundle_sparse_topk("cpu", topk_bundle, view(q), view(k), view(weights), 4, view(indices))
    with pytest.raises(ValueError, match=r"(?s)no entry for sparse_topk float32 Di=16 causal=yes layout=bhsd "
                                         r"precision=int8 family=any; it holds:\n  sparse_topk float32 Di=16"):
        _core._bundle_sparse_topk("cpu", topk_bundle, view(q), view(k), view(weights), 5, view(indices),
                                  precision="int8")


def test_topk_entry_lines_and_templates_are_pythons(topk_bundle):
    entries = entries_of({"families": TOPK_FAMILIES})
    payload = build_payload(entries)
    assert topk_bundle.entries() == [entry_line(r["op"], r["facts"], len(r["forward"]), len(r["backward"]))
                                     for r in payload["entries"]]
    assert topk_bundle.entries()[0] == ("sparse_topk float32 Di=16 causal=yes layout=bhsd precision=float "
                                        "family=any templates=1+0")
    for facts, record in zip(entries, payload["entries"]):
        for b, hi, r, c, k in ((1, 1, 1, 1, 1), (2, 3, 9, 5000, 64), (1, 64, 1, 100000, 2048)):
            shape = {"B": b, "Hi": hi, "R": r, "C": c, "K": k, "Di": facts.head_dim}
            strides = {"q": (7 * hi * r * 64, 64, 7 * hi * 64, 1), "k": (c * 64, 0, 64, 1),
                       "weights": (hi * r, 1, hi, 0)}
            d = topk_descriptor(facts, shape, strides)
            sizes = topk_codegen.topk_sizes(shape, strides, 4096, runtime_strides=True)
            assert choose(record["forward"], sizes) == json.loads(json.dumps(asdict(topk_codegen.topk_template(d))))


@pytest.mark.parametrize("family, message", [
    ({"op": TOPK, "head_dim": [16], "family": ["apple9"]}, "unknown keys"),
    ({"op": TOPK, "head_dim": [2048], "precision": ["int8"]}, "'head_dim' values must be integers"),
    ({"op": TOPK, "head_dim": [16], "precision": ["half"]}, "'precision' value 'half' is not one of"),
    ({"op": TOPK, "head_dim": [16], "causal": ["lower_right"]}, "'causal' values must be true or false"),
])
def test_topk_spec_errors_name_the_key(family, message):
    with pytest.raises(ValueError, match=message):
        entries_of({"families": [family]})


def test_indexer_then_sparse_attention_from_cpp_is_pythons_pipeline():
    """DeepSeek's pipeline without Python: sparse_topk's lists (B, R, 1, topk), shared by the kv
    heads, fed to sparse_attention, from one bundle; the same bits as Python's two ops."""
    bundle = _core._Bundle.from_bytes(pack(build_payload(entries_of({"families": [
        {"op": TOPK, "dtype": ["float16"], "head_dim": [32], "layout": ["bshd"], "causal": [True]},
        {**BASE, "dtype": ["float16"], "head_dim": [32], "layout": ["bshd"], "topk_length": [False]}]}))))
    rng = np.random.default_rng(50)
    r, c, topk = 6, 30, 8
    q_index, k_index = (rng.standard_normal((B, n, heads, 32)).astype(np.float16) for n, heads in ((r, 3), (c, 1)))
    weights = rng.random((B, r, 3), dtype=np.float32)
    q = rng.standard_normal((B, r, 2 * HKV, 32)).astype(np.float16)
    k, v = (rng.standard_normal((B, c, HKV, 32)).astype(np.float16) for _ in "kv")
    lists = mfa_native.sparse_topk(q_index, k_index, weights, topk, layout="bshd", device="cpu")
    expected = mfa_native.sparse_attention(q, k, v, lists, layout="bshd", device="cpu")
    indices = poison(lists.shape, np.int32)
    _core._bundle_sparse_topk("cpu", bundle, view(q_index), view(k_index), view(weights), topk, view(indices),
                              layout="bshd")
    out = poison(expected.shape, np.float16)
    _core._bundle_sparse_attention("cpu", bundle, view(q), view(k), view(v), view(indices), view(out), layout="bshd")
    np.testing.assert_array_equal(indices, lists)
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))
