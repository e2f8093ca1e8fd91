"""The int8 attention passes: Int8Problem -> pass description (runtime/passes.py).

`int8_attention_template` / `int8_attention_pass`: the quantizers (int8_quantize.py) and the attention kernel
(int8_forward.py), one pass: the int8 values, scales and means are intermediates, in device
memory only. `int8_quantizer_pass`: the same quantizer kernels with those buffers as the
outputs, so tests can check them against a numpy quantizer.
"""

from __future__ import annotations

from ...runtime.arrays import MSL_SCALARS
from ...runtime.passes import PassDescription
from ..attention.descriptor import sizes_of
from ...runtime.templates import PassTemplate, evaluate
from ..attention.passes import (BAKE_LENGTHS, B, Hq, R, call_sizes, common, forward_inputs, shapes, tensor_spec,
                                valid_for)
from ..kernel.passes import TensorSpec, build_template
from ..kernel.tables import CPU_FAMILY
from . import operands as int8_operands
from .forward import generate_int8
from .problem import Int8Problem, describe_int8
from .quantize import quantizer_kernels


def int8_attention_template(problem: Int8Problem, *, family: str = CPU_FAMILY,
                            bake_lengths: bool = BAKE_LENGTHS) -> PassTemplate:
    """The pass of int8 attention as a template (its sizes named, what bundle entries hold):
    quantizers, then the attention kernel."""
    p = problem.attention
    x = describe_int8(problem, family=family, bake_lengths=bake_lengths)
    outputs = {"o": tensor_spec(p)(p.dtype, shapes(p)["o"])}
    if p.return_lse:
        outputs["lse"] = TensorSpec("float32", (B, Hq, R))
    kernels = quantizer_kernels(x) + (generate_int8(x),)
    return _template("int8_attention", problem, x, kernels, forward_inputs(p, x.attention), outputs)


def int8_attention_pass(problem: Int8Problem, *, family: str = CPU_FAMILY,
                        bake_lengths: bool = BAKE_LENGTHS) -> PassDescription:
    """The pass of int8 attention for `problem`'s own sizes (int8_attention_template, evaluated)."""
    template = int8_attention_template(problem, family=family, bake_lengths=bake_lengths)
    return evaluate(template, call_sizes(problem.attention))


def int8_quantizer_pass(problem: Int8Problem, *, family: str = CPU_FAMILY) -> PassDescription:
    """The quantizer kernels of `problem` alone, every buffer they write an output
    (int8_operands' logical shapes, C-contiguous). Inputs: those of q, k and v they read
    (v only with pv="int8")."""
    p = problem.attention
    x = describe_int8(problem, family=family)
    kernels = quantizer_kernels(x)
    written = dict.fromkeys(o.name for k in kernels for o in k.plan.operands if o.writes)
    outputs = {name: TensorSpec(MSL_SCALARS[int8_operands.element_type(name)].name, int8_operands.shape(name, x))
               for name in written}
    read = {o.name for k in kernels for o in k.plan.operands if not o.writes}
    inputs = {name: spec for name, spec in forward_inputs(p, x.attention).items() if name in read}
    return evaluate(_template("int8_quantizers", problem, x, kernels, inputs, outputs), call_sizes(p))


def _template(name: str, problem: Int8Problem, x, kernels, inputs, outputs) -> PassTemplate:
    """The template of `kernels` (the dense family's sizes and guards; the int8 kernels' tiles
    depend on R as the dense ones do)."""
    p = problem.attention
    given, guards = common(p, x.attention, sizes_of(p))
    guards += x.attention.rows.guards(p, x.attention.family)
    return build_template(name, kernels, sizes=given, inputs=inputs, outputs=outputs, guards=guards,
                          valid_for={**valid_for(p, x.attention.family), "qk_scale": problem.qk_scale,
                                     "smooth_k": problem.smooth_k, "pv": problem.pv})
