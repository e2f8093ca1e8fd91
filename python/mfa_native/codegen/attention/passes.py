"""The attention passes: problem -> pass template (runtime/templates.py) -> pass description.

Forward: the one-pass kernel, or, for decode shapes that would leave the device idle, the
split-KV partial kernel and the combine kernel. Backward: the dQ kernel (which also stores
D and the rows' shares of dsinks), the dK/dV kernel, and with sinks the dsinks reduction.
The key facet adds its inputs and sizes and may bring kernels of its own (the sparse wing's
lists). Inputs are declared with the strides the kernels were compiled for; outputs are
allocated contiguous in the problem's layout.

A template keeps B, Hq, Hkv, R, C (and the key facet's sizes) symbolic; its guards say for
which of them its tiles were chosen, so one template serves every call they admit.
`attention_pass` evaluates the template for the problem's own sizes.
"""

from __future__ import annotations

from dataclasses import replace

from ...runtime.passes import PassDescription
from ...runtime.templates import PassTemplate, evaluate
from ..kernel.layouts import physical
from ..kernel.passes import TensorSpec, build_template, contiguous
from ..kernel.sizes import Extent
from ..kernel.tables import CPU_FAMILY
from ..storage.facet import STORAGES
from . import split as split_kv
from .backward import generate_dkdv, generate_dq
from .combine import generate_combine
from .descriptor import (SIZE_NAMES, VIEW_SIZE_NAMES, AttentionFacts, backward_sizes, describe, describe_backward,
                         sizes_of)
from .dsinks import generate_dsinks
from .forward import generate, generate_partial
from .problem import AttentionBackwardProblem, AttentionProblem
from .visits import KEY_VISITS

# Sequence lengths and batch/head counts are runtime values by default: a new
# length reuses the compiled kernel (measured in the README).
BAKE_LENGTHS = False
B, Hq, Hkv, R, C = (Extent(1, (name,)) for name in SIZE_NAMES)


def tensor_spec(p: AttentionProblem):
    """The TensorSpec maker of `p`'s pass buffers: spec(dtype, shape, strides=None) of a
    (batch, head, sequence, feature) tensor in the problem's layout, or with logical=False a
    tensor whose axes are already in memory order. Packed sequences (a key facet that is not
    `batched`) have no batch axis: it is left out."""
    drop = 0 if p.keys.batched else 1

    def spec(dtype: str, shape, strides=None, *, logical: bool = True) -> TensorSpec:
        if not logical:
            return TensorSpec(dtype, tuple(shape), None if strides is None else tuple(strides))
        return TensorSpec(dtype, physical(shape, p.layout)[drop:],
                          None if strides is None else physical(strides, p.layout)[drop:])

    return spec


def shapes(p: AttentionProblem) -> dict[str, tuple[Extent, ...]]:
    """The logical shapes of q, k, v and o, in runtime sizes and literal head dims."""
    D, Dv = Extent(p.head_dim), Extent(p.value_dim)
    return {"q": (B, Hq, R, D), "k": (B, Hkv, C, D), "v": (B, Hkv, C, Dv), "o": (B, Hq, R, Dv)}


def forward_inputs(p: AttentionProblem, d: AttentionFacts) -> dict[str, TensorSpec]:
    """q, k and v as stored, the mask, the sinks (the inputs every attention pass has), laid
    out as `d`'s kernels were compiled for."""
    spec, shape = tensor_spec(p), shapes(p)
    inputs = {"q": spec(p.dtype, shape["q"], d.q.strides),
              **d.k_storage.inputs("k", shape["k"], d.k, p.dtype, spec),
              **d.v_storage.inputs("v", shape["v"], d.v, p.dtype, spec)}
    if p.mask != "none":  # (B, Hq, R, C) whatever the layout
        inputs["mask"] = TensorSpec(p.mask_dtype, (B, Hq, R, C), d.rules.mask_layout.strides)
    if p.sinks:
        inputs["sinks"] = TensorSpec("float32", (Hq,), (Extent(1),))
    for transform in p.scores:
        inputs.update(transform.inputs(spec, d.keys.batches))
    return inputs


def rows_spec(p: AttentionProblem, strides: bool = True) -> TensorSpec:
    """lse and the like: (B, Hq, R) float32, contiguous ((Hq, R) for packed sequences); an
    input's with its strides."""
    shape = (B, Hq, R) if p.keys.batched else (Hq, R)
    return TensorSpec("float32", shape, contiguous(shape) if strides else None)


def valid_for(p: AttentionProblem, family: str) -> dict[str, object]:
    """The facts a template of `p` was generated for (its kernels bake them)."""
    return dict(dtype=p.dtype, layout=p.layout, head_dim=p.head_dim, value_dim=p.value_dim, gqa_ratio=p.gqa_ratio,
                causal=p.causal, window="runtime" if p.runtime_window else None if p.window is None else list(p.window),
                mask=p.mask, mask_dtype=p.mask_dtype, sinks=p.sinks,
                scale="runtime" if p.runtime_scale else p.softmax_scale, return_lse=p.return_lse,
                scores=[t.describe() for t in p.scores],
                keys=KEY_VISITS.name_of(p.keys), k_storage=STORAGES.name_of(p.k_storage),
                v_storage=STORAGES.name_of(p.v_storage), family=family,
                **({"deterministic": "batch_invariant"} if p.batch_invariant else {}),
                **({"strides": "runtime"} if p.runtime_strides else {}))


