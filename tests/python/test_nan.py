"""NaN never disappears (issue "Hardening", part 1): a NaN in anything a row's softmax includes
makes that row's output and lse NaN; a NaN in v[c, d] of a key a row sees makes its element d
NaN; positions no row attends are never read, so a NaN there cannot matter. Checked against
the float64 reference and, where torch is installed, against PyTorch's math attention and
its autograd."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from test_attention import make_inputs

import mfa_native
from mfa_native import BlockMask
from mfa_native.reference import (allowed_keys, attention_backward_reference, attention_reference,
                                  block_sparse_attention_reference)
from mfa_native.runtime.devices import tuned_as

R, C, D = 24, 40, 16


def run(q, k, v, **kwargs):
    out, lse = mfa_native.attention(q, k, v, return_lse=True, **kwargs)
    expected, expected_lse = attention_reference(q, k, v, return_lse=True, **kwargs)
    return out, lse, expected, expected_lse


def assert_same_nans_and_values(actual, expected, tolerance=1e-4):
    """NaN exactly where `expected` has NaN, the same infinities, the rest within `tolerance`."""
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(actual), np.isinf(expected))
    finite = np.isfinite(expected)
    assert relative_l2(np.where(finite, actual, 0), np.where(finite, expected, 0)) < tolerance


@pytest.mark.parametrize("kwargs", [{}, dict(causal=True), dict(window=(6, 2))])
def test_a_nan_query_row_makes_its_row_nan(rng, kwargs):
    q, k, v = make_inputs(rng, R=R, C=C, D=D)
    q[0, 1, 5, 3] = np.nan
    out, lse, expected, expected_lse = run(q, k, v, **kwargs)
    assert np.isnan(out[0, 1, 5]).all() and np.isnan(lse[0, 1, 5])
    assert_same_nans_and_values(out, expected)
    assert_same_nans_and_values(lse, expected_lse, 1e-5)


@pytest.mark.parametrize("kwargs", [{}, dict(causal=True), dict(mask="bool")])
def test_a_nan_key_makes_every_row_that_sees_it_nan(rng, kwargs):
    q, k, v = make_inputs(rng, R=R, C=C, D=D)
    k[0, 0, 30, 7] = np.nan
    if kwargs.get("mask") == "bool":
        kwargs = dict(mask=rng.random((R, C)) > 0.4)
    out, lse, expected, expected_lse = run(q, k, v, **kwargs)
    sees = np.broadcast_to(allowed_keys(R, C, kwargs.get("causal", False)), (R, C)).copy()
    if "mask" in kwargs:
        sees &= kwargs["mask"]
    assert np.isnan(lse[0, 0, sees[:, 30]]).all() and np.isfinite(lse[0, 0, ~sees[:, 30]]).all()
    assert_same_nans_and_values(out, expected)
    assert_same_nans_and_values(lse, expected_lse, 1e-5)


def test_a_nan_in_an_additive_mask_it_sees_makes_the_row_nan(rng):
    q, k, v = make_inputs(rng, R=R, C=C, D=D)
    mask = rng.standard_normal((R, C)).astype(np.float32)
    mask[3, 2] = np.nan                     # seen by row 3
    mask[20, 39] = np.nan                   # behind the causal mask of row 20: never attended
    mask[7, :] = -np.inf                    # a row with no key
    out, lse, expected, expected_lse = run(q, k, v, mask=mask, causal="upper_left")
    assert np.isnan(out[:, :, 3]).all() and np.isfinite(out[:, :, 20]).all()
    assert (out[:, :, 7] == 0).all() and np.isneginf(lse[:, :, 7]).all()
    assert_same_nans_and_values(out, expected)
    assert_same_nans_and_values(lse, expected_lse, 1e-5)


def test_a_nan_value_element_reaches_that_element_of_the_rows_that_see_it(rng):
    q, k, v = make_inputs(rng, R=R, C=C, D=D, Dv=8)
    v[0, 1, 12, 5] = np.nan
    out, lse, expected, _ = run(q, k, v, causal=True)
    sees = allowed_keys(R, C, True)[:, 12]
    assert np.isnan(out[0, 1, sees, 5]).all()
    assert np.isfinite(out[0, 1][:, [0, 1, 2, 3, 4, 6, 7]]).all() and np.isfinite(out[0, 0]).all()
    assert np.isfinite(lse).all()
    # Rows that do not see key 12 may get the NaN too (PyTorch's math path gives it to all:
    # their weight 0 times NaN), else they are exact.
    rest = ~np.isnan(out)
    assert relative_l2(out[rest], np.where(np.isnan(expected), 0, expected)[rest]) < 1e-4


def test_positions_no_row_attends_are_never_read(rng):
    """Keys after the last a causal row sees, before the first a window sees, past the block
    lists, and the split-KV decode's keys all hold NaN where no row looks: results stay exact."""
    q, k, v = make_inputs(rng, R=R, C=C, D=D)
    clean_k, clean_v = k.copy(), v.copy()
    for x in (k, v):
        x[:, :, R:] = np.nan                              # upper-left causal: keys >= R unseen
    out = mfa_native.attention(q, k, v, causal="upper_left")
    assert relative_l2(out, attention_reference(q, clean_k, clean_v, causal="upper_left")) < 1e-4
    k, v = clean_k.copy(), clean_v.copy()
    for x in (k, v):
        x[:, :, :13] = np.nan                             # window (3, 0): row 0 sees keys 13.. (C - R = 16)
    out = mfa_native.attention(q, k, v, window=(3, 0))
    assert relative_l2(out, attention_reference(q, clean_k, clean_v, window=(3, 0))) < 1e-4
    k, v = clean_k.copy(), clean_v.copy()
    for x in (k, v):
        x[:, :, 16:32] = np.nan                           # key block 1 of 16 is never listed
    block_mask = BlockMask(np.full((1, 1, 2), 2, np.int32), np.array([[[[0, 2], [2, 0]]]], np.int32),
                           block_size=16)
    out = mfa_native.block_sparse_attention(q, k, v, block_mask)
    assert relative_l2(out, block_sparse_attention_reference(q, clean_k, clean_v, block_mask)) < 1e-4


