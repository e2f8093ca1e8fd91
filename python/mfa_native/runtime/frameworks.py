"""PyTorch and MLX arrays as numpy views, and outputs allocated by their framework.

The ops compute on numpy arrays. A torch CPU tensor or an MLX array is viewed as
one without a copy (bfloat16 as its 16-bit pattern, viewed back as
ml_dtypes.bfloat16). An op's outputs for torch CPU tensors are the runner's
pool arrays (pool_arrays.py) under tensors made over them (torch.from_numpy), so
the kernels write device memory the tensors return with no copy; MLX has no
array over foreign memory, so its outputs are MLX arrays, viewed the same way
and written in place.

A torch MPS tensor has no host view: it is stood in for by a numpy array of its
shape, strides and dtype over one placeholder element (validation and codegen
read only those), and the runner binds the tensor itself in its place, through
DLPack, as a Metal buffer (`FrameworkCall.bind`). MPS calls run on the metal
device after torch.mps.synchronize() (mfa_native does not share torch's MPS
command queue: torch's pending work on the inputs must finish first) and have
finished when they return, so torch's later work sees the results.

Neither framework is imported here: an array is recognized through the modules
its caller has already imported (sys.modules).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Iterable, Sequence

import ml_dtypes
import numpy as np

from .. import _core
from .arrays import DTYPES
from .devices import Device

BFLOAT16 = DTYPES["bfloat16"]


class Framework:
    """One array library: how to recognize its arrays, view them as numpy and allocate outputs."""

    name: str
    module: str  # the module whose presence in sys.modules means its arrays may be passed
    adapter: str  # the mfa_native module that registers the framework's `Differentiating` on import
    score_mods: str  # the mfa_native module whose TRACES traces a score_mod function written with the framework
    wraps_host = False  # whether `over` makes its arrays over numpy memory with no copy

    def may_differentiate(self, arrays: Iterable[Any]) -> bool:
        """Whether the framework may differentiate a call on `arrays` (then the call goes through
        its adapter, so that the framework sees it); `arrays` is consumed only as far as needed."""
        raise NotImplementedError

    def owns(self, x: Any) -> bool:
        raise NotImplementedError

    def as_numpy(self, x: Any, name: str) -> np.ndarray:
        """A numpy view of x's host memory (no copy); `name` is the argument, for errors."""
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Any) -> Any:
        """An uninitialized C-contiguous array of the framework, on `like`'s device."""
        raise NotImplementedError

    def over(self, array: np.ndarray) -> Any:
        """The framework's array over `array`'s memory, no copy (only where `wraps_host`)."""
        raise NotImplementedError

    def on_metal(self, x: Any) -> bool:
        """Whether x lives in Metal memory with no host view (bound through DLPack)."""
        return False

    def refusing_gradient(self, value: Any, source: Any, message: str) -> Any:
        """`value` (of `source`'s shape and dtype), computed off the graph from `source`, tied
        back to it so that a gradient asked through it raises NotImplementedError(message)
        instead of being zero."""
        raise NotImplementedError


class Torch(Framework):
    """torch.Tensor on the CPU or MPS (requires_grad is fine: the views are of the detached tensor)."""

    name, module, adapter, score_mods = "torch", "torch", "mfa_native.torch.library", "mfa_native.torch.score_mod"
    wraps_host = True

    def may_differentiate(self, arrays: Iterable[Any]) -> bool:
        import torch

        return torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in arrays)

    def owns(self, x: Any) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(x, torch.Tensor)

    def as_numpy(self, x: Any, name: str) -> np.ndarray:
        import torch

        if x.device.type != "cpu":
            raise TypeError(f"{name} is a torch tensor on {x.device}; mfa_native reads CPU and MPS tensors")
        x = x.detach()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(BFLOAT16)
        float8 = getattr(ml_dtypes, str(x.dtype).removeprefix("torch."), None) if x.dtype.itemsize == 1 else None
        if float8 is not None:   # float8_e4m3fn, float8_e5m2 (KV caches): numpy reads their bytes
            return x.view(torch.uint8).numpy().view(float8)
        try:
            return x.numpy()
        except TypeError:   # a dtype numpy has no view of (other float8 types): mfa_native reads none of them
            raise TypeError(f"{name} has dtype {x.dtype}, which mfa_native does not read (float32, float16, "
                            "bfloat16, float8 caches, and the integer and bool types its arguments name)") from None

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Any) -> Any:
        import torch

        return torch.empty(shape, dtype=_torch_dtype(dtype), device=like.device)

    def over(self, array: np.ndarray) -> Any:
        import torch

        if array.dtype == BFLOAT16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)

    def on_metal(self, x: Any) -> bool:
        return x.device.type == "mps"

    def refusing_gradient(self, value: Any, source: Any, message: str) -> Any:
        import torch

        if not (torch.is_grad_enabled() and source.requires_grad):
            return value
        return value + _torch_refusal().apply(source, message)


