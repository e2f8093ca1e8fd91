"""`quantize` against its origins: MLX's `mx.quantize` (affine, every bits and group size) and
the `gguf` package's q8_0, q4_0, q4_1, q5_0 and q5_1 reference quantizers, for float32, float16 and
bfloat16.

Inputs mix normal rows, offset uniform rows (all positive), rows with a large outlier,
negative-dominant rows (MLX's negative scales), zero and constant groups, and a row whose
values fall exactly on rounding ties. The integers must equal the reference's; a difference
of 1 is allowed only where the reference's own float32 value sits on a rounding boundary
(found explicitly below: there a different but IEEE-valid evaluation order may round the
other way). Scales and biases must equal the reference's to one ulp of their dtype. Outputs
are poisoned (conftest): a field the kernel never wrote fails."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from ml_dtypes import bfloat16

import mfa_native
from mfa_native import QuantizedTensor
from mfa_native.ops import quantize as quantize_op

try:
    import mlx.core as mx
except ImportError:
    mx = None
try:
    import gguf
except ImportError:
    gguf = None
needs_mlx = pytest.mark.skipif(mx is None, reason="needs mlx (pip install mlx)")
needs_gguf = pytest.mark.skipif(gguf is None, reason="needs the gguf package")

MX_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(bfloat16): "bfloat16"}
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
# Every bits x group size in float16; float32 and bfloat16 take every bits at 64 and bits 4 at 32 and 128
# (each (dtype, format) is a kernel to compile: this keeps a cold run short).
AFFINE_CASES = ([(np.float16, b, g) for b in BITS for g in GROUP_SIZES]
                + [(dt, b, 64) for dt in (np.float32, bfloat16) for b in BITS]
                + [(dt, 4, g) for dt in (np.float32, bfloat16) for g in (32, 128)])
GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1"}


def to_mlx(x: np.ndarray):
    """x as an MLX array of the same dtype (bfloat16 through float32, which holds it exactly)."""
    return mx.array(x.astype(np.float32)).astype(getattr(mx, MX_DTYPES[x.dtype]))


def to_numpy(a) -> np.ndarray:
    """An MLX array as numpy, float dtypes as float32 (exact)."""
    return np.array(a.astype(mx.float32)) if a.dtype in (mx.float16, mx.bfloat16, mx.float32) else np.array(a)


def inputs(rng, rows: int, D: int, dtype) -> np.ndarray:
    """(rows, D) of every kind the quantizers treat differently, rows shuffled."""
    kinds = [lambda: rng.standard_normal(D),
             lambda: rng.uniform(3.0, 5.0, D),                         # offset: all positive
             lambda: rng.standard_normal(D) * (1 + 60 * (np.arange(D) == rng.integers(D))),  # an outlier
             lambda: -np.abs(rng.standard_normal(D)) * 3 + 0.5,        # negative-dominant groups
             lambda: np.where(np.arange(D) < D // 2, 0.0, 1.5),        # zero and constant groups
             lambda: np.resize([3.0, 2.5, 1.5, 0.0, 0.5, -1.5], D) * 2.0 ** rng.integers(-3, 3)]  # ties
    x = np.stack([kinds[i % len(kinds)]() for i in range(rows)])
    return x[rng.permutation(rows)].astype(dtype)


def affine_codes(data: np.ndarray, bits: int) -> np.ndarray:
    """The integers of affine `data` (uint32 words, a little-endian bit stream per row)."""
    stream = np.unpackbits(np.ascontiguousarray(data).astype("<u4").view(np.uint8), axis=-1, bitorder="little")
    return (stream.reshape(*data.shape[:-1], -1, bits).astype(np.int64) << np.arange(bits)).sum(-1)


def gguf_fields(data: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(d as float16, m as float16 or None, integers) of raw GGUF blocks (..., blocks * bytes),
    read from ggml's block layouts (block_q8_0, _q4_0, _q4_1, _q5_0, _q5_1), independently of
    mfa_native's own reader."""
    size, has_m, fifth_bits = {"q8_0": (34, False, False), "q4_0": (18, False, False), "q4_1": (20, True, False),
                               "q5_0": (22, False, True), "q5_1": (24, True, True)}[fmt]
    blocks = np.ascontiguousarray(data).reshape(-1, size)
    d = blocks[:, :2].copy().view("<f2")[:, 0]
    m = blocks[:, 2:4].copy().view("<f2")[:, 0] if has_m else None
    if fmt == "q8_0":
        return d, m, blocks[:, 2:].view(np.int8).astype(np.int64)
    start = 2 + 2 * has_m + 4 * fifth_bits
    codes = np.concatenate([blocks[:, start:] & 15, blocks[:, start:] >> 4], axis=-1).astype(np.int64)
    if fifth_bits:
        qh = blocks[:, start - 4:start].copy().view("<u4").astype(np.int64)
        codes |= ((qh >> np.arange(32)) & 1) << 4
    return d, m, codes


