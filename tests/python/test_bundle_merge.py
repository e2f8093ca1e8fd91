"""merge_attention from a bundle: mfa::merge_attention (through _core's test hook) on the cpu
backend gives Python's mfa_native.merge_attention bit for bit (both layouts, every dtype, parts
with -inf and NaN lse, strided parts), and the same bad calls raise the same exception with
the same message."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import mfa_native
from mfa_native import _core
from mfa_native.bundle import entries_of
from mfa_native.bundle.file import pack
from mfa_native.bundle.writer import build_payload, entry_line

from conftest import poison, untouched
from test_bundle_cpp import view

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
FAMILIES = [{"op": "merge_attention", "value_dim": [40], "parts": [1, 3], "layout": ["bhsd", "bshd"]}]
B, HQ, DV = 2, 3, 40


@pytest.fixture(scope="module")
def bundle():
    return _core._Bundle.from_bytes(pack(build_payload(entries_of({"families": FAMILIES}))))


def _parts(rng, dtype, layout, n, r):
    shape = (B, HQ, r, DV) if layout == "bhsd" else (B, r, HQ, DV)
    outputs = [rng.standard_normal(shape).astype(DTYPES[dtype]) for _ in range(n)]
    lses = [rng.standard_normal((B, HQ, r)).astype(np.float32) * 4 for _ in range(n)]
    if r > 1:
        for lse in lses:   # rows a part saw no key of, one row no part saw, one NaN
            lse[0, 0, 1] = -np.inf
        lses[0][1, 1, 0] = np.nan
    if n > 1 and r > 2:
        lses[-1][0, 2, 2] = -np.inf
    return outputs, lses


def _cpp(bundle, outputs, lses, layout, out, lse):
    _core._bundle_merge_attention("cpu", bundle, [view(o) for o in outputs], [view(x) for x in lses], view(out),
                                  view(lse), layout=layout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("n, r", [(3, 5), (1, 2), (3, 0)])
def test_matches_python_bit_for_bit(bundle, dtype, layout, n, r):
    rng = np.random.default_rng([n, r, len(dtype), len(layout)])
    outputs, lses = _parts(rng, dtype, layout, n, r)
    o, lse = mfa_native.merge_attention(outputs, lses, layout=layout, device="cpu")
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _cpp(bundle, outputs, lses, layout, out, rows)
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows.view(np.uint32), lse.view(np.uint32))


def test_strided_parts_are_read_as_python_reads_them(bundle):
    rng = np.random.default_rng(4)
    outputs, lses = _parts(rng, "float32", "bhsd", 3, 6)
    outputs = [np.concatenate([o, o], axis=2)[:, :, ::2] for o in outputs]   # rows two apart
    lses = [np.concatenate([x, x], axis=1)[:, ::2] for x in lses]
    o, lse = mfa_native.merge_attention(outputs, lses, device="cpu")
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _cpp(bundle, outputs, lses, "bhsd", out, rows)
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows.view(np.uint32), lse.view(np.uint32))


BAD_CALLS = {   # what changes from a good three-part float32 call
    "no parts": lambda o, l: ([], []),
    "lengths differ": lambda o, l: (o, l[:2]),
    "integer parts": lambda o, l: ([x.astype(np.int32) for x in o], l),
    "dtypes differ": lambda o, l: ([o[0], o[1].astype(np.float16), o[2]], l),
    "shapes differ": lambda o, l: ([o[0], o[1][:, :, :-1], o[2]], l),
    "not 4-d": lambda o, l: ([x[0] for x in o], l),
    "lse dtype": lambda o, l: (o, [l[0], l[1].astype(np.float16), l[2]]),
    "lse shape": lambda o, l: (o, [l[0], l[1], l[2][:, :-1]]),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_raise_pythons_message(bundle, case):
    rng = np.random.default_rng(7)
    outputs, lses = BAD_CALLS[case](*_parts(rng, "float32", "bhsd", 3, 5))
    with pytest.raises((ValueError, TypeError)) as python:
        mfa_native.merge_attention(outputs, lses, device="cpu")
    out, lse = poison((B, HQ, 5, DV), np.float32), poison((B, HQ, 5), np.float32)
    with pytest.raises((ValueError, TypeError)) as cpp:
        _cpp(bundle, outputs, lses, "bhsd", out, lse)
    assert (cpp.type, str(cpp.value)) == (python.type, str(python.value))
    assert untouched(out, lse)


def test_caller_outputs_are_checked(bundle):
    """By merge_attention's declaration: the parts' dtype (TypeError), their shape (ValueError),
    contiguous."""
    outputs, lses = _parts(np.random.default_rng(1), "float16", "bhsd", 3, 5)
    with pytest.raises(TypeError, match=r"out must be the merged output .*float16 \(2, 3, 5, 40\), got float32"):
        _cpp(bundle, outputs, lses, "bhsd", poison((B, HQ, 5, DV), np.float32), poison((B, HQ, 5), np.float32))
    with pytest.raises(ValueError, match=r"lse must be the merged lse \(B, Hq, R\), float32 \(2, 3, 5\), got "
                                         r"float32 \(2, 5, 3\)"):
        _cpp(bundle, outputs, lses, "bhsd", poison((B, HQ, 5, DV), np.float16), poison((B, 5, HQ), np.float32))
    with pytest.raises(ValueError, match="lse must be contiguous"):
        _cpp(bundle, outputs, lses, "bhsd", poison((B, HQ, 5, DV), np.float16),
             poison((B, HQ, 10), np.float32)[:, :, ::2])


def test_a_call_the_bundle_lacks_lists_its_entries(bundle):
    outputs, lses = _parts(np.random.default_rng(2), "float32", "bhsd", 2, 3)
    out, rows = poison((B, HQ, 3, DV), np.float32), poison((B, HQ, 3), np.float32)
    with pytest.raises(ValueError, match=r"(?s)no entry for merge_attention float32 Dv=40 parts=2 layout=bhsd; "
                                         r"it holds:\n  merge_attention float32 Dv=40 parts=1 layout=bhsd "
                                         r"templates=1\+0"):
        _cpp(bundle, outputs, lses, "bhsd", out, rows)
    assert np.isnan(out).all() and np.isnan(rows).all()


def test_entry_lines_match_pythons(bundle):
    payload = build_payload(entries_of({"families": FAMILIES}))
    assert bundle.entries() == [entry_line(e["op"], e["facts"], len(e["forward"]), len(e["backward"]))
                                for e in payload["entries"]]
