"""quantize from a bundle: mfa::quantize (through _core's test hook) on the cpu backend gives
Python's mfa_native.quantize bit for bit (every GGUF format, affine formats, every dtype, any
shape: one template per entry, x's groups its runtime size; strided x; groups with NaN), and the
same bad calls raise the same exception with the same message."""

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
GGUF = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
FAMILIES = [{"op": "quantize", "format": list(GGUF)},
            {"op": "quantize", "format": ["affine"], "bits": [3, 4, 8], "group_size": [32, 64]}]
SHAPES = [(2, 3, 5, 64), (1, 32), (4, 0, 64), (7, 128)]


@pytest.fixture(scope="module")
def bundle():
    return _core._Bundle.from_bytes(pack(build_payload(entries_of({"families": FAMILIES}))))


def _x(rng, dtype, shape):
    x = (rng.standard_normal(shape) * 3).astype(DTYPES[dtype])
    if x.size > 64:
        x.reshape(-1)[37] = np.nan   # its group dequantizes to NaN, the others unaffected
    return x


def _cpp(bundle, x, fields, fmt, bits=None, group_size=None):
    views = {name: view(a) for name, a in fields.items()}
    _core._bundle_quantize("cpu", bundle, view(x), **views, format=fmt, bits=bits, group_size=group_size)


def _fields(tensor):
    return {name: getattr(tensor, name) for name in ("data", "scales", "biases") if getattr(tensor, name) is not None}


def _check(bundle, x, fmt, bits=None, group_size=None):
    expected = mfa_native.quantize(x, fmt, bits, group_size, device="cpu")
    fields = {name: poison(a.shape, a.dtype) for name, a in _fields(expected).items()}
    _cpp(bundle, x, fields, fmt, bits, group_size)
    for name, a in _fields(expected).items():
        np.testing.assert_array_equal(fields[name].view(np.uint8), a.view(np.uint8), err_msg=name)


@pytest.mark.parametrize("fmt", GGUF)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gguf_matches_python_bit_for_bit(bundle, fmt, dtype):
    rng = np.random.default_rng([len(fmt), ord(fmt[1]), ord(fmt[-1]), len(dtype)])
    for shape in SHAPES:
        _check(bundle, _x(rng, dtype, shape), fmt)


@pytest.mark.parametrize("bits, group_size", [(None, 64), (3, 32), (4, None), (8, 32)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_affine_matches_python_bit_for_bit(bundle, dtype, bits, group_size):
    rng = np.random.default_rng([bits or 0, group_size or 0, len(dtype)])
    for shape in SHAPES:
        if shape[-1] % (group_size or 64) == 0:
            _check(bundle, _x(rng, dtype, shape), "affine", bits, group_size)


def test_a_strided_x_is_read_as_python_reads_it(bundle):
    x = _x(np.random.default_rng(3), "float16", (6, 4, 64)).transpose(1, 0, 2)
    _check(bundle, x, "q4_1")
    _check(bundle, x, "affine", 4, 32)


BAD_CALLS = {   # (x's dtype and shape, format, bits, group_size)
    "unknown format": ("float32", (2, 64), "q3_k", None, None),
    "affine bits": ("float32", (2, 64), "affine", 7, None),
    "affine group size": ("float32", (2, 64), "affine", 4, 16),
    "gguf bits": ("float32", (2, 64), "q8_0", 4, None),
    "gguf group size": ("float32", (2, 64), "q4_0", None, 64),
    "integer x": ("int32", (2, 64), "q8_0", None, None),
    "last axis": ("float32", (2, 48), "q8_0", None, None),
    "last axis affine": ("float16", (2, 96), "affine", None, None),
    "empty last axis": ("float32", (2, 0), "q8_0", None, None),
    "scalar": ("float32", (), "q8_0", None, None),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_raise_pythons_message(bundle, case):
    dtype, shape, fmt, bits, group_size = BAD_CALLS[case]
    x = np.ones(shape, np.int32 if dtype == "int32" else DTYPES[dtype])
    with pytest.raises((ValueError, TypeError)) as python:
        mfa_native.quantize(x, fmt, bits, group_size, device="cpu")
    data = poison((2, 34), np.uint8)
    with pytest.raises((ValueError, TypeError)) as cpp:
        _core._bundle_quantize("cpu", bundle, view(x), view(data), format=fmt, bits=bits, group_size=group_size)
    assert (cpp.type, str(cpp.value)) == (python.type, str(python.value))
    assert untouched(data)


def test_caller_fields_are_checked(bundle):
    """By quantize's declaration: the format's dtype (TypeError), x's leading axes and the
    format's width (ValueError), the fields the format has."""
    x = _x(np.random.default_rng(1), "float16", (3, 64))
    with pytest.raises(ValueError, match=r"data must be uint8 \(3, 68\) for q8_0, got uint8 \(3, 34\)"):
        _cpp(bundle, x, {"data": poison((3, 34), np.uint8)}, "q8_0")
    with pytest.raises(ValueError, match=r"data must be uint8 \(3, 68\) for q8_0, got uint8 \(1, 3, 68\)"):
        _cpp(bundle, x, {"data": poison((1, 3, 68), np.uint8)}, "q8_0")
    with pytest.raises(TypeError, match=r"data must be uint8 \(3, 68\) for q8_0, got uint32 \(3, 17\)"):
        _cpp(bundle, x, {"data": poison((3, 17), np.uint32)}, "q8_0")
    with pytest.raises(TypeError, match=r"scales must be float16 \(3, 2\) for affine 8-bit, groups of 32, got "
                                        r"float32 \(3, 2\)"):
        _cpp(bundle, x, {"data": poison((3, 16), np.uint32), "scales": poison((3, 2), np.float32),
                         "biases": poison((3, 2), np.float16)}, "affine", group_size=32)
    with pytest.raises(ValueError, match="q8_0 has no scales"):
        _cpp(bundle, x, {"data": poison((3, 68), np.uint8), "scales": poison((3, 2), np.float16)}, "q8_0")
    with pytest.raises(ValueError, match="biases is required for affine 8-bit, groups of 32"):
        _cpp(bundle, x, {"data": poison((3, 16), np.uint32), "scales": poison((3, 2), np.float16)}, "affine",
             group_size=32)


def test_a_call_the_bundle_lacks_lists_its_entries(bundle):
    x = _x(np.random.default_rng(2), "float32", (2, 64))
    fields = {name: poison(shape, dtype) for name, (shape, dtype) in
              {"data": ((2, 4), np.uint32), "scales": ((2, 1), np.float32), "biases": ((2, 1), np.float32)}.items()}
    before = {name: x.tobytes() for name, x in fields.items()}
    with pytest.raises(ValueError, match=r"(?s)no entry for quantize float32 format=affine bits=2 group_size=64; "
                                         r"it holds:\n  quantize float32 format=q8_0 bits=8 group_size=32 "):
        _cpp(bundle, x, fields, "affine", 2)
    assert {name: x.tobytes() for name, x in fields.items()} == before


def test_entry_lines_match_pythons(bundle):
    payload = build_payload(entries_of({"families": FAMILIES}))
    assert bundle.entries() == [entry_line(e["op"], e["facts"], len(e["forward"]), len(e["backward"]))
                                for e in payload["entries"]]
