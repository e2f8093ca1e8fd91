"""mfa_native.attention against the float64 reference over the issue's matrix of problems.

Every output is poisoned (NaN) before the kernel runs, so an element the kernel
never writes fails the comparison.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import relative_l2
from ml_dtypes import bfloat16

import mfa_native
from mfa_native import codegen
from mfa_native.ops.attention import validate
from mfa_native.reference import attention_reference
from mfa_native.runtime.devices import TuningFacts, tuned_as, tuning_facts
from mfa_native.runtime.runner import PreparedPass

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-2}


def make_inputs(rng, *, B=1, Hq=2, Hkv=None, R=19, C=37, D=32, Dv=None, dtype="float32", layout="bhsd"):
    """Fresh standard-normal q, k, v in `layout`, rounded to `dtype`."""
    Hkv = Hkv or Hq
    Dv = Dv or D

    def tensor(heads, length, dim):
        shape = (B, heads, length, dim) if layout == "bhsd" else (B, length, heads, dim)
        return rng.standard_normal(shape).astype(DTYPES[dtype])

    return tensor(Hq, R, D), tensor(Hkv, C, D), tensor(Hkv, C, Dv)


def check(q, k, v, tolerances: dict[str, float] = TOLERANCE, **kwargs):
    """Runs attention (with lse) and compares output and lse with the reference (relative L2
    below `tolerances`[dtype], a path's table)."""
    dtype = {np.dtype(t): name for name, t in DTYPES.items()}[q.dtype]
    out, lse = mfa_native.attention(q, k, v, return_lse=True, **kwargs)
    expected, expected_lse = attention_reference(q, k, v, return_lse=True, **kwargs)
    assert out.dtype == q.dtype and out.shape == expected.shape
    assert lse.dtype == np.float32 and lse.shape == expected_lse.shape
    tolerance = tolerances[dtype]
    if np.linalg.norm(expected) > 0:
        assert relative_l2(out, expected) < tolerance
    else:
        assert np.all(out.astype(np.float32) == 0)
    empty = np.isneginf(expected_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], expected_lse[~empty], rtol=tolerance, atol=tolerance)
    rows_out = out if kwargs.get("layout", "bhsd") == "bhsd" else out.transpose(0, 2, 1, 3)
    assert np.all(rows_out[empty].astype(np.float32) == 0), "rows without keys must be exactly 0"
    return out, lse


@pytest.mark.parametrize("dtype, layout, heads", list(itertools.product(
    DTYPES, ["bhsd", "bshd"], [(2, 2), (4, 2), (3, 1)])))
def test_dtypes_layouts_and_gqa(rng, dtype, layout, heads):
    q, k, v = make_inputs(rng, B=2, Hq=heads[0], Hkv=heads[1], D=40, dtype=dtype, layout=layout)
    check(q, k, v, layout=layout)


HEAD_DIMS = [(d, d) for d in (8, 40, 64, 72, 80, 96, 128, 160, 192, 256)] + [
    (1, 1), (3, 5), (33, 17), (100, 36), (192, 128), (64, 32), (24, 56), (256, 8)]


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=[f"D{d}-Dv{dv}" for d, dv in HEAD_DIMS])
def test_head_dimensions(rng, dims):
    dtype = list(DTYPES)[HEAD_DIMS.index(dims) % 3]
    q, k, v = make_inputs(rng, R=11, C=21, D=dims[0], Dv=dims[1], dtype=dtype)
    check(q, k, v, causal=True)


LENGTHS = [(1, 1), (1, 77), (5, 300), (16, 200), (33, 17), (64, 64), (77, 1), (9, 1000), (130, 45)]


@pytest.mark.parametrize("lengths", LENGTHS, ids=[f"R{r}-C{c}" for r, c in LENGTHS])
def test_sequence_lengths_including_one_and_ragged(rng, lengths):
    q, k, v = make_inputs(rng, R=lengths[0], C=lengths[1], D=16)
    check(q, k, v)


def test_decode_shapes(rng):
    for rows in (1, 2, 3, 8, 9, 16):
        q, k, v = make_inputs(rng, Hq=4, Hkv=1, R=rows, C=1500, D=64, dtype="float16")
        check(q, k, v, causal=True)


