"""Argument checks and conversions shared by the ops: each names the argument it rejects.

The ops call these on a call's first sight of a signature (shapes, strides, dtypes,
flags); `warm.py` makes later calls with the same signature skip them.
"""

from __future__ import annotations

import numbers

import numpy as np

from ..runtime.arrays import FLOAT_DTYPES
from .rules import Binding

_CAUSAL = {False: "none", True: "lower_right", "none": "none", "lower_right": "lower_right",
           "upper_left": "upper_left"}
MAX_INDEX = 2**31 - 1   # sizes, positions and window sides the kernels hold in (signed) 32-bit integers
MAX_SCALE = float(np.finfo(np.float32).max / np.log2(np.e))  # the kernels scale logits by scale * log2(e), float32


def layout_of(layout) -> str:
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    return layout


def scale_value(scale) -> float | None:
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    if not np.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if abs(scale) > MAX_SCALE:
        raise ValueError(f"scale is {scale}; the kernels take scale * log2(e) in float32, so |scale| must be "
                         f"at most {MAX_SCALE:.4g}")
    return float(scale)


def softcap_value(softcap) -> float | None:
    """A logit cap: None (no cap) or a finite real number above 0, as a float."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number or None, got {type(softcap).__name__}")
    if not (np.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be finite and above 0 (None: no cap), got {softcap}")
    return float(softcap)


def flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def as_array(x, name: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError, ValueError) as error:
            raise TypeError(f"{name} supports DLPack but numpy cannot read it (a CPU array is needed): {error}") \
                from error
    raise TypeError(f"{name} must be a numpy array or a CPU array supporting DLPack, got {type(x).__name__}")


def given_arrays(values: dict, names) -> dict[str, np.ndarray | None]:
    """The arrays named `names` among a call's `values`, numpy views by name (None: not given)."""
    return {name: None if values.get(name) is None else as_array(values[name], name) for name in names}


def is_empty(B: int, Hq: int, R: int, C: int) -> bool:
    """Nothing to compute: no output rows (B, Hq or R = 0) or no keys (C = 0)."""
    return B * Hq * R * C == 0


def dtype_of(x: np.ndarray, name: str) -> str:
    dtype = FLOAT_DTYPES.get(x.dtype)
    if dtype is None:
        raise TypeError(f"{name} must be float32, float16 or bfloat16 (ml_dtypes), got {x.dtype}")
    return dtype


def causal_mode(causal) -> str:
    if isinstance(causal, (bool, np.bool_)):
        return _CAUSAL[bool(causal)]
    if isinstance(causal, str) and causal in _CAUSAL:
        return _CAUSAL[causal]
    raise ValueError(f"causal must be False, True, 'lower_right' or 'upper_left' (or 'none'), got {causal!r}")


def deterministic_mode(deterministic) -> str:
    """"batch_invariant", or "run_to_run" for False and True (what every kernel already is)."""
    if isinstance(deterministic, (bool, np.bool_)):
        return "run_to_run"
    if isinstance(deterministic, str) and deterministic in ("batch_invariant", "run_to_run"):
        return deterministic
    raise ValueError(f"deterministic must be False, True, 'run_to_run' or 'batch_invariant', got {deterministic!r}")


def window_sides(window, q_len: int, kv_len: int) -> tuple[int, int] | None:
    """(left, right) with -1 for unbounded; a side too wide to remove any key for these lengths
    (left >= C, right >= R) is unbounded too, so no side the kernels hold exceeds 32 bits."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be a (left, right) pair of ints, got {window!r}")
    sides = []
    for side, value in zip(("left", "right"), window):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"window {side} must be an int, got {value!r}")
        if value < -1:
            raise ValueError(f"window {side} must be >= 0, or -1 for unbounded, got {value}")
        sides.append(int(value))
    left, right = sides
    return (-1 if left >= max(kv_len, 1) else left, -1 if right >= max(q_len, 1) else right)


def normalized(x: np.ndarray) -> np.ndarray:
    """A view whose size-1 axes have stride 0 (their stride is meaningless and may be negative)."""
    strides = tuple(0 if n == 1 else s for n, s in zip(x.shape, x.strides))
    if strides == x.strides:
        return x
    return np.lib.stride_tricks.as_strided(x, x.shape, strides, writeable=x.flags.writeable)  # writable if x is: an inout binds it


def usable_in_place(x: np.ndarray) -> bool:
    item = x.dtype.itemsize
    last_ok = x.shape[-1] == 1 or x.strides[-1] in (0, item)
    return last_ok and all(s >= 0 and s % item == 0 for s in x.strides)


def bindable(x: np.ndarray) -> np.ndarray:
    """x itself when its strides can be baked into the kernel; otherwise a contiguous copy
    (a non-contiguous last axis, negative strides, or strides that are not whole elements)."""
    x = normalized(x)
    if not usable_in_place(x) or (x.strides[-1] == 0 and x.shape[-1] > 1):
        x = np.ascontiguousarray(x)
    return x


def aligned(arrays: dict[str, np.ndarray], allocated: tuple[str, ...]) -> frozenset[str]:
    """AttentionProblem.aligned: the names of `arrays` whose first element is aligned to two
    elements (a vector pair), and the `allocated` outputs (fresh pool memory always is). The
    warm path's signature holds each array's `alignment`, so a call that shares a signature
    shares these facts."""
    return frozenset(name for name, x in arrays.items()
                     if x.__array_interface__["data"][0] % (2 * x.dtype.itemsize) == 0) | frozenset(allocated)


def element_strides(x: np.ndarray) -> tuple[int, int, int, int]:
    return tuple(s // x.dtype.itemsize for s in x.strides)  # type: ignore[return-value]


def ruled(x, name: str, binding: Binding) -> np.ndarray:
    """x read as an array, checked against its rule (rules.py) and made bindable as its rule
    says the kernels read it: strided in place where they can, else a contiguous copy."""
    x = as_array(x, name)
    binding.check(name, x.shape, str(x.dtype))
    return np.ascontiguousarray(x) if binding.rules[name].reads == "contiguous" else bindable(x)


def mask_array(mask, binding: Binding) -> tuple[np.ndarray, str, str]:
    """The mask broadcast (stride 0, no copy) to (B, Hq, R, C), its kind and element dtype;
    its rule (attention_rules.MASK) checks it, float64 taken as float32."""
    mask = as_array(mask, "mask")
    if mask.dtype == np.float64:
        mask = mask.astype(np.float32)  # no float64 on the GPU: the mask's own (unbroadcast) size is copied
    binding.check("mask", mask.shape, str(mask.dtype))
    kind, dtype = ("bool", "bool") if mask.dtype == np.bool_ else ("additive", FLOAT_DTYPES[mask.dtype])
    mask = normalized(np.broadcast_to(mask, binding.expected("mask")))
    if not usable_in_place(mask):
        mask = np.ascontiguousarray(mask)
    return mask, kind, dtype


def float32_array(x, name: str, binding: Binding) -> tuple[np.ndarray, int]:
    """sinks or alibi_slopes: any float dtype, as the float32 its rule asks, checked; and the
    index of the shape it has among its rule's."""
    x = as_array(x, name)
    if x.dtype not in FLOAT_DTYPES and x.dtype != np.float64:
        raise TypeError(f"{name} must be a float array, got dtype {x.dtype}")
    shape = binding.check(name, x.shape, "float32")
    return np.ascontiguousarray(x, dtype=np.float32), shape


def window_list(window) -> list[int] | None:
    """window as a torch.library schema holds it: None or [left, right] (checked for its form)."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be a (left, right) pair of ints, got {window!r}")
    return [int(side) for side in window]
