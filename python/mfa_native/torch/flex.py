"""`mfa_native.torch.flex_attention`: torch.nn.attention.flex_attention.flex_attention without
score_mod, computed by mfa_native's block-sparse kernels, with autograd.

The block mask is FlexAttention's own (create_block_mask, BlockMask.from_kv_blocks; None: every
key), converted once per mask object (`BlockMask.from_torch`: the lists, and its mask_mod as
bits of the partial blocks), or a mfa_native.BlockMask. The gradients come from
`block_sparse_attention_backward`, through the op's torch custom op (torch/library.py).

FlexAttention's conventions: q, k, v are (B, H, L, D); scale defaults to 1 / sqrt(D); q heads
other than k's need enable_gqa=True; a row with no allowed key gives output 0 and lse -inf;
lse is the natural-log logsumexp of the scaled scores (flex_attention returns its log2 stats
times ln 2), (B, Hq, R) float32.
"""

from __future__ import annotations

from ..ops.block_sparse import BLOCK_SPARSE_ATTENTION
from ..ops.flex_bits import as_block_mask, everything
from .library import torch_function

_block_sparse_attention = torch_function(BLOCK_SPARSE_ATTENTION)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """torch.nn.attention.flex_attention.flex_attention, its arguments in its positions: torch
    tensors in and out, differentiable in q, k and v. `kernel_options` (Triton's tile and
    pipeline choices) change no result and are ignored.

    Returns:
        The output (B, Hq, R, Dv) in q's dtype, and with return_lse the (B, Hq, R) float32 lse.

    Raises:
        NotImplementedError for a score_mod or return_aux (not computed yet); ValueError for
        head counts that differ without enable_gqa, a mask made for other lengths
        (block_mask.shape); TypeError for a block_mask of another kind.
    """
    if score_mod is not None:
        raise NotImplementedError("score_mod is not computed by mfa_native yet: call flex_attention without it "
                                  "(torch's own flex_attention compiles it)")
    if return_aux is not None:
        raise NotImplementedError("return_aux is not computed by mfa_native: pass return_lse=True for the lse")
    if query.size(1) != key.size(1) and not enable_gqa:
        raise ValueError(f"query has {query.size(1)} heads and key {key.size(1)}: pass enable_gqa=True for GQA")
    converted = everything() if block_mask is None else as_block_mask(block_mask)
    return _block_sparse_attention(query, key, value, converted, scale=scale, return_lse=return_lse)
