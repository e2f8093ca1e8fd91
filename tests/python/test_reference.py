"""The float64 reference against a direct, row-by-row reading of the semantics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mfa_native.reference import allowed_keys, attention_probabilities, attention_reference


def naive(q, k, v, *, scale=None, causal=False, mask=None, window=None, sinks=None):
    """One query row at a time, straight from the issue's wording (bhsd, float64)."""
    B, Hq, R, D = q.shape
    Hkv, C = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    mode = {False: None, True: "lower_right"}.get(causal, causal)
    out = np.zeros((B, Hq, R, v.shape[3]))
    lse = np.full((B, Hq, R), -np.inf)
    full_mask = None if mask is None else np.broadcast_to(mask, (B, Hq, R, C))
    for b in range(B):
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            for i in range(R):
                logits, values = [], []
                for j in range(C):
                    if mode == "lower_right" and j > i + C - R:
                        continue
                    if mode == "upper_left" and j > i:
                        continue
                    if window is not None:
                        offset = j - (i + C - R)
                        if (window[0] != -1 and offset < -window[0]) or (window[1] != -1 and offset > window[1]):
                            continue
                    logit = scale * float(np.dot(q[b, h, i], k[b, kv, j]))
                    if full_mask is not None:
                        if full_mask.dtype == bool:
                            if not full_mask[b, h, i, j]:
                                continue
                        else:
                            if full_mask[b, h, i, j] <= -1e30:
                                continue
                            logit += float(full_mask[b, h, i, j])
                    logits.append(logit)
                    values.append(v[b, kv, j])
                if sinks is not None:
                    logits.append(float(sinks[h]))
                    values.append(np.zeros(v.shape[3]))
                if not logits:
                    continue
                top = max(logits)
                weights = np.exp(np.array(logits) - top)
                out[b, h, i] = weights @ np.array(values) / weights.sum()
                lse[b, h, i] = top + math.log(weights.sum())
    return out, lse


def _inputs(rng, B=2, Hq=4, Hkv=2, R=5, C=7, D=3, Dv=4):
    return (rng.standard_normal((B, Hq, R, D)), rng.standard_normal((B, Hkv, C, D)),
            rng.standard_normal((B, Hkv, C, Dv)))


@pytest.mark.parametrize("causal", [False, True, "lower_right", "upper_left"])
@pytest.mark.parametrize("shape", [(5, 7), (7, 5), (6, 6), (1, 4)])
def test_causal_alignments_match_the_row_by_row_reading(rng, causal, shape):
    q, k, v = _inputs(rng, R=shape[0], C=shape[1])
    out, lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    expected, expected_lse = naive(q, k, v, causal=causal)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], expected_lse[np.isfinite(expected_lse)], rtol=1e-12)


@pytest.mark.parametrize("window", [(0, 0), (2, 1), (-1, 0), (1, -1), (3, 3)])
def test_window_masks_sinks_and_scale_match_the_row_by_row_reading(rng, window):
    q, k, v = _inputs(rng, R=6, C=9)
    bool_mask = rng.random((1, 4, 6, 9)) > 0.3
    additive = rng.standard_normal((6, 9))
    additive[2, ::2] = -np.inf
    sinks = rng.standard_normal(4)
    for kwargs in ({"mask": bool_mask}, {"mask": additive, "sinks": sinks}, {"sinks": sinks, "causal": True},
                   {"scale": 0.3, "mask": bool_mask, "causal": "upper_left"}):
        out, lse = attention_reference(q, k, v, window=window, return_lse=True, **kwargs)
        expected, expected_lse = naive(q, k, v, window=window, **kwargs)
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, expected_lse, rtol=1e-12)


def test_rows_without_keys_give_zero_and_minus_infinity_and_sinks_only_add_to_the_denominator(rng):
    q, k, v = _inputs(rng, R=6, C=3)
    out, lse = attention_reference(q, k, v, causal=True, return_lse=True)  # rows 0..2 see no key
    assert np.all(out[:, :, :3] == 0) and np.all(np.isneginf(lse[:, :, :3]))
    assert np.all(np.isfinite(lse[:, :, 3:]))
    sinks = rng.standard_normal(4)
    out, lse = attention_reference(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert np.all(out[:, :, :3] == 0)
    np.testing.assert_allclose(lse[:, :, :3], np.broadcast_to(sinks[None, :, None], (2, 4, 3)))


def test_probabilities_sum_to_one_less_the_sink_share(rng):
    q, k, _ = _inputs(rng)
    sinks = rng.standard_normal(4)
    probabilities, lse = attention_probabilities(q, k, sinks=sinks)
    np.testing.assert_allclose(probabilities.sum(-1) + np.exp(sinks[None, :, None] - lse), 1.0, rtol=1e-12)


def test_bshd_layout_is_bhsd_with_swapped_axes(rng):
    q, k, v = _inputs(rng)
    swap = (0, 2, 1, 3)
    out = attention_reference(q.transpose(swap), k.transpose(swap), v.transpose(swap), layout="bshd", causal=True)
    np.testing.assert_allclose(out.transpose(swap), attention_reference(q, k, v, causal=True), rtol=1e-12)


def test_allowed_keys_follow_the_issue_formula():
    allowed = allowed_keys(3, 5, causal=True, window=(1, -1))
    # query i lines up with key i + 2; it sees that key and one to its left.
    np.testing.assert_array_equal(allowed, [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(allowed_keys(3, 2, causal="upper_left"), [[1, 0], [1, 1], [1, 1]])