def test_split_kv_decode_keeps_the_nan(rng):
    q, k, v = make_inputs(rng, Hq=2, Hkv=1, R=2, C=3000, D=D)
    k[0, 0, 2500, 0] = np.nan                             # in one split only
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=64), mfa_native.profile() as prof:
        out, lse, expected, expected_lse = run(q, k, v)
    assert len(prof.records) == 2 and np.isnan(out).all() and np.isnan(lse).all()
    q, k, v = make_inputs(rng, Hq=2, Hkv=1, R=2, C=3000, D=D)
    v[0, 0, 100, 3] = np.nan
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=64):
        out, lse, expected, expected_lse = run(q, k, v)
    assert_same_nans_and_values(out, expected)
    assert np.isfinite(lse).all()


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_backward_gradients_are_nan_where_the_reference_says(rng, where):
    q, k, v = make_inputs(rng, R=R, C=C, D=D)
    {"q": q, "k": k, "v": v}[where][0, 1, 9, 2] = np.nan
    o, lse = mfa_native.attention(q, k, v, return_lse=True)
    do = rng.standard_normal(o.shape).astype(np.float32)
    grads = mfa_native.attention_backward(q, k, v, o, lse, do)
    expected = attention_backward_reference(q, k, v, do, out=o)
    for grad, reference in zip(grads, expected):
        assert_same_nans_and_values(grad, reference, 1e-3)


def test_against_pytorch_math_attention_and_its_autograd(rng):
    torch = pytest.importorskip("torch")
    q, k, v = make_inputs(rng, R=R, C=C, D=D)
    mask = rng.standard_normal((R, C)).astype(np.float32)
    q[0, 0, 2, 1] = np.nan
    k[0, 1, 33, 4] = np.nan
    mask[11, 5] = np.nan
    out, lse = mfa_native.attention(q, k, v, mask=mask, return_lse=True)
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    logits = tq @ tk.transpose(-1, -2) / np.sqrt(D) + torch.tensor(mask, dtype=torch.float64)
    expected = torch.softmax(logits, dim=-1) @ tv
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected.detach().numpy()))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(torch.logsumexp(logits, -1).detach().numpy()))
    do = rng.standard_normal(out.shape).astype(np.float32)
    expected.backward(torch.tensor(do, dtype=torch.float64))
    grads = mfa_native.attention_backward(q, k, v, out, lse, do, mask=mask)
    for grad, tensor in zip(grads, (tq, tk, tv)):
        np.testing.assert_array_equal(np.isnan(grad), np.isnan(tensor.grad.numpy()))