def near_boundary(v: np.ndarray, boundary: float) -> np.ndarray:
    """Where float32 v lies within 2 ulps of a rounding boundary k + `boundary` (0.5 for
    round-to-nearest, 0 for truncation): the reference's rounding decides the integer there."""
    v = v.astype(np.float64)
    distance = np.abs((v - boundary) - np.round(v - boundary))
    return distance <= 2 * np.spacing(np.abs(v).astype(np.float32)).astype(np.float64)


def affine_values(x: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """(w - bias) / scale in float32 with MLX's float32 scale and bias: what MLX rounds (rint)."""
    w = x.astype(np.float32).reshape(-1, group_size)
    w_min, w_max = w.min(-1, keepdims=True), w.max(-1, keepdims=True)
    side = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / np.float32((1 << bits) - 1), np.float32(1e-7))
    scale = np.where(side, scale, -scale)
    edge = np.where(side, w_min, w_max)
    q0 = np.rint(edge / scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(q0 != 0, edge / q0, scale)
    bias = np.where(q0 != 0, edge, np.float32(0))
    return ((w - bias) / scale).reshape(*x.shape[:-1], -1)


def gguf_values(x: np.ndarray, fmt: str) -> np.ndarray:
    """What ggml's reference rounds: x * id (q8_0, roundf), x * id + 8.5 or + 16.5 (q4_0, q5_0,
    truncation), (x - min) * id + 0.5 (q4_1, q5_1, truncation)."""
    w = x.astype(np.float32).reshape(-1, 32)
    w_min = w.min(-1, keepdims=True)
    d = {"q8_0": lambda: np.abs(w).max(-1, keepdims=True) / np.float32(127),
         "q4_0": lambda: np.take_along_axis(w, np.abs(w).argmax(-1)[:, None], -1) / np.float32(-8),
         "q5_0": lambda: np.take_along_axis(w, np.abs(w).argmax(-1)[:, None], -1) / np.float32(-16),
         "q4_1": lambda: (w.max(-1, keepdims=True) - w_min) / np.float32(15),
         "q5_1": lambda: (w.max(-1, keepdims=True) - w_min) / np.float32(31)}[fmt]()
    with np.errstate(divide="ignore"):
        id_ = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    return {"q8_0": lambda: w * id_, "q4_0": lambda: w * id_ + np.float32(8.5),
            "q5_0": lambda: w * id_ + np.float32(16.5), "q4_1": lambda: (w - w_min) * id_ + np.float32(0.5),
            "q5_1": lambda: (w - w_min) * id_ + np.float32(0.5)}[fmt]()


def assert_codes(ours: np.ndarray, reference: np.ndarray, boundary: np.ndarray) -> None:
    diff = ours.astype(np.int64) - reference.astype(np.int64)
    wrong = (diff != 0) & ~((np.abs(diff) == 1) & boundary)
    assert not wrong.any(), f"{wrong.sum()} integers differ from the reference away from a rounding tie, " \
                            f"first at {np.argwhere(wrong)[0]}: {ours[wrong][0]} vs {reference[wrong][0]}"


def ordered(a: np.ndarray) -> np.ndarray:
    """Float bit patterns as integers in the floats' order (adjacent floats differ by 1)."""
    bits = a.view({2: np.int16, 4: np.int32}[a.dtype.itemsize]).astype(np.int64)
    sign = np.int64(1) << (8 * a.dtype.itemsize - 1)
    return np.where(bits < 0, -(bits + sign), bits)


def assert_ulps(ours: np.ndarray, reference: np.ndarray, ulps: int, what: str) -> None:
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    np.testing.assert_array_equal(np.isnan(ours.astype(np.float32)), np.isnan(reference.astype(np.float32)))
    distance = np.abs(ordered(ours) - ordered(reference))
    assert distance.max(initial=0) <= ulps, f"{what}: {distance.max()} ulps from the reference"


def assert_dequantized_like_mlx(out: np.ndarray, expected: np.ndarray, q: QuantizedTensor) -> None:
    """out (float32 scale * q + bias, rounded once) against mx.dequantize's float32-cast
    `expected`: equal in float32; in float16 and bfloat16, where MLX rounds each operation,
    within 2 epsilons of the terms (|bias| + |scale| * q_max: they cancel near zero)."""
    if out.dtype == np.float32:
        np.testing.assert_array_equal(out, expected)
        return
    scales, biases = (np.asarray(a).astype(np.float32) for a in (q.arrays()["scales"], q.arrays()["biases"]))
    terms = np.abs(biases) + np.abs(scales) * ((1 << q.bits) - 1)
    epsilon = np.float32(2.0 ** (-10 if out.dtype == np.float16 else -7))
    bound = (2 * epsilon * terms).repeat(q.group_size, -1)
    assert (np.abs(out.astype(np.float32) - expected) <= bound).all()


@needs_mlx
@pytest.mark.parametrize("dtype, bits, group_size", AFFINE_CASES)
def test_affine_equals_mlx(rng, dtype, bits, group_size):
    x = inputs(rng, 12, 256, dtype)
    q = mfa_native.quantize(x, "affine", bits, group_size)
    wq, scales, biases = mx.quantize(to_mlx(x), group_size, bits)
    assert (q.format, q.bits, q.group_size, q.shape, q.dtype) == ("affine", bits, group_size, x.shape, x.dtype)
    assert q.data.dtype == np.uint32 and q.data.shape == tuple(wq.shape)
    boundary = near_boundary(affine_values(x, bits, group_size), 0.5)
    assert_codes(affine_codes(q.data, bits), affine_codes(np.array(wq), bits), boundary)
    assert_ulps(q.scales, to_numpy(scales).astype(dtype), 1, "scales")
    assert_ulps(q.biases, to_numpy(biases).astype(dtype), 1, "biases")
    assert (q.scales.astype(np.float32) < 0).any() and (q.scales.astype(np.float32) > 0).any()
    # The round trip, of our fields: ours computes scale * q + bias in float32 and rounds once, MLX in the
    # dtype's own arithmetic (float16, bfloat16: rounded per operation, so off where they cancel).
    expected = to_numpy(mx.dequantize(mx.array(q.data), to_mlx(q.scales), to_mlx(q.biases), group_size, bits))
    out = q.dequantize()
    assert out.dtype == x.dtype
    assert_dequantized_like_mlx(out, expected, q)


@needs_gguf
@pytest.mark.parametrize("fmt", GGUF_TYPES)
@pytest.mark.parametrize("dtype", (np.float32, np.float16, bfloat16))
def test_gguf_equals_the_gguf_package(rng, fmt, dtype):
    x = inputs(rng, 12, 256, dtype)
    q = mfa_native.quantize(x, fmt)
    qtype = getattr(gguf.GGMLQuantizationType, GGUF_TYPES[fmt])
    blocks = gguf.quants.quantize(x.astype(np.float32), qtype)
    bits = {"q8_0": 8, "q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5}[fmt]
    assert (q.format, q.bits, q.group_size, q.shape, q.dtype) == (fmt, bits, 32, x.shape, x.dtype)
    assert q.scales is None and q.biases is None and q.data.dtype == np.uint8 and q.data.shape == blocks.shape
    d, m, codes = gguf_fields(q.data, fmt)
    reference_d, reference_m, reference_codes = gguf_fields(blocks, fmt)
    assert_ulps(d, reference_d, 1, "d")
    if m is not None:
        np.testing.assert_array_equal(m, reference_m)   # the block's minimum, rounded to float16 once
    assert_codes(codes, reference_codes, near_boundary(gguf_values(x, fmt), 0.5 if fmt == "q8_0" else 0.0))
    # The round trip: our blocks dequantize as gguf dequantizes them (both float32 d * q, rounded once).
    expected = gguf.quants.dequantize(q.data, qtype).reshape(x.shape).astype(dtype)
    assert_ulps(q.dequantize(), expected, 0, "dequantize()")


@needs_mlx
@needs_gguf
def test_exact_ties_round_as_the_references_do(rng):
    """Values on exact halves: MLX rounds them to even (std::rint), ggml away from zero (roundf)."""
    x = np.resize(np.array([3.0, 2.5, 1.5, 0.0, 0.5, 0.25, 1.25, 2.0], np.float32), (4, 64))
    x[2:] *= -1
    q = mfa_native.quantize(x, bits=2, group_size=32)
    wq, _, _ = mx.quantize(mx.array(x), 32, 2)
    values = affine_values(x, 2, 32)
    assert (np.abs(values - np.floor(values) - 0.5) == 0).sum() > 0   # there are exact ties
    np.testing.assert_array_equal(affine_codes(q.data, 2), affine_codes(np.array(wq), 2))
    y = np.resize(np.array([127.0, 63.5, -0.5, 1.5, -2.5, 0.0], np.float32), (2, 32))
    assert (np.abs(gguf_values(y, "q8_0")) % 1 == 0.5).any()
    np.testing.assert_array_equal(mfa_native.quantize(y, "q8_0").data,
                                  gguf.quants.quantize(y, gguf.GGMLQuantizationType.Q8_0))


@needs_mlx
@needs_gguf
@pytest.mark.parametrize("D", (32, 64, 128, 256))
def test_head_tensors(rng, D):
    """(B, H, C, D) key/value-cache shaped tensors: every leading axis is a row axis."""
    x = inputs(rng, 2 * 3 * 5, D, np.float16).reshape(2, 3, 5, D)
    q = mfa_native.quantize(x, bits=4, group_size=32)
    wq, scales, biases = mx.quantize(to_mlx(x), 32, 4)
    assert q.data.shape == (2, 3, 5, D // 8) and q.scales.shape == (2, 3, 5, D // 32)
    assert_codes(affine_codes(q.data, 4), affine_codes(np.array(wq), 4),
                 near_boundary(affine_values(x, 4, 32), 0.5))
    g = mfa_native.quantize(x, "q8_0")
    assert g.data.shape == (2, 3, 5, D // 32 * 34)
    np.testing.assert_array_equal(g.data.reshape(-1, 34),
                                  gguf.quants.quantize(x.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
                                  .reshape(-1, 34))


@needs_mlx
def test_mlx_in_mlx_out_and_from_mlx(rng):
    x = inputs(rng, 6, 128, np.float16)
    q = mfa_native.quantize(to_mlx(x), bits=4)
    assert all(isinstance(a, mx.array) for a in (q.data, q.scales, q.biases))
    assert (q.data.dtype, q.scales.dtype, q.dtype) == (mx.uint32, mx.float16, np.float16)
    expected = mfa_native.quantize(x, bits=4)
    np.testing.assert_array_equal(np.array(q.data), expected.data)
    np.testing.assert_array_equal(to_numpy(q.scales), expected.scales.astype(np.float32))
    # MLX data dequantizes through mx.dequantize: exactly MLX's.
    wq, scales, biases = mx.quantize(to_mlx(x), 64, 4)
    wrapped = QuantizedTensor.from_mlx(wq, scales, biases, group_size=64, bits=4)
    out = wrapped.dequantize()
    assert isinstance(out, mx.array) and out.dtype == mx.float16
    np.testing.assert_array_equal(to_numpy(out), to_numpy(mx.dequantize(wq, scales, biases, 64, 4)))
    # numpy copies of MLX's arrays wrap as they are, and dequantize in float32.
    copies = QuantizedTensor.from_mlx(np.array(wq), np.array(scales), np.array(biases), group_size=64, bits=4)
    assert copies.data.dtype == np.uint32 and copies.shape == x.shape
    assert_dequantized_like_mlx(copies.dequantize(), to_numpy(out), copies)
    # MLX's other modes have no biases: named, not a missing-argument TypeError.
    with pytest.raises(ValueError, match="mode: .*'mxfp4'"):
        QuantizedTensor.from_mlx(*mx.quantize(to_mlx(x), 32, 4, mode="mxfp4"), group_size=32, bits=4, mode="mxfp4")
    with pytest.raises(ValueError, match="mode: .*without biases"):
        QuantizedTensor.from_mlx(wq, scales, group_size=64, bits=4)
    g = mfa_native.quantize(to_mlx(x), "q4_0")
    assert isinstance(g.data, mx.array) and g.data.dtype == mx.uint8 and g.scales is None
    out = g.dequantize()
    assert isinstance(out, mx.array) and out.dtype == mx.float16


def test_torch_in_torch_out(rng):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "uint32"):
        pytest.skip("torch.uint32 needs torch >= 2.3")
    x = inputs(rng, 4, 64, np.float32)
    q = mfa_native.quantize(torch.from_numpy(x).to(torch.bfloat16), bits=8)
    assert isinstance(q.data, torch.Tensor) and q.data.dtype == torch.uint32 and q.scales.dtype == torch.bfloat16
    expected = mfa_native.quantize(x.astype(bfloat16), bits=8)
    np.testing.assert_array_equal(q.data.numpy(), expected.data)
    assert isinstance(q.dequantize(), torch.Tensor)
    g = mfa_native.quantize(torch.from_numpy(x), "q8_0")
    assert isinstance(g.data, torch.Tensor) and g.data.dtype == torch.uint8


def test_non_finite_groups_dequantize_to_nan_and_leave_the_others_alone(rng):
    x = rng.standard_normal((3, 128)).astype(np.float32)
    x[0, 5], x[1, 70], x[2, 127] = np.nan, np.inf, -np.inf
    bad = np.zeros((3, 4), bool)
    bad[0, 0] = bad[1, 2] = bad[2, 3] = True
    for fmt, kwargs in (("affine", dict(bits=4, group_size=32)), ("q8_0", {}), ("q4_0", {}), ("q4_1", {}),
                        ("q5_0", {}), ("q5_1", {})):
        q = mfa_native.quantize(x, fmt, **kwargs)
        out = q.dequantize().reshape(3, 4, 32)
        np.testing.assert_array_equal(np.isnan(out).all(-1), bad)
        np.testing.assert_array_equal(np.isnan(out).any(-1), bad)
        clean = x.copy()
        clean[bad.repeat(32, -1)] = 0.0
        expected = mfa_native.quantize(clean, fmt, **kwargs).dequantize().reshape(3, 4, 32)
        np.testing.assert_array_equal(out[~bad], expected[~bad])


def test_strided_empty_and_warm_calls(rng, monkeypatch):
    x = rng.standard_normal((8, 4, 128)).astype(np.float32)
    view = x[::2, :, :]
    assert not view.flags.c_contiguous
    np.testing.assert_array_equal(mfa_native.quantize(view, "q4_0").data,
                                  mfa_native.quantize(np.ascontiguousarray(view), "q4_0").data)
    empty = mfa_native.quantize(np.zeros((0, 2, 64), np.float16), bits=3)
    assert empty.shape == (0, 2, 64) and empty.data.shape == (0, 2, 6) and empty.scales.shape == (0, 2, 1)
    # A second call of the same signature runs the prepared pass: no validation, no codegen.
    first = mfa_native.quantize(view, "q4_0")
    monkeypatch.setattr(quantize_op.codegen, "quantize_pass", lambda *a: pytest.fail("warm call built a pass"))
    again = mfa_native.quantize(view, "q4_0")
    np.testing.assert_array_equal(again.data, first.data)


@pytest.mark.parametrize("fmt, bits", [("affine", 3), ("affine", 8), ("q8_0", None), ("q4_0", None), ("q5_1", None)])
@pytest.mark.parametrize("shape", [(0, 2, 64), (3, 0, 64)])
def test_an_empty_tensor_dequantizes_to_an_empty_one(fmt, bits, shape):
    empty = mfa_native.quantize(np.zeros(shape, np.float16), fmt, bits=bits)
    values = empty.dequantize()
    assert values.shape == shape and values.dtype == np.float16


@pytest.mark.parametrize("call, error, match", [
    (lambda x: mfa_native.quantize(x, "q6_k"), ValueError, "format must be one of"),
    (lambda x: mfa_native.quantize(x, 4), TypeError, "format must be a str"),
    (lambda x: mfa_native.quantize(x, bits=7), ValueError, "bits must be one of"),
    (lambda x: mfa_native.quantize(x, bits=4.0), TypeError, "bits must be an int"),
    (lambda x: mfa_native.quantize(x, bits=True), TypeError, "bits must be an int"),
    (lambda x: mfa_native.quantize(x, group_size=16), ValueError, "group_size must be one of"),
    (lambda x: mfa_native.quantize(x, "q4_0", bits=8), ValueError, "q4_0 has bits=4"),
    (lambda x: mfa_native.quantize(x, "q5_1", bits=4), ValueError, "q5_1 has bits=5"),
    (lambda x: mfa_native.quantize(x, "q8_0", group_size=64), ValueError, "group_size=32"),
    (lambda x: mfa_native.quantize(x[:, :48]), ValueError, "multiple of group_size"),
    (lambda x: mfa_native.quantize(x[:, :0]), ValueError, "positive multiple"),
    (lambda x: mfa_native.quantize(x[0, 0, ...]), ValueError, "last axis"),
    (lambda x: mfa_native.quantize(x.astype(np.int32)), TypeError, "x must be float32, float16 or bfloat16"),
    (lambda x: mfa_native.quantize(x.astype(np.float64)), TypeError, "x must be float32"),
    (lambda x: mfa_native.quantize(x.tolist()), TypeError, "x must be a numpy array"),
])
def test_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(np.ones((2, 128), np.float32))


def test_generated_kernel_reads_as_its_format():
    from mfa_native.codegen.storage import quantize as codegen
    from mfa_native.quant_formats import QuantFormat

    source = codegen.generate(codegen.QuantizeDescriptor("bfloat16", QuantFormat.of("affine", 5, 128))).source
    assert "kernel void quantize(" in source and "device bfloat* scales [[buffer(2)]]" in source
    code = [line.split("//")[0] for line in source.splitlines()]
    assert not any(" / " in line for line in code)   # every division is precise::divide
    gguf_source = codegen.generate(codegen.QuantizeDescriptor("float16", QuantFormat.of("q4_0"))).source
    assert "scales" not in gguf_source and "device uchar* data [[buffer(1)]]" in gguf_source


def test_the_guide_snippet_runs():
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "quantized.md").read_text()
    start = guide.index("## Quantized tensors\n")
    section = guide[start:guide.index("\n## ", start + 1)]
    namespace: dict = {}
    exec(compile(re.findall(r"```python\n(.*?)```", section, re.S)[0], "quantized.md", "exec"), namespace)  # noqa: S102
    assert namespace["error"] < 0.05
