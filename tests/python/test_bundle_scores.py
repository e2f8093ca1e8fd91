"""Score transforms in bundles: an entry bakes its softcap, ALiBi kind and score_mod (text and
tensor shapes), and mfa::attention / attention_backward run them from C++ with Python's bits
on the cpu backend, take the slopes and the score_mod's tensors as call arguments, and refuse
a call whose transforms no entry bakes."""

from __future__ import annotations

import re

import numpy as np
import pytest

import mfa_native
from mfa_native import _core, reference
from mfa_native.bundle import entries_of
from mfa_native.bundle.writer import build_payload, entry_line
from mfa_native.codegen.attention.score_mod import ScoreMod

from conftest import poison, relative_l2
from test_bundle_cpp import bundle, cpp_options, view  # noqa: F401 (bundle: the fixture, over this payload)

# score + bias[h] * (q_idx - kv_idx) where doc[kv_idx] == doc[q_idx], else score - 1 (a document bias):
# mfa_native.torch.score_mod.trace's text of that function, with bias (4,) float and doc (20,) int.
DOCUMENT_BIAS = ("float score(); int b(); int h(); int q_idx(); int kv_idx(); int read[0](4); int read[0](3); "
                 "bool eq(5,6); float read[1](2); int sub(3,4); float mul(8,9); float add(0,10); "
                 "float const[1.0](); float sub(0,12); float where(7,11,13)")
SCORE_MOD = {"text": DOCUMENT_BIAS, "tensors": [{"dtype": "int", "shape": [20]}, {"dtype": "float", "shape": [4]}]}
BASE = {"op": "attention", "dtype": ["float32"], "mask": ["none"], "window": [False], "family": ["apple9"],
        "backward": True}
FAMILIES = [
    {**BASE, "head_dim": [16], "gqa_ratio": [2], "causal": ["lower_right"], "sinks": [False], "layout": ["bhsd"],
     "softcap": [2.0], "alibi": ["per_batch"]},
    {**BASE, "head_dim": [8], "causal": ["none"], "sinks": [True], "layout": ["bshd"], "alibi": ["per_head"],
     "score_mod": [SCORE_MOD]},
]


@pytest.fixture(scope="module")
def payload():
    return build_payload(entries_of({"families": FAMILIES}))


def _score_mod_tensors(rng):
    return [np.sort(rng.integers(0, 4, 20)).astype(np.int32), rng.standard_normal(4).astype(np.float32)]


def _capped_problem(rng):
    """Family 0: B 2, GQA 2, causal, softcap 2 and per-batch slopes."""
    q = rng.standard_normal((2, 4, 7, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 11, 16)).astype(np.float32) for _ in "kv")
    return q, k, v, dict(causal="lower_right", softcap=2.0, alibi_slopes=rng.uniform(0.1, 1, (2, 4)).astype(np.float32))


def _score_mod_problem(rng):
    """Family 1: bshd, sinks, per-head slopes and the document bias."""
    q = rng.standard_normal((1, 9, 2, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 13, 2, 8)).astype(np.float32) for _ in "kv")
    return q, k, v, dict(layout="bshd", sinks=rng.standard_normal(2).astype(np.float32),
                         alibi_slopes=rng.uniform(0.1, 1, 2).astype(np.float32), score_mod=DOCUMENT_BIAS,
                         score_mod_tensors=_score_mod_tensors(rng))


