"""The KV-cache call from a bundle: mfa::attention_with_kvcache (through _core's test hook) on
the cpu backend gives Python's mfa_native.attention_with_kvcache bit for bit, the appended
cache rows included (contiguous and paged, float, q8_0, affine and float8 caches (k and v in
different float8 formats, with descales), GQA, with and without an append, sinks, a window, a
softcap, a score_mod and batch-invariant decode), from entries written without a scale; and
the same bad calls raise the same exception with the same message, before anything is
written."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

import mfa_native
from mfa_native import _core
from mfa_native.bundle import entries_of
from mfa_native.bundle.file import pack
from mfa_native.bundle.writer import build_payload, entry_line

from conftest import poison, untouched
from test_bundle_cpp import cpp_options, view
from test_bundle_scores import DOCUMENT_BIAS, SCORE_MOD

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
AFFINE = dict(bits=4, group_size=32)   # the affine caches' format
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
    {**BASE, "dtype": ["float32"], "page_size": [None, 4], "cache": ["affine"], "bits": [4], "group_size": [32],
     "append": [True]},
    {**BASE, "dtype": ["float32"], "page_size": [None], "cache": [[E4M3, E5M2]], "append": [True]},
    {**BASE, "dtype": ["float16"], "page_size": [4], "cache": [E5M2], "append": [True]},
    {**BASE, "dtype": ["float32"], "page_size": [4], "cache": ["q8_0"], "append": [True],
     "deterministic": ["batch_invariant"]},
]
# (family index, dtype, paged, storage (a cache storage as the spec names it, or k's and v's),
# appended rows, R, options): the default run takes the unmarked ones, -m exhaustive every one.
CASES = [
    pytest.param(0, "float32", True, "q8_0", 3, 3, {}, id="paged-q8_0-append"),
    pytest.param(0, "float32", True, "q8_0", 2, 2, dict(rotary=(16, False, True)), id="paged-q8_0-rotary-neox",
                 marks=pytest.mark.exhaustive),
    pytest.param(1, "float16", False, "plain", 0, 2, dict(window=(5, 0), sinks=True, softcap=20.0, scale=0.3),
                 id="contiguous-float16-window-sinks-softcap"),
    *(pytest.param(2, "float32", paged, storage, appended, r, {}, marks=pytest.mark.exhaustive,
                   id=f"{'paged' if paged else 'contiguous'}-{storage}-append{appended}-R{r}")
      for paged in (False, True) for storage in ("plain", "q8_0") for appended, r in ((0, 1), (2, 2), (1, 9))),
    pytest.param(2, "float32", False, "plain", 3, 3, dict(rotary=(32, True, False)), marks=pytest.mark.exhaustive,
                 id="contiguous-plain-rotary-gptj"),
    pytest.param(2, "float32", False, "q8_0", 1, 2, dict(batch=1), marks=pytest.mark.exhaustive,
                 id="contiguous-q8_0-one-sequence"),
    pytest.param(3, "float32", False, "plain", 2, 3, dict(score_mod=True), id="contiguous-plain-append-score_mod"),
    pytest.param(4, "float32", False, "affine", 2, 2, {}, id="contiguous-affine-append"),
    pytest.param(4, "float32", True, "affine", 3, 3, {}, id="paged-affine-append"),
    pytest.param(5, "float32", False, (E4M3, E5M2), 2, 2, dict(descales=True), id="contiguous-float8-pair-descales"),
    pytest.param(6, "float16", True, E5M2, 1, 1, dict(descales=True), id="paged-float8_e5m2-float16-descales"),
    pytest.param(5, "float32", False, (E4M3, E5M2), 1, 1, {}, marks=pytest.mark.exhaustive,
                 id="contiguous-float8-pair-no-descales"),
    pytest.param(7, "float32", True, "q8_0", 1, 1, dict(deterministic="batch_invariant"),
                 id="paged-q8_0-decode-batch-invariant"),
]
B, HKV, D, PAGE, BLOCKS, CMAX = 3, 2, 32, 4, 13, 20


@pytest.fixture(scope="module")
def payload():
    return build_payload(entries_of({"families": FAMILIES}))


@pytest.fixture(scope="module")
def bundle(payload):
    return _core._Bundle.from_bytes(pack(payload))


def test_entry_lines_match_pythons(bundle, payload):
    """The C++ reader's lines are writer.entry_line's, the storages (a pair, affine's bits and
    group size, float8) included."""
    lines = [entry_line(e["op"], e["facts"], len(e["forward"]), len(e["backward"])) for e in payload["entries"]]
    assert bundle.entries() == lines
    assert any(" cache=affine bits=4 group_size=32 append=yes" in line for line in lines)
    assert any(f" cache={E4M3},{E5M2} append=yes" in line for line in lines)


def _stored(rng, x: np.ndarray, storage: str):
    """Float cache `x` stored as `storage` (a spec's name: plain, a GGUF format, affine, a float8 dtype)."""
    if storage == "plain":
        return x
    if storage in (E4M3, E5M2):   # values a float8 cache holds with a descale about 1
        return (x * rng.uniform(0.5, 2)).astype(getattr(ml_dtypes, storage))
    return mfa_native.quantize(x, storage, **(AFFINE if storage == "affine" else {}), device="cpu")


def _descales(rng, batch: int) -> dict:
    """flash-attn 3's descales in forms a call may give: (B, Hkv) transposed and reversed (a
    factor per batch and head, strides (-4, 4 * B): read from a copy), (B, Hkv) expanded from a
    column (strides (4, 0)), a 0-d one."""
    return dict(k_descale=rng.uniform(0.5, 2, (HKV, batch)).astype(np.float32).T[::-1],
                q_descale=np.broadcast_to(rng.uniform(0.5, 2, (batch, 1)).astype(np.float32), (batch, HKV)),
                v_descale=np.array(rng.uniform(0.5, 2), np.float32))


def _problem(rng, dtype, paged, storage, appended, r, options):
    """The arguments of one call (numpy, as Python takes them): options["batch"] (default B)
    sequences, options["descales"] each descale its cache's storage takes, the rest of `options`
    as keyword arguments."""
    t = DTYPES[dtype]
    batch = options.get("batch", B)
    q = rng.standard_normal((batch, r, 2 * HKV, D)).astype(t)
    shape = (BLOCKS, PAGE, HKV, D) if paged else (batch, CMAX, HKV, D)
    storages = storage if isinstance(storage, tuple) else (storage, storage)
    caches = [_stored(rng, rng.standard_normal(shape).astype(t), s) for s in storages]
    capacity = 4 * PAGE if paged else CMAX
    lengths = rng.integers(0, capacity - appended + 1, batch).astype(np.int32)
    args = dict(cache_seqlens=lengths, causal=True)
    if paged:
        args["block_table"] = rng.permutation(BLOCKS)[:batch * 4].reshape(batch, 4).astype(np.int32)
    if appended:
        args["k"], args["v"] = (rng.standard_normal((batch, appended, HKV, D)).astype(t) for _ in "kv")
    if options.get("descales"):
        descales = _descales(rng, batch)
        args.update({name: descales[name] for name in ("q_descale", "k_descale") if storages[0] in (E4M3, E5M2)})
        if storages[1] in (E4M3, E5M2):
            args["v_descale"] = descales["v_descale"]
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
                 if name not in ("sinks", "rotary", "batch", "score_mod", "descales")})
    return q, caches, args


