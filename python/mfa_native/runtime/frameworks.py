"""PyTorch and MLX arrays as numpy views, and outputs allocated by their framework.

The ops compute on numpy arrays. A torch tensor or an MLX array is viewed as
one without a copy (bfloat16 as its 16-bit pattern, viewed back as
ml_dtypes.bfloat16), and the op's outputs are allocated by the caller's
framework and viewed the same way, so the op writes straight into the tensors
it returns. Neither framework is imported here: an array is recognized through
the modules its caller has already imported (sys.modules).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .arrays import DTYPES

BFLOAT16 = DTYPES["bfloat16"]


class Framework:
    """One array library: how to recognize its arrays, view them as numpy and allocate outputs."""

    name: str
    module: str  # the module whose presence in sys.modules means its arrays may be passed

    def owns(self, x: Any) -> bool:
        raise NotImplementedError

    def as_numpy(self, x: Any, name: str) -> np.ndarray:
        """A numpy view of x's memory (no copy); `name` is the argument, for errors."""
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Any) -> Any:
        """An uninitialized C-contiguous array of the framework, on `like`'s device."""
        raise NotImplementedError


class Torch(Framework):
    """torch.Tensor on the CPU (requires_grad is fine: the view is of the detached tensor)."""

    name, module = "torch", "torch"

    def owns(self, x: Any) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(x, torch.Tensor)

    def as_numpy(self, x: Any, name: str) -> np.ndarray:
        import torch

        if x.device.type != "cpu":
            raise TypeError(f"{name} is a torch tensor on {x.device}; mfa_native reads CPU tensors "
                            "(MPS tensors are not supported yet)")
        x = x.detach()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(BFLOAT16)
        return x.numpy()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Any) -> Any:
        import torch

        return torch.empty(shape, dtype=_torch_dtype(dtype), device=like.device)


class Mlx(Framework):
    """mlx.core.array: evaluated, then read through the buffer protocol (MLX's unified memory)."""

    name, module = "mlx", "mlx.core"

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


FRAMEWORKS: tuple[Framework, ...] = (Torch(), Mlx())


def framework_of(x: Any) -> Framework | None:
    """The framework owning x, or None (numpy, or another array type the ops read as numpy)."""
    if type(x) is np.ndarray or x is None:
        return None
    for framework in FRAMEWORKS:
        if framework.module in sys.modules and framework.owns(x):
            return framework
    return None


class Allocation:
    """Outputs of one call, allocated by `framework` on `like`'s device: `__call__` is the
    runner's allocator (it returns the numpy view), `natives` maps a result back."""

    def __init__(self, framework: Framework, like: Any) -> None:
        self.framework = framework
        self.like = like
        self._made: list[tuple[np.ndarray, Any]] = []

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        native = self.framework.empty(tuple(shape), np.dtype(dtype), self.like)
        view = self.framework.as_numpy(native, "an output")
        self._made.append((view, native))
        return view

    def natives(self, result: Any) -> Any:
        """`result` (an op's return value: an array or a tuple of them) with every array this
        allocation made replaced by its framework array."""
        if isinstance(result, tuple):
            return tuple(self.natives(r) for r in result)
        for view, native in self._made:
            if view is result:
                return native
        return result


def _torch_dtype(dtype: np.dtype):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
            "int32": torch.int32, "uint8": torch.uint8, "int8": torch.int8, "bool": torch.bool}[dtype.name]


def _mlx_dtype(dtype: np.dtype):
    import mlx.core as mx

    return {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32, "int32": mx.int32,
            "uint8": mx.uint8, "int8": mx.int8, "bool": mx.bool_}[dtype.name]

