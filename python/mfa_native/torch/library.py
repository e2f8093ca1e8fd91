"""`torch.ops.mfa_native.attention` and `.attention_backward`: torch.library custom ops.

Registered with fake implementations (so torch.compile and FakeTensor trace them
without running them) and, for the forward, `register_autograd` running the
backward op. Their real implementations are mfa_native's ops, which read the
tensors in place and write into tensors torch allocates.

No `from __future__ import annotations` here: torch.library infers the schemas
from the annotations' runtime values.
"""

import atexit
from typing import Optional

import torch
from torch import Tensor

from ..ops import attention as _forward_module, attention_backward as _backward_module
from ..ops.attention import attention as _attention
from ..ops.attention_backward import attention_backward as _attention_backward

CAUSAL = {False: "none", True: "lower_right", "lower_right": "lower_right", "upper_left": "upper_left"}
_AS_OPTION = {"none": False, "lower_right": "lower_right", "upper_left": "upper_left"}


def _window(window: Optional[list[int]]) -> Optional[tuple[int, int]]:
    return None if window is None else (window[0], window[1])


@torch.library.custom_op("mfa_native::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], sinks: Optional[Tensor],
                 scale: Optional[float], causal: str, window: Optional[list[int]], layout: str) -> tuple[Tensor, Tensor]:
    """(o, lse) of `mfa_native.attention`; causal is "none", "lower_right" or "upper_left"."""
    o, lse = _attention(q, k, v, scale=scale, causal=_AS_OPTION[causal], mask=mask, window=_window(window),
                        sinks=sinks, layout=layout, return_lse=True)
    return o, lse


@attention_op.register_fake
def _attention_fake(q, k, v, mask, sinks, scale, causal, window, layout):
    rows = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("mfa_native::attention_backward", mutates_args=())
def attention_backward_op(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                          mask: Optional[Tensor], sinks: Optional[Tensor], scale: Optional[float], causal: str,
                          window: Optional[list[int]], layout: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks) of `mfa_native.attention_backward`; dsinks is empty, shape (0,),
    without sinks."""
    grads = _attention_backward(q, k, v, o, lse, do, scale=scale, causal=_AS_OPTION[causal], mask=mask,
                                window=_window(window), sinks=sinks, layout=layout)
    if sinks is None:
        return (*grads, q.new_empty(0, dtype=torch.float32))
    return grads


@attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, o, lse, do, mask, sinks, scale, causal, window, layout):
    heads = 0 if sinks is None else sinks.shape[0]
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((heads,), dtype=torch.float32))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, sinks, scale, causal, window, layout = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, mask, sinks)
    ctx.options = (scale, causal, window, layout)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, mask, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_backward_op(q, k, v, o, lse, do, mask, sinks, *ctx.options)
    return dq, dk, dv, None, None if sinks is None else dsinks.to(sinks.dtype), None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


# torch's op registry keeps these functions, and through them the ops' prepared passes, alive
# past interpreter teardown, which nanobind reports as leaks: drop the passes at exit.
atexit.register(_forward_module._calls.clear)
atexit.register(_backward_module._calls.clear)
