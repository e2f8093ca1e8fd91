"""attention with k and/or v as QuantizedTensors: the result equals attention over
k.dequantize(), v.dequantize() (the float64 reference, tolerance of q's dtype), for every
format and every dense feature; the kernels read each stored byte once per kv head.

Quantized tensors are built from fresh random stored values (every bit pattern a format
can hold, negative affine scales included), so the decoder is checked on its whole range;
one test wraps what MLX's own mx.quantize writes.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import relative_l2
from ml_dtypes import bfloat16

import mfa_native
from mfa_native import QuantizedTensor, codegen
from mfa_native.quant_formats import AFFINE_BITS, AFFINE_GROUP_SIZES, QuantFormat
from mfa_native.reference import attention_reference
from mfa_native.runtime.devices import tuned_as

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-2}


def random_quantized(rng, shape, format="affine", bits=None, group_size=None, scale_dtype=np.float32,
                     dtype=None) -> QuantizedTensor:
    """A QuantizedTensor of logical `shape` whose stored values are fresh random bits; affine
    scales of both signs and biases, GGUF scales (and minimums) as float16 in the blocks."""
    f = QuantFormat.of(format, bits, group_size)
    rows, D = shape[:-1], shape[-1]
    if f.affine:
        data = rng.integers(0, 2**32, (*rows, f.data_width(D)), dtype=np.uint32)
        groups = (*rows, f.groups(D))
        scales = (rng.uniform(0.5, 1.5, groups) * rng.choice([-1, 1], groups) / 2**f.bits).astype(scale_dtype)
        biases = rng.uniform(-1, 1, groups).astype(scale_dtype)
        return QuantizedTensor(data, scales, biases, format="affine", bits=f.bits, group_size=f.group_size,
                               dtype=dtype)
    blocks = rng.integers(0, 256, (*rows, D // 32, f.group_bytes), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, (*rows, D // 32)) * rng.choice([-1, 1], (*rows, D // 32)) / 2**f.bits)
    blocks[..., :2] = d.astype("<f2")[..., None].view(np.uint8)
    if f.minimum:   # q4_1, q5_1: a finite minimum m (random bytes could be inf or NaN)
        blocks[..., 2:4] = rng.uniform(-1, 1, (*rows, D // 32)).astype("<f2")[..., None].view(np.uint8)
    return QuantizedTensor(blocks.reshape(*rows, -1), format=format, dtype=dtype)


def tensors(rng, *, B=1, Hq=4, Hkv=2, R=5, C=150, D=64, Dv=None, dtype="float32", layout="bhsd",
            k_format=("affine", 4, 64), v_format=("affine", 8, 32)):
    """q (float), k and v (quantized where a format is given, else float) in `layout`."""
    Dv = Dv or D

    def shape(heads, length, dim):
        return (B, heads, length, dim) if layout == "bhsd" else (B, length, heads, dim)

    q = rng.standard_normal(shape(Hq, R, D)).astype(DTYPES[dtype])
    k, v = (rng.standard_normal(shape(Hkv, C, dim)).astype(DTYPES[dtype]) if fmt is None else
            random_quantized(rng, shape(Hkv, C, dim), *fmt, scale_dtype=DTYPES[dtype])
            for fmt, dim in ((k_format, D), (v_format, Dv)))
    return q, k, v


def floats(x, dtype):
    """What attention over a quantized tensor equals: its dequantized values in q's dtype."""
    return x.dequantize().astype(dtype) if isinstance(x, QuantizedTensor) else x


def check(q, k, v, **kwargs):
    out, lse = mfa_native.attention(q, k, v, return_lse=True, **kwargs)
    expected, expected_lse = attention_reference(q, floats(k, q.dtype), floats(v, q.dtype), return_lse=True,
                                                 **kwargs)
    dtype = {np.dtype(t): name for name, t in DTYPES.items()}[q.dtype]
    assert out.dtype == q.dtype and out.shape == expected.shape
    assert relative_l2(out, expected) < TOLERANCE[dtype]
    empty = np.isneginf(expected_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], expected_lse[~empty], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    return out


