"""An oracle written by someone else: forward and backward against PyTorch's
scaled_dot_product_attention and autograd, in float64. Runs where torch is
installed (`pip install torch`), skipped elsewhere."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import mfa_native

torch = pytest.importorskip("torch")
F = torch.nn.functional


def rel(actual, expected) -> float:
    """Relative L2 error; exactly-zero gradients (one visible key) are measured against a small floor."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-3 * np.sqrt(expected.size)))


def torch_attention(q, k, v, *, causal, mask, window, sinks):
    """softmax(q k^T / sqrt(D) + mask) v with the issue's causal, window and sink rules, in torch."""
    R, C = q.shape[2], k.shape[2]
    i, j = torch.arange(R)[:, None], torch.arange(C)[None, :]
    allowed = torch.ones(R, C, dtype=torch.bool)
    if causal == "upper_left":
        allowed &= j <= i
    elif causal:
        allowed &= j <= i + C - R
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j - (i + C - R) >= -left
        if right >= 0:
            allowed &= j - (i + C - R) <= right
    bias = torch.zeros(R, C, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    if mask is not None:
        mask = torch.tensor(mask)
        bias = bias.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else bias + mask.double()
    if sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    else:  # the sink is one more logit with a zero value
        group = q.shape[1] // k.shape[1]
        scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
        out = torch.softmax(scores, -1)[..., :C] @ v.repeat_interleave(group, 1)
    return torch.nan_to_num(out, nan=0.0)  # rows with no allowed key give 0


CASES = list(itertools.product([(1, 9), (13, 13), (20, 7)], [False, True, "upper_left"],
                               ["none", "bool", "additive"], [None, (4, 1)], [False, True]))


@pytest.mark.parametrize("shape,causal,mask_kind,window,use_sinks", CASES)
def test_forward_and_backward_match_pytorch(rng, shape, causal, mask_kind, window, use_sinks):
    (R, C), B, Hq, Hkv, D, Dv = shape, 2, 4, 2, 16, 12
    q = rng.standard_normal((B, Hq, R, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, C, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, C, Dv)).astype(np.float32)
    mask = None
    if mask_kind == "bool":
        mask = rng.random((1, Hq, R, C)) < 0.7
    elif mask_kind == "additive":
        mask = rng.standard_normal((B, 1, R, C)).astype(np.float32)
    sinks = rng.standard_normal(Hq).astype(np.float32) if use_sinks else None

    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    ts = None if sinks is None else torch.tensor(sinks, dtype=torch.float64, requires_grad=True)
    expected = torch_attention(tq, tk, tv, causal=causal, mask=mask, window=window, sinks=ts)
    do = rng.standard_normal(expected.shape).astype(np.float32)
    expected.backward(torch.tensor(do, dtype=torch.float64))

    o, lse = mfa_native.attention(q, k, v, causal=causal, mask=mask, window=window, sinks=sinks,
                                  return_lse=True, device="cpu")
    assert rel(o, expected.detach().numpy()) < 1e-4
    grads = mfa_native.attention_backward(q, k, v, o, lse, do, causal=causal, mask=mask, window=window,
                                          sinks=sinks, device="cpu")
    wanted = [tq.grad, tk.grad, tv.grad] + ([ts.grad] if use_sinks else [])
    assert len(grads) == len(wanted)
    for got, want in zip(grads, wanted):
        assert rel(got, want.numpy()) < 1e-3
