"""From generated kernels to a pass description (runtime/passes.py): every buffer the
kernels bind, declared once.

A family's pass builder names the pass's inputs and outputs (dtype, shape and, for
inputs, strides); everything else follows from the kernels' launch plans: each
operand the caller does not supply is an intermediate (its extent is in the plan),
or the runtime-size struct (a constant); which kernels read and write a buffer
follows from the const-ness of its MSL type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..runtime.arrays import DTYPES, MSL_SCALARS, span_bytes
from ..runtime.passes import BufferDecl, KernelLaunch, PassDescription
from .kernel_source import KernelSource
from .plan import Operand
from .sizes import SIZES_OPERAND


@dataclass(frozen=True)
class TensorSpec:
    """An input or output of a pass: dtype name, shape and (inputs) element strides, physical order."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None


def build_pass(name: str, kernels: Sequence[KernelSource], *, sizes: Mapping[str, int],
               inputs: Mapping[str, TensorSpec], outputs: Mapping[str, TensorSpec]) -> PassDescription:
    """The description of `kernels` run in order with runtime `sizes`."""
    launches = tuple(KernelLaunch(entry=k.plan.kernel_name, source=k.source, threadgroups=k.plan.threadgroups(sizes),
                                  threads_per_threadgroup=(k.plan.threads_per_threadgroup, 1, 1),
                                  buffers=tuple(o.name for o in k.plan.operands)) for k in kernels)
    uses: dict[str, list[tuple[int, Operand]]] = {}
    for index, kernel in enumerate(kernels):
        for operand in kernel.plan.operands:
            uses.setdefault(operand.name, []).append((index, operand))
    buffers = []
    for buffer_name, used in uses.items():
        readers = tuple(i for i, o in used if not o.writes)
        writers = tuple(i for i, o in used if o.writes)
        first_kernel, operand = used[0]
        if buffer_name in inputs or buffer_name in outputs:
            role = "input" if buffer_name in inputs else "output"
            spec = inputs.get(buffer_name) or outputs[buffer_name]
            strides = spec.strides if role == "input" else _contiguous(spec.shape)
            nbytes = span_bytes(spec.shape, strides, DTYPES[spec.dtype].itemsize)
            buffers.append(BufferDecl(buffer_name, role, spec.dtype, spec.shape, nbytes, readers, writers,
                                      strides=spec.strides if role == "input" else None))
        elif buffer_name == SIZES_OPERAND:
            words = _one_value(buffer_name, [kernels[i].plan.sizes.words(sizes) for i, _ in used])
            buffers.append(BufferDecl(buffer_name, "constant", "uint32", (len(words),), 4 * len(words), readers,
                                      writers, value=words))
        else:
            if operand.extent is None:
                raise ValueError(f"pass {name!r}: {kernels[first_kernel].plan.kernel_name} operand {buffer_name!r} "
                                 "is neither an input, an output nor an intermediate with an extent")
            count = _one_value(buffer_name, [o.extent.value(sizes) for _, o in used if o.extent is not None])
            dtype = _element_dtype(operand)
            buffers.append(BufferDecl(buffer_name, "intermediate", dtype, (count,),
                                      count * DTYPES[dtype].itemsize, readers, writers))
    missing = [n for n in (*inputs, *outputs) if n not in uses]
    if missing:
        raise ValueError(f"pass {name!r}: no kernel binds {missing}")
    return PassDescription(name, launches, tuple(buffers))


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _element_dtype(operand: Operand) -> str:
    """The numpy dtype name of a `device T*` operand's elements."""
    element = operand.msl_type.replace("device", "").replace("const", "").replace("*", "").strip()
    return MSL_SCALARS[element].name


def _one_value(name: str, values: list):
    if any(v != values[0] for v in values):
        raise ValueError(f"the kernels of a pass disagree about buffer {name!r}: {values}")
    return values[0]
