"""Packed sequences from a bundle: mfa::attention_varlen (through _core's test hook) on the cpu
backend gives Python's mfa_native.attention_varlen bit for bit (GQA with and without packed
heads, by max_seqlen_q or total_q, empty sequences, a window, sinks and a softcap), from
entries written without a scale; the entry's template for a call is codegen's for every
(cu_seqlens, max_seqlen_q) tried; and the same bad calls raise the same exception with the
same message, before anything is written: both check by the ops' declarations
(ops/varlen_rules.py), which the bundle carries."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, replace

import ml_dtypes
import numpy as np
import pytest

import mfa_native
from mfa_native import _core, codegen
from mfa_native.bundle import entries_of
from mfa_native.bundle.file import pack
from mfa_native.bundle.writer import (VARLEN_BOUND, build_payload, choose, entry_line, forward_templates, problem,
                                      without_bound)

from conftest import poison
from test_bundle_cpp import view
from test_bundle_scores import DOCUMENT_BIAS, SCORE_MOD

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
HKV, D, PAGE, BLOCKS = 2, 32, 4, 30
BASE = {"op": "attention_varlen", "family": ["apple9"], "head_dim": [32], "sinks": [False], "window": [False]}
FAMILIES = [
    {**BASE, "dtype": ["float32"], "gqa_ratio": [4], "causal": ["lower_right"], "backward": True},
    {**BASE, "dtype": ["float16"], "gqa_ratio": [1], "causal": ["none"], "window": [True], "sinks": [True],
     "softcap": [20.0], "backward": True},
    {**BASE, "dtype": ["float32"], "gqa_ratio": [1], "causal": ["lower_right"], "seqused_k": [True]},
    {**BASE, "dtype": ["float32"], "gqa_ratio": [2], "causal": ["lower_right"], "page_size": [PAGE]},
    {**BASE, "dtype": ["float32"], "gqa_ratio": [1], "causal": ["none"], "alibi": ["per_batch", "per_head"],
     "backward": True},
    {**BASE, "dtype": ["float32"], "gqa_ratio": [1], "causal": ["lower_right"], "score_mod": [SCORE_MOD],
     "backward": True},
]


@pytest.fixture(scope="module")
def bundle():
    return _core._Bundle.from_bytes(pack(build_payload(entries_of({"families": FAMILIES}))))


def _cu(rng, sequences: int, longest: int) -> np.ndarray:
    """cu_seqlens of `sequences` random lengths 0..longest (some empty)."""
    return np.concatenate([[0], np.cumsum(rng.integers(0, longest + 1, sequences))]).astype(np.int32)


def _problem(rng, dtype: str, ratio: int, sequences: int, longest_q: int, longest_k: int, options: dict):
    """The arguments of one call (numpy, as Python takes them)."""
    t = DTYPES[dtype]
    cu_q, cu_k = _cu(rng, sequences, longest_q), _cu(rng, sequences, longest_k)
    q = rng.standard_normal((int(cu_q[-1]), ratio * HKV, D)).astype(t)
    k, v = (rng.standard_normal((int(cu_k[-1]), HKV, D)).astype(t) for _ in "kv")
    args = dict(options)
    if args.pop("sinks", False):
        args["sinks"] = rng.standard_normal(ratio * HKV).astype(np.float32)
    if args.pop("score_mod", False):   # the document bias: doc (20,) int and bias (4,) float, read per sequence
        args.update(score_mod=DOCUMENT_BIAS, score_mod_tensors=[np.sort(rng.integers(0, 4, 20)).astype(np.int32),
                                                                 rng.standard_normal(4).astype(np.float32)])
    alibi = args.pop("alibi", None)
    if alibi:   # per sequence (B, Hq) or per head (Hq,)
        args["alibi_slopes"] = rng.uniform(0.01, 0.5, (sequences, ratio * HKV) if alibi == "per_batch"
                                           else ratio * HKV).astype(np.float32)
    if args.pop("seqused_k", False):   # each sequence's first keys, some none
        args["seqused_k"] = rng.integers(0, np.diff(cu_k) + 1).astype(np.int32)
    paged = args.pop("paged", None)
    if paged is not None:   # pages in a random order; cu_seqlens_k counts logical keys, or is None
        width, blocks = -(-longest_k // PAGE), max(BLOCKS, -(-longest_k // PAGE) * sequences)
        k, v = (rng.standard_normal((blocks, PAGE, HKV, D)).astype(t) for _ in "kv")
        table = rng.permutation(blocks)[:sequences * width].reshape(sequences, width).astype(np.int32)
        args["block_table"] = np.where(rng.random(table.shape) < 0.1, -1, table).astype(np.int32) if paged == "cu" \
            else table
        if paged == "used":
            args["seqused_k"] = rng.integers(0, width * PAGE + 1, sequences).astype(np.int32)
        if paged != "cu":
            cu_k = None
        if paged == "cu":   # pages past each sequence's keys may be anything (-1): they are not read
            lengths = np.diff(cu_k)
            needed = np.arange(width)[None, :] < -(-lengths[:, None] // PAGE)
            args["block_table"] = np.where(needed, table, -1).astype(np.int32)
    return (q, k, v, cu_q, cu_k), args


def _cpu():
    return next(d for d in mfa_native.devices() if d.kind == "cpu")


def _views(args: dict) -> dict:
    """The hook's views of a call's array arguments (score_mod_tensors: a list of them)."""
    views = {name: view(x) for name, x in args.items() if isinstance(x, np.ndarray)}
    if "score_mod_tensors" in args:
        views["score_mod_tensors"] = [view(x) for x in args["score_mod_tensors"]]
    return views


def _cpp(bundle, arrays, args, out, lse, batch=None):
    q, k, v, cu_q, cu_k = arrays
    views = _views(args)
    options = {name: x for name, x in args.items() if name not in views and name != "causal"}
    _core._bundle_attention_varlen("cpu", bundle, view(q), view(k), view(v), view(cu_q),
                                   None if cu_k is None else view(cu_k), view(out), None if lse is None else view(lse),
                                   causal="lower_right" if args.get("causal") else "none", batch=batch, **views,
                                   **options)


# (dtype, GQA ratio, sequences, longest q, longest k, options): packed heads by total_q, by the
# hint, none (too many queries), and the window/sinks/softcap entry.
CASES = [
    pytest.param("float32", 4, 5, 6, 40, dict(causal=True), id="gqa4-packs-by-total_q"),
    pytest.param("float32", 4, 6, 20, 30, dict(causal=True, max_seqlen_q=20, max_seqlen_k=30),
                 id="gqa4-packs-by-hint"),
    pytest.param("float32", 4, 4, 40, 50, dict(causal=True, scale=0.2), id="gqa4-unpacked"),
    pytest.param("float16", 1, 5, 30, 30, dict(window=(7, 2), sinks=True, softcap=20.0, scale=0.3),
                 id="float16-window-sinks-softcap"),
    pytest.param("float32", 4, 3, 1, 9, dict(causal=True, max_seqlen_q=1), id="gqa4-decode"),
    pytest.param("float32", 1, 6, 12, 20, dict(causal=True, seqused_k=True, max_seqlen_k=20), id="seqused_k"),
    pytest.param("float32", 2, 4, 5, 13, dict(causal=True, paged="cu"), id="paged-cu_seqlens_k"),
    pytest.param("float32", 2, 4, 30, 13, dict(causal=True, paged="used"), id="paged-seqused_k"),
    pytest.param("float32", 2, 3, 7, 9, dict(causal=True, paged="whole"), id="paged-whole-table"),
    pytest.param("float32", 2, 1, 7, 9, dict(causal=True, paged="used"), id="paged-one-sequence"),
    pytest.param("float32", 1, 5, 9, 12, dict(alibi="per_batch"), id="alibi-per-sequence"),
    pytest.param("float32", 1, 4, 9, 12, dict(alibi="per_head"), id="alibi-per-head"),
    pytest.param("float32", 1, 4, 15, 20, dict(causal=True, score_mod=True), id="score_mod"),
]


@pytest.mark.parametrize("dtype, ratio, sequences, longest_q, longest_k, options", CASES)
def test_matches_python_bit_for_bit(bundle, dtype, ratio, sequences, longest_q, longest_k, options):
    rng = np.random.default_rng([ratio, sequences, longest_q, longest_k])
    arrays, args = _problem(rng, dtype, ratio, sequences, longest_q, longest_k, options)
    o, lse = mfa_native.attention_varlen(*arrays, return_lse=True, device="cpu", **args)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _cpp(bundle, arrays, args, out, rows)
    assert not np.isnan(o.astype(np.float32)).all()
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows, lse)
    out = poison(o.shape, o.dtype)   # without lse: the same output
    _cpp(bundle, arrays, args, out, None)
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))


def _cpp_backward(bundle, arrays, o, lse, do, args, grads):
    q, k, v, cu_q, cu_k = arrays
    views = _views(args)
    options = {name: x for name, x in args.items() if name not in views and name != "causal"}
    dsinks = None if len(grads) < 4 else view(grads[3])
    _core._bundle_attention_varlen_backward("cpu", bundle, view(q), view(k), view(v), view(o), view(lse), view(do),
                                            view(cu_q), None if cu_k is None else view(cu_k), *map(view, grads[:3]),
                                            dsinks=dsinks, causal="lower_right" if args.get("causal") else "none",
                                            **views, **options)


@pytest.mark.parametrize("dtype, ratio, sequences, longest_q, longest_k, options",
                         [case for case in CASES if not {"seqused_k", "paged"} & set(case.values[-1])])
def test_backward_matches_python_bit_for_bit(bundle, dtype, ratio, sequences, longest_q, longest_k, options):
    rng = np.random.default_rng([ratio, sequences, longest_q, longest_k, 1])
    arrays, args = _problem(rng, dtype, ratio, sequences, longest_q, longest_k, options)
    o, lse = mfa_native.attention_varlen(*arrays, return_lse=True, device="cpu", **args)
    do = rng.standard_normal(o.shape).astype(o.dtype)
    expected = mfa_native.attention_varlen_backward(*arrays[:3], o, lse, do, *arrays[3:], device="cpu", **args)
    grads = [poison(x.shape, x.dtype) for x in expected]
    _cpp_backward(bundle, arrays, o, lse, do, args, grads)
    for got, want in zip(grads, expected):
        assert not np.isnan(want.astype(np.float32)).all()
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


BAD_BACKWARD = {   # what changes from a good backward call
    "o dtype": dict(o=lambda a: a["o"].astype(np.float16)),
    "do shape": dict(do=lambda a: a["do"][1:]),
    "lse dtype": dict(lse=lambda a: a["lse"].astype(np.float16)),
    "lse shape": dict(lse=lambda a: a["lse"].T.copy()),
    "cu_seqlens_k decreasing": dict(cu_k=lambda a: np.array([0, 3, 2, 1, 20, a["cu_k"][-1]], np.int32)),
    "cu_seqlens_q start": dict(cu_q=lambda a: a["cu_q"] + 1),
    "k rank": dict(k=lambda a: a["k"][None]),
}


@pytest.mark.parametrize("case", BAD_BACKWARD)
def test_bad_backward_calls_raise_pythons_message_before_writing(bundle, case):
    rng = np.random.default_rng(8)
    (q, k, v, cu_q, cu_k), args = _problem(rng, "float32", 4, 5, 6, 30, dict(causal=True))
    o, lse = mfa_native.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, device="cpu", **args)
    given = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, o=o, lse=lse, do=rng.standard_normal(o.shape).astype(o.dtype))
    given.update({name: change(given) for name, change in BAD_BACKWARD[case].items()})
    arrays = tuple(given[name] for name in ("q", "k", "v", "cu_q", "cu_k"))
    with pytest.raises((ValueError, TypeError)) as python:
        mfa_native.attention_varlen_backward(*arrays[:3], given["o"], given["lse"], given["do"], *arrays[3:],
                                             device="cpu", **args)
    grads = [poison(x.shape, np.float32) for x in (q, k, v)]
    with pytest.raises((ValueError, TypeError)) as cpp:
        _cpp_backward(bundle, arrays, given["o"], given["lse"], given["do"], args, grads)
    assert (cpp.type, str(cpp.value)) == (python.type, str(python.value))
    assert all(np.isnan(g).all() for g in grads)


@pytest.mark.exhaustive
@pytest.mark.parametrize("seed", range(40))
def test_random_calls_match_python_bit_for_bit(bundle, seed):
    """Random sequences (counts, lengths, empty ones) and max_seqlen_q hints (none, the
    longest, more) on every family of the bundle: forward (and backward where the entry has
    it) bit for bit."""
    rng = np.random.default_rng([seed, 99])
    dtype, ratio, options = [("float32", 4, dict(causal=True)),
                             ("float16", 1, dict(window=(int(rng.integers(-1, 9)), int(rng.integers(-1, 9))),
                                                 sinks=True, softcap=20.0)),
                             ("float32", 1, dict(causal=True, seqused_k=True)),
                             ("float32", 2, dict(causal=True, paged=str(rng.choice(["cu", "used", "whole"]))))][seed % 4]
    sequences, longest_q = int(rng.integers(1, 10)), int(rng.choice([1, 2, 5, 16, 40]))
    arrays, args = _problem(rng, dtype, ratio, sequences, longest_q, int(rng.integers(1, 40)), options)
    longest = int(np.diff(arrays[3]).max())
    hint = [None, longest, longest + int(rng.integers(1, 30))][seed % 3]
    if hint is not None:
        args["max_seqlen_q"] = hint
    o, lse = mfa_native.attention_varlen(*arrays, return_lse=True, device="cpu", **args)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _cpp(bundle, arrays, args, out, rows)
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows, lse)
    if seed % 4 < 2:
        do = rng.standard_normal(o.shape).astype(o.dtype)
        expected = mfa_native.attention_varlen_backward(*arrays[:3], o, lse, do, *arrays[3:], device="cpu", **args)
        grads = [poison(x.shape, x.dtype) for x in expected]
        _cpp_backward(bundle, arrays, o, lse, do, args, grads)
        for got, want in zip(grads, expected):
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_a_batch_keeps_the_unit_table_it_encodes(bundle):
    """Encoded into a CommandBatch, the call's unit table (built from cu_seqlens at the call)
    lives in a pool buffer the batch holds: later calls and their tables do not change it."""
    rng = np.random.default_rng(12)
    first, args = _problem(rng, "float32", 4, 5, 20, 30, dict(causal=True, max_seqlen_q=20))
    o, lse = mfa_native.attention_varlen(*first, return_lse=True, device="cpu", **args)
    batch = _core.CommandBatch(_cpu())
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _cpp(bundle, first, args, out, rows, batch=batch)
    assert np.isnan(out).all()   # not run yet
    other, other_args = _problem(rng, "float32", 4, 7, 20, 30, dict(causal=True, max_seqlen_q=20))
    for _ in range(3):   # calls run at once, each building its own tables from the pool
        _cpp(bundle, other, other_args, poison((*other[0].shape[:2], D), np.float32), None)
    batch.commit()
    batch.wait()
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows, lse)


def test_a_paged_backward_is_refused_with_pythons_words(bundle):
    """Both raise NotImplementedError (C++: mfa::NotImplementedError), with the same message."""
    rng = np.random.default_rng(13)
    arrays, args = _problem(rng, "float32", 2, 3, 4, 8, dict(causal=True, paged="cu"))
    o, lse = mfa_native.attention_varlen(*arrays, return_lse=True, device="cpu", **args)
    with pytest.raises(NotImplementedError) as python:
        mfa_native.attention_varlen_backward(*arrays[:3], o, lse, o, *arrays[3:], device="cpu", **args)
    grads = [poison(arrays[0].shape, np.float32), poison((8, HKV, D), np.float32), poison((8, HKV, D), np.float32)]
    with pytest.raises(NotImplementedError) as cpp:
        _cpp_backward(bundle, arrays, o, lse, o, args, grads)
    assert str(cpp.value) == str(python.value) and all(np.isnan(g).all() for g in grads)


@pytest.mark.parametrize("longest_q, longest_k", [(4, 0), (0, 5)], ids=["no-keys", "no-queries"])
def test_empty_call_writes_pythons_zeros_and_lse(bundle, longest_q, longest_k):
    rng = np.random.default_rng(11)
    arrays, args = _problem(rng, "float16", 1, 3, longest_q, longest_k, dict(sinks=True))
    o, lse = mfa_native.attention_varlen(*arrays, return_lse=True, device="cpu", **args)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _cpp(bundle, arrays, args, out, rows)
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows, lse)


@pytest.mark.parametrize("facts", entries_of({"families": [
    {**BASE, "dtype": ["float32"], "gqa_ratio": [1, 4, 16], "causal": ["lower_right"]},
    {**BASE, "dtype": ["float16"], "gqa_ratio": [2], "causal": ["none"], "window": [True]},
    {**BASE, "dtype": ["float32"], "gqa_ratio": [8], "causal": ["lower_right"], "seqused_k": [True]},
    {**BASE, "dtype": ["float32"], "gqa_ratio": [4], "causal": ["lower_right"], "page_size": [3]}]}),
    ids=lambda f: f"gqa{f.gqa_ratio}{'-seqused_k' if f.seqused_k else ''}{f'-page{f.page_size}' if f.page_size else ''}")
def test_entry_templates_are_codegens_for_every_bound(facts):
    """For many (cu_seqlens, max_seqlen_q) the entry's first template whose guards hold is,
    its query bound put aside, the template codegen generates for that call (packed heads
    or not, each bound's own unit)."""
    forward = forward_templates(facts)
    rng = np.random.default_rng(facts.gqa_ratio)
    for _ in range(60):
        sequences = int(rng.integers(1, 9))
        cu_q = _cu(rng, sequences, int(rng.choice([1, 3, 8, 20, 70])))
        cu_k = _cu(rng, sequences, 50)
        longest = int(np.diff(cu_q).max())
        hint = [None, longest, longest + int(rng.integers(0, 40))][int(rng.integers(0, 3))]
        total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
        if total_q == 0 or total_k == 0:
            continue
        bound = total_q if hint is None else hint   # ops/varlen.py's per-sequence query bound
        keys = codegen.SequenceRanges(sequences, bound, facts.seqused_k)
        if facts.page_size:   # as ops/varlen_keys.py's visit: pages following each other, the table's width
            keys = codegen.PagedSequences(sequences, bound, page_size=facts.page_size,
                                          pages_per_sequence=int(rng.integers(1, 9)), page_rows=facts.page_size)
        p = replace(problem(facts, total_q, total_k, kv_heads=HKV), keys=keys)
        sizes = {**codegen.call_sizes(p, 4), VARLEN_BOUND: max(bound, 1)}
        expected = json.loads(json.dumps(asdict(codegen.attention_template(p, family=facts.family,
                                                                           parallel_threadgroups=4))))
        chosen = choose(forward, sizes)
        assert chosen is not None and without_bound(chosen) == expected, (cu_q, hint)


BAD_CALLS = {   # what changes from a good call (packed heads, hints given)
    "q rank": dict(q=lambda a: a["q"][0]),
    "cu_seqlens_q dtype": dict(cu_q=lambda a: a["cu_q"].astype(np.float32)),
    "cu_seqlens_q shape": dict(cu_q=lambda a: a["cu_q"][None]),
    "k rank": dict(k=lambda a: a["k"][None]),
    "v rows": dict(v=lambda a: a["v"][1:]),
    "cu_seqlens_k missing": dict(cu_k=lambda a: None),
    "cu_seqlens_k length": dict(cu_k=lambda a: a["cu_k"][:-1]),
    "k dtype": dict(k=lambda a: a["k"].astype(np.float16)),
    "head dim": dict(k=lambda a: a["k"][:, :, :16].copy()),
    "cu_seqlens_q start": dict(cu_q=lambda a: a["cu_q"] + 1),
    "cu_seqlens_q end": dict(cu_q=lambda a: np.concatenate([a["cu_q"][:-1], [a["cu_q"][-1] - 1]]).astype(np.int32)),
    "cu_seqlens_q decreasing": dict(cu_q=lambda a: np.array([0, 9, 4, 4, 20, a["cu_q"][-1]], np.int32)),
    "cu_seqlens_k decreasing": dict(cu_k=lambda a: np.array([0, 3, 2, 1, 20, a["cu_k"][-1]], np.int32)),
    "cu_seqlens_k start": dict(cu_k=lambda a: a["cu_k"] + 2),
    "cu_seqlens_k end": dict(cu_k=lambda a: np.concatenate([a["cu_k"][:-1], [a["cu_k"][-1] + 1]]).astype(np.int32)),
    "cu_seqlens_q empty": dict(cu_q=lambda a: a["cu_q"][:0]),
    "cu_seqlens_k too many": dict(cu_k=lambda a: np.lib.stride_tricks.as_strided(np.zeros(1, np.int32),
                                                                                 (2**24 + 2,), (0,))),
    "max_seqlen_q short": dict(max_seqlen_q=lambda a: 1),
    "max_seqlen_k short": dict(max_seqlen_k=lambda a: 2),
    "max_seqlen_q negative": dict(max_seqlen_q=lambda a: -1),
    "window type": dict(window=lambda a: (1, -2)),
    "alibi_slopes rows": dict(alibi_slopes=lambda a: np.ones((2, a["q"].shape[1]), np.float32)),
    "alibi_slopes length": dict(alibi_slopes=lambda a: np.ones(a["q"].shape[1] + 1, np.float32)),
    "score_mod_tensors without score_mod": dict(score_mod_tensors=lambda a: [np.zeros(4, np.float32)]),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_raise_pythons_message_before_writing(bundle, case):
    rng = np.random.default_rng(7)
    (q, k, v, cu_q, cu_k), args = _problem(rng, "float32", 4, 5, 6, 30, dict(causal=True))
    args.update(max_seqlen_q=int(np.diff(cu_q).max()), max_seqlen_k=int(np.diff(cu_k).max()))
    given = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, **args)
    given.update({name: change(given) for name, change in BAD_CALLS[case].items()})
    arrays = tuple(given.pop(name) for name in ("q", "k", "v", "cu_q", "cu_k"))
    with pytest.raises((ValueError, TypeError)) as python:
        mfa_native.attention_varlen(*arrays, device="cpu", **given)
    out, rows = poison((q.shape[0], q.shape[1], D), np.float32), poison((q.shape[1], q.shape[0]), np.float32)
    with pytest.raises((ValueError, TypeError)) as cpp:
        _cpp(bundle, arrays, given, out, rows)
    assert (cpp.type, str(cpp.value)) == (python.type, str(python.value))
    assert np.isnan(out).all() and np.isnan(rows).all()


BAD_USED = {   # what changes from a good call with seqused_k
    "seqused_k shape": lambda used, cu_k: used[:-1],
    "seqused_k dtype": lambda used, cu_k: used.astype(np.float32),
    "seqused_k negative": lambda used, cu_k: used - 3,
    "seqused_k rank": lambda used, cu_k: used[None],
    "seqused_k beyond": lambda used, cu_k: np.diff(cu_k).astype(np.int32) + np.arange(len(used), dtype=np.int32) % 2,
    "max_seqlen_k below the used keys": None,
}


@pytest.mark.parametrize("case", BAD_USED)
def test_bad_seqused_k_raises_pythons_message_before_writing(bundle, case):
    rng = np.random.default_rng(9)
    arrays, args = _problem(rng, "float32", 1, 5, 6, 30, dict(causal=True, seqused_k=True))
    if BAD_USED[case] is None:
        args["max_seqlen_k"] = int(args["seqused_k"].max()) - 1
    else:
        args["seqused_k"] = BAD_USED[case](args["seqused_k"], arrays[4])
    with pytest.raises((ValueError, TypeError)) as python:
        mfa_native.attention_varlen(*arrays, device="cpu", **args)
    q = arrays[0]
    out, rows = poison((q.shape[0], q.shape[1], D), np.float32), poison((q.shape[1], q.shape[0]), np.float32)
    with pytest.raises((ValueError, TypeError)) as cpp:
        _cpp(bundle, arrays, args, out, rows)
    assert (cpp.type, str(cpp.value)) == (python.type, str(python.value))
    assert np.isnan(out).all() and np.isnan(rows).all()


BAD_PAGED = {   # what changes from a good paged call (cu_seqlens_k counting each sequence's keys)
    "k rank": dict(k=lambda a: a["k"][0]),
    "v pages": dict(v=lambda a: a["v"][1:]),
    "page size 0": dict(k=lambda a: a["k"][:, :0], v=lambda a: a["v"][:, :0]),
    "pages overlap": dict(k=lambda a: np.lib.stride_tricks.as_strided(a["k"], (BLOCKS - 1, PAGE, HKV, D),
                                                                      (a["k"].strides[1], *a["k"].strides[1:]))),
    "v rows apart": dict(v=lambda a: np.ascontiguousarray(np.stack([a["v"], a["v"]], 1))[:, 0]),
    "block_table form": dict(block_table=lambda a: a["block_table"][1:]),
    "block_table dtype": dict(block_table=lambda a: a["block_table"].astype(np.float32)),
    "cu_seqlens_k start": dict(cu_k=lambda a: a["cu_k"] + 1),
    "beyond the pages": dict(cu_k=lambda a: (a["cu_k"] * 4).astype(np.int32)),
    "page not read out of range": dict(block_table=lambda a: np.where(a["block_table"] >= 0, a["block_table"] + BLOCKS,
                                                                      a["block_table"]).astype(np.int32)),
    "seqused_k negative": dict(seqused_k=lambda a: np.full(len(a["cu_k"]) - 1, -1, np.int32)),
    "max_seqlen_k short": dict(max_seqlen_k=lambda a: 0),
    "cu_seqlens_k decreasing": dict(cu_k=lambda a: a["cu_k"][::-1].copy()),
    "rows apart (C++ only)": None,
}


@pytest.mark.parametrize("case", BAD_PAGED)
def test_bad_paged_calls_raise_pythons_message_before_writing(bundle, case):
    rng = np.random.default_rng(10)
    (q, k, v, cu_q, cu_k), args = _problem(rng, "float32", 2, 4, 5, 13, dict(causal=True, paged="cu"))
    given = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, **args)
    if BAD_PAGED[case] is None:   # HND pages, read in place by Python; a bundle entry's pages follow each other
        given["k"], given["v"] = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (k, v))
    else:
        given.update({name: change(given) for name, change in BAD_PAGED[case].items()})
    arrays = tuple(given.pop(name) for name in ("q", "k", "v", "cu_q", "cu_k"))
    out, rows = poison((q.shape[0], q.shape[1], D), np.float32), poison((q.shape[1], q.shape[0]), np.float32)
    with pytest.raises((ValueError, TypeError)) as cpp:
        _cpp(bundle, arrays, given, out, rows)
    assert np.isnan(out).all() and np.isnan(rows).all()
    if BAD_PAGED[case] is None:
        assert "rows apart; a bundle entry reads pages that follow each other" in str(cpp.value)
        return
    with pytest.raises((ValueError, TypeError)) as python:
        mfa_native.attention_varlen(*arrays, device="cpu", **given)
    assert (cpp.type, str(cpp.value)) == (python.type, str(python.value))