GGUF = [("q8_0", None, None), ("q4_0", None, None), ("q4_1", None, None), ("q5_0", None, None), ("q5_1", None, None)]
FORMATS = [("affine", bits, 64) for bits in AFFINE_BITS] + [("affine", 4, g) for g in AFFINE_GROUP_SIZES] + GGUF


@pytest.mark.parametrize("fmt", FORMATS, ids=["-".join(str(x) for x in f if x) for f in FORMATS])
def test_every_format_as_k_and_as_v(rng, fmt):
    q, k, v = tensors(rng, R=3, C=97, D=128, k_format=fmt, v_format=fmt)
    check(q, k, v, causal=True)


@pytest.mark.parametrize("k_format, v_format", [(GGUF[4], GGUF[2]), (GGUF[3], ("affine", 4, 32))],
                         ids=["q5_1-q4_1", "q5_0-affine"])
def test_k_and_v_in_different_formats(rng, k_format, v_format):
    """llama.cpp users give K and V different cache types (-ctk, -ctv)."""
    q, k, v = tensors(rng, Hq=4, Hkv=2, R=5, C=70, D=64, dtype="float16", k_format=k_format, v_format=v_format)
    check(q, k, v, causal=True)


@pytest.mark.parametrize("which", ["k", "v"])
def test_only_one_of_k_and_v_quantized(rng, which):
    fmt = ("q4_0", None, None)
    q, k, v = tensors(rng, k_format=fmt if which == "k" else None, v_format=fmt if which == "v" else None)
    check(q, k, v)


FEATURES = [
    dict(causal=True), dict(causal="upper_left"), dict(window=(20, 3)), dict(mask="bool"), dict(mask="additive"),
    dict(sinks=True), dict(causal=True, sinks=True, mask="additive", window=(40, -1)),
]


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("lengths", [(1, 300), (7, 130), (40, 40)], ids=lambda x: f"R{x[0]}-C{x[1]}")
def test_dense_features(rng, features, lengths):
    R, C = lengths
    q, k, v = tensors(rng, Hq=6, Hkv=2, R=R, C=C, D=32, k_format=("affine", 8, 32), v_format=("q8_0", None, None))
    kwargs = dict(features)
    if kwargs.get("mask") == "bool":
        kwargs["mask"] = rng.random((R, C)) > 0.4
        kwargs["mask"][0] = False   # a row with no key
    elif kwargs.get("mask") == "additive":
        mask = rng.standard_normal((1, 6, R, C)).astype(np.float32)
        mask[..., : C // 3] = -np.inf
        kwargs["mask"] = mask
    if kwargs.get("sinks"):
        kwargs["sinks"] = rng.standard_normal(6).astype(np.float32)
    check(q, k, v, **kwargs)


@pytest.mark.parametrize("dtype, layout, heads, dims", [
    ("float16", "bshd", (8, 1), (64, 64)),
    ("bfloat16", "bhsd", (12, 4), (64, 32)),
    ("float32", "bshd", (3, 3), (32, 128)),
    ("float16", "bhsd", (16, 2), (128, 64)),
])
def test_dtypes_layouts_gqa_and_value_dims(rng, dtype, layout, heads, dims):
    q, k, v = tensors(rng, B=2, Hq=heads[0], Hkv=heads[1], R=4, C=200, D=dims[0], Dv=dims[1], dtype=dtype,
                      layout=layout, k_format=("affine", 4, 32), v_format=("q4_0", None, None))
    check(q, k, v, causal=True, layout=layout)


@pytest.mark.parametrize("causal", [True, "upper_left"])
def test_prefill_spans_several_threadgroups_per_kv_head(rng, causal):
    """R * ratio (query, head) pairs beyond one threadgroup's 128 rows: 77 * 4 = 308 pairs."""
    q, k, v = tensors(rng, Hq=8, Hkv=2, R=77, C=90, D=32, k_format=("affine", 6, 32), v_format=("q8_0", None, None))
    check(q, k, v, causal=causal, window=(30, 5))


def test_split_kv_decode(rng):
    q, k, v = tensors(rng, Hq=8, Hkv=2, R=1, C=1500, D=64, k_format=("affine", 4, 64), v_format=("affine", 4, 64))
    sinks = rng.standard_normal(8).astype(np.float32)
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=64), mfa_native.profile() as prof:
        check(q, k, v, sinks=sinks, window=(700, 0))
    assert [r.kernel for r in prof.records] == [codegen.PARTIAL_KERNEL_NAME, codegen.COMBINE_KERNEL_NAME]


