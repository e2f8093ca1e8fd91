"""`scaled_dot_product_attention` with exactly torch's semantics, and `sdpa_override()`.

torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask,
dropout_p, is_causal, scale, enable_gqa): query (..., L, E), key (..., S, E),
value (..., S, Ev), leading axes broadcast as batch (the head axis is dim -3 for
enable_gqa, which repeats each kv head over Hq / Hkv query heads); is_causal is
upper-left; a bool mask is True = attend, a float mask is added; the mask
broadcasts to (..., L, S). Here the leading axes are broadcast (stride 0, no
copy) and flattened into mfa_native's (B, H, R, D).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from ..codegen import MAX_HEAD_DIM
from .functional import attention

_TORCH_SDPA = F.scaled_dot_product_attention  # torch's own, whatever sdpa_override does later
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REMOVED = -1e30  # an additive mask value at or below this removes the key in mfa_native's kernels


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
    """torch.nn.functional.scaled_dot_product_attention, computed by mfa_native (differentiable:
    query, key and value get gradients).

    Same arguments, shapes, broadcasting and results as torch's, with these limits: dropout_p
    must be 0; dtypes float32, float16 and bfloat16; head dims 1..576. Empty inputs give
    torch's result: an empty output, or with no keys an output of zeros (and zero
    gradients). A row whose keys are all masked gives 0, as torch does, except that additive
    mask values <= -1e30 count as removed: a row whose every key is masked with such finite
    values gives 0 here where torch averages those keys' values (`sdpa_override` falls back
    to torch for such masks).

    Args:
        query: (..., L, E) torch tensor, CPU or MPS; the leading axes broadcast as batch.
        key: (..., S, E), query's dtype.
        value: (..., S, Ev).
        attn_mask: None, a boolean mask (True = attend) or a float mask added to the logits
            (float32 or query's dtype), broadcastable to (..., L, S); it gets no gradient.
        dropout_p: 0.0 only.
        is_causal: upper-left causal (query i sees keys j <= i), torch's; not with attn_mask.
        scale: the logit scale; None: 1 / sqrt(E).
        enable_gqa: query's head axis (dim -3) may be a multiple of key's and value's; each kv
            head serves Hq / Hkv query heads.

    Returns:
        The output (..., L, Ev), query's dtype and device.

    Raises:
        NotImplementedError: dropout_p other than 0, or an attn_mask that requires grad.
        TypeError: float64 (or another dtype mfa_native has no kernels for).
        ValueError: a head dim beyond 576.
        RuntimeError: what torch's own SDPA raises for these arguments (dtypes or ranks it
            refuses, shapes that do not agree, attn_mask with is_causal), with its message.

    Example:
        ```python
        import torch
        import torch.nn.functional as F
        from mfa_native.torch import scaled_dot_product_attention

        torch.manual_seed(0)
        q = torch.randn(1, 4, 16, 32, requires_grad=True)   # 4 query heads
        k, v = torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32)   # 2 kv heads
        mask = torch.rand(16, 16) > 0.2   # True = attend, broadcast over batch and heads
        mask[:, 0] = True                 # every row keeps a key
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out.sum().backward()
        assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                              atol=1e-5)
        ```
    """
    if dropout_p != 0.0:
        raise NotImplementedError(f"mfa_native has no attention dropout: dropout_p must be 0.0, got {dropout_p}")
    _check(query, key, value, attn_mask, is_causal)
    if attn_mask is not None and attn_mask.requires_grad:
        raise NotImplementedError("mfa_native gives attn_mask no gradient; pass attn_mask.detach()")
    return _run(_canonical(query, key, value, attn_mask, enable_gqa), is_causal, scale)


def _run(canonical: tuple, is_causal: bool, scale: float | None) -> Tensor:
    q, k, v, mask, shape = canonical
    return attention(q, k, v, scale=scale, causal="upper_left" if is_causal else False, mask=mask).reshape(shape)


def _check(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, is_causal: bool) -> None:
    """torch's own argument checks, with its errors."""
    if (not (query.dtype == key.dtype == value.dtype) or min(query.dim(), key.dim(), value.dim()) < 2
            or (attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype))):
        meta = [None if x is None else torch.empty(x.shape, dtype=x.dtype, device="meta")
                for x in (query, key, value, attn_mask)]
        _TORCH_SDPA(*meta[:3], attn_mask=meta[3])  # raises torch's error for these dtypes and ranks
        raise RuntimeError("query, key, value and attn_mask have dtypes or ranks torch refuses")
    if is_causal and attn_mask is not None:  # torch's math backend's error (its CPU kernel combines the two)
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")


