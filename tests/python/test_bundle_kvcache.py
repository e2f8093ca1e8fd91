"""The KV-cache call from a bundle: mfa::attention_with_kvcache (through _core's test hook) on
the cpu backend gives Python's mfa_native.attention_with_kvcache bit for bit, the appended
cache rows included (contiguous and paged, float and q8_0 caches, GQA, with and without an
append, sinks, a window, a softcap and a score_mod), from entries written without a scale; and the same bad
calls raise the same exception with the same message, before anything is written."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import mfa_native
from mfa_native import _core
from mfa_native.bundle import entries_of
from mfa_native.bundle.file import pack
from mfa_native.bundle.writer import build_payload

from conftest import poison
from test_bundle_cpp import view
from test_bundle_scores import DOCUMENT_BIAS, SCORE_MOD

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
BASE = {"op": "attention_with_kvcache", "family": ["apple9"], "head_dim": [32], "gqa_ratio": [2],
        "causal": ["lower_right"], "window": [False], "sinks": [False]}
FAMILIES = [
    {**BASE, "dtype": ["float32"], "page_size": [4], "cache": ["q8_0"], "append": [True], "rotary_dim": [None, 16],
     "rotary_interleaved": [False], "rotary_seqlens": [True]},
    {**BASE, "dtype": ["float16"], "page_size": [None], "cache": ["plain"], "append": [False], "window": [True],
     "sinks": [True], "softcap": [20.0]},
    {**BASE, "dtype": ["float32"], "page_size": [None, 4], "cache": ["plain", "q8_0"], "append": [True, False],
     "rotary_dim": [None, 32], "rotary_interleaved": [True], "rotary_seqlens": [False]},
    {**BASE, "dtype": ["float32"], "page_size": [None], "cache": ["plain"], "append": [True], "score_mod": [SCORE_MOD]},
]
# (family index, dtype, paged, quantized, appended rows, R, options): the default run takes the
# first two, -m exhaustive every one.
CASES = [
    pytest.param(0, "float32", True, True, 3, 3, {}, id="paged-q8_0-append"),
    pytest.param(0, "float32", True, True, 2, 2, dict(rotary=(16, False, True)), id="paged-q8_0-rotary-neox",
                 marks=pytest.mark.exhaustive),
    pytest.param(1, "float16", False, False, 0, 2, dict(window=(5, 0), sinks=True, softcap=20.0, scale=0.3),
                 id="contiguous-float16-window-sinks-softcap"),
    *(pytest.param(2, "float32", paged, quantized, appended, r, {}, marks=pytest.mark.exhaustive,
                   id=f"{'paged' if paged else 'contiguous'}-{'q8_0' if quantized else 'plain'}-append{appended}-R{r}")
      for paged in (False, True) for quantized in (False, True) for appended, r in ((0, 1), (2, 2), (1, 9))),
    pytest.param(2, "float32", False, False, 3, 3, dict(rotary=(32, True, False)), marks=pytest.mark.exhaustive,
                 id="contiguous-plain-rotary-gptj"),
    pytest.param(2, "float32", False, True, 1, 2, dict(batch=1), marks=pytest.mark.exhaustive,
                 id="contiguous-q8_0-one-sequence"),
    pytest.param(3, "float32", False, False, 2, 3, dict(score_mod=True), id="contiguous-plain-append-score_mod"),
]
B, HKV, D, PAGE, BLOCKS, CMAX = 3, 2, 32, 4, 13, 20


@pytest.fixture(scope="module")
def bundle():
    return _core._Bundle.from_bytes(pack(build_payload(entries_of({"families": FAMILIES}))))


def _problem(rng, dtype, paged, quantized, appended, r, options):
    """The arguments of one call (numpy, as Python takes them): options["batch"] (default B)
    sequences, the rest of `options` as keyword arguments."""
    t = DTYPES[dtype]
    batch = options.get("batch", B)
    q = rng.standard_normal((batch, r, 2 * HKV, D)).astype(t)
    shape = (BLOCKS, PAGE, HKV, D) if paged else (batch, CMAX, HKV, D)
    caches = [rng.standard_normal(shape).astype(t) for _ in "kv"]
    if quantized:
        caches = [mfa_native.quantize(c, "q8_0", device="cpu") for c in caches]
    capacity = 4 * PAGE if paged else CMAX
    lengths = rng.integers(0, capacity - appended + 1, batch).astype(np.int32)
    args = dict(cache_seqlens=lengths, causal=True)
    if paged:
        args["block_table"] = rng.permutation(BLOCKS)[:batch * 4].reshape(batch, 4).astype(np.int32)
    if appended:
        args["k"], args["v"] = (rng.standard_normal((batch, appended, HKV, D)).astype(t) for _ in "kv")
    if "sinks" in options:
        args["sinks"] = rng.standard_normal(2 * HKV).astype(np.float32)
    if "score_mod" in options:   # the document bias: doc (CMAX,) int by key row, bias (Hq,) float
        args.update(score_mod=DOCUMENT_BIAS, score_mod_tensors=[np.sort(rng.integers(0, 4, CMAX)).astype(np.int32),
                                                                rng.standard_normal(2 * HKV).astype(np.float32)])
    if "rotary" in options:   # (rotary_dim, interleaved, rotary_seqlens given)
        dim, interleaved, starts = options["rotary"]
        angles = rng.uniform(0, 6.3, (capacity + r, dim // 2))
        args.update(rotary_cos=np.cos(angles).astype(t), rotary_sin=np.sin(angles).astype(t),
                    rotary_interleaved=interleaved)
        if starts:
            args["rotary_seqlens"] = rng.integers(0, capacity - appended + 1, batch).astype(np.int32)
    args.update({name: value for name, value in options.items()
                 if name not in ("sinks", "rotary", "batch", "score_mod")})
    return q, caches, args


def _copies(caches):
    return [c.with_fields(data=c.data.copy()) if isinstance(c, mfa_native.QuantizedTensor) else c.copy()
            for c in caches]


def _data(cache):
    return cache.data if isinstance(cache, mfa_native.QuantizedTensor) else cache


def _cpp(bundle, q, caches, args, out, lse):
    quantized = isinstance(caches[0], mfa_native.QuantizedTensor)
    views = {name: view(x) for name, x in args.items() if isinstance(x, np.ndarray)}
    options = {name: x for name, x in args.items() if not isinstance(x, np.ndarray) and name != "causal"}
    if "score_mod_tensors" in options:
        options["score_mod_tensors"] = [view(t) for t in options["score_mod_tensors"]]
    _core._bundle_attention_with_kvcache("cpu", bundle, view(q), view(_data(caches[0])), view(_data(caches[1])),
                                         view(out), view(lse), cache_format="q8_0" if quantized else "",
                                         causal="lower_right" if args["causal"] else "none", **views, **options)


@pytest.mark.parametrize("family, dtype, paged, quantized, appended, r, options", CASES)
def test_matches_python_bit_for_bit(bundle, family, dtype, paged, quantized, appended, r, options):
    rng = np.random.default_rng([family, appended, r, paged, quantized])
    q, caches, args = _problem(rng, dtype, paged, quantized, appended, r, options)
    python_caches, cpp_caches = _copies(caches), _copies(caches)
    o, lse = mfa_native.attention_with_kvcache(q, *python_caches, return_lse=True, device="cpu", **args)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _cpp(bundle, q, cpp_caches, args, out, rows)
    assert not np.isnan(o.astype(np.float32)).any()
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows, lse)
    for python_cache, cpp_cache, given in zip(python_caches, cpp_caches, caches):
        assert np.array_equal(_data(cpp_cache).view(np.uint8), _data(python_cache).view(np.uint8))
        if appended:   # the append wrote something, in both
            assert not np.array_equal(_data(python_cache).view(np.uint8), _data(given).view(np.uint8))


BAD_CALLS = {   # what changes from a good paged q8_0 call with an append
    "cache_seqlens dtype": dict(cache_seqlens=lambda a: a["cache_seqlens"].astype(np.float32)),
    "cache_seqlens negative": dict(cache_seqlens=lambda a: a["cache_seqlens"] - 20),
    "beyond capacity": dict(cache_seqlens=lambda a: a["cache_seqlens"] + 14),
    "page out of range": dict(block_table=lambda a: a["block_table"] + 20),
    "block_table form": dict(block_table=lambda a: a["block_table"][:2]),
    "k without v": dict(v=lambda a: None),
    "k shape": dict(k=lambda a: a["k"][:, :, :1].copy()),
    "lengths missing": dict(cache_seqlens=lambda a: None),
    "rotary_sin missing": dict(rotary_sin=lambda a: None),
    "rotary dtype": dict(rotary_cos=lambda a: a["rotary_cos"].astype(np.float16)),
    "rotary too wide": dict(rotary_cos=lambda a: np.ones((40, 40), np.float32),
                            rotary_sin=lambda a: np.ones((40, 40), np.float32)),
    "rotary too short": dict(rotary_cos=lambda a: a["rotary_cos"][:4].copy(),
                             rotary_sin=lambda a: a["rotary_sin"][:4].copy()),
    "rotary_seqlens negative": dict(rotary_seqlens=lambda a: a["rotary_seqlens"] - 20),
    "rotary without append": dict(k=lambda a: None, v=lambda a: None),
    "score_mod tensor missing": dict(score_mod=lambda a: DOCUMENT_BIAS,
                                     score_mod_tensors=lambda a: [np.arange(CMAX, dtype=np.int32)]),
    "score_mod text": dict(score_mod=lambda a: "float score(); float sub(0)", score_mod_tensors=lambda a: None),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_raise_pythons_message_before_writing(bundle, case):
    rng = np.random.default_rng(7)
    q, caches, args = _problem(rng, "float32", True, True, 3, 3, dict(rotary=(16, False, True)))
    args.update({name: change(args) for name, change in BAD_CALLS[case].items()})
    args = {name: value for name, value in args.items() if value is not None}
    with pytest.raises((ValueError, TypeError)) as python:
        mfa_native.attention_with_kvcache(q, *_copies(caches), device="cpu", **args)
    cpp_caches = _copies(caches)
    out, rows = poison((B, 3, 2 * HKV, D), np.float32), poison((B, 2 * HKV, 3), np.float32)
    with pytest.raises((ValueError, TypeError)) as cpp:
        _cpp(bundle, q, cpp_caches, args, out, rows)
    assert (cpp.type, str(cpp.value)) == (python.type, str(python.value))
    assert all(np.array_equal(_data(c).view(np.uint8), _data(g).view(np.uint8)) for c, g in zip(cpp_caches, caches))


def test_a_call_the_bundle_lacks_lists_its_entries(bundle):
    rng = np.random.default_rng(3)
    q, caches, args = _problem(rng, "float32", True, False, 0, 1, {})
    args["block_table"] = args["block_table"][:, :2].copy()   # fine, but page size 5 has no entry:
    args["cache_seqlens"] = np.minimum(args["cache_seqlens"], 10)
    caches = [np.ascontiguousarray(np.concatenate([c, c[:, :1]], axis=1)) for c in caches]
    with pytest.raises(ValueError, match=r"(?s)no entry for attention_with_kvcache .* page_size=5 .*it holds:\n  "
                                         r"attention_with_kvcache float32"):
        _cpp(bundle, q, caches, args, poison((B, 1, 2 * HKV, D), np.float32), poison((B, 2 * HKV, 1), np.float32))


def test_a_rotating_window_entry_serves_no_call_that_turns_q_otherwise():
    """Without causal, q's rows turn at one position unless a window is given (flash-attn's
    rule), so an entry baked with a window cannot serve a windowless call that rotates."""
    family = {**BASE, "dtype": ["float32"], "causal": ["none"], "window": [True], "page_size": [4],
              "cache": ["q8_0"], "append": [True], "rotary_dim": [16], "rotary_interleaved": [False],
              "rotary_seqlens": [True]}
    windowed = _core._Bundle.from_bytes(pack(build_payload(entries_of({"families": [family]}))))
    rng = np.random.default_rng(5)
    q, caches, args = _problem(rng, "float32", True, True, 1, 1, dict(rotary=(16, False, True)))
    args["causal"] = False
    out, rows = poison((B, 1, 2 * HKV, D), np.float32), poison((B, 2 * HKV, 1), np.float32)
    with pytest.raises(ValueError, match="no entry for attention_with_kvcache .* causal=none .* window=no"):
        _cpp(windowed, q, _copies(caches), args, out, rows)
