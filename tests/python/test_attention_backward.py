"""mfa_native.attention_backward against the float64 analytic gradients, over the issue's matrix.

o and lse come from the forward kernel, as in training. The reference takes
D = rowsum(dO o O) from that same o, as the kernels must: in float16 and
bfloat16, o's rounding moves D, and where P (dP - D) cancels (a row whose one
visible key holds nearly all the weight) that is all that is left of the
gradient. Everything else in the reference is exact float64.

Every output and intermediate (dq, dk, dv, the D rows and the dsinks shares)
is poisoned (NaN) before the kernels run, so an element they never write fails
the comparison.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import relative_l2
from ml_dtypes import bfloat16
from test_attention import DTYPES, MASK_NAMES, _masks, make_inputs

import mfa_native
from mfa_native.ops.attention_backward import validate_backward
from mfa_native.reference import attention_backward_reference
from mfa_native.runtime.devices import tuned_as

TOLERANCE = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 3e-2}
NAMES = ("dq", "dk", "dv", "dsinks")


def output_gradient(rng, q, v, layout="bhsd"):
    """A fresh random dO shaped like attention's output, in q's dtype."""
    shape = (*q.shape[:3], v.shape[3])
    return rng.standard_normal(shape).astype(q.dtype)


def gradient_error(grad, reference, terms) -> float:
    """Relative L2 error; for a gradient that (nearly) cancels to 0, relative to 1% of the size
    of its terms (`terms`: the gradient with D = 0), since their rounding is all that is left.
    NaN anywhere fails (inf)."""
    size = max(np.linalg.norm(reference), 0.01 * np.linalg.norm(terms))
    grad = np.asarray(grad, dtype=np.float64)
    if not np.all(np.isfinite(grad)):
        return float("inf")
    if size == 0:
        return 0.0 if not grad.any() else float("inf")  # nothing to differentiate: exactly 0
    return float(np.linalg.norm(grad - reference) / size)


def check(rng, q, k, v, tolerances: dict[str, float] = TOLERANCE, **kwargs):
    """Forward (with lse), then backward; every gradient against the reference (below
    `tolerances`[dtype], a path's table). Returns them."""
    dtype = {np.dtype(t): name for name, t in DTYPES.items()}[q.dtype]
    do = output_gradient(rng, q, v)
    o, lse = mfa_native.attention(q, k, v, return_lse=True, **kwargs)
    grads = mfa_native.attention_backward(q, k, v, o, lse, do, **kwargs)
    expected = attention_backward_reference(q, k, v, do, out=o, **kwargs)
    terms = attention_backward_reference(q, k, v, do, out=np.zeros_like(o), **kwargs)
    assert len(grads) == len(expected) == (4 if kwargs.get("sinks") is not None else 3)
    for name, grad, reference, like in zip(NAMES, grads, expected, (q, k, v)):
        assert grad.shape == reference.shape == like.shape, name
        assert grad.dtype == q.dtype, name
    for name, grad, reference, term in zip(NAMES, grads, expected, terms):
        error = gradient_error(grad, reference, term)
        assert error < tolerances[dtype], f"{name}: relative L2 error {error:.2e}"
    if len(grads) == 4:
        assert grads[3].dtype == np.float32
    return grads, lse


@pytest.mark.parametrize("dtype, layout, heads", list(itertools.product(
    DTYPES, ["bhsd", "bshd"], [(2, 2), (4, 2), (3, 1)])))
def test_dtypes_layouts_and_gqa(rng, dtype, layout, heads):
    q, k, v = make_inputs(rng, B=2, Hq=heads[0], Hkv=heads[1], D=40, dtype=dtype, layout=layout)
    check(rng, q, k, v, layout=layout)


HEAD_DIMS = [(d, d) for d in (8, 40, 64, 96, 128, 160, 256)] + [(1, 1), (3, 5), (33, 17), (192, 128), (24, 56)]


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=[f"D{d}-Dv{dv}" for d, dv in HEAD_DIMS])
def test_head_dimensions(rng, dims):
    dtype = list(DTYPES)[HEAD_DIMS.index(dims) % 3]
    q, k, v = make_inputs(rng, R=11, C=21, D=dims[0], Dv=dims[1], dtype=dtype)
    check(rng, q, k, v, causal=True)


