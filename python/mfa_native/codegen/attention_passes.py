"""The attention passes: problem -> pass description (runtime/passes.py).

Forward: the one-pass kernel, or, for decode shapes that would leave the device
idle, the split-KV partial kernel and the combine kernel. Backward: the dQ
kernel (which also stores D and the rows' shares of dsinks), the dK/dV kernel,
and with sinks the dsinks reduction. Inputs are declared with the strides the
kernels were compiled for; outputs are allocated contiguous in the problem's
layout.
"""

from __future__ import annotations

from ..runtime.passes import PassDescription
from .attention_backward import generate_dkdv, generate_dq, generate_dsinks
from .attention_combine import generate_combine
from .attention_forward import generate, generate_partial
from .descriptor import describe, describe_backward, sizes_of
from .passes import TensorSpec, build_pass
from .problem import AttentionBackwardProblem, AttentionProblem, physical
from .split import kv_split
from .tables import CPU_FAMILY

# Sequence lengths and batch/head counts are runtime values by default: a new
# length reuses the compiled kernel (measured in the README).
BAKE_LENGTHS = False


def _tensor(p: AttentionProblem, dtype: str, shape, strides=None) -> TensorSpec:
    """A (batch, head, sequence, feature) tensor in the problem's layout."""
    return TensorSpec(dtype, physical(shape, p.layout), None if strides is None else physical(strides, p.layout))


def _rows(p: AttentionProblem) -> tuple[int, int, int]:
    return (p.batch, p.q_heads, p.q_len)


def _forward_inputs(p: AttentionProblem) -> dict[str, TensorSpec]:
    inputs = {"q": _tensor(p, p.dtype, p.q_shape, p.q_strides), "k": _tensor(p, p.dtype, p.k_shape, p.k_strides),
              "v": _tensor(p, p.dtype, p.v_shape, p.v_strides)}
    if p.mask != "none":
        inputs["mask"] = TensorSpec(p.mask_dtype, p.mask_shape, p.mask_strides)  # (B, Hq, R, C) whatever the layout
    if p.sinks:
        inputs["sinks"] = TensorSpec("float32", (p.q_heads,), (1,))
    return inputs


def attention_pass(problem: AttentionProblem, *, family: str = CPU_FAMILY, bake_lengths: bool = BAKE_LENGTHS,
                   parallel_threadgroups: int | None = None) -> PassDescription:
    """The forward pass of `problem`: one kernel, or the split-KV pair for decode shapes that
    would leave a device running `parallel_threadgroups` threadgroups at once idle."""
    p = problem
    split = kv_split(p, family, parallel_threadgroups) if parallel_threadgroups else None
    d = describe(p, family=family, bake_lengths=bake_lengths, split=split)
    kernels = (generate(d),) if split is None else (generate_partial(d), generate_combine(d))
    outputs = {"o": _tensor(p, p.dtype, p.o_shape)}
    if p.return_lse:
        outputs["lse"] = TensorSpec("float32", _rows(p))
    return build_pass("attention", kernels, sizes=sizes_of(p, split), inputs=_forward_inputs(p), outputs=outputs)


def attention_backward_pass(problem: AttentionBackwardProblem, *, family: str = CPU_FAMILY,
                            bake_lengths: bool = BAKE_LENGTHS) -> PassDescription:
    """The backward pass of `problem`: dQ (which also stores D = rowsum(dO o O)), then dK/dV
    (which reads it), then with sinks the dsinks reduction."""
    p = problem.forward
    d = describe_backward(problem, family=family, bake_lengths=bake_lengths)
    kernels = (generate_dq(d), generate_dkdv(d)) + ((generate_dsinks(d),) if p.sinks else ())
    inputs = _forward_inputs(p)
    inputs["o"] = _tensor(p, p.dtype, p.o_shape, problem.o_strides)
    inputs["dout"] = _tensor(p, p.dtype, p.o_shape, problem.dout_strides)
    inputs["lse"] = TensorSpec("float32", _rows(p), (p.q_heads * p.q_len, p.q_len, 1))
    outputs = {"dq": _tensor(p, p.dtype, p.q_shape), "dk": _tensor(p, p.dtype, p.k_shape),
               "dv": _tensor(p, p.dtype, p.v_shape)}
    if p.sinks:
        outputs["dsinks"] = TensorSpec("float32", (p.q_heads,))
    return build_pass("attention_backward", kernels, sizes=sizes_of(p), inputs=inputs, outputs=outputs)