def test_strided_fields_of_a_preallocated_cache(rng):
    """mlx-lm's caches: fields allocated for more steps than are filled, read through a slice."""
    C, steps = 90, 128
    q = rng.standard_normal((1, 4, 2, 64)).astype(np.float16)
    cache = random_quantized(rng, (1, 2, steps, 64), "affine", 8, 64, np.float16)
    fields = {name: x[:, :, :C] for name, x in cache.arrays().items()}
    k = QuantizedTensor(fields["data"], fields["scales"], fields["biases"], bits=8, group_size=64)
    assert not fields["data"].flags.c_contiguous
    v = random_quantized(rng, (1, 2, C, 64), "q8_0", dtype=np.float16)
    check(q, k, v, causal=True)


def test_quantized_tensor_of_another_float_dtype_is_read_in_qs(rng):
    """A GGUF tensor's logical dtype is float32 by default; a float16 q reads it as float16."""
    q, _, v = tensors(rng, dtype="float16", v_format=None)
    k = random_quantized(rng, (1, 2, 150, 64), "q8_0")
    assert k.dtype == np.float32
    check(q, k, v)


def test_wraps_what_mlx_quantize_writes(rng):
    mx = pytest.importorskip("mlx.core")
    q, k, v = tensors(rng, Hq=8, Hkv=2, R=2, C=120, D=64, k_format=None, v_format=None)
    quantized = {}
    for name, x in (("k", k), ("v", v)):
        wq, scales, biases = mx.quantize(mx.array(x), group_size=32, bits=4)
        quantized[name] = QuantizedTensor.from_mlx(wq, scales, biases, group_size=32, bits=4)
    out = mfa_native.attention(mx.array(q), quantized["k"], quantized["v"], causal=True)
    assert isinstance(out, mx.array)
    expected = attention_reference(q, np.array(quantized["k"].dequantize()), np.array(quantized["v"].dequantize()),
                                   causal=True)
    assert relative_l2(np.array(out), expected) < 1e-4


def test_torch_fields_and_queries_give_torch(rng):
    torch = pytest.importorskip("torch")
    q, k, v = tensors(rng, dtype="float16", k_format=("affine", 8, 64), v_format=("q4_0", None, None))
    as_torch = {name: torch.from_numpy(x) for name, x in k.arrays().items()}
    k_torch = QuantizedTensor(as_torch["data"], as_torch["scales"], as_torch["biases"], bits=8, group_size=64)
    v_torch = QuantizedTensor(torch.from_numpy(v.field("data")), format="q4_0", dtype=np.float16)
    out = mfa_native.attention(torch.from_numpy(q), k_torch, v_torch, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    assert isinstance(k_torch.dequantize(), torch.Tensor)
    expected = attention_reference(q, floats(k, q.dtype), floats(v, q.dtype), causal=True)
    assert relative_l2(out.numpy(), expected) < TOLERANCE["float16"]


def test_warm_calls_read_new_contents(rng):
    """Calls of one signature share a prepared pass; each reads its own tensors."""
    for _ in range(3):
        check(*tensors(rng, k_format=("affine", 4, 64), v_format=("q4_0", None, None)), causal=True)


def test_nan_in_a_scale_reaches_the_rows_that_read_it(rng):
    q, k, v = tensors(rng, Hq=2, Hkv=2, R=3, C=50, D=64, k_format=("affine", 8, 64), v_format=None)
    k.arrays()["scales"][0, 1, 20, 0] = np.nan
    out = mfa_native.attention(q, k, v)
    assert np.isnan(out[0, 1]).all() and np.isfinite(out[0, 0]).all()


# ---------------------------------------------------------------------------
# Traffic: every stored byte once per kv head, however many query heads read it.


@pytest.mark.parametrize("fmt", [("affine", 4, 64), ("affine", 8, 128), ("affine", 3, 32), *GGUF],
                         ids=lambda f: "-".join(str(x) for x in f if x))
@pytest.mark.parametrize("ratio", [1, 8, 32])
def test_decode_reads_the_quantized_bytes_once(rng, fmt, ratio):
    Hkv, C = 2, 512
    q, k, v = tensors(rng, Hq=Hkv * ratio, Hkv=Hkv, R=1, C=C, D=128, dtype="float16", k_format=fmt, v_format=fmt)
    with mfa_native.profile() as prof:
        mfa_native.attention(q, k, v, causal=True)
    for name, x in (("k", k), ("v", v)):
        read = sum(prof.bytes_read.get(buffer, 0) for buffer in (name, f"{name}_scales", f"{name}_biases"))
        assert x.nbytes <= read <= 1.05 * x.nbytes, (name, read, x.nbytes)


def test_split_decode_reads_the_quantized_bytes_once(rng):
    q, k, v = tensors(rng, Hq=16, Hkv=2, R=1, C=2048, D=64, dtype="float16", k_format=("q4_0", None, None),
                      v_format=("affine", 4, 64))
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=64), mfa_native.profile() as prof:
        mfa_native.attention(q, k, v)
    assert len(prof.records) == 2
    read = {name: sum(prof.bytes_read.get(b, 0) for b in (name, f"{name}_scales", f"{name}_biases"))
            for name in "kv"}
    assert k.nbytes <= read["k"] <= 1.05 * k.nbytes and v.nbytes <= read["v"] <= 1.05 * v.nbytes


