"""Gradients of the tensors a score_mod captured (a learnable bias), as FlexAttention gives them.

The kernels give q, k and v their gradients; a captured tensor's is the sum, over the
elements that read it, of dS' = P o (dP - D), the gradient of the loss with respect to the
modified score. `with_captured_gradients` ties the output to the captured tensors that
require grad through `_CapturedGradients`, whose backward recomputes, densely with torch ops
(B x Hq x R x C float32, on the host's side of the call), the modified scores with the user's
score_mod (so torch's autograd differentiates the reads), P from the kernels' lse and the
block mask's visit counts (its from_mask rule applied in partial blocks, as the kernels do),
and dS', and sums it into the tensors with autograd.grad.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..reference import block_sparse_bias


def with_captured_gradients(out, lse, score_mod, block_mask, tensors, query, key, value, scale):
    """`out` tied to the `tensors` score_mod read (those that require grad get gradients)."""
    learnable = [t for t in tensors if t.requires_grad]
    context = (score_mod, block_mask, learnable, scale)
    return _CapturedGradients.apply(context, out, lse.detach(), query.detach(), key.detach(), value.detach(),
                                    *learnable)


class _CapturedGradients(torch.autograd.Function):
    """Identity on the output; its backward adds the captured tensors' gradients."""

    @staticmethod
    def forward(ctx, context, out, lse, query, key, value, *learnable):
        ctx.context = context
        ctx.save_for_backward(out.detach(), lse, query, key, value)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        out, lse, query, key, value = ctx.saved_tensors
        score_mod, block_mask, learnable, scale = ctx.context
        groups = query.size(1) // key.size(1)
        k, v = (x.float().repeat_interleave(groups, dim=1) for x in (key, value))
        scores = query.float() @ k.transpose(-1, -2) * (1 / math.sqrt(query.size(-1)) if scale is None else scale)
        b, h, i, j = torch.meshgrid(*(torch.arange(n, device=scores.device) for n in scores.shape), indexing="ij")
        with torch.enable_grad():
            modified = score_mod(scores, b, h, i, j)
        rule = getattr(block_mask, "rule", None)   # from_mask's, which the kernels apply in partial blocks
        rules = {} if rule is None else {"causal": rule.causal, "window": rule.window, "mask": rule.mask}
        visits = block_sparse_bias(block_mask, np.zeros((*scores.shape[:3], 1)), np.zeros((1, 1, scores.size(3), 1)),
                                   **rules)
        logits = modified.detach() + torch.from_numpy(visits).float().to(scores.device)
        rows = torch.where(lse.isinf(), 0.0, lse)[..., None]
        p = torch.where(lse[..., None] == -math.inf, 0.0, torch.exp(logits - rows))
        do = grad_out.float()
        ds = p * (do @ v.transpose(-1, -2) - (do * out.float()).sum(-1, keepdim=True))
        grads = torch.autograd.grad(modified, learnable, ds, allow_unused=True)
        return (None, grad_out, None, None, None, None,
                *(None if g is None else g.to(t.dtype) for g, t in zip(grads, learnable)))
