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
from dataclasses import replace

from .attention_backward import generate_dkdv, generate_dq, generate_dsinks
from .block_lists import generate_classify, generate_kv_lists, generate_q_lists, generate_transpose
from .attention_combine import generate_combine
from .attention_forward import generate, generate_partial
from . import sparse_backward
from .sparse_forward import generate_sparse
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


def _kv_inputs(p: AttentionProblem, name: str, shape, strides, storage) -> dict[str, TensorSpec]:
    """k or v: a tensor of the problem's dtype, or a quantized tensor's fields."""
    if storage is None:
        return {name: _tensor(p, p.dtype, shape, strides)}
    f, rows = storage.format, shape[:3]
    inputs = {name: _tensor(p, f.data_dtype, (*rows, f.data_width(shape[3])), storage.data_strides)}
    if f.affine:
        for field, strides in (("scales", storage.scale_strides), ("biases", storage.bias_strides)):
            inputs[f"{name}_{field}"] = _tensor(p, storage.scale_dtype, (*rows, f.groups(shape[3])), strides)
    return inputs


def _forward_inputs(p: AttentionProblem) -> dict[str, TensorSpec]:
    inputs = {"q": _tensor(p, p.dtype, p.q_shape, p.q_strides),
              **_kv_inputs(p, "k", p.k_shape, p.k_strides, p.k_quant),
              **_kv_inputs(p, "v", p.v_shape, p.v_strides, p.v_quant)}
    if p.mask != "none":
        inputs["mask"] = TensorSpec(p.mask_dtype, p.mask_shape, p.mask_strides)  # (B, Hq, R, C) whatever the layout
    if p.sinks:
        inputs["sinks"] = TensorSpec("float32", (p.q_heads,), (1,))
    if p.tokens is not None:
        shape = (p.batch, p.kv_heads, p.q_len, p.tokens.topk)
        inputs["indices"] = _tensor(p, "int32", shape, p.tokens.index_strides)
        if p.tokens.length_strides is not None:
            inputs["topk_length"] = TensorSpec("int32", (p.batch, p.q_len), p.tokens.length_strides)
    if p.blocks is not None:
        inputs.update(_lists(p, "kv", "q_len", "q_block", p.blocks.width))
        if p.blocks.full:
            inputs.update(_lists(p, "full_kv", "q_len", "q_block", p.blocks.full_width))
    return inputs


def _lists(p: AttentionProblem, prefix: str, length: str, block: str, width: int) -> dict[str, TensorSpec]:
    """A BlockMask's (num_blocks, indices) pair: int32, C-contiguous, (B|1, H|1, blocks[, width])."""
    lists = p.blocks
    axes = (1 if lists.batch_broadcast else p.batch, 1 if lists.head_broadcast else p.q_heads,
            -(-getattr(p, length) // getattr(lists, block)))
    num, indices = axes, (*axes, width)
    return {f"{prefix}_num_blocks": TensorSpec("int32", num, _dense(num)),
            f"{prefix}_indices": TensorSpec("int32", indices, _dense(indices))}


def _dense(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for n in reversed(shape):
        strides.append(running)
        running *= n
    return tuple(reversed(strides))


def attention_pass(problem: AttentionProblem, *, family: str = CPU_FAMILY, bake_lengths: bool = BAKE_LENGTHS,
                   parallel_threadgroups: int | None = None) -> PassDescription:
    """The forward pass of `problem`: one kernel, or the split-KV pair for decode shapes that
    would leave a device running `parallel_threadgroups` threadgroups at once idle."""
    p = problem
    if p.blocks is not None:  # the forward walks the kv lists only
        p = replace(p, blocks=replace(p.blocks, q_width=None, full_q_width=None))
    dense = p.blocks is None and p.tokens is None
    split = kv_split(p, family, parallel_threadgroups) if parallel_threadgroups and dense else None
    d = describe(p, family=family, bake_lengths=bake_lengths, split=split)
    if p.tokens is not None:
        kernels = (generate_sparse(d),)
    else:
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
    dsinks = (generate_dsinks(d),) if p.sinks else ()
    if p.tokens is not None:
        kernels = (sparse_backward.generate_transpose(d), sparse_backward.generate_dq(d),
                   sparse_backward.generate_dkdv(d)) + dsinks
    else:
        transpose = (generate_transpose(d),) if p.blocks is not None and not p.blocks.transposed_given else ()
        kernels = transpose + (generate_dq(d), generate_dkdv(d)) + dsinks
    inputs = _forward_inputs(p)
    if p.blocks is not None and p.blocks.transposed_given:
        inputs.update(_lists(p, "q", "kv_len", "k_block", p.blocks.q_width))
        if p.blocks.full:
            inputs.update(_lists(p, "full_q", "kv_len", "k_block", p.blocks.full_q_width))
    inputs["o"] = _tensor(p, p.dtype, p.o_shape, problem.o_strides)
    inputs["dout"] = _tensor(p, p.dtype, p.o_shape, problem.dout_strides)
    inputs["lse"] = TensorSpec("float32", _rows(p), (p.q_heads * p.q_len, p.q_len, 1))
    outputs = {"dq": _tensor(p, p.dtype, p.q_shape), "dk": _tensor(p, p.dtype, p.k_shape),
               "dv": _tensor(p, p.dtype, p.v_shape)}
    if p.sinks:
        outputs["dsinks"] = TensorSpec("float32", (p.q_heads,))
    return build_pass("attention_backward", kernels, sizes=sizes_of(p), inputs=inputs, outputs=outputs)


def block_mask_pass(problem: AttentionProblem, *, family: str = CPU_FAMILY) -> PassDescription:
    """BlockMask.from_mask on the device: the problem's masking rules (causal, window, mask),
    its block sizes (problem.blocks), its batch and query heads; q, k and v play no part.
    Outputs the eight lists of a BlockMask, in FlexAttention's order."""
    p = problem
    d = describe(p, family=family)
    rows, cols = -(-p.q_len // p.blocks.q_block), -(-p.kv_len // p.blocks.k_block)
    inputs = {"mask": TensorSpec(p.mask_dtype, p.mask_shape, p.mask_strides)} if p.mask != "none" else {}
    outputs = {}
    for prefix, blocks, width in (("kv", rows, cols), ("q", cols, rows)):
        for full in ("", "full_"):
            outputs[f"{full}{prefix}_num_blocks"] = TensorSpec("int32", (p.batch, p.q_heads, blocks))
            outputs[f"{full}{prefix}_indices"] = TensorSpec("int32", (p.batch, p.q_heads, blocks, width))
    kernels = (generate_classify(d), generate_kv_lists(d), generate_q_lists(d))
    return build_pass("block_mask_from_mask", kernels, sizes=sizes_of(p), inputs=inputs, outputs=outputs)
