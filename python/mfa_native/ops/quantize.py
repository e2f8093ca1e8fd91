"""`mfa_native.quantize`: a float tensor quantized along its last axis, on the device."""

from __future__ import annotations

import numbers

import numpy as np

from ..codegen.storage import quantize as codegen
from ..quant_formats import FORMATS, QuantFormat
from ..quantized import QuantizedTensor
from ..runtime import runner
from ..runtime.arrays import DTYPES
from ..runtime.devices import Device, resolve_device
from ..runtime.frameworks import FrameworkCall, framework_of
from . import arguments as check
from .warm import Checked, PreparedCall, SignatureCache, pick, prepared_call, run, signature

ARGUMENTS = ("x",)
MAX_GROUPS = 2**32 - 1   # the kernel's one runtime size, a 32-bit word
_calls = SignatureCache()


def quantize(x, format: str = "affine", bits: int | None = None, group_size: int | None = None, *,
             device: Device | str | None = None) -> QuantizedTensor:
    """x quantized along its last axis, by a generated kernel, as MLX's or GGUF's quantizer does.

    Args:
        x: float32, float16 or bfloat16, any shape (B, H, C, D) or otherwise: every leading
            axis is a row axis; the last (D) must be a positive multiple of group_size. A
            numpy array, a torch tensor or an MLX array; any strides (a strided x is copied
            contiguous first).
        format: "affine" (MLX's `mx.quantize` layout), "q8_0" or "q4_0" (GGUF's blocks).
        bits: affine: 2, 3, 4, 5, 6 or 8 (None: 8). GGUF: None, or the format's own (8, 4).
        group_size: affine: 32, 64 or 128 values per scale and bias (None: 64). GGUF: None or 32.
        device: where the kernel runs (None: the default device).

    Returns:
        A QuantizedTensor of x's shape and dtype whose data, scales and biases are numpy
        arrays for a numpy x, torch tensors (on x's device) for torch, MLX arrays for MLX:
        affine: data uint32 (..., D * bits / 32), scales and biases (..., D / group_size)
        in x's dtype; GGUF: data uint8 (..., D / 32 * 34 or 18), scales and biases None.

    The integers are what `mx.quantize` (MLX's CPU quantizer) and the `gguf` package
    (ggml's reference quantizers) give for the same input (they may differ by 1 where
    their float32 arithmetic sits exactly on a rounding boundary); scales and biases are
    theirs, rounded to their dtype. Everything is computed in float32.

    Non-finite input: a group holding NaN or +-inf gets a NaN scale (affine: scale and bias)
    and integers 0, so it dequantizes to NaN; the other groups are unaffected.

    Raises:
        TypeError: x is not a float array; bits or group_size is not an int; format not a str.
        ValueError: an unknown format, bits or group_size for the format, or a last axis
            that is no positive multiple of the group size.
    """
    framework = framework_of(x)
    if framework is None:
        x = check.as_array(x, "x")
        return _tensor(_quantize(x, format, bits, group_size, device), x.dtype, format, bits, group_size)
    if framework.on_metal(x):
        raise TypeError(f"x is a torch tensor on {x.device}: quantize reads CPU tensors (a QuantizedTensor "
                        "holds host-visible arrays)")
    call = FrameworkCall(framework, like=x)
    x = call.view(x, "x")
    with runner.caller_arrays(call):
        fields = _quantize(x, format, bits, group_size, device)
    return _tensor(call.natives(fields), x.dtype, format, bits, group_size)


def _tensor(fields: tuple, dtype: np.dtype, format, bits, group_size) -> QuantizedTensor:
    """The QuantizedTensor of a call's output fields (numpy or the caller's framework)."""
    f = quant_format(format, bits, group_size)
    data, scales, biases = fields if f.affine else (fields[0], None, None)
    return QuantizedTensor(data, scales, biases, format=f.name, bits=f.bits, group_size=f.group_size, dtype=dtype)


def _quantize(x, format, bits, group_size, device) -> tuple:
    """(data,) or (data, scales, biases) for a numpy x (or a framework's view of one)."""
    device = resolve_device(device)
    key = signature((x,), (format, bits, group_size), device)

    def prepare():
        f = quant_format(format, bits, group_size)
        array = check.as_array(x, "x")
        dtype = check.dtype_of(array, "x")
        if array.ndim < 1 or array.shape[-1] == 0 or array.shape[-1] % f.group_size:
            raise ValueError(f"x's last axis must be a positive multiple of group_size ({f.group_size}) for "
                             f"{f.describe()}, got shape {array.shape}")
        if array.size // f.group_size > MAX_GROUPS:
            raise ValueError(f"x has {array.size // f.group_size} groups; at most {MAX_GROUPS} fit one call")
        contiguous = array.flags.c_contiguous
        checked = Checked(bound={"x": array if contiguous else np.ascontiguousarray(array)},
                          converts={"x": None if contiguous else np.ascontiguousarray})
        results = ("data", "scales", "biases") if f.affine else ("data",)
        descriptor = codegen.QuantizeDescriptor(dtype, f)
        if array.size == 0:
            return _nothing(descriptor, array.shape, results, checked)
        return prepared_call(codegen.quantize_pass(descriptor, array.shape), device, checked, ARGUMENTS, results)

    return run(_calls, key, (x,), prepare)


def quant_format(format, bits, group_size) -> QuantFormat:
    """The format the arguments name (each checked for its type, then QuantFormat its value)."""
    if not isinstance(format, str):
        raise TypeError(f"format must be a str (one of {FORMATS}), got {type(format).__name__}")
    for name, value in (("bits", bits), ("group_size", group_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    return QuantFormat.of(format, None if bits is None else int(bits),
                          None if group_size is None else int(group_size))


class _NoKernels:
    """Stands in for a prepared pass when x has no rows: the outputs are allocated, empty."""

    def __init__(self, outputs: tuple[tuple[tuple[int, ...], np.dtype], ...]) -> None:
        self.outputs = outputs

    def run(self, inputs):
        return [runner.allocate(shape, dtype) for shape, dtype in self.outputs]


def _nothing(d: codegen.QuantizeDescriptor, shape, results, checked) -> tuple[PreparedCall, list]:
    f, rows = d.format, shape[:-1]
    widths = {"data": (f.data_dtype, f.data_width(shape[-1])), "scales": (d.dtype, f.groups(shape[-1])),
              "biases": (d.dtype, f.groups(shape[-1]))}
    outputs = tuple(((*rows, widths[name][1]), DTYPES[widths[name][0]]) for name in results)
    call = PreparedCall(_NoKernels(outputs), pick(ARGUMENTS, ARGUMENTS, checked.converts), tuple)
    return call, [checked.bound["x"]]
