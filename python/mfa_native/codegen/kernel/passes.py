"""From generated kernels to a pass template (runtime/templates.py): every buffer the
kernels bind, declared once, with its sizes kept symbolic.

A family's pass builder names the pass's inputs and outputs (dtype, shape and, for inputs,
the strides its kernels were compiled for, as Extents of the runtime sizes); everything
else follows from the kernels' launch plans: each operand the caller does not supply is an
intermediate (its extent is in the plan), or the runtime-size struct (a constant); which
kernels read and write a buffer follows from the const-ness of its MSL type (an input some
kernel writes is the caller's memory written in place: role "inout"). The builder
also names the sizes it derives and the guards its tile choices hold under.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ...runtime.arrays import MSL_SCALARS
from ...runtime.templates import BufferTemplate, KernelTemplate, PassTemplate
from .msl import extent
from .plan import GridAxis, Operand
from .sizes import SIZES_OPERAND, Extent
from .source import KernelSource

Axis = Extent | int


@dataclass(frozen=True)
class TensorSpec:
    """An input or output of a pass: dtype name, shape and (inputs) element strides, physical
    order; each axis an Extent of the runtime sizes (or an int)."""

    dtype: str
    shape: tuple[Axis, ...]
    strides: tuple[Axis, ...] | None = None


def expression(axis: Axis) -> str:
    """An Extent (or int) as a size expression."""
    return str(axis) if isinstance(axis, int) else extent(axis)


def grid_expression(axis: GridAxis) -> str:
    count = expression(axis.extent)
    return count if axis.per_threadgroup == 1 else f"cdiv({count}, {axis.per_threadgroup})"


def contiguous(shape: Sequence[Axis]) -> tuple[Extent, ...]:
    """The strides of a C-contiguous tensor of `shape`, as Extents."""
    strides, running = [], Extent(1)
    for axis in reversed(shape):
        strides.append(running)
        running = running.times(axis if isinstance(axis, Extent) else Extent(axis))
    return tuple(reversed(strides))


def build_template(name: str, kernels: Sequence[KernelSource], *, sizes: Sequence[str],
                   inputs: Mapping[str, TensorSpec], outputs: Mapping[str, TensorSpec],
                   derived: Sequence[tuple[str, str]] = (), guards: Sequence[str] = (),
                   valid_for: Mapping[str, object] | None = None) -> PassTemplate:
    """The template of `kernels` run in order; `sizes` are the runtime sizes a caller gives."""
    launches = tuple(KernelTemplate(k.plan.kernel_name, k.source, tuple(grid_expression(a) for a in k.plan.grid),
                                    (k.plan.threads_per_threadgroup, 1, 1), tuple(o.name for o in k.plan.operands))
                     for k in kernels)
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
            role = ("inout" if writers else "input") if buffer_name in inputs else "output"
            spec = inputs.get(buffer_name) or outputs[buffer_name]
            strides = tuple(map(expression, spec.strides)) if buffer_name in inputs else None
            buffers.append(BufferTemplate(buffer_name, role, spec.dtype, tuple(map(expression, spec.shape)),
                                          readers, writers, strides=strides))
        elif buffer_name == SIZES_OPERAND:
            fields = _one_value(buffer_name, [kernels[i].plan.sizes.fields for i, _ in used])
            buffers.append(BufferTemplate(buffer_name, "constant", "uint32", (str(len(fields)),), readers, writers,
                                          value=fields))
        else:
            if operand.extent is None:
                raise ValueError(f"pass {name!r}: {kernels[first_kernel].plan.kernel_name} operand {buffer_name!r} "
                                 "is neither an input, an output nor an intermediate with an extent")
            count = _one_value(buffer_name, [expression(o.extent) for _, o in used if o.extent is not None])
            buffers.append(BufferTemplate(buffer_name, "intermediate", _element_dtype(operand), (count,),
                                          readers, writers))
    missing = [n for n in (*inputs, *outputs) if n not in uses]
    if missing:
        raise ValueError(f"pass {name!r}: no kernel binds {missing}")
    return PassTemplate(name, tuple(sizes), tuple(derived), tuple(guards), tuple((valid_for or {}).items()),
                        launches, tuple(buffers))


def _element_dtype(operand: Operand) -> str:
    """The numpy dtype name of a `device T*` operand's elements."""
    element = operand.msl_type.replace("device", "").replace("const", "").replace("*", "").strip()
    return MSL_SCALARS[element].name


def _one_value(name: str, values: list):
    if any(v != values[0] for v in values):
        raise ValueError(f"the kernels of a pass disagree about buffer {name!r}: {values}")
    return values[0]
