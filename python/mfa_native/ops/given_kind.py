"""The caller's array kind: an op takes and returns numpy, torch or MLX arrays.

The ops compute on numpy arrays. A call whose leading arrays (q, k, v) are torch tensors or
MLX arrays has every array argument of that kind viewed as numpy (no copy;
runtime/frameworks.py) and its outputs allocated by that framework, and returns them: numpy
in, numpy out; torch in, torch out; MLX in, MLX out. Torch MPS tensors run on the metal
device, bound in place. A call with numpy leading arrays goes to the op directly (the
declared function checks that inline: declaration.py).

A framework must see the call to differentiate it, or it takes the outputs for constants
and gives the inputs zero gradients. So a call the framework may differentiate
(`Framework.may_differentiate`: every MLX call, a torch call with grad enabled and an argument
that requires it) runs through the framework's adapter, which registered itself
(`runtime.frameworks.adapter`: mlx.py's custom functions, torch/library.py's custom ops; the
ops never import them); inside those, the op runs as below (`inside_adapter`). An op without
a backward runs as below in either framework, its floating outputs then tied to its floating
inputs by a function whose backward raises: a gradient asked through it is an error, never a
zero.
"""

from __future__ import annotations

import threading
from typing import Any

from ..quantized import QuantizedTensor
from ..runtime import runner
from ..runtime.frameworks import FrameworkCall, adapter, framework_of


def call(op, values: dict[str, Any]):
    """Runs `op` (a declaration.Op) on `values` (every argument by name) in their kind."""
    leading, others = op.leading, op.others
    found = {name: [framework_of(_stored(x)) for x in items(values.get(name))] for name in leading + others}
    kinds = {kind for name in leading for kind in found[name]}
    if len(kinds) > 1:
        described = ", ".join(f"{name}: {_kind_names(found[name])}" for name in leading)
        raise TypeError(f"{', '.join(leading)} must be one kind of array (numpy, torch or mlx), got {described}")
    framework = kinds.pop() if kinds else None
    if framework is None:
        return op.numpy_call(values)
    if not getattr(_adapter, "inside", False) and framework.may_differentiate(
            t for name in leading + others for x in items(values.get(name)) for t in _tensors(x)):
        return adapter(framework)(op, values)
    framework_call = FrameworkCall(framework, like=items(values[leading[0]])[0])
    given, values = values, dict(values)
    if framework_call.on_metal:
        if op.on_metal or not op.takes_device:
            why = op.on_metal or f"{op.name} computes on the host"
            raise TypeError(f"{leading[0]} is a {framework.name} array on {framework_call.like.device}: {why}; "
                            "pass CPU tensors")
        if values.get("device") is None:
            values["device"] = "metal"
        _check_in_place(op, values)
    for name in leading + others:
        for kind in found[name]:
            if kind is not None and kind is not framework:
                raise TypeError(f"{name} is a {kind.name} array but {leading[0]} is {framework.name}; "
                                f"{name} must be numpy or {framework.name}")
        value = values[name]
        if isinstance(value, (list, tuple)):
            values[name] = type(value)(_view(framework_call, x, name) for x in value)
        else:
            values[name] = _view(framework_call, value, name)
    with runner.caller_arrays(framework_call):
        result = op.call(values)
    result = framework_call.natives(result)
    return result if op.wrap is None else op.wrap(result, op.bound(given))   # the arguments as given


_adapter = threading.local()  # .inside: this thread runs an op inside its framework adapter


def inside_adapter():
    """The block runs an op for its framework adapter: call it directly, not through the adapter."""
    return runner.scoped(_adapter, "inside", True)


def writes_in_place(op, values: dict[str, Any]) -> bool:
    """Whether this call writes an argument in place (a KV cache given rows to append)."""
    return any(a.written_with is not None and values.get(a.written_with) is not None for a in op.arguments)


def items(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _tensors(x) -> list:
    """An argument's arrays: itself, or a QuantizedTensor's fields."""
    return list(x.fields().values()) if isinstance(x, QuantizedTensor) else [x]


def _stored(x):
    """What tells an argument's kind: its own, or a QuantizedTensor's data's."""
    return x.data if isinstance(x, QuantizedTensor) else x


def _check_in_place(op, values: dict[str, Any]) -> None:
    """Raises ValueError for a Metal tensor the op would write in place that is not contiguous:
    the pass binds a device copy of it (FrameworkCall.view), which the caller never sees."""
    for argument in op.arguments:
        if argument.written_with is None or values.get(argument.written_with) is None:
            continue
        for x in _tensors(values[argument.name]):
            if hasattr(x, "is_contiguous") and not x.is_contiguous():
                raise ValueError(f"{argument.name} is a non-contiguous {x.device} tensor (strides {tuple(x.stride())}): "
                                 f"with {argument.written_with} given the op writes it in place, which only a "
                                 "contiguous Metal tensor can be; make the cache contiguous once and keep it")


def _view(call: FrameworkCall, x, name: str):
    """x as numpy (a QuantizedTensor holds numpy views of its fields already)."""
    if isinstance(x, QuantizedTensor) or framework_of(x) is not call.framework:
        return x
    return call.view(x, name)


def _kind_names(kinds) -> str:
    return "/".join(sorted({"numpy" if k is None else k.name for k in kinds}))
