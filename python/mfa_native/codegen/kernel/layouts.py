"""Tensor layouts: logical axes, memory order, and strides as Extents.

Attention's tensors are four-axis, in the logical order (batch, head, sequence,
feature) whatever their memory layout ("bhsd" or "bshd"). A kernel depends on
strides only as `OperandLayout`s: a stride equal to the dense stride of its
operand (the product of the inner axes' sizes) is kept symbolic, e.g. `R * 64`,
so a contiguous tensor of another length reuses the kernel; any other stride is
a literal. Or every stride is a runtime size (`runtime_layout`): then one kernel serves every
view whose innermost axis is unit, as a bundle's kernels must.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sizes import Extent

Strides = tuple[int, int, int, int]


def memory_order(layout: str) -> tuple[int, int, int, int]:
    """Logical axes (0 batch, 1 head, 2 sequence, 3 feature) from outermost to innermost in memory."""
    return (0, 1, 2, 3) if layout == "bhsd" else (0, 2, 1, 3)


def physical(values: tuple, layout: str) -> tuple:
    """Logical (batch, head, sequence, feature) order -> memory order of `layout`, and back
    (the swap is its own inverse)."""
    return tuple(values) if layout == "bhsd" else (values[0], values[2], values[1], values[3])


def contiguous_strides(layout: str, shape: tuple[int, int, int, int]) -> Strides:
    """Strides (elements, logical axis order) of a C-contiguous tensor of logical `shape` in `layout`."""
    strides = [0, 0, 0, 0]
    running = 1
    for axis in reversed(memory_order(layout)):
        strides[axis] = running
        running *= shape[axis]
    return tuple(strides)  # type: ignore[return-value]


@dataclass(frozen=True)
class OperandLayout:
    """Strides (as Extents) of one tensor operand, in logical axis order."""

    strides: tuple[Extent, Extent, Extent, Extent]


def operand_layout(shape, sizes, strides, order, baked: dict[str, int] | None) -> OperandLayout:
    """Symbolic strides: dense ones as products of the inner sizes, others as literals.

    `shape` are the actual sizes, `sizes` their Extents (runtime names or literals),
    `strides` the actual strides, all in logical order; `order` lists the logical
    axes from outermost to innermost in memory; `baked` sizes become literals.
    """
    result: list[Extent] = [Extent(0)] * 4
    dense = Extent(1)
    for axis in reversed(order):
        stride = strides[axis]
        if shape[axis] == 1 or (stride != 0 and stride == dense.value(_actual_sizes(shape, sizes))):
            result[axis] = dense        # dense (or irrelevant: a single index)
        else:
            result[axis] = Extent(stride)
        if stride != 0 or shape[axis] == 1:
            dense = sizes[axis].times(result[axis])
    if baked is not None:
        result = [e.bake(baked) for e in result]
    return OperandLayout(tuple(result))  # type: ignore[arg-type]


def stride_names(operand: str, axes: tuple[str, ...] = ("batch", "head", "row")) -> tuple[str, ...]:
    """The runtime sizes holding `operand`'s strides (elements) on `axes`, outermost first."""
    return tuple(f"{operand}_{axis}_stride" for axis in axes)


def runtime_layout(names: tuple[str, ...], baked: dict[str, int] | None) -> OperandLayout:
    """Strides read from the runtime sizes `names` (logical order); with three names the
    feature axis is unit. `baked` sizes become literals."""
    strides = [Extent(1, (name,)) for name in names] + [Extent(1)] * (4 - len(names))
    if baked is not None:
        strides = [e.bake(baked) for e in strides]
    return OperandLayout(tuple(strides))  # type: ignore[arg-type]


def _actual_sizes(shape, sizes) -> dict[str, int]:
    """Runtime size names -> values, read off an operand's shape and its size Extents."""
    return {e.sizes[0]: n for n, e in zip(shape, sizes) if e.sizes}


def pairs_align(layout: OperandLayout, width: int, first_aligned: bool) -> bool:
    """Whether every lane's two adjacent elements (features c, c + 1 of a row, c even) of an
    operand are one aligned vector: its first element aligned to two elements, a unit feature
    stride, even strides on the other axes (for every runtime size: even factors) and an even
    width (no pair straddles the last feature)."""
    return (first_aligned and width % 2 == 0 and layout.strides[3] == Extent(1)
            and all(stride.factor % 2 == 0 for stride in layout.strides[:3]))