# ---------------------------------------------------------------------------
# What is refused.


def test_backward_refuses_quantized_kv(rng):
    q, k, v = tensors(rng, v_format=None)
    o, lse = mfa_native.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="k is a QuantizedTensor: a quantized cache has no gradient"):
        mfa_native.attention_backward(q, k, v, o, lse, o)


def test_sparse_ops_refuse_quantized_kv(rng):
    q, k, v = tensors(rng, R=4, k_format=None)
    indices = rng.integers(0, 150, (1, 2, 4, 8), dtype=np.int32)
    with pytest.raises(TypeError, match="v is a QuantizedTensor: only attention reads quantized K/V"):
        mfa_native.sparse_attention(q, q[:, :2, :1].repeat(150, 2), v, indices)


def test_mismatched_quantized_shapes_are_refused(rng):
    q, k, v = tensors(rng, C=150)
    short = random_quantized(rng, (1, 2, 149, 64), "q8_0")
    with pytest.raises(ValueError, match="v must have k's heads and length"):
        mfa_native.attention(q, k, short)
    with pytest.raises(ValueError, match="head dimension"):
        mfa_native.attention(q, random_quantized(rng, (1, 2, 150, 32), "q8_0"), v)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(format="affine", bits=7), ValueError, "bits must be one of"),
    (dict(format="affine", bits=4, group_size=16), ValueError, "group_size must be one of"),
    (dict(format="q6_k"), ValueError, "format must be one of"),
])
def test_bad_formats_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        QuantizedTensor(np.zeros((2, 8), np.uint32), np.zeros((2, 1), np.float32), np.zeros((2, 1), np.float32),
                        **kwargs)


def test_a_given_shape_must_be_the_datas(rng):
    blocks = random_quantized(rng, (2, 3, 64), "q8_0").field("data")
    assert QuantizedTensor(blocks, format="q8_0", shape=(2, 3, 64)).shape == (2, 3, 64)
    with pytest.raises(ValueError, match="is not the logical shape"):
        QuantizedTensor(blocks, format="q8_0", shape=(2, 3, 128))


def test_every_field_combination_compiles_one_kernel_per_format(rng):
    """The descriptor keeps formats apart: two formats never share a cached kernel."""
    sources = set()
    for fmt in itertools.islice(FORMATS, 0, None, 3):
        q, k, v = tensors(rng, R=1, C=40, D=128, k_format=fmt, v_format=fmt)
        description = codegen.attention_pass(mfa_native.ops.attention.validate(
            (q, k, v, None, None), scale=None, causal=False, window=None, layout="bhsd", return_lse=False,
            quantized_refusal=None).problem)
        sources.add(description.kernels[0].source)
    assert len(sources) == len(list(itertools.islice(FORMATS, 0, None, 3)))