@dataclass
class _Affine:
    """An affine cache's fields as given, unchecked: what QuantizedTensor's constructor refuses,
    for the C++ op to refuse as it does."""

    fields: dict
    bits: int
    group_size: int
    format: str = "affine"


def _copies(caches):
    return [c.with_fields(**{name: x.copy() for name, x in c.arrays().items()})
            if isinstance(c, mfa_native.QuantizedTensor)
            else _Affine({name: x.copy() for name, x in c.fields.items()}, c.bits, c.group_size)
            if isinstance(c, _Affine) else c.copy() for c in caches]


def _fields(cache) -> dict[str, np.ndarray]:
    """A cache's stored arrays: a QuantizedTensor's fields, else the array itself as "data"."""
    if isinstance(cache, _Affine):
        return cache.fields
    return cache.arrays() if isinstance(cache, mfa_native.QuantizedTensor) else {"data": cache}


def _data(cache):
    return _fields(cache)["data"]


def _cpp(bundle, q, caches, args, out, lse):
    options = cpp_options({name: x for name, x in args.items() if name != "causal"})
    if "deterministic" in options:
        options["batch_invariant"] = options.pop("deterministic") == "batch_invariant"
    formats = [getattr(c, "format", "") for c in caches]
    for name, cache in zip("kv", caches):   # an affine cache's fields, bits and group_size
        if getattr(cache, "format", "") == "affine":
            options.update({f"{name}_{field}": view(_fields(cache)[field]) for field in ("scales", "biases")},
                           **{f"{name}_bits": cache.bits, f"{name}_group_size": cache.group_size})
    _core._bundle_attention_with_kvcache("cpu", bundle, view(q), view(_data(caches[0])), view(_data(caches[1])),
                                         view(out), view(lse), cache_format=formats[0], v_cache_format=formats[1],
                                         causal="lower_right" if args["causal"] else "none", **options)


