"""`mfa_native.attention`: the fused flash-attention forward pass."""

from __future__ import annotations

import numbers
import threading

import numpy as np

from . import codegen
from ._arrays import bfloat16, byte_span
from ._devices import Device, resolve_device
from .codegen import AttentionProblem
from .kernel import Kernel

_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(bfloat16): "bfloat16"}
_CAUSAL = {False: "none", True: "lower_right", "lower_right": "lower_right", "upper_left": "upper_left"}


def attention(q, k, v, *, scale=None, causal=False, mask=None, window=None, sinks=None, layout="bhsd",
              return_lse=False, device: Device | str | None = None):
    """Softmax attention, fused: softmax(scale * q k^T + mask) v, computed blockwise on the device.

    Args:
        q, k, v: numpy arrays (or CPU arrays that support DLPack) of one dtype:
            float32, float16 or ml_dtypes.bfloat16. With layout "bhsd", q is
            (B, Hq, R, D), k is (B, Hkv, C, D), v is (B, Hkv, C, Dv); "bshd" swaps
            the sequence and head axes. Hq must be a multiple of Hkv (query head h
            reads kv head h // (Hq // Hkv)). D and Dv are 1..256. Any non-negative
            strides with a contiguous last axis are used in place, without a copy.
        scale: logit scale; default 1 / sqrt(D).
        causal: False, True (= "lower_right": the last query lines up with the
            last key, as in MLX and FlashAttention 2.1+) or "upper_left" (query i
            sees keys j <= i, PyTorch's is_causal).
        mask: boolean (True = attend) or additive float mask, broadcastable to
            (B, Hq, R, C) whatever the layout; broadcast axes are read with stride
            0. Additive values of -inf (or <= -1e30) remove the key.
        window: (left, right): key j is allowed for query i iff
            -left <= j - (i + C - R) <= right; -1 leaves a side unbounded.
        sinks: (Hq,) one extra logit per head in the softmax denominator, with no value.
        layout: "bhsd" or "bshd"; the output uses the same layout.
        return_lse: also return lse, (B, Hq, R) float32: the natural log of the
            softmax denominator (sink included).
        device: a Device, "cpu", "metal" or None for the default device.

    Returns:
        The output, a numpy array with q's dtype and layout, shape (.., Dv); with
        return_lse, the tuple (output, lse). A row with no allowed key (and no
        sink) gives output 0 and lse -inf.

    Raises:
        TypeError, ValueError naming the argument that is wrong.
    """
    call = _Call.validate(q, k, v, scale=scale, causal=causal, mask=mask, window=window, sinks=sinks,
                          layout=layout, return_lse=return_lse)
    out, lse = call.run(resolve_device(device))
    return (out, lse) if return_lse else out