SPLIT_CASES = [
    dict(dims=dict(R=1, C=1500, D=64)),
    dict(dims=dict(Hq=4, Hkv=2, R=5, C=1300, D=40, Dv=24, dtype="float16", layout="bshd"),
         kwargs=dict(causal=True, sinks=True, layout="bshd")),
    dict(dims=dict(R=3, C=2000, D=16, dtype="bfloat16"), kwargs=dict(window=(100, 0))),  # most splits see no key
    dict(dims=dict(R=16, C=777, D=8), kwargs=dict(mask=True, causal="upper_left", sinks=True)),
]


def test_split_kv_fills_the_device_it_runs_on(rng):
    """The cpu backend reports room for two threadgroups per worker thread; a one-head decode
    over many keys splits to fill it, a many-head one does not."""
    cpu = mfa_native.devices()[-1]
    workers = int(cpu.properties["worker_threads"])
    tensor_ops = cpu.tuning.tensor_ops   # MFA_NATIVE_TENSOR_OPS=on has the cpu act as an M5
    assert tuning_facts(cpu) == TuningFacts("apple9@cpu", 2 * workers, tensor_ops)   # the family carrying its table
    many_keys = make_inputs(rng, Hq=1, R=1, C=256 * 4 * workers, D=8)
    with mfa_native.profile() as prof:
        mfa_native.attention(*many_keys, device=cpu)
    assert [r.kernel for r in prof.records] == [codegen.PARTIAL_KERNEL_NAME, codegen.COMBINE_KERNEL_NAME]
    with mfa_native.profile() as prof:
        mfa_native.attention(*make_inputs(rng, Hq=2 * workers, R=1, C=2048, D=8), device=cpu)
    assert [r.kernel for r in prof.records] == [codegen.KERNEL_NAME]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=["plain", "gqa-causal-sinks-bshd", "window", "mask-sinks"])
def test_split_kv_decode(rng, case):
    """Decode on a device with room for 64 threadgroups: the keys are split, then combined."""
    q, k, v = make_inputs(rng, **case["dims"])
    kwargs = dict(case.get("kwargs", {}))
    heads = q.shape[1] if kwargs.get("layout", "bhsd") == "bhsd" else q.shape[2]
    if kwargs.get("sinks"):
        kwargs["sinks"] = rng.standard_normal(heads).astype(np.float32)
    if kwargs.get("mask"):
        R, C = case["dims"]["R"], case["dims"]["C"]
        mask = rng.random((R, C)) > 0.5
        mask[2] = False  # a row with no key (only the sink)
        kwargs["mask"] = mask
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=64), mfa_native.profile() as prof:
        check(q, k, v, **kwargs)
    assert [r.kernel for r in prof.records] == [codegen.PARTIAL_KERNEL_NAME, codegen.COMBINE_KERNEL_NAME]


@pytest.mark.parametrize("causal", [True, "lower_right", "upper_left"])
@pytest.mark.parametrize("lengths", [(13, 29), (29, 13), (24, 24), (1, 40), (40, 1)])
def test_causal_alignments(rng, causal, lengths):
    q, k, v = make_inputs(rng, R=lengths[0], C=lengths[1], D=24)
    check(q, k, v, causal=causal)


def _masks(rng, B, H, R, C):
    """Boolean and additive masks of several broadcast shapes, some with fully masked rows."""
    full = rng.random((B, H, R, C)) > 0.4
    full[0, 0, 3] = False  # a row with no allowed key
    additive = rng.standard_normal((R, C)).astype(np.float32)
    additive[5] = -np.inf
    additive[:, 2] = np.finfo(np.float32).min
    return {
        "bool full": full,
        "bool (R, C)": rng.random((R, C)) > 0.5,
        "bool key padding (B, 1, 1, C)": np.arange(C)[None, None, None, :] < np.array([C - 3, 4])[:, None, None, None],
        "bool per row (H, R, 1)": rng.random((H, R, 1)) > 0.3,
        "additive float32": additive,
        "additive float16 (B, H, R, C)": rng.standard_normal((B, H, R, C)).astype(np.float16),
        "additive bfloat16 (1, C)": rng.standard_normal((1, C)).astype(bfloat16),
        "additive float64 (H, 1, C)": rng.standard_normal((H, 1, C)),
    }


MASK_NAMES = list(_masks(np.random.default_rng(0), 2, 2, 9, 9))


@pytest.mark.parametrize("name", MASK_NAMES)
def test_masks(rng, name):
    q, k, v = make_inputs(rng, B=2, Hq=2, R=17, C=40, D=16)
    mask = _masks(rng, 2, 2, 17, 40)[name]
    check(q, k, v, mask=mask)


