"""The int8 attention passes: Int8Problem -> pass description (runtime/passes.py).

`int8_attention_pass`: the quantizers (int8_quantize.py) and the attention kernel
(int8_forward.py), one pass: the int8 values, scales and means are intermediates, in device
memory only. `int8_quantizer_pass`: the same quantizer kernels with those buffers as the
outputs, so tests can check them against a numpy quantizer.
"""

from __future__ import annotations

from ..runtime.arrays import MSL_SCALARS
from ..runtime.passes import PassDescription
from . import int8_operands
from .attention_passes import BAKE_LENGTHS, _forward_inputs, _tensor
from .descriptor import sizes_of
from .int8_forward import generate_int8
from .int8_problem import Int8Problem, describe_int8
from .int8_quantize import quantizer_kernels
from .passes import TensorSpec, build_pass
from .tables import CPU_FAMILY


def int8_attention_pass(problem: Int8Problem, *, family: str = CPU_FAMILY,
                        bake_lengths: bool = BAKE_LENGTHS) -> PassDescription:
    """The pass of int8 attention: quantizers, then the attention kernel."""
    p = problem.attention
    x = describe_int8(problem, family=family, bake_lengths=bake_lengths)
    outputs = {"o": _tensor(p, p.dtype, p.o_shape)}
    if p.return_lse:
        outputs["lse"] = TensorSpec("float32", (p.batch, p.q_heads, p.q_len))
    kernels = quantizer_kernels(x) + (generate_int8(x),)
    return build_pass("int8_attention", kernels, sizes=sizes_of(p), inputs=_forward_inputs(p), outputs=outputs)


def int8_quantizer_pass(problem: Int8Problem, *, family: str = CPU_FAMILY) -> PassDescription:
    """The quantizer kernels of `problem` alone, every buffer they write an output
    (int8_operands' logical shapes, C-contiguous). Inputs: those of q, k and v they read
    (v only with pv="int8")."""
    p = problem.attention
    x = describe_int8(problem, family=family)
    kernels = quantizer_kernels(x)
    sizes = sizes_of(p)
    written = dict.fromkeys(o.name for k in kernels for o in k.plan.operands if o.writes)
    outputs = {name: TensorSpec(MSL_SCALARS[int8_operands.element_type(name)].name,
                                int8_operands.shape(name, x, sizes)) for name in written}
    read = {o.name for k in kernels for o in k.plan.operands if not o.writes}
    inputs = {name: spec for name, spec in _forward_inputs(p).items() if name in read}
    return build_pass("int8_quantizers", kernels, sizes=sizes, inputs=inputs, outputs=outputs)