@pytest.mark.parametrize("make", [_capped_problem, _score_mod_problem], ids=["softcap-alibi", "score_mod"])
def test_score_transforms_run_from_a_bundle_with_pythons_bits(bundle, make, rng):
    q, k, v, options = make(rng)
    o, lse = mfa_native.attention(q, k, v, return_lse=True, device="cpu", **options)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _core._bundle_attention("cpu", bundle, view(q), view(k), view(v), view(out), view(rows), **cpp_options(options))
    assert out.tobytes() == o.tobytes() and rows.tobytes() == lse.tobytes()
    plain = {name: value for name, value in options.items() if name in ("causal", "layout", "sinks")}
    assert relative_l2(o, mfa_native.attention(q, k, v, device="cpu", **plain)) > 0.05   # the transforms matter
    if "score_mod" not in options:   # the float64 reference knows softcap and ALiBi (test_score_mod checks the rest)
        assert relative_l2(out, reference.attention_reference(q, k, v, causal=True, softcap=2.0,
                                                              alibi_slopes=options["alibi_slopes"])) < 1e-5

    do = rng.standard_normal(o.shape).astype(np.float32)
    grads = mfa_native.attention_backward(q, k, v, o, lse, do, device="cpu", **options)
    mine = [poison(x.shape, x.dtype) for x in grads]
    dsinks = view(mine[3]) if "sinks" in options else None
    _core._bundle_attention_backward("cpu", bundle, view(q), view(k), view(v), view(o), view(lse), view(do),
                                     *map(view, mine[:3]), dsinks, **cpp_options(options))
    for ours, theirs in zip(mine, grads):
        assert ours.tobytes() == theirs.tobytes()


def test_entry_lines_name_the_transforms(bundle, payload):
    lines = bundle.entries()
    assert lines == [entry_line(r["op"], r["facts"], len(r["forward"]), len(r["backward"])) for r in payload["entries"]]
    assert " softcap=2 alibi=per_batch family=" in lines[0]
    assert " alibi=per_head score_mod=" in lines[1] and "softcap" not in lines[1]


def _refused(bundle, q, k, v, options, match, error=ValueError):
    out = poison((*q.shape[:3], v.shape[-1]), np.float32)
    before = out.tobytes()
    with pytest.raises(error, match=match):
        _core._bundle_attention("cpu", bundle, view(q), view(k), view(v), view(out), **cpp_options(options))
    assert out.tobytes() == before


def test_a_call_whose_transforms_no_entry_bakes_is_refused(bundle, rng):
    q, k, v, options = _capped_problem(rng)
    for change, shown in (({"softcap": 3.0}, "softcap=3 alibi=per_batch"), ({"softcap": None}, "layout=bhsd alibi"),
                          ({"alibi_slopes": options["alibi_slopes"][0]}, "softcap=2 alibi=per_head"),
                          ({"alibi_slopes": None}, "softcap=2 family")):
        _refused(bundle, q, k, v, {**options, **change}, f"no entry for attention .*{shown}")
    q, k, v, options = _score_mod_problem(rng)
    other = DOCUMENT_BIAS.replace("float const[1.0]", "float const[2.0]")
    wider = [options["score_mod_tensors"][0], rng.standard_normal(5).astype(np.float32)]
    for change in ({"score_mod": other}, {"score_mod_tensors": wider}, {"score_mod": "", "score_mod_tensors": []}):
        _refused(bundle, q, k, v, {**options, **change}, "no entry for attention")


def test_bad_transform_arguments_are_refused_as_python_refuses_them(bundle, rng):
    q, k, v, options = _capped_problem(rng)
    for change in ({"alibi_slopes": options["alibi_slopes"][:, :3].copy()}, {"softcap": -1.0}):
        with pytest.raises(ValueError) as python:
            mfa_native.attention(q, k, v, device="cpu", **{**options, **change})
        prefix = str(python.value).split(", got")[0]
        _refused(bundle, q, k, v, {**options, **change}, "^" + prefix.replace("(", r"\(").replace(")", r"\)"))
    _refused(bundle, q, k, v, {**options, "alibi_slopes": options["alibi_slopes"].astype(np.float16)},
             "alibi_slopes must be float32, got dtype float16", TypeError)
    q, k, v, options = _score_mod_problem(rng)
    _refused(bundle, q, k, v, {**options, "score_mod": ""}, "score_mod_tensors given without a score_mod")
    tensors = [options["score_mod_tensors"][0].astype(np.float16), options["score_mod_tensors"][1]]
    _refused(bundle, q, k, v, {**options, "score_mod_tensors": tensors},
             r"score_mod_tensors\[0\] must be float32 or int32", TypeError)
    # Tensors the expression does not read as given (missing, one short, a rank off): Python's words.
    for tensors in ([], options["score_mod_tensors"][:1], [options["score_mod_tensors"][0].reshape(4, 5),
                                                            options["score_mod_tensors"][1]]):
        with pytest.raises(ValueError) as python:
            mfa_native.attention(q, k, v, device="cpu", **{**options, "score_mod_tensors": tensors})
        assert "the expression reads tensors {0: 1, 1: 1}" in str(python.value)
        _refused(bundle, q, k, v, {**options, "score_mod_tensors": tensors}, "^" + re.escape(str(python.value)) + "$")