def test_entry_lines_are_the_writers():
    payload = build_payload(entries_of({"families": FAMILIES[2:4]}))
    lines = _core._Bundle.from_bytes(pack(payload)).entries()
    assert lines == [entry_line(r["op"], r["facts"], len(r["forward"]), len(r["backward"])) for r in payload["entries"]]
    assert " seqused_k=yes " in lines[0] and " page_size=4 seqused_k=no " in lines[1] and lines[1].endswith("+0")


def test_a_call_the_bundle_lacks_lists_its_entries(bundle):
    rng = np.random.default_rng(3)
    arrays, args = _problem(rng, "float32", 2, 3, 5, 9, dict(causal=True))
    q = arrays[0]
    out = poison((q.shape[0], q.shape[1], D), np.float32)
    with pytest.raises(ValueError, match=r"(?s)no entry for attention_varlen float32 D=32 Dv=32 gqa=2 .*it holds:\n  "
                                         r"attention_varlen float32 D=32 Dv=32 gqa=4"):
        _cpp(bundle, arrays, args, out, None)
    assert np.isnan(out).all()


def test_bad_outputs_are_refused_by_the_declaration(bundle):
    """The C++ caller's outputs (Python returns its own) are checked by the declarations' rules:
    out and dq of another shape or dtype are refused before anything is written."""
    rng = np.random.default_rng(14)
    arrays, args = _problem(rng, "float32", 4, 3, 6, 20, dict(causal=True))
    q, k, v = arrays[:3]
    out = poison((q.shape[0] + 1, q.shape[1], D), np.float32)
    with pytest.raises(ValueError, match=re.escape(f"out must have shape (total_q, Hq, Dv) = {(*q.shape[:2], D)}, "
                                                   f"got {out.shape}")):
        _cpp(bundle, arrays, args, out, None)
    assert np.isnan(out).all()
    o, lse = mfa_native.attention_varlen(*arrays, return_lse=True, device="cpu", **args)
    grads = [poison(q.shape, np.float16), poison(k.shape, np.float32), poison(v.shape, np.float32)]
    with pytest.raises(TypeError, match="dq has dtype float16 but must be float32"):
        _cpp_backward(bundle, arrays, o, lse, o, args, grads)
    assert all(np.isnan(g.astype(np.float32)).all() for g in grads)