def _canonical(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
               enable_gqa: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None, tuple[int, ...]]:
    """(q, k, v, mask) as mfa_native's (B, H, R, D) views, and the shape of torch's output.
    RuntimeError for shapes torch refuses."""
    if key.shape[-1] != query.shape[-1] or value.shape[-2] != key.shape[-2]:
        raise RuntimeError(f"query (..., L, E), key (..., S, E) and value (..., S, Ev) do not agree: query "
                           f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    rank = max(query.dim(), key.dim(), value.dim())
    n = max(rank, 4)
    q, k, v = (x.reshape((1,) * (n - x.dim()) + tuple(x.shape)) for x in (query, key, value))
    batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    Hq, Hk, Hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if enable_gqa:
        if Hq % Hk or Hq % Hv:
            raise RuntimeError("Number of heads in key and value must divide the number of heads in query")
        heads = Hq
        if Hk != Hv:  # mfa_native shares one kv head count: repeat both to Hq heads (a copy)
            k, v = k.repeat_interleave(Hq // Hk, -3), v.repeat_interleave(Hq // Hv, -3)
    else:
        heads = torch.broadcast_shapes((Hq,), (Hk,), (Hv,))[0]
    kv_heads = Hk if enable_gqa and Hk == Hv else (1 if Hk == Hv == 1 else heads)
    L, S = q.shape[-2], k.shape[-2]
    B = math.prod(batch)   # explicit sizes: an empty tensor reshapes too
    q = q.expand(*batch, heads, L, q.shape[-1]).reshape(B, heads, L, q.shape[-1])
    k, v = (x.expand(*batch, kv_heads, S, x.shape[-1]).reshape(B, kv_heads, S, x.shape[-1]) for x in (k, v))
    mask = attn_mask
    if mask is not None:
        torch.broadcast_shapes(mask.shape, (*batch, heads, L, S))  # torch's error when it does not broadcast
        if len(batch) != 1 or mask.dim() > 4:
            mask = mask.expand(*batch, heads, L, S).reshape(B, heads, L, S)
    shape = (*batch, heads, L, v.shape[-1])[n - rank:]
    return q, k, v, mask, shape


def _supported(query, key, value, attn_mask, dropout_p, is_causal) -> bool:
    """Whether mfa_native gives exactly what torch's SDPA gives for these arguments."""
    tensors = (query, key, value)
    if not all(isinstance(x, Tensor) and x.device.type in ("cpu", "mps") for x in tensors):
        return False
    if len({x.device for x in tensors}) != 1 or (
            attn_mask is not None and attn_mask.device != query.device):
        return False
    if query.dtype not in _DTYPES or not (query.dtype == key.dtype == value.dtype):
        return False
    if dropout_p != 0.0 or min(x.dim() for x in tensors) < 2 or any(x.numel() == 0 for x in tensors):
        return False
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        return False
    if attn_mask is None:
        return True
    if is_causal or attn_mask.requires_grad or attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        return False
    if attn_mask.dtype == torch.bool:
        return True
    top = attn_mask.amax(dim=-1)  # a row masked entirely with finite values <= -1e30: torch averages it
    return not bool(((top <= REMOVED) & (top > float("-inf"))).any())


@contextmanager
def sdpa_override() -> Iterator[None]:
    """Inside the block, torch.nn.functional.scaled_dot_product_attention runs through mfa_native
    where the result is exactly torch's (float32/float16/bfloat16 CPU or MPS tensors, no
    dropout, head dims <= 576, ...), and through torch's own otherwise; shape errors are torch's.

    It replaces the attribute `torch.nn.functional.scaled_dot_product_attention`, so code
    that looks it up when calling (Transformers, Diffusers: `F.scaled_dot_product_attention(...)`)
    uses it; a reference taken before the block (`from torch.nn.functional import ...`) does
    not. Not thread-safe: the attribute is process-wide. Blocks may nest; the original is
    restored on exit, also on an exception.

    Returns:
        A context manager (its value is None).

    Raises:
        RuntimeError: inside the block, what torch's SDPA raises for arguments it refuses (its
            own error: mfa_native never makes a call fail that torch would compute).

    Example:
        ```python
        import torch
        import torch.nn.functional as F
        from mfa_native.torch import sdpa_override

        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 16, 32) for _ in range(3))
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with sdpa_override():   # code calling F.scaled_dot_product_attention now runs mfa_native
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert torch.allclose(out, expected, atol=1e-5)
        ```
    """
    original = F.scaled_dot_product_attention

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if _supported(query, key, value, attn_mask, dropout_p, is_causal):
            try:
                canonical = _canonical(query, key, value, attn_mask, enable_gqa)
            except RuntimeError:  # shapes torch refuses: torch says so
                canonical = None
            if canonical is not None:
                return _run(canonical, is_causal, scale)
        return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
