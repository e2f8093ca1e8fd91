"""The operands int8 attention adds to the attention catalog (operands.py): the quantizers'
results, each defined once with its element type, what it holds and its shape.

In an int8 attention pass they are intermediates (device memory only); the quantizer pass
(int8_passes.int8_quantizer_pass) makes them outputs, to be checked. Every one is
C-contiguous in logical order, whatever the inputs' layout. Shapes name runtime sizes
(B, Hq, Hkv, R, C) and the head dimensions D and Dv, which are literals in the kernels.
"""

from __future__ import annotations

from ..kernel.layouts import OperandLayout
from ..kernel.plan import Operand
from ..kernel.sizes import Extent
from .problem import Int8Descriptor

# name -> (MSL element type, logical shape, what it holds)
_CATALOG = {
    "q_int8": ("char", ("B", "Hq", "R", "D"), "q as int8"),
    "q_scale": ("float", ("B", "Hq", "R"), "each query row's scale (the rows of a tile share it)"),
    "q_shift": ("float", ("B", "Hq", "R"), "q . mean(k): smooth_k's shift of the row's logits, before the scale"),
    "k_int8": ("char", ("B", "Hkv", "C", "D"), "k (minus its mean with smooth_k) as int8"),
    "k_attended": ("char", ("B", "Hkv", "C"), "1 when some query may attend the key, else 0 (attended.py)"),
    "k_scale": ("float", ("B", "Hkv", "C"), "each key row's scale (the rows of a tile share it)"),
    "k_mean": ("float", ("B", "Hkv", "D"), "mean of k over the attended keys, per channel (float32)"),
    "k_mean_low": ("float", ("B", "Hkv", "D"), "the mean less k_mean: with it, k's mean to float64's precision"),
    "v_int8": ("char", ("B", "Hkv", "C", "Dv"), "v minus its mean, as int8"),
    "v_scale": ("float", ("B", "Hkv", "Dv"), "v's scale per channel"),
    "v_mean": ("float", ("B", "Hkv", "Dv"), "mean of v over the attended keys, per channel"),
}

NAMES = tuple(_CATALOG)


def _features(x: Int8Descriptor) -> dict[str, int]:
    return {"D": x.attention.head_dim, "Dv": x.attention.value_dim}


def element_type(name: str) -> str:
    return _CATALOG[name][0]


def shape(name: str, x: Int8Descriptor) -> tuple[Extent, ...]:
    """The operand's logical shape: runtime sizes, and the head dims as literals."""
    features = _features(x)
    return tuple(Extent(features[axis]) if axis in features else Extent(1, (axis,)) for axis in _CATALOG[name][1])


def layout(name: str, x: Int8Descriptor) -> OperandLayout:
    """Strides (Extents) of a four-axis operand, C-contiguous in logical order."""
    axes = _CATALOG[name][1]
    features = _features(x)
    strides, dense = [], Extent(1)
    for axis in reversed(axes):
        strides.append(dense)
        dense = Extent(features[axis]).times(dense) if axis in features else Extent(1, (axis,)).times(dense)
    return OperandLayout(tuple(reversed(strides)))  # type: ignore[arg-type]


def _extent(name: str, x: Int8Descriptor) -> Extent:
    features = _features(x)
    extent = Extent(1)
    for axis in _CATALOG[name][1]:
        extent = extent.times(Extent(features[axis]) if axis in features else Extent(1, (axis,)))
    return extent


def _operand(name: str, x: Int8Descriptor, const: bool) -> Operand:
    element, _, purpose = _CATALOG[name]
    axes = ", ".join(_CATALOG[name][1])
    return Operand(name, f"device {'const ' if const else ''}{element}*", f"({axes}) {purpose}", _extent(name, x))


def reads(x: Int8Descriptor, *names: str) -> list[Operand]:
    return [_operand(n, x, True) for n in names]


def writes(x: Int8Descriptor, *names: str) -> list[Operand]:
    return [_operand(n, x, False) for n in names]
