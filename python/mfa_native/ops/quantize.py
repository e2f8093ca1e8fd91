"""`mfa_native.quantize`: a float tensor quantized along its last axis, on the device."""

from __future__ import annotations

import numbers

import numpy as np

from ..codegen.storage import quantize as codegen
from ..quant_formats import FORMATS, QuantFormat
from ..quantized import QuantizedTensor
from ..runtime.frameworks import framework_of
from ..runtime.arrays import DTYPES
from ..runtime.devices import Device
from . import arguments as check
from .attention_rules import FLOATS
from .declaration import Arg, Call, Op, Out
from .empty import empty_call, filled
from .rules import LEADING, ArrayRule, Binding, Checks, Require
from .warm import Checked, PreparedCall, prepared_call

MAX_GROUPS = 2**32 - 1   # the kernel's one runtime size, a 32-bit word
# The sizes and texts the format gives (quant_format): group_size, group_width (data's
# elements per group: uint32 words, or a GGUF block's bytes), groups (x's elements / group_size);
# format (its description) and data_dtype.
_LAST_AXIS = "x's last axis must be a positive multiple of group_size ({group_size}) for {format}, got shape {x.shape}"
X_RULE = ArrayRule(dtypes=FLOATS, shapes=((LEADING, "D"),), binds=True, reads="contiguous",
                   dtype_error="x must be float32, float16 or bfloat16 (ml_dtypes), got {x.dtype}",
                   rank_error=_LAST_AXIS)
CHECKS = Checks(
    requires=(Require("D > 0 && D % group_size == 0", _LAST_AXIS),
              Require(f"groups <= {MAX_GROUPS}", f"x has {{groups}} groups; at most {MAX_GROUPS} fit one call")),
    layouts={"none": ()})   # no array has a layout


def _field(name: str, width: str, dtype: str | None = None) -> ArrayRule:
    """A field a C++ caller gives (Python returns new ones): x's leading axes and `width` per
    row, `dtype` (a template: the format's) or, None, x's; contiguous."""
    message = (f"{name} must be {dtype or '{x.dtype}'} {{{name}.expected}} for {{format}}, got {{{name}.dtype}} "
               f"{{{name}.shape}}")
    return ArrayRule(dtypes=(dtype,) if dtype else (), dtype_of=None if dtype else "x", shapes=((LEADING, width),),
                     written=True, reads="contiguous", dtype_error=message, shape_error=message)


