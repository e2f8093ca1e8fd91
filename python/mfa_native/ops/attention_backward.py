"""`mfa_native.attention_backward`: the gradients of `attention`, from two kernels without atomics."""

from __future__ import annotations

import numpy as np

from . import codegen
from ._devices import Device, resolve_device
from .attention import (_as_array, _axes, _bindable, _Call, _dispatch, _element_strides, _logical, _physical,
                        _tuning_facts)
from .codegen import AttentionBackwardProblem


def attention_backward(q, k, v, o, lse, do, *, scale=None, causal=False, mask=None, window=None, sinks=None,
                       layout="bhsd", device: Device | str | None = None):
    """Gradients of `attention` with respect to q, k, v (and sinks), given the gradient of its output.

    Args:
        q, k, v, scale, causal, mask, window, sinks, layout: exactly as passed to
            `attention` (same semantics, shapes, dtypes and strides).
        o, lse: what `attention(..., return_lse=True)` returned: the output (q's
            dtype and layout, shape (.., Dv)) and lse, (B, Hq, R) float32.
        do: the gradient of the loss with respect to o, shaped and typed like o.
            o and do may have any non-negative strides with a contiguous last axis.
        device: a Device, "cpu", "metal" or None for the default device.

    Returns:
        (dq, dk, dv), laid out like q, k and v (contiguous) in the inputs' dtype;
        with sinks, (dq, dk, dv, dsinks), dsinks being (Hq,) float32. With GQA, dk
        and dv sum the query heads that share each kv head. The mask gets no
        gradient. Rows with no allowed key contribute nothing. Accumulation runs
        in float32.

    Raises:
        TypeError, ValueError naming the argument that is wrong.
    """
    call = _BackwardCall.validate(q, k, v, o, lse, do, scale=scale, causal=causal, mask=mask, window=window,
                                  sinks=sinks, layout=layout)
    return call.run(resolve_device(device))


class _BackwardCall:
    """One validated backward call: the problem and the arrays to bind."""

    def __init__(self, problem: AttentionBackwardProblem, arrays: dict[str, np.ndarray]) -> None:
        self.problem = problem
        self.arrays = arrays

    @classmethod
    def validate(cls, q, k, v, o, lse, do, *, scale, causal, mask, window, sinks, layout) -> _BackwardCall:
        forward = _Call.validate(q, k, v, scale=scale, causal=causal, mask=mask, window=window, sinks=sinks,
                                 layout=layout, return_lse=False)
        p = forward.problem
        dtype = forward.arrays["q"].dtype
        shape = _physical(p.o_shape, layout)
        arrays = dict(forward.arrays)
        arrays["o"] = _like_output(o, "o", dtype, shape, layout)
        arrays["dout"] = _like_output(do, "do", dtype, shape, layout)
        arrays["lse"] = _lse(lse, (p.batch, p.q_heads, p.q_len))
        problem = AttentionBackwardProblem(p, o_strides=_logical(_element_strides(arrays["o"]), layout),
                                           dout_strides=_logical(_element_strides(arrays["dout"]), layout))
        return cls(problem, arrays)

    def run(self, device: Device) -> tuple[np.ndarray, ...]:
        p = self.problem.forward
        backward = codegen.attention_backward_pass(self.problem, family=_tuning_facts(device)[0])
        dtype = self.arrays["q"].dtype
        outputs = {"dq": (_physical(p.q_shape, p.layout), dtype), "dk": (_physical(p.k_shape, p.layout), dtype),
                   "dv": (_physical(p.v_shape, p.layout), dtype)}
        bound = _dispatch(backward, self.arrays, outputs, device)
        grads = (bound["dq"], bound["dk"], bound["dv"])
        if not p.sinks:
            return grads
        # The dQ kernel stores each row's -p_sink * D; the sum over batch and rows is dsinks.
        shares = bound["sink_grad"].reshape(p.batch, p.q_heads, p.q_len)
        return (*grads, shares.sum(axis=(0, 2), dtype=np.float64).astype(np.float32))


def _like_output(x, name: str, dtype: np.dtype, shape: tuple[int, ...], layout: str) -> np.ndarray:
    """o or do: attention's output shape and q's dtype."""
    x = _as_array(x, name)
    if x.dtype != dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but q has {dtype}; {name} must have q's dtype, "
                        "like attention's output")
    if x.shape != shape:
        axes = _axes(layout).replace("D", "Dv")
        raise ValueError(f"{name} must have attention's output shape ({axes}) = {shape}, got {x.shape}")
    return _bindable(x)


def _lse(lse, shape: tuple[int, int, int]) -> np.ndarray:
    lse = _as_array(lse, "lse")
    if lse.dtype != np.float32:
        raise TypeError(f"lse must be float32, as attention(..., return_lse=True) returns it, got {lse.dtype}")
    if lse.shape != shape:
        raise ValueError(f"lse must have shape (B, Hq, R) = {shape}, got {lse.shape}")
    return np.ascontiguousarray(lse)