LENGTHS = [(1, 1), (1, 77), (5, 300), (16, 200), (33, 17), (64, 64), (77, 1), (130, 45)]


@pytest.mark.parametrize("lengths", LENGTHS, ids=[f"R{r}-C{c}" for r, c in LENGTHS])
def test_sequence_lengths_including_one_and_ragged(rng, lengths):
    q, k, v = make_inputs(rng, R=lengths[0], C=lengths[1], D=16)
    check(rng, q, k, v)


@pytest.mark.parametrize("dims", [(64, 64), (200, 72)])
def test_the_other_family_table(rng, dims):
    """Apple7's tiles (four simdgroups per threadgroup at D = 64) run and match too."""
    q, k, v = make_inputs(rng, Hq=4, Hkv=2, R=70, C=45, D=dims[0], Dv=dims[1], dtype="float16")
    with tuned_as(mfa_native.default_device(), family="apple7"):
        check(rng, q, k, v, causal=True, mask=rng.random((70, 45)) > 0.2)


def test_decode_shapes(rng):
    for rows in (1, 3, 9):
        q, k, v = make_inputs(rng, Hq=4, Hkv=1, R=rows, C=700, D=64, dtype="float16")
        check(rng, q, k, v, causal=True)


@pytest.mark.parametrize("causal", [True, "lower_right", "upper_left"])
@pytest.mark.parametrize("lengths", [(13, 29), (29, 13), (24, 24), (1, 40), (40, 1)])
def test_causal_alignments(rng, causal, lengths):
    q, k, v = make_inputs(rng, R=lengths[0], C=lengths[1], D=24)
    check(rng, q, k, v, causal=causal)


@pytest.mark.parametrize("name", MASK_NAMES)
def test_masks(rng, name):
    q, k, v = make_inputs(rng, B=2, Hq=2, R=17, C=40, D=16)
    check(rng, q, k, v, mask=_masks(rng, 2, 2, 17, 40)[name])


@pytest.mark.parametrize("window", [(0, 0), (4, 0), (-1, 3), (2, -1), (5, 5)])
def test_windows(rng, window):
    for lengths in ((20, 50), (50, 20)):
        q, k, v = make_inputs(rng, R=lengths[0], C=lengths[1], D=16)
        check(rng, q, k, v, window=window)


def test_sinks(rng):
    q, k, v = make_inputs(rng, Hq=3, R=20, C=33, D=16)
    sinks = (2 * rng.standard_normal(3)).astype(np.float32)
    check(rng, q, k, v, sinks=sinks)
    check(rng, q, k, v, sinks=sinks, window=(8, 0))  # gpt-oss: sliding window with sinks
    # Rows with no key but a sink: p_sink = 1 and D = 0, so they add nothing; the rest still do.
    q, k, v = make_inputs(rng, Hq=3, Hkv=1, R=20, C=6, D=16, dtype="float16")
    (dq, _, _, dsinks), _ = check(rng, q, k, v, sinks=sinks, causal=True)
    assert np.all(dq[0, :, :14].astype(np.float32) == 0)
    assert np.all(dsinks != 0)


def test_rows_without_keys_get_exactly_zero_and_no_nan(rng):
    q, k, v = make_inputs(rng, B=1, Hq=2, R=21, C=30, D=16)
    mask = rng.random((1, 2, 21, 30)) > 0.3
    mask[0, 0, [0, 7, 20]] = False  # no allowed key: lse = -inf
    mask[0, 1, :, 8:16] = False     # a block no row of head 1 sees
    (dq, dk, dv), lse = check(rng, q, k, v, mask=mask)
    assert np.all(np.isneginf(lse[0, 0, [0, 7, 20]]))
    assert np.all(dq[0, 0, [0, 7, 20]] == 0)
    additive = np.where(mask, rng.standard_normal(mask.shape), -np.inf).astype(np.float32)
    check(rng, q, k, v, mask=additive, causal="upper_left")
    # Every row empty: all gradients are exactly 0.
    (dq, dk, dv), _ = check(rng, q, k, v, mask=np.zeros((21, 30), dtype=bool))
    assert not dq.any() and not dk.any() and not dv.any()