@pytest.mark.parametrize("family, dtype, paged, storage, appended, r, options", CASES)
def test_matches_python_bit_for_bit(bundle, family, dtype, paged, storage, appended, r, options):
    rng = np.random.default_rng([family, appended, r, paged, len(str(storage))])
    q, caches, args = _problem(rng, dtype, paged, storage, appended, r, options)
    python_caches, cpp_caches = _copies(caches), _copies(caches)
    o, lse = mfa_native.attention_with_kvcache(q, *python_caches, return_lse=True, device="cpu", **args)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _cpp(bundle, q, cpp_caches, args, out, rows)
    assert not np.isnan(o.astype(np.float32)).any()
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows, lse)
    for python_cache, cpp_cache, given in zip(python_caches, cpp_caches, caches):
        for field, x in _fields(cpp_cache).items():   # the data, an affine cache's scales and biases
            assert np.array_equal(x.view(np.uint8), _fields(python_cache)[field].view(np.uint8)), field
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
    "rotary with no rows appended": dict(k=lambda a: a["k"][:, :0], v=lambda a: a["v"][:, :0]),   # Rn = 0
    "score_mod tensor missing": dict(score_mod=lambda a: DOCUMENT_BIAS,
                                     score_mod_tensors=lambda a: [np.arange(CMAX, dtype=np.int32)]),
    "score_mod text": dict(score_mod=lambda a: "float score(); float sub(0)", score_mod_tensors=lambda a: None),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_raise_pythons_message_before_writing(bundle, case):
    rng = np.random.default_rng(7)
    q, caches, args = _problem(rng, "float32", True, "q8_0", 3, 3, dict(rotary=(16, False, True)))
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
    assert untouched(out, rows)


def test_a_call_the_bundle_lacks_lists_its_entries(bundle):
    rng = np.random.default_rng(3)
    q, caches, args = _problem(rng, "float32", True, "plain", 0, 1, {})
    args["block_table"] = args["block_table"][:, :2].copy()   # fine, but page size 5 has no entry:
    args["cache_seqlens"] = np.minimum(args["cache_seqlens"], 10)
    caches = [np.ascontiguousarray(np.concatenate([c, c[:, :1]], axis=1)) for c in caches]
    out, rows = poison((B, 1, 2 * HKV, D), np.float32), poison((B, 2 * HKV, 1), np.float32)
    with pytest.raises(ValueError, match=r"(?s)no entry for attention_with_kvcache .* page_size=5 .*it holds:\n  "
                                         r"attention_with_kvcache float32"):
        _cpp(bundle, q, caches, args, out, rows)
    assert np.isnan(out).all() and np.isnan(rows).all()


def test_a_rotating_window_entry_serves_no_call_that_turns_q_otherwise():
    """Without causal, q's rows turn at one position unless a window is given (flash-attn's
    rule), so an entry baked with a window cannot serve a windowless call that rotates."""
    family = {**BASE, "dtype": ["float32"], "causal": ["none"], "window": [True], "page_size": [4],
              "cache": ["q8_0"], "append": [True], "rotary_dim": [16], "rotary_interleaved": [False],
              "rotary_seqlens": [True]}
    windowed = _core._Bundle.from_bytes(pack(build_payload(entries_of({"families": [family]}))))
    rng = np.random.default_rng(5)
    q, caches, args = _problem(rng, "float32", True, "q8_0", 1, 1, dict(rotary=(16, False, True)))
    args["causal"] = False
    out, rows = poison((B, 1, 2 * HKV, D), np.float32), poison((B, 2 * HKV, 1), np.float32)
    with pytest.raises(ValueError, match="no entry for attention_with_kvcache .* causal=none .* window=no"):
        _cpp(windowed, q, _copies(caches), args, out, rows)


# What changes from a good call (the float8 pair's with descales, or the affine cache's); each
# refused by Python, by ops/float8_cache.py's checks.
BAD_STORAGE_CALLS = {
    "k_descale for an affine cache": ("affine", dict(k_descale=lambda a: np.ones(1, np.float32))),
    "q_descale for an affine k_cache": ("affine", dict(q_descale=lambda a: np.ones((B, HKV), np.float32))),
    "descale dtype": ("float8", dict(k_descale=lambda a: a["k_descale"].astype(np.float16))),
    "descale shape": ("float8", dict(v_descale=lambda a: np.ones((B, HKV + 1), np.float32))),
    "descale 1-d": ("float8", dict(q_descale=lambda a: np.ones(HKV, np.float32))),
}


def _storage_call(rng, base: str):
    if base == "affine":
        return _problem(rng, "float32", False, "affine", 2, 2, {})
    return _problem(rng, "float32", False, (E4M3, E5M2), 2, 2, dict(descales=True))