def _mutations(rng, count: int) -> list[str]:
    """The document bias's text, each with one random edit: a character replaced, dropped or
    doubled, a term swapped with its neighbour, or a grammar character (quote, bracket, digit,
    sign, a non-ASCII letter) put in: most are no longer texts of terms, some are again."""
    pieces = list("[](),;. -+e0123456789'\"\\x_") + ["ö", "nan", "inf", "True", "read", "not"]
    texts = []
    for _ in range(count):
        text, at = DOCUMENT_BIAS, int(rng.integers(0, len(DOCUMENT_BIAS)))
        edit = int(rng.integers(0, 4))
        if edit == 0:
            text = text[:at] + str(rng.choice(pieces)) + text[at + 1:]
        elif edit == 1:
            text = text[:at] + text[at + 1:]
        elif edit == 2:
            text = text[:at] + text[at] + text[at:]
        else:
            terms = text.split("; ")
            i = int(rng.integers(0, len(terms) - 1))
            terms[i], terms[i + 1] = terms[i + 1], terms[i]
            text = "; ".join(terms)
        texts.append(text)
    return texts


def test_score_mod_texts_are_read_as_python_reads_them(bundle, rng):
    """Malformed texts (a part off the grammar, an unknown operation, a read without a tensor
    index, a term read before it is computed, operands off the operation's arity, reads not
    matching the tensors) are refused by C++
    with Python's exact message before anything is written; the texts Python accepts C++ accepts
    too (then the bundle has no entry baking them)."""
    q, k, v, options = _score_mod_problem(rng)
    fixed = ["float score(); ", "float  score()", "float score(1)", "float scores()", "int b(); int read(0)",
             "int b(); int read[-1](0)", "int b(); int read[x](0)", "float const[1e5]()", "float const[1_0]()",
             "float score(); float add(0,,0)", "float score(); float add(0,1)", "float sc\u00f6re()",
             "float const['a']()", "int b(); int read[007](0); float to_float(1)",
             "int b(); int read[99999999999999999999](0); float to_float(1)", "float score(); float sub(0)",
             "float score(); float neg(0,0)"]
    texts = fixed + _mutations(rng, 120)
    refused = 0
    for text in texts:
        try:
            ScoreMod(text, tuple(("int" if t.dtype == np.int32 else "float", t.shape)
                                 for t in options["score_mod_tensors"]))
        except ValueError as python:
            refused += 1
            _refused(bundle, q, k, v, {**options, "score_mod": text}, "^" + re.escape(str(python)) + "$")
        else:
            _refused(bundle, q, k, v, {**options, "score_mod": text}, "no entry for attention")
    assert len(fixed) <= refused < len(texts)   # both verdicts were exercised
    with pytest.raises(ValueError) as python:   # the public call gives the same refusal
        mfa_native.attention(q, k, v, device="cpu", **{**options, "score_mod": fixed[4]})
    assert str(python.value) == "score_mod: term 1 of the expression text is not a term: 'int read(0)'"


@pytest.mark.parametrize("key, value, message", [
    ("softcap", [0], "'softcap' values: softcap must be finite and above 0"),
    ("alibi", ["sideways"], "'alibi' value 'sideways' is not one of"),
    ("score_mod", [{"text": DOCUMENT_BIAS}], "'score_mod' score_mod: the expression reads tensors"),
    ("score_mod", ["x + 1"], "'score_mod' values are null or"),
])
def test_spec_errors_name_the_transform(key, value, message):
    with pytest.raises(ValueError, match=message):
        entries_of({"families": [{**FAMILIES[0], key: value}]})