class Mlx(Framework):
    """mlx.core.array: evaluated (mx.eval waits for MLX's stream), then read through the buffer
    protocol (MLX's memory is unified, on a Mac too)."""

    name, module, adapter, score_mods = "mlx", "mlx.core", "mfa_native.mlx", "mfa_native.mlx_score_mod"

    def may_differentiate(self, arrays: Iterable[Any]) -> bool:
        return True   # an MLX transformation gives no sign of itself

    def owns(self, x: Any) -> bool:
        mx = sys.modules.get("mlx.core")
        return mx is not None and isinstance(x, mx.array)

    def as_numpy(self, x: Any, name: str) -> np.ndarray:
        import mlx.core as mx

        bits = x.dtype == mx.bfloat16
        try:
            view = np.asarray(memoryview(x.view(mx.uint16) if bits else x))
        except RuntimeError as error:  # MLX refuses to evaluate inside mx.compile / mx.vmap
            raise RuntimeError(f"{name} is an MLX array being traced (mx.compile or mx.vmap): mfa_native's "
                               "ops run eagerly on evaluated arrays; call them outside the transformation") \
                from error
        return view.view(BFLOAT16) if bits else view

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Any) -> Any:
        import mlx.core as mx

        out = mx.zeros(shape, dtype=_mlx_dtype(dtype))  # MLX has no uninitialized allocation
        mx.eval(out)
        return out

    def refusing_gradient(self, value: Any, source: Any, message: str) -> Any:
        import mlx.core as mx

        @mx.custom_function
        def refusal(x):
            return mx.zeros_like(x)

        @refusal.vjp
        def vjp(primals, cotangent, output):
            raise NotImplementedError(message)

        return value + refusal(source)


def _torch_refusal():
    """A torch.autograd.Function giving zeros of its input whose backward raises its message."""
    import torch

    class Refusal(torch.autograd.Function):
        @staticmethod
        def forward(ctx, source, message):
            ctx.message = message
            return torch.zeros_like(source)

        @staticmethod
        def backward(ctx, grad):
            raise NotImplementedError(ctx.message)

    return Refusal


FRAMEWORKS: tuple[Framework, ...] = (Torch(), Mlx())


Differentiating = Callable[[Any, dict], Any]   # (op, every argument by name) -> the call's result
_ADAPTERS: dict[str, Differentiating] = {}


def register_adapter(name: str, differentiating: Differentiating) -> None:
    """Called by a framework's adapter module when it is imported: how a call of an op on the
    framework's arrays runs so that the framework sees it (its custom op or custom function).
    The ops never import the adapters; they find them here."""
    _ADAPTERS[name] = differentiating


def adapter(framework: Framework) -> Differentiating:
    """The framework's registered Differentiating, importing its adapter module the first time."""
    if framework.name not in _ADAPTERS:
        importlib.import_module(framework.adapter)
    return _ADAPTERS[framework.name]


def trace_score_mod(framework: Framework, score_mod: Callable) -> tuple[str, list]:
    """The text and captured arrays of a score_mod function written with `framework`, by its
    tracer (kept per function while what it sees stays the same)."""
    return importlib.import_module(framework.score_mods).TRACES.traced(score_mod)


def framework_of(x: Any) -> Framework | None:
    """The framework owning x, or None (numpy, or another array type the ops read as numpy)."""
    if type(x) is np.ndarray or x is None:
        return None
    for framework in FRAMEWORKS:
        if framework.module in sys.modules and framework.owns(x):
            return framework
    return None


# Array arguments whose values validation reads (sinks: (Hq,); cu_seqlens: (B + 1,); a KV
# cache's lengths and block table): an MPS tensor of them comes to the host.
HOST_READ = ("sinks", "cu_seqlens_q", "cu_seqlens_k", "cache_seqlens", "block_table")


