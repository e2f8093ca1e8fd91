"""The float64 gradient reference against central finite differences of the reference forward.

If these pass, the analytic formulas in `attention_backward_reference` are the
gradients of exactly the semantics `attention_reference` implements, so the
kernel tests can trust them.
"""

from __future__ import annotations

import numpy as np
import pytest

from mfa_native.reference import attention_backward_reference, attention_reference

STEP = 1e-6


def numeric_gradient(loss, x: np.ndarray) -> np.ndarray:
    """d loss / d x by central differences, one element at a time (x is perturbed in place)."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        saved = x[index]
        x[index] = saved + STEP
        up = loss()
        x[index] = saved - STEP
        down = loss()
        x[index] = saved
        grad[index] = (up - down) / (2 * STEP)
    return grad


def tensors(rng, B=1, Hq=2, Hkv=1, R=3, C=5, D=3, Dv=2, layout="bhsd"):
    def tensor(heads, length, dim):
        shape = (B, heads, length, dim) if layout == "bhsd" else (B, length, heads, dim)
        return rng.standard_normal(shape)

    return tensor(Hq, R, D), tensor(Hkv, C, D), tensor(Hkv, C, Dv), tensor(Hq, R, Dv)


def masks(rng):
    bool_mask = rng.random((2, 3, 5)) > 0.3
    bool_mask[1, 2] = False  # a row with no allowed key
    additive = rng.standard_normal((3, 5))
    additive[0, 1] = -np.inf
    additive[2, :] = np.finfo(np.float64).min  # a fully removed row
    return bool_mask, additive


CASES = {
    "plain": dict(),
    "gqa 4/2, Dv != D": dict(shape=dict(Hq=4, Hkv=2, D=4, Dv=3)),
    "causal lower right, R < C": dict(kwargs=dict(causal=True)),
    "causal lower right, R > C": dict(shape=dict(R=5, C=3), kwargs=dict(causal="lower_right")),
    "causal upper left": dict(kwargs=dict(causal="upper_left")),
    "bool mask with an empty row": dict(mask="bool"),
    "additive mask, broadcast": dict(mask="additive"),
    "window": dict(shape=dict(R=4, C=6), kwargs=dict(window=(1, 1))),
    "sinks": dict(kwargs=dict(sinks=True)),
    "sinks + causal + window, bshd": dict(shape=dict(layout="bshd", R=4, C=4),
                                          kwargs=dict(sinks=True, causal=True, window=(2, 0), layout="bshd")),
    "scale": dict(kwargs=dict(scale=0.7)),
}


@pytest.mark.parametrize("name", CASES)
def test_analytic_gradients_match_finite_differences(rng, name):
    case = CASES[name]
    q, k, v, dout = tensors(rng, **case.get("shape", {}))
    kwargs = dict(case.get("kwargs", {}))
    layout = kwargs.get("layout", "bhsd")
    heads = q.shape[1] if layout == "bhsd" else q.shape[2]
    sinks = rng.standard_normal(heads) if kwargs.pop("sinks", False) else None
    if "mask" in case:
        kwargs["mask"] = masks(rng)[0 if case["mask"] == "bool" else 1]

    def loss():
        return float(np.sum(attention_reference(q, k, v, sinks=sinks, **kwargs) * dout))

    grads = attention_backward_reference(q, k, v, dout, sinks=sinks, **kwargs)
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    assert len(grads) == len(inputs)
    for grad, x in zip(grads, inputs):
        assert grad.shape == x.shape and grad.dtype == np.float64
        assert np.all(np.isfinite(grad))
        np.testing.assert_allclose(grad, numeric_gradient(loss, x), rtol=1e-5, atol=1e-7)


def test_rows_without_keys_get_no_gradient(rng):
    q, k, v, dout = tensors(rng)
    bool_mask, _ = masks(rng)
    dq, dk, dv = attention_backward_reference(q, k, v, dout, mask=bool_mask)
    assert np.all(dq[0, 1, 2] == 0)
    assert np.abs(dq).sum() > 0 and np.abs(dk).sum() > 0 and np.abs(dv).sum() > 0


def test_delta_from_a_given_output(rng):
    """D = rowsum(dout o out) equals sum_j p_ij dp_ij for the exact output; a rounded output
    moves dq, dk and dsinks (through D) but not dv."""
    q, k, v, dout = tensors(rng, Hq=2, Hkv=2, R=4, C=6)
    sinks = rng.standard_normal(2)
    exact = attention_backward_reference(q, k, v, dout, sinks=sinks)
    out = attention_reference(q, k, v, sinks=sinks)
    for grad, same in zip(exact, attention_backward_reference(q, k, v, dout, sinks=sinks, out=out)):
        np.testing.assert_allclose(same, grad, rtol=1e-12, atol=1e-14)
    rounded = attention_backward_reference(q, k, v, dout, sinks=sinks, out=out.astype(np.float16))
    np.testing.assert_array_equal(rounded[2], exact[2])
    for index in (0, 1, 3):
        assert not np.allclose(rounded[index], exact[index], rtol=1e-9, atol=0)
        np.testing.assert_allclose(rounded[index], exact[index], rtol=0, atol=1e-2)
