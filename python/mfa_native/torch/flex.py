"""`mfa_native.torch.flex_attention`: torch.nn.attention.flex_attention.flex_attention, computed
by mfa_native's block-sparse kernels, with autograd.

The block mask is FlexAttention's own (create_block_mask, BlockMask.from_kv_blocks; None: every
key), converted once per mask object (`BlockMask.from_torch`: the lists, and its mask_mod as
bits of the partial blocks), or a mfa_native.BlockMask. A score_mod is traced (torch/score_mod.py)
into an expression the kernels compile and the tensors it reads, once per function while what
it sees stays the same (score_mod_traces.py), else on every call. The gradients come from
`block_sparse_attention_backward`, through the op's torch custom op (torch/library.py).

FlexAttention's conventions: q, k, v are (B, H, L, D); scale defaults to 1 / sqrt(D); q heads
other than k's need enable_gqa=True; a row with no allowed key gives output 0 and lse -inf;
lse is the natural-log logsumexp of the scaled scores (flex_attention returns its log2 stats
times ln 2), (B, Hq, R) float32.
"""

from __future__ import annotations

import torch

from ..ops.block_sparse import BLOCK_SPARSE_ATTENTION
from ..ops.flex_bits import as_block_mask, everything
from .library import torch_function
from .score_mod import TRACES
from .score_mod_gradients import with_captured_gradients

_block_sparse_attention = torch_function(BLOCK_SPARSE_ATTENTION)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """torch.nn.attention.flex_attention.flex_attention, computed by mfa_native's block-sparse kernels.

    Its arguments in its positions, torch tensors in and out, differentiable in query, key and
    value (through `mfa_native.block_sparse_attention_backward`). The block mask is converted
    once per mask object (`mfa_native.BlockMask.from_torch`: its lists, and its mask_mod
    evaluated into bits of the partial blocks).

    Args:
        query: (B, Hq, R, D) torch tensor, float32, float16 or bfloat16 (CPU or MPS).
        key: (B, Hkv, C, D), query's dtype.
        value: (B, Hkv, C, Dv).
        score_mod: None, or FlexAttention's `score_mod(score, b, h, q_idx, kv_idx) -> score`,
            traced into the kernels (forward and backward; its derivative with respect to the
            score derived from it): arithmetic, comparisons, logic, torch.where, exp, log,
            tanh, sigmoid, sqrt, abs, minimum, maximum, floor, ceil, clamp, small integer
            powers, casts between float and integer, integer arithmetic on the indices, and
            reads of captured tensors indexed at every axis by b, h, q_idx, kv_idx
            expressions (a negative index counts from the end; an index outside the tensor
            makes that score NaN). It computes in float32; a result of -inf removes the key.
            A captured float tensor that requires grad (a learnable bias) gets its gradient,
            the sum of dS over the elements that read it, recomputed densely with torch ops
            (B x Hq x R x C float32) in the backward.
        block_mask: FlexAttention's BlockMask (create_block_mask, BlockMask.from_kv_blocks),
            a mfa_native.BlockMask, or None for every key.
        scale: the logit scale; None: 1 / sqrt(D).
        enable_gqa: allow Hq to be a multiple of Hkv (required when they differ).
        return_lse: also return the lse.
        kernel_options: Triton's tile and pipeline choices: they change no result and are
            ignored.
        return_aux: None only (NotImplementedError otherwise): pass return_lse=True for the lse.

    Returns:
        The output (B, Hq, R, Dv) in query's dtype; with return_lse=True the tuple (output,
            lse), lse (B, Hq, R) float32, the natural-log logsumexp of the scaled scores (0
            output and -inf lse for a row with no allowed key).

    Raises:
        NotImplementedError: return_aux (not computed).
        ValueError: a score_mod that cannot be traced or uses an operation outside its
            vocabulary (naming it); head counts that differ without enable_gqa; a block mask made for other
            lengths (its seq_lengths); any argument `mfa_native.block_sparse_attention`
            refuses with a ValueError.
        TypeError: a block_mask of another kind; any argument
            `mfa_native.block_sparse_attention` refuses with a TypeError.

    Example:
        ```python
        import torch
        import torch.nn.functional as F
        from torch.nn.attention.flex_attention import create_block_mask
        from mfa_native.torch import flex_attention

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 16, 32, requires_grad=True) for _ in range(3))
        block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=16, KV_LEN=16, device="cpu")
        out = flex_attention(q, k, v, block_mask=block_mask)
        (dq,) = torch.autograd.grad(out.sum(), q)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (expected_dq,) = torch.autograd.grad(expected.sum(), q)
        assert torch.allclose(out, expected, atol=1e-5) and torch.allclose(dq, expected_dq, atol=1e-4)
        ```
    """
    if return_aux is not None:
        raise NotImplementedError("return_aux is not computed by mfa_native: pass return_lse=True for the lse")
    if query.size(1) != key.size(1) and not enable_gqa:
        raise ValueError(f"query has {query.size(1)} heads and key {key.size(1)}: pass enable_gqa=True for GQA")
    converted = everything() if block_mask is None else as_block_mask(block_mask)
    text, tensors = (None, []) if score_mod is None else TRACES.traced(score_mod)
    learnable = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    results = _block_sparse_attention(query, key, value, converted, scale=scale, return_lse=return_lse or learnable,
                                      score_mod=text, score_mod_tensors=[t.detach() for t in tensors])
    if not learnable:
        return results
    out, lse = results
    out = with_captured_gradients(out, lse, score_mod, converted, tensors, query, key, value, scale)
    return (out, lse) if return_lse else out