class FrameworkCall:
    """One op call on `framework`'s arrays: views its arguments (`view`), allocates its outputs
    (`__call__`, the runner's allocator), binds Metal tensors in place of their stand-ins
    (`bind`, the runner's binder) and maps the result back (`natives`)."""

    def __init__(self, framework: Framework, like: Any) -> None:
        self.framework = framework
        self.like = like
        self.on_metal = framework.on_metal(like)
        self.wraps_host = framework.wraps_host and not self.on_metal
        self._made: list[tuple[np.ndarray, Any]] = []
        self._metal: dict[int, Any] = {}  # stand-in data address -> the Metal tensor it stands for
        if self.on_metal:
            import torch

            torch.mps.synchronize()  # torch's queued work on the inputs finishes before ours reads them

    def view(self, x: Any, name: str) -> np.ndarray:
        """x (an array of the framework) as numpy: a view of its memory, or a Metal tensor's stand-in."""
        if not self.framework.on_metal(x):
            return self.framework.as_numpy(x, name)
        if not self.on_metal:
            raise TypeError(f"{name} is on {x.device} but {self.like.device} is where the call runs")
        if name in HOST_READ:  # small arrays whose values validation reads come to the host
            return self.framework.as_numpy(x.detach().cpu(), name)
        x = x.detach().contiguous()  # a device copy when strided or broadcast: stand-ins are never read or copied
        # The placeholder sits as far past a 16-byte boundary as the tensor's first element does in
        # its buffer, so the alignment codegen reads off the stand-in is the tensor's
        # (AttentionProblem.aligned: vector accesses).
        misaligned = x.storage_offset() * x.element_size() % 16
        placeholder = np.zeros(32, np.uint8)[misaligned:misaligned + x.element_size()].view(_numpy_dtype(x.dtype))
        stand_in = np.lib.stride_tricks.as_strided(placeholder, tuple(x.shape),
                                                   tuple(s * x.element_size() for s in x.stride()))
        self._metal[stand_in.__array_interface__["data"][0]] = x
        return stand_in

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype, host: np.ndarray | None) -> np.ndarray:
        """An output (runner.CallerArrays): `host` under the framework's array over it, or a
        view of an array the framework allocated."""
        if host is None:
            native = self.framework.empty(tuple(shape), np.dtype(dtype), self.like)
            host = self.view(native, "an output")
        else:
            native = self.framework.over(host)
        self._made.append((host, native))
        return host

    def bind(self, arrays: Sequence[np.ndarray], device: Device) -> list:
        """The arrays a pass runs on, with each Metal tensor's stand-in (or a view of it, such as a
        broadcast mask) replaced by the tensor, bound in place as a core Buffer."""
        if not self._metal:
            return list(arrays)
        if device.kind != "metal":
            raise ValueError(f"MPS tensors run on the metal device, not {device.kind}")
        bound = []
        for a in arrays:
            tensor = self._metal.get(a.__array_interface__["data"][0])
            bound.append(a if tensor is None else _core.metal_buffer_from_dlpack(device, tensor.__dlpack__()))
        return bound

    def readable(self, output: np.ndarray) -> np.ndarray:
        """An output this call allocated, as numpy the host can read: a Metal tensor's stand-in
        holds no data, so its tensor comes back to the host."""
        for view, native in self._made:
            if view is output and self.framework.on_metal(native):
                return self.framework.as_numpy(native.cpu(), "an output")
        return output

    def natives(self, result: Any) -> Any:
        """`result` (an op's return value: an array or a tuple of them) with every array this
        call allocated replaced by its framework array."""
        if isinstance(result, tuple):
            return tuple(self.natives(r) for r in result)
        for view, native in self._made:
            if view is result:
                return native
        return result


def _torch_dtype(dtype: np.dtype):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
            "int32": torch.int32, "uint8": torch.uint8, "int8": torch.int8, "bool": torch.bool,
            "uint32": getattr(torch, "uint32", None)}[dtype.name]   # torch.uint32: torch >= 2.3


def _numpy_dtype(dtype) -> np.dtype:
    import torch

    return {torch.bfloat16: BFLOAT16, torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
            torch.int32: np.dtype(np.int32), torch.uint8: np.dtype(np.uint8), torch.int8: np.dtype(np.int8),
            torch.bool: np.dtype(np.bool_)}[dtype]


def _mlx_dtype(dtype: np.dtype):
    import mlx.core as mx

    return {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32, "int32": mx.int32,
            "uint8": mx.uint8, "int8": mx.int8, "bool": mx.bool_, "uint32": mx.uint32}[dtype.name]
