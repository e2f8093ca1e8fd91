"""`mfa_native.attention_backward`: the gradients of `attention`, from kernels without atomics."""

from __future__ import annotations

import numpy as np

from .. import codegen
from ..codegen import AttentionBackwardProblem, physical
from ..runtime.devices import Device, resolve_device, tuning_facts
from . import arguments as check
from .attention import Validated, validate
from .empty import empty_backward
from .given_kind import returns_given_kind
from .warm import PreparedCall, SignatureCache, prepared_call, run, same_memory, signature

ARGUMENTS = ("q", "k", "v", "o", "lse", "dout", "mask", "sinks")  # the array arguments, in call order
_calls = SignatureCache()


@returns_given_kind(("q", "k", "v"), ("o", "lse", "do", "mask", "sinks"))
def attention_backward(q, k, v, o, lse, do, *, scale=None, causal=False, mask=None, window=None, sinks=None,
                       layout="bhsd", device: Device | str | None = None):
    """Gradients of `attention` with respect to q, k, v (and sinks), given the gradient of its output.

    Args:
        q, k, v, scale, causal, mask, window, sinks, layout: exactly as passed to
            `attention` (same semantics, shapes, dtypes and strides).
        o, lse: what `attention(..., return_lse=True)` returned: the output (q's
            dtype and layout, shape (.., Dv)) and lse, (B, Hq, R) float32.
        do: the gradient of the loss with respect to o, shaped and typed like o.
            q, k and v are one kind (numpy, torch or MLX); the other arrays are
            numpy or that kind.
            o and do may have any non-negative strides with a contiguous last axis.
        device: a Device, "cpu", "metal" or None for the default device.

    Returns:
        (dq, dk, dv) of q's kind, laid out like q, k and v (contiguous) in the inputs' dtype;
        with sinks, (dq, dk, dv, dsinks), dsinks being (Hq,) float32. With GQA, dk
        and dv sum the query heads that share each kv head. The mask gets no
        gradient. Rows with no allowed key contribute nothing. Accumulation runs
        in float32.

    Raises:
        TypeError, ValueError naming the argument that is wrong.
    """
    device = resolve_device(device)
    arrays = (q, k, v, o, lse, do, mask, sinks)
    key = signature(arrays, (scale, causal, window, layout), device)
    return run(_calls, key, arrays, lambda: _prepare(arrays, scale=scale, causal=causal, window=window, layout=layout,
                                                     device=device))


def validate_backward(arrays, *, scale, causal, window, layout) -> Validated:
    """Every check of `attention_backward`'s arguments; `arrays` = (q, k, v, o, lse, do, mask,
    sinks) as passed. The problem is an AttentionBackwardProblem."""
    q, k, v, o, lse, do, mask, sinks = arrays
    forward = validate((q, k, v, mask, sinks), scale=scale, causal=causal, window=window, layout=layout,
                       return_lse=False, quantized_refusal="a quantized cache has no gradient; attention_backward "
                       "differentiates attention over float k and v")
    p = forward.problem
    dtype = forward.bound["q"].dtype
    shape = physical(p.o_shape, layout)
    rows = (p.batch, p.q_heads, p.q_len)
    bound, converts = dict(forward.bound), dict(forward.converts)
    converts["o"] = lambda x: check.like_output(x, "o", dtype, shape, layout)
    converts["dout"] = lambda x: check.like_output(x, "do", dtype, shape, layout)
    converts["lse"] = lambda x: check.lse_array(x, rows)
    for name, raw in (("o", o), ("dout", do), ("lse", lse)):
        bound[name] = converts[name](raw)
        if same_memory(raw, bound[name]):
            converts[name] = None
    problem = AttentionBackwardProblem(p, o_strides=physical(check.element_strides(bound["o"]), layout),
                                       dout_strides=physical(check.element_strides(bound["dout"]), layout))
    return Validated(problem, bound, converts)


def _prepare(arrays, *, scale, causal, window, layout, device: Device) -> tuple[PreparedCall, list[np.ndarray]]:
    """The first call of a signature: every check, then the backward pass, prepared; and
    this call's inputs."""
    call = validate_backward(arrays, scale=scale, causal=causal, window=window, layout=layout)
    p = call.problem.forward
    if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        return empty_backward(p, ARGUMENTS, call)
    description = codegen.attention_backward_pass(call.problem, family=tuning_facts(device).family)
    return prepared_call(description, device, call, ARGUMENTS, gradients(p.sinks))


def gradients(sinks: bool) -> tuple[str, ...]:
    """What a backward op returns: (dq, dk, dv), and dsinks with sinks."""
    return ("dq", "dk", "dv", "dsinks") if sinks else ("dq", "dk", "dv")