def _refused_alike(bundle, q, caches, args, python_call=None):
    """Python's call (or `python_call`) and C++'s raise one exception type and message; C++
    wrote nothing to the caches or the outputs."""
    with pytest.raises((ValueError, TypeError)) as python:
        if python_call is None:
            mfa_native.attention_with_kvcache(q, *_copies(caches), device="cpu", **args)
        else:
            python_call()
    cpp_caches = _copies(caches)
    out, rows = poison((*q.shape[:3], D), np.float32), poison((B, 2 * HKV, q.shape[1]), np.float32)
    with pytest.raises((ValueError, TypeError)) as cpp:
        _cpp(bundle, q, cpp_caches, args, out, rows)
    assert (cpp.type, str(cpp.value)) == (python.type, str(python.value))
    for cpp_cache, given in zip(cpp_caches, caches):
        assert all(np.array_equal(x.view(np.uint8), _fields(given)[f].view(np.uint8))
                   for f, x in _fields(cpp_cache).items())
    assert np.isnan(out).all() and np.isnan(rows).all()


@pytest.mark.parametrize("case", BAD_STORAGE_CALLS)
def test_bad_descales_raise_pythons_message_before_writing(bundle, case):
    base, changes = BAD_STORAGE_CALLS[case]
    q, caches, args = _storage_call(np.random.default_rng(11), base)
    args.update({name: change(args) for name, change in changes.items()})
    _refused_alike(bundle, q, caches, args)


# An affine cache's fields as QuantizedTensor's constructor refuses them (Python raises there).
BAD_AFFINE_FIELDS = {
    "scales shape": dict(scales=lambda x: x[..., :0]),
    "scales dtype": dict(scales=lambda x: x.astype(np.int32)),
    "biases dtype": dict(biases=lambda x: x.astype(np.float16)),
    "data dtype": dict(data=lambda x: x.view(np.uint8)),
    "data width": dict(data=lambda x: x[..., :3]),
    "bits": dict(bits=7),
    "group_size": dict(group_size=48),
}


@pytest.mark.parametrize("case", BAD_AFFINE_FIELDS)
def test_bad_affine_fields_raise_pythons_message_before_writing(bundle, case):
    q, caches, args = _storage_call(np.random.default_rng(12), "affine")
    v = caches[1]
    fields = {**v.arrays(), "bits": v.bits, "group_size": v.group_size}
    fields.update({name: change(fields[name]) if callable(change) else change
                   for name, change in BAD_AFFINE_FIELDS[case].items()})
    bad = _Affine({name: fields[name] for name in ("data", "scales", "biases")}, fields["bits"],
                  fields["group_size"])

    def python_call():
        mfa_native.QuantizedTensor(fields["data"], fields["scales"], fields["biases"], format="affine",
                                   bits=fields["bits"], group_size=fields["group_size"])
    _refused_alike(bundle, q, [caches[0], bad], args, python_call)


def test_storages_no_entry_serves_are_refused_before_writing(bundle):
    """What Python serves but no entry bakes: an affine cache whose scales are not q's dtype or
    affine caches of two formats (ArgumentError), a plain k_cache beside a q8_0 v_cache (no
    entry, listing the bundle's)."""
    rng = np.random.default_rng(13)
    q, caches, args = _storage_call(rng, "affine")
    half = [c.with_fields(scales=c.field("scales").astype(np.float16), biases=c.field("biases").astype(np.float16))
            for c in caches]
    mixed = [rng.standard_normal((B, CMAX, HKV, D)).astype(np.float32),
             mfa_native.quantize(rng.standard_normal((B, CMAX, HKV, D)).astype(np.float32), "q8_0", device="cpu")]
    eight = [caches[0], mfa_native.quantize(caches[1].dequantize(), "affine", bits=8, group_size=32, device="cpu")]
    for given, message in ((half, "k_cache.scales must have q's dtype float32 in a bundle call"),
                           (eight, r"must share bits and group_size in a bundle call .* got affine 4-bit, groups of "
                                   r"32 and affine 8-bit, groups of 32"),
                           (mixed, r"(?s)no entry for attention_with_kvcache .* cache=plain,q8_0 .*it holds:")):
        cpp_caches = _copies(given)
        out, rows = poison((B, 2, 2 * HKV, D), np.float32), poison((B, 2 * HKV, 2), np.float32)
        with pytest.raises(ValueError, match=message):
            _cpp(bundle, q, cpp_caches, args, out, rows)
        for cpp_cache, cache in zip(cpp_caches, given):
            assert all(np.array_equal(x.view(np.uint8), _fields(cache)[f].view(np.uint8))
                       for f, x in _fields(cpp_cache).items())
        assert np.isnan(out).all()