def test_combinations(rng):
    q, k, v = make_inputs(rng, B=2, Hq=4, Hkv=2, R=23, C=31, D=40, Dv=24, dtype="float16", layout="bshd")
    mask = rng.random((2, 1, 23, 31)) > 0.3
    check(rng, q, k, v, causal=True, mask=mask, sinks=rng.standard_normal(4).astype(np.float32), layout="bshd")
    q, k, v = make_inputs(rng, Hq=2, R=30, C=30, D=16, dtype="bfloat16")
    check(rng, q, k, v, causal="upper_left", window=(6, -1), mask=rng.standard_normal((30, 30)).astype(np.float32),
          scale=0.2)
    q, k, v = make_inputs(rng, Hq=4, Hkv=1, R=64, C=80, D=8)
    check(rng, q, k, v, causal=True, window=(10, 2), mask=rng.random((64, 80)) > 0.2,
          sinks=rng.standard_normal(4).astype(np.float32))


def test_scale(rng):
    q, k, v = make_inputs(rng, D=16)
    check(rng, q, k, v, scale=1.7)
    check(rng, q, k, v, scale=np.float32(0.01))


def test_strided_inputs_are_used_in_place(rng):
    buffer = rng.standard_normal((2, 40, 6, 24)).astype(np.float32)
    q = buffer[:, 3:20, 1:5, :16]                                                           # bshd view, gaps everywhere
    k = rng.standard_normal((2, 2, 30, 16)).astype(np.float32).transpose(0, 2, 1, 3)        # bhsd memory, bshd view
    v = np.broadcast_to(rng.standard_normal((2, 30, 1, 12)).astype(np.float32), (2, 30, 2, 12))  # stride 0 heads
    o, lse = mfa_native.attention(q, k, v, causal=True, layout="bshd", return_lse=True)
    o_view = np.zeros((2, 17, 4, 20), np.float32)[..., 2:14]   # o and do in place: rows 80 apart, not 48
    o_view[...] = o
    do = rng.standard_normal((2, 4, 17, 12)).astype(np.float32).transpose(0, 2, 1, 3)
    call = validate_backward((q, k, v, o_view, lse, do, None, None), scale=None, causal=True, window=None,
                             layout="bshd")
    for name, array in (("q", q), ("k", k), ("v", v), ("o", o_view), ("dout", do)):
        assert np.shares_memory(call.bound[name], array), f"{name} was copied"
        assert call.converts[name] is None, f"a warm call would convert {name}"
    grads = mfa_native.attention_backward(q, k, v, o_view, lse, do, causal=True, layout="bshd")
    expected = attention_backward_reference(q, k, v, do, causal=True, layout="bshd")
    for grad, reference in zip(grads, expected):
        assert grad.flags.c_contiguous and grad.shape == reference.shape
        assert relative_l2(grad, reference) < TOLERANCE["float32"]


def test_dlpack_inputs(rng):
    class CpuTensor:
        """A foreign array that only speaks DLPack."""

        def __init__(self, array):
            self._array = array

        def __dlpack__(self, **kwargs):
            return self._array.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self._array.__dlpack_device__()

    q, k, v = make_inputs(rng, D=16)
    do = output_gradient(rng, q, v)
    o, lse = mfa_native.attention(q, k, v, return_lse=True)
    grads = mfa_native.attention_backward(*(CpuTensor(x) for x in (q, k, v, o, lse, do)))
    for grad, reference in zip(grads, attention_backward_reference(q, k, v, do)):
        assert relative_l2(grad, reference) < TOLERANCE["float32"]


def test_bfloat16_gradients_are_bfloat16(rng):
    q, k, v = make_inputs(rng, D=16, dtype="bfloat16")
    grads, _ = check(rng, q, k, v, sinks=np.float32([0.3, -0.2]))
    assert [g.dtype for g in grads] == [np.dtype(bfloat16)] * 3 + [np.dtype(np.float32)]
