"""`returns_given_kind`: one decorator makes an op take and return numpy, torch or MLX arrays.

The op itself computes on numpy arrays. Decorated, a call whose leading arrays
(q, k, v) are torch tensors or MLX arrays has every array argument of that kind
viewed as numpy (no copy; runtime/frameworks.py) and its outputs allocated by
that framework, and returns them: numpy in, numpy out; torch in, torch out; MLX
in, MLX out. Torch MPS tensors run on the metal device, bound in place. A call
with numpy q, k and v goes to the op directly (its warm path costs a type
check per leading array more).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from ..quantized import QuantizedTensor
from ..runtime import runner
from ..runtime.frameworks import FrameworkCall, framework_of

Op = TypeVar("Op", bound=Callable[..., Any])


def returns_given_kind(leading: Sequence[str], others: Sequence[str] = ()) -> Callable[[Op], Op]:
    """Decorates an op whose array parameters are `leading` (they must be one kind: their kind
    is the call's) and `others` (numpy or the call's kind). A parameter holding a list or tuple
    of arrays counts each of them."""
    leading, others = tuple(leading), tuple(others)
    count = len(leading)

    def decorate(op: Op) -> Op:
        signature = inspect.signature(op)

        if count not in (2, 3):
            raise ValueError(f"an op leads with 2 or 3 arrays, not {count}")
        ndarray = np.ndarray

        @functools.wraps(op)
        def call(*args, **kwargs):
            # numpy q, k (and v): the op as is. Spelled out, as this is every warm call's path.
            if len(args) >= count and type(args[0]) is ndarray and \
                    (type(args[1]) is ndarray or _quantized_host(args[1])) and \
                    (count == 2 or type(args[2]) is ndarray or _quantized_host(args[2])):
                return op(*args, **kwargs)
            return _in_framework(op, signature, leading, others, args, kwargs)

        return call  # type: ignore[return-value]

    return decorate


def _in_framework(op, signature: inspect.Signature, leading, others, args, kwargs):
    bound = signature.bind(*args, **kwargs)
    values = bound.arguments
    found = {name: [framework_of(_stored(x)) for x in _items(values.get(name))] for name in leading + others}
    kinds = {kind for name in leading for kind in found[name]}
    if len(kinds) > 1:
        described = ", ".join(f"{name}: {_kind_names(found[name])}" for name in leading)
        raise TypeError(f"{', '.join(leading)} must be one kind of array (numpy, torch or mlx), got {described}")
    framework = kinds.pop() if kinds else None
    if framework is None:
        return op(*args, **kwargs)
    call = FrameworkCall(framework, like=_items(values[leading[0]])[0])
    if call.on_metal:
        if "device" not in signature.parameters:
            raise TypeError(f"{op.__name__} computes on the host: pass CPU tensors, not {call.like.device} ones")
        if values.get("device") is None:
            values["device"] = "metal"
    for name in leading + others:
        if name not in values:
            continue
        for kind in found[name]:
            if kind is not None and kind is not framework:
                raise TypeError(f"{name} is a {kind.name} array but {leading[0]} is {framework.name}; "
                                f"{name} must be numpy or {framework.name}")
        value = values[name]
        if isinstance(value, (list, tuple)):
            values[name] = type(value)(_view(call, x, name) for x in value)
        else:
            values[name] = _view(call, value, name)
    with runner.caller_arrays(call):
        result = op(*bound.args, **bound.kwargs)
    return call.natives(result)


def _items(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _quantized_host(x) -> bool:
    """Whether x is a QuantizedTensor of numpy fields (numpy arrays are told apart inline)."""
    return type(x) is QuantizedTensor and type(x.data) is np.ndarray


def _stored(x):
    """What tells an argument's kind: its own, or a QuantizedTensor's data's."""
    return x.data if isinstance(x, QuantizedTensor) else x


def _view(call: FrameworkCall, x, name: str):
    """x as numpy (a QuantizedTensor holds numpy views of its fields already)."""
    if isinstance(x, QuantizedTensor) or framework_of(x) is not call.framework:
        return x
    return call.view(x, name)


def _kind_names(kinds) -> str:
    return "/".join(sorted({"numpy" if k is None else k.name for k in kinds}))
