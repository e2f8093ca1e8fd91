"""flash_attn_with_kvcache's rotary embedding: q and the appended k rotated at their absolute
positions before the call, with flash-attn's rules.

- rotary_cos and rotary_sin are (seqlen_ro, rotary_dim / 2), q's dtype; the first rotary_dim
  features of each row rotate, the rest pass unchanged; v is never rotated.
- k's new row i of batch b sits at position cache_seqlens[b] + i. q's row i too when causal or
  local (a window); otherwise every q row of batch b sits at cache_seqlens[b].
- rotary_interleaved: features (0, 1), (2, 3), ... pair up (GPT-J); otherwise feature j pairs
  with j + rotary_dim / 2 (GPT-NeoX). A pair (x1, x2) becomes (x1 cos - x2 sin, x1 sin + x2 cos),
  computed in float32 and rounded once to the dtype, as flash-attn's kernel does.

The rotation runs as torch operations on the tensors' device, before the attention pass (not
fused into its append kernel).
"""

from __future__ import annotations

import torch


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
             interleaved: bool) -> torch.Tensor:
    """x (B, S, H, D) with its first rotary_dim features rotated at positions (B, S)."""
    half = cos.shape[1]
    c, s = (t.float()[positions][:, :, None, :] for t in (cos, sin))   # (B, S, 1, rotary_dim / 2)
    head = x[..., :2 * half].float()
    x1, x2 = (head[..., 0::2], head[..., 1::2]) if interleaved else (head[..., :half], head[..., half:])
    r1, r2 = x1 * c - x2 * s, x1 * s + x2 * c
    turned = torch.stack((r1, r2), -1).flatten(-2) if interleaved else torch.cat((r1, r2), -1)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half:]), -1)


def rotate(q, k, rotary_cos, rotary_sin, cache_seqlens, interleaved: bool, causal_or_local: bool):
    """(q, k) rotated for flash_attn_with_kvcache; ValueError naming the argument for tables of
    the wrong shape or dtype, too short for the positions, or given without k and v."""
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin are given together")
    if k is None:
        raise ValueError("rotary_cos needs k and v: the rotary embedding applies to the rows appended (flash-attn's "
                         "rule)")
    if cache_seqlens is None:
        raise ValueError("rotary_cos needs cache_seqlens: the new rows' positions")
    D = q.shape[-1]
    if (rotary_cos.dim() != 2 or rotary_cos.shape != rotary_sin.shape or 2 * rotary_cos.shape[1] > D
            or rotary_cos.shape[1] == 0):
        raise ValueError(f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2) with rotary_dim <= D = "
                         f"{D}, got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
    if rotary_cos.dtype != q.dtype or rotary_sin.dtype != q.dtype:
        raise ValueError(f"rotary_cos and rotary_sin must have q's dtype {q.dtype}, got {rotary_cos.dtype} and "
                         f"{rotary_sin.dtype}")
    start = cache_seqlens.detach().to(rotary_cos.device, torch.int64)[:, None]
    k_positions = start + torch.arange(k.shape[1], device=start.device)
    q_positions = start + (torch.arange(q.shape[1], device=start.device) if causal_or_local
                           else torch.zeros(q.shape[1], dtype=torch.int64, device=start.device))
    last = max((int(p.max()) for p in (k_positions, q_positions) if p.numel()), default=-1)
    if last >= rotary_cos.shape[0]:
        raise ValueError(f"rotary_cos has {rotary_cos.shape[0]} positions (seqlen_ro), too few for position {last} "
                         "(cache_seqlens + the new rows)")
    return (_rotated(q, rotary_cos, rotary_sin, q_positions, interleaved),
            _rotated(k, rotary_cos, rotary_sin, k_positions, interleaved))