def quant_format(format, bits, group_size) -> QuantFormat:
    """The format the arguments name (each checked for its type, then QuantFormat its value)."""
    if not isinstance(format, str):
        raise TypeError(f"format must be a str (one of {FORMATS}), got {type(format).__name__}")
    for name, value in (("bits", bits), ("group_size", group_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    return QuantFormat.of(format, None if bits is None else int(bits),
                          None if group_size is None else int(group_size))


def _binding(f: QuantFormat, elements: int) -> Binding:
    """The binding quantize's checks run in for format `f` and an x of `elements` values: the
    sizes and texts the format gives (see CHECKS)."""
    sizes = {"group_size": f.group_size, "group_width": f.data_width(f.group_size), "groups": elements // f.group_size}
    return Binding({"x": X_RULE}, CHECKS, "none", sizes, {"format": f.describe(), "data_dtype": f.data_dtype})


def _prepare(call: Call, device: Device) -> tuple[PreparedCall, list[np.ndarray]]:
    f = quant_format(call.format, call.bits, call.group_size)
    array = check.as_array(call.x, "x")
    _binding(f, array.size).bind({"x": (array.shape, str(array.dtype))})
    dtype = check.dtype_of(array, "x")
    contiguous = array.flags.c_contiguous
    checked = Checked(bound={"x": array if contiguous else np.ascontiguousarray(array)},
                      converts={"x": None if contiguous else np.ascontiguousarray})
    results = ("data", "scales", "biases") if f.affine else ("data",)
    descriptor = codegen.QuantizeDescriptor(dtype, f)
    if array.size == 0:
        return empty_call([], call.op.array_names, checked, lambda inputs: _no_rows(descriptor, array.shape, results))
    return prepared_call(codegen.quantize_pass(descriptor, array.shape), device, checked, call.op.array_names,
                         results)


def _no_rows(d: codegen.QuantizeDescriptor, shape: tuple[int, ...], results) -> list[np.ndarray]:
    """The fields of an x with no rows: allocated, empty."""
    f, rows = d.format, shape[:-1]
    widths = {"data": (f.data_dtype, f.data_width(shape[-1])), "scales": (d.dtype, f.groups(shape[-1])),
              "biases": (d.dtype, f.groups(shape[-1]))}
    return [filled((*rows, widths[name][1]), DTYPES[widths[name][0]], 0) for name in results]


def _tensor(fields: tuple, call: Call) -> QuantizedTensor:
    """The QuantizedTensor of a call's output fields (numpy or the caller's framework)."""
    f = quant_format(call.format, call.bits, call.group_size)
    data, scales, biases = fields if f.affine else (fields[0], None, None)
    framework = framework_of(call.x)   # call.x as given: numpy, torch or MLX
    x = call.x if framework is None else framework.as_numpy(call.x, "x")
    tensor = QuantizedTensor(data, scales, biases, format=f.name, bits=f.bits, group_size=f.group_size, dtype=x.dtype)
    return tensor if framework is None else tensor.quantized_from(call.x, call.op.no_backward)


QUANTIZE = Op(
    "quantize",
    "x quantized along its last axis, by a generated kernel, as MLX's or GGUF's quantizer does.",
    arguments=(
        Arg("x", "array", leading=True, keyword=False, rule=X_RULE, doc="""
            float32, float16 or bfloat16, any shape (B, H, C, D) or otherwise: every leading
            axis is a row axis; the last (D) must be a positive multiple of group_size. A
            numpy array, a torch tensor or an MLX array; any strides (a strided x is copied
            contiguous first)."""),
        Arg("format", "option", default="affine", keyword=False,
            doc='"affine" (MLX\'s `mx.quantize` layout), or GGUF\'s blocks: "q8_0", "q4_0", "q4_1", '
                '"q5_0" or "q5_1".'),
        Arg("bits", "option", default=None, keyword=False,
            doc="affine: 2, 3, 4, 5, 6 or 8 (None: 8). GGUF: None, or the format's own (8, 4)."),
        Arg("group_size", "option", default=None, keyword=False,
            doc="affine: 32, 64 or 128 values per scale and bias (None: 64). GGUF: None or 32."),
    ),
    outputs=(Out("data", "the quantized values", rule=_field("data", "D / group_size * group_width", "{data_dtype}")),
             Out("scales", "affine scales", rule=_field("scales", "D / group_size")),
             Out("biases", "affine biases", rule=_field("biases", "D / group_size"))),
    prepare=_prepare,
    checks=CHECKS,
    wrap=_tensor,
    on_metal="quantize reads CPU tensors (a QuantizedTensor holds host-visible arrays)",
    no_backward="quantize rounds to integers: it has no gradient",
    details="""
    The integers are what `mx.quantize` (MLX's CPU quantizer) and the `gguf` package
    (ggml's reference quantizers) give for the same input (they may differ by 1 where
    their float32 arithmetic sits exactly on a rounding boundary); scales and biases are
    theirs, rounded to their dtype. Everything is computed in float32. The result can be
    passed as k or v to `attention` and `attention_with_kvcache`, which read it quantized.

    Non-finite input: a group holding NaN or +-inf gets a NaN scale (affine: scale and bias)
    and integers 0, so it dequantizes to NaN; the other groups are unaffected.
    """,
    returns="""
    A QuantizedTensor of x's shape and dtype whose data, scales and biases are numpy
    arrays for a numpy x, torch tensors (on x's device) for torch, MLX arrays for MLX:
    affine: data uint32 (..., D * bits / 32), scales and biases (..., D / group_size) in
    x's dtype; GGUF: data uint8 (..., D / 32 * 34 or 18), scales and biases None.
    """,
    raises="""
    TypeError: x is not a float array (float32, float16, bfloat16); bits or group_size is
        not an int; format is not a str.
    ValueError: an unknown format, bits or group_size for the format, or a last axis that
        is no positive multiple of the group size.
    """,
    example="""
    import numpy as np
    import mfa_native

    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 2, 16, 32), dtype=np.float32)
    kq = mfa_native.quantize(k, "affine", bits=8, group_size=32, device="cpu")
    print(kq)   # QuantizedTensor(shape=(1, 2, 16, 32), dtype=float32, format='affine 8-bit, groups of 32')
    print(kq.data.dtype, kq.data.shape, kq.scales.shape)   # uint32 (1, 2, 16, 8) (1, 2, 16, 1)
    step = np.abs(np.repeat(kq.scales, 32, axis=-1))   # each group's quantization step
    assert np.all(np.abs(kq.dequantize() - k) <= step)
    """)
quantize = QUANTIZE.function