@pytest.mark.parametrize("window", [(0, 0), (4, 0), (-1, 3), (2, -1), (5, 5)])
def test_windows(rng, window):
    for lengths in ((20, 50), (50, 20)):
        q, k, v = make_inputs(rng, R=lengths[0], C=lengths[1], D=16)
        check(q, k, v, window=window)


def test_sinks(rng):
    q, k, v = make_inputs(rng, Hq=3, R=20, C=33, D=16)
    sinks = (2 * rng.standard_normal(3)).astype(np.float32)
    check(q, k, v, sinks=sinks)
    check(q, k, v, sinks=sinks, window=(8, 0))  # gpt-oss: sliding window with sinks
    # Rows with no key but a sink: output 0, lse = the sink.
    q, k, v = make_inputs(rng, Hq=3, R=20, C=6, D=16)
    _, lse = check(q, k, v, sinks=sinks, causal=True)
    np.testing.assert_allclose(lse[0, :, :14], np.repeat(sinks[:, None], 14, axis=1), rtol=1e-6)


def test_combinations(rng):
    q, k, v = make_inputs(rng, B=2, Hq=4, Hkv=2, R=23, C=31, D=40, Dv=24, dtype="float16", layout="bshd")
    mask = rng.random((2, 1, 23, 31)) > 0.3
    check(q, k, v, causal=True, mask=mask, sinks=rng.standard_normal(4).astype(np.float32), layout="bshd")
    q, k, v = make_inputs(rng, Hq=2, R=30, C=30, D=16, dtype="bfloat16")
    check(q, k, v, causal="upper_left", window=(6, -1), mask=rng.standard_normal((30, 30)).astype(np.float32),
          scale=0.2)
    q, k, v = make_inputs(rng, R=64, C=80, D=8)
    check(q, k, v, causal=True, window=(10, 2), mask=rng.random((64, 80)) > 0.2, sinks=np.float32([0.5, -1.0]))


def test_scale(rng):
    q, k, v = make_inputs(rng, D=16)
    check(q, k, v, scale=1.7)
    check(q, k, v, scale=np.float32(0.01))


def test_strided_inputs_are_used_in_place(rng):
    buffer = rng.standard_normal((2, 40, 6, 24)).astype(np.float32)
    q = buffer[:, 3:20, 1:5, :16]                                                           # bshd view, gaps everywhere
    k = rng.standard_normal((2, 2, 30, 16)).astype(np.float32).transpose(0, 2, 1, 3)        # bhsd memory, bshd view
    v = np.broadcast_to(rng.standard_normal((2, 30, 1, 12)).astype(np.float32), (2, 30, 2, 12))  # stride 0 heads
    call = validate((q, k, v, None, None), scale=None, causal=True, window=None, layout="bshd", return_lse=False)
    for name, array in (("q", q), ("k", k), ("v", v)):
        assert np.shares_memory(call.bound[name], array), f"{name} was copied"
        assert call.converts[name] is None, f"a warm call would convert {name}"
    check(q, k, v, causal=True, layout="bshd")


def test_dlpack_inputs(rng):
    class CpuTensor:
        """A foreign array that only speaks DLPack."""

        def __init__(self, array):
            self._array = array

        def __dlpack__(self, **kwargs):
            return self._array.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self._array.__dlpack_device__()

    q, k, v = make_inputs(rng, D=16, dtype="float16")
    mask = rng.random((19, 37)) > 0.5
    out = mfa_native.attention(CpuTensor(q), CpuTensor(k), CpuTensor(v), mask=CpuTensor(mask))
    assert isinstance(out, np.ndarray)
    assert relative_l2(out, attention_reference(q, k, v, mask=mask)) < TOLERANCE["float16"]


def test_baked_lengths_give_the_same_result(rng):
    """The codegen option to bake sizes as literals, its pass run by the runner directly."""
    q, k, v = make_inputs(rng, B=2, Hq=4, Hkv=2, R=21, C=35, D=24)
    problem = codegen.AttentionProblem(2, 4, 2, 21, 35, 24, 24, causal="lower_right", return_lse=True)
    description = codegen.attention_pass(problem, bake_lengths=True)
    assert [b.role for b in description.buffers] == ["input"] * 3 + ["output"] * 2  # no sizes struct
    prepared = PreparedPass(description, mfa_native.default_device())
    assert prepared.input_names == ("q", "k", "v") and prepared.output_names == ("o", "lse")
    out, lse = prepared.run([q, k, v])
    expected, expected_lse = attention_reference(q, k, v, causal=True, return_lse=True)
    assert relative_l2(out, expected) < TOLERANCE["float32"]
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5)