def common(p: AttentionProblem, d: AttentionFacts, sizes: dict[str, int]) -> tuple[list[str], list[str]]:
    """The sizes a caller gives (the lengths and counts, the key facet's, the runtime window's
    sides and strides) and the guards every attention template has: the GQA ratio its kernels
    bake, and with baked lengths the lengths themselves."""
    given = [name for name in sizes if name in SIZE_NAMES or name in d.keys.sizes_given or name in VIEW_SIZE_NAMES]
    guards = [f"Hq == {p.gqa_ratio} * Hkv"]
    if d.sizes.baked is not None:
        guards += [f"{name} == {value}" for name, value in d.sizes.baked]
    return given, guards


def attention_template(problem: AttentionProblem, *, family: str = CPU_FAMILY, bake_lengths: bool = BAKE_LENGTHS,
                       parallel_threadgroups: int | None = None) -> PassTemplate:
    """The forward pass of `problem` as a template: one kernel, or the split-KV pair for decode
    shapes that would leave a device running `parallel_threadgroups` threadgroups at once
    idle (the template then takes that count as size P and decides by it)."""
    p = replace(problem, keys=problem.keys.forward_only())
    decides = bool(parallel_threadgroups) and p.keys.split_length is not None
    split = split_kv.kv_split(p, family, parallel_threadgroups) if decides else None
    sizes = sizes_of(p, split)
    d = describe(p, family=family, bake_lengths=bake_lengths, split=split)
    kernels = d.keys.forward_kernels(
        d, lambda: (generate(d),) if split is None else (generate_partial(d), generate_combine(d)))
    outputs = {"o": tensor_spec(p)(p.dtype, shapes(p)["o"])}
    if p.return_lse:
        outputs["lse"] = rows_spec(p, strides=False)
    given, guards = common(p, d, sizes)
    derived = list(d.keys.derived)
    guards += d.rows.guards(p, family)
    if decides:
        given.append(split_kv.DEVICE_SIZE)
        derived += split_kv.derived(p, family)
        guards.append("SPLIT" if split else "!SPLIT")
    inputs = {d.keys.rebinds.get(name, name): spec
              for name, spec in {**forward_inputs(p, d), **d.keys.inputs(tensor_spec(p))}.items()}
    return build_template("attention", kernels, sizes=given, inputs=inputs, outputs=outputs, derived=derived,
                          guards=guards, valid_for=valid_for(p, family))


def call_sizes(problem: AttentionProblem, parallel_threadgroups: int | None = None) -> dict[str, int]:
    """The runtime sizes of a call of `problem` (what a template's `sizes` name)."""
    sizes = sizes_of(problem)
    if parallel_threadgroups:
        sizes[split_kv.DEVICE_SIZE] = parallel_threadgroups
    return sizes


def attention_pass(problem: AttentionProblem, *, family: str = CPU_FAMILY, bake_lengths: bool = BAKE_LENGTHS,
                   parallel_threadgroups: int | None = None) -> PassDescription:
    """The forward pass of `problem` (attention_template, evaluated for its sizes)."""
    template = attention_template(problem, family=family, bake_lengths=bake_lengths,
                                  parallel_threadgroups=parallel_threadgroups)
    return evaluate(template, call_sizes(problem, parallel_threadgroups))


def attention_backward_template(problem: AttentionBackwardProblem, *, family: str = CPU_FAMILY,
                                bake_lengths: bool = BAKE_LENGTHS) -> PassTemplate:
    """The backward pass of `problem` as a template: dQ (which also stores D = rowsum(dO o O)),
    then dK/dV (which reads it), then with sinks the dsinks reduction."""
    p = problem.forward
    spec, shape = tensor_spec(p), shapes(p)
    d = describe_backward(problem, family=family, bake_lengths=bake_lengths)
    kernels = d.keys.backward_kernels(d, lambda: (generate_dq(d), generate_dkdv(d)))
    kernels += (generate_dsinks(d),) if p.sinks else ()
    inputs = {**forward_inputs(p, d), **d.keys.backward_inputs(spec)}
    inputs["o"] = spec(p.dtype, shape["o"], d.o.strides)
    inputs["dout"] = spec(p.dtype, shape["o"], d.dout.strides)
    inputs["lse"] = rows_spec(p)
    outputs = {"dq": spec(p.dtype, shape["q"]), "dk": spec(p.dtype, shape["k"]), "dv": spec(p.dtype, shape["v"])}
    if p.sinks:
        outputs["dsinks"] = TensorSpec("float32", (Hq,))
    outputs.update(d.keys.backward_outputs(spec))
    given, guards = common(p, d, backward_sizes(problem))
    return build_template("attention_backward", kernels, sizes=given, inputs=inputs, outputs=outputs,
                          derived=d.keys.derived, guards=guards + list(p.rows.backward_guards(p, family)),
                          valid_for=valid_for(p, family))


def attention_backward_pass(problem: AttentionBackwardProblem, *, family: str = CPU_FAMILY,
                            bake_lengths: bool = BAKE_LENGTHS) -> PassDescription:
    """The backward pass of `problem` (attention_backward_template, evaluated for its sizes)."""
    template = attention_backward_template(problem, family=family, bake_lengths=bake_lengths)
    return evaluate(template, backward_sizes(problem))