def _allocate(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Storage for outputs and intermediates (tests replace this to poison them)."""
    return np.empty(shape, dtype=dtype)


class _Call:
    """One validated call: the problem and the arrays to bind."""

    def __init__(self, problem: AttentionProblem, arrays: dict[str, np.ndarray]) -> None:
        self.problem = problem
        self.arrays = arrays

    @classmethod
    def validate(cls, q, k, v, *, scale, causal, mask, window, sinks, layout, return_lse) -> _Call:
        if layout not in ("bhsd", "bshd"):
            raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
        q, k, v = (_as_array(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        dtype = _dtype_of(q, "q")
        for x, name in ((k, "k"), (v, "v")):
            if x.dtype != q.dtype:
                raise TypeError(f"{name} has dtype {x.dtype} but q has {q.dtype}; q, k and v must share one dtype")
        B, Hq, Hkv, R, C, D, Dv = _dimensions(q, k, v, layout)
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
                raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
            if not np.isfinite(scale):
                raise ValueError(f"scale must be finite, got {scale}")
            scale = float(scale)
        causal_mode = _causal_mode(causal)
        window = _window(window)
        if not isinstance(return_lse, (bool, np.bool_)):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")

        arrays = {"q": _bindable(q), "k": _bindable(k), "v": _bindable(v)}
        mask_kind, mask_dtype, mask_strides = "none", None, None
        if mask is not None:
            arrays["mask"], mask_kind, mask_dtype = _mask(mask, (B, Hq, R, C))
            mask_strides = _element_strides(arrays["mask"])
        if sinks is not None:
            arrays["sinks"] = _sinks(sinks, Hq)

        problem = AttentionProblem(
            batch=B, q_heads=Hq, kv_heads=Hkv, q_len=R, kv_len=C, head_dim=D, value_dim=Dv,
            dtype=dtype, layout=layout,
            q_strides=_logical(_element_strides(arrays["q"]), layout),
            k_strides=_logical(_element_strides(arrays["k"]), layout),
            v_strides=_logical(_element_strides(arrays["v"]), layout),
            causal=causal_mode, window=window, mask=mask_kind, mask_dtype=mask_dtype, mask_strides=mask_strides,
            sinks=sinks is not None, scale=scale, return_lse=bool(return_lse))
        return cls(problem, arrays)

    def run(self, device: Device) -> tuple[np.ndarray, np.ndarray | None]:
        p = self.problem
        family, parallel_threadgroups = _tuning_facts(device)
        attention_pass = codegen.attention_pass(p, family=family, parallel_threadgroups=parallel_threadgroups)
        outputs = {"o": (_physical(p.o_shape, p.layout), self.arrays["q"].dtype)}
        if p.return_lse:
            outputs["lse"] = ((p.batch, p.q_heads, p.q_len), np.float32)
        bound = _dispatch(attention_pass, self.arrays, outputs, device)
        return bound["o"], bound.get("lse")


def _dispatch(attention_pass: codegen.AttentionPass, inputs: dict[str, np.ndarray],
              outputs: dict[str, tuple[tuple[int, ...], object]], device: Device) -> dict[str, np.ndarray]:
    """Runs the pass's kernels in order, binding operands by name: the inputs, the outputs
    (name -> (shape, dtype)) and the float32 intermediates the plans ask for. Outputs and
    intermediates are allocated here, through `_allocate`. Returns every bound array by name."""
    sizes = attention_pass.sizes
    bound: dict[str, object] = {name: _span(array) for name, array in inputs.items()}
    for name, (shape, dtype) in outputs.items():
        bound[name] = _allocate(shape, dtype)
    for kernel_source in attention_pass.kernels:
        plan = kernel_source.plan
        for operand in plan.operands:
            if operand.scratch is not None and operand.name not in bound:
                bound[operand.name] = _allocate((operand.scratch.bake(sizes).factor,), np.float32)
        if plan.sizes_fields:
            bound["sizes"] = plan.sizes_struct(sizes)
        kernel = _kernel(kernel_source.source, plan.kernel_name, device)
        kernel(plan.buffers(bound), threadgroups=plan.threadgroups(sizes),
               threads_per_threadgroup=plan.threads_per_threadgroup)
    return bound  # type: ignore[return-value]


_tuning: dict[str, tuple[str, int]] = {}


def _tuning_facts(device: Device) -> tuple[str, int]:
    """(tile-table family, parallel threadgroups) of a device: fixed for its life, so read
    once per device kind (device.properties is rebuilt by the core on every access)."""
    facts = _tuning.get(device.kind)
    if facts is None:
        facts = _tuning[device.kind] = (codegen.family_of(device), _parallel_threadgroups(device))
    return facts


def _parallel_threadgroups(device: Device) -> int:
    """About how many threadgroups the device runs at once; decode splits the keys to fill it."""
    properties = device.properties
    if device.kind == "cpu":
        return 2 * int(properties.get("worker_threads", "1"))
    cores = properties.get("gpu_cores", "unknown")  # "unknown" where Metal does not say
    return 16 * (int(cores) if cores.isdigit() else 10)


# ---------------------------------------------------------------------------
# Compiled kernels, per (source, device).

_kernels: dict[tuple[str, str, str], Kernel] = {}
_kernels_lock = threading.Lock()


def _kernel(source: str, name: str, device: Device) -> Kernel:
    key = (source, device.kind, device.name)
    with _kernels_lock:
        kernel = _kernels.get(key)
    if kernel is None:
        kernel = Kernel(source, name, device=device)
        with _kernels_lock:
            _kernels.setdefault(key, kernel)
    return kernel


# ---------------------------------------------------------------------------
# Argument checks and conversions.


def _axes(layout: str) -> str:
    return "B, Hq, R, D" if layout == "bhsd" else "B, R, Hq, D"


def _logical(values, layout: str) -> tuple:
    """Physical axis order -> logical (batch, head, sequence, feature); the swap is its own inverse."""
    return tuple(values) if layout == "bhsd" else (values[0], values[2], values[1], values[3])


_physical = _logical


def _as_array(x, name: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError, ValueError) as error:
            raise TypeError(f"{name} supports DLPack but numpy cannot read it (a CPU array is needed): {error}") \
                from error
    raise TypeError(f"{name} must be a numpy array or a CPU array supporting DLPack, got {type(x).__name__}")


def _dimensions(q: np.ndarray, k: np.ndarray, v: np.ndarray, layout: str) -> tuple[int, ...]:
    """(B, Hq, Hkv, R, C, D, Dv) from shapes that must agree."""
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions ({_axes(layout)}), got shape {x.shape}")
        if 0 in x.shape:
            raise ValueError(f"{name} has an empty dimension: shape {x.shape}")
    B, Hq, R, D = _logical(q.shape, layout)
    kb, Hkv, C, kd = _logical(k.shape, layout)
    vb, vh, vc, Dv = _logical(v.shape, layout)
    if kb != B or vb != B:
        raise ValueError(f"q, k and v must share the batch size: q {q.shape}, k {k.shape}, v {v.shape}")
    if kd != D:
        raise ValueError(f"k's head dimension ({kd}) must match q's ({D}): q {q.shape}, k {k.shape}")
    if vh != Hkv or vc != C:
        raise ValueError(f"v must have k's heads and length ({layout}): k {k.shape}, v {v.shape}")
    if Hq % Hkv:
        raise ValueError(f"q's head count ({Hq}) must be a multiple of k/v's ({Hkv}) (GQA/MQA)")
    for name, dim in (("D (q/k head dimension)", D), ("Dv (v head dimension)", Dv)):
        if dim > codegen.MAX_HEAD_DIM:
            raise ValueError(f"{name} is {dim}; the kernels support 1..{codegen.MAX_HEAD_DIM}")
    return B, Hq, Hkv, R, C, D, Dv


def _dtype_of(x: np.ndarray, name: str) -> str:
    dtype = _DTYPES.get(x.dtype)
    if dtype is None:
        raise TypeError(f"{name} must be float32, float16 or bfloat16 (ml_dtypes), got {x.dtype}")
    return dtype


def _causal_mode(causal) -> str:
    if isinstance(causal, (bool, np.bool_)):
        return _CAUSAL[bool(causal)]
    if isinstance(causal, str) and causal in _CAUSAL:
        return _CAUSAL[causal]
    raise ValueError(f"causal must be False, True, 'lower_right' or 'upper_left', got {causal!r}")


def _window(window) -> tuple[int, int] | None:
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
    return (sides[0], sides[1])


def _normalized(x: np.ndarray) -> np.ndarray:
    """A view whose size-1 axes have stride 0 (their stride is meaningless and may be negative)."""
    strides = tuple(0 if n == 1 else s for n, s in zip(x.shape, x.strides))
    if strides == x.strides:
        return x
    return np.lib.stride_tricks.as_strided(x, x.shape, strides, writeable=False)


def _usable_in_place(x: np.ndarray) -> bool:
    item = x.dtype.itemsize
    last_ok = x.shape[-1] == 1 or x.strides[-1] in (0, item)
    return last_ok and all(s >= 0 and s % item == 0 for s in x.strides)


def _bindable(x: np.ndarray) -> np.ndarray:
    """x itself when its strides can be baked into the kernel; otherwise a contiguous copy
    (a non-contiguous last axis, negative strides, or strides that are not whole elements)."""
    x = _normalized(x)
    if not _usable_in_place(x) or (x.strides[-1] == 0 and x.shape[-1] > 1):
        x = np.ascontiguousarray(x)
    return x


def _element_strides(x: np.ndarray) -> tuple[int, int, int, int]:
    return tuple(s // x.dtype.itemsize for s in x.strides)  # type: ignore[return-value]


def _span(x: np.ndarray) -> np.ndarray:
    """The memory an operand's kernel reads, as uint8 starting at its first element."""
    if x.ndim and x.shape[-1] > 1 and x.strides[-1] == 0:
        x = x[..., :1]  # broadcast along the last axis: the kernel reads index 0 (stride 0)
    span, start = byte_span(x)
    return span[start:]


def _mask(mask, shape: tuple[int, int, int, int]) -> tuple[np.ndarray, str, str]:
    """The mask broadcast (stride 0, no copy) to (B, Hq, R, C), its kind and element dtype."""
    mask = _as_array(mask, "mask")
    if mask.dtype == np.bool_:
        kind, dtype = "bool", "bool"
    elif mask.dtype in _DTYPES or mask.dtype == np.float64:
        if mask.dtype == np.float64:
            mask = mask.astype(np.float32)  # no float64 on the GPU: the mask's own (unbroadcast) size is copied
        kind, dtype = "additive", _DTYPES[mask.dtype]
    else:
        raise TypeError(f"mask must be boolean (True = attend) or float (additive), got dtype {mask.dtype}")
    if mask.ndim > 4:
        raise ValueError(f"mask of shape {mask.shape} does not broadcast to (B, Hq, R, C) = {shape}")
    try:
        mask = np.broadcast_to(mask, shape)
    except ValueError:
        raise ValueError(f"mask of shape {mask.shape} does not broadcast to (B, Hq, R, C) = {shape}") from None
    mask = _normalized(mask)
    if not _usable_in_place(mask):
        mask = np.ascontiguousarray(mask)
    return mask, kind, dtype


def _sinks(sinks, q_heads: int) -> np.ndarray:
    sinks = _as_array(sinks, "sinks")
    if sinks.dtype not in _DTYPES and sinks.dtype != np.float64:
        raise TypeError(f"sinks must be a float array, got dtype {sinks.dtype}")
    if sinks.shape != (q_heads,):
        raise ValueError(f"sinks must have shape (Hq,) = ({q_heads},), got {sinks.shape}")
    sinks = np.ascontiguousarray(sinks, dtype=np.float32)
    if not np.all(np.isfinite(sinks)):
        raise ValueError("sinks must be finite")
    return sinks
