"""torch.library custom ops derived from the ops' declarations (ops/declaration.py).

`custom_op(op)` registers `torch.ops.mfa_native.<op.name>` from the declaration alone: its
schema (array arguments as `Tensor` / `Tensor?`, in declaration order, then the options
with their declared schema types; an option that only selects outputs, such as
return_lse, is left out and every output returned), a fake implementation from the
outputs' declared shapes (so torch.compile and FakeTensor trace it without running it),
and, when the op declares a backward, `register_autograd` running the backward's custom
op. Arguments are read in place and outputs written into tensors torch allocates.

The backward's arguments are found by name: a forward argument, a forward output (o, lse),
or `d` + an output's name for that output's gradient (do). The backward's results go to
the forward arguments its `gradients` map names. A forward output whose gradient the
backward does not take (lse) is not differentiable; an array argument the op gives no
gradient (mask) raises NotImplementedError when autograd asks for one. An absent optional
output (dsinks without sinks) is an empty (0,) tensor.

A call whose `quantized` arguments (k, v) are QuantizedTensors, which no schema holds, runs
through `_WithQuantizedConstants`, a torch.autograd.Function read off the same declaration:
the QuantizedTensors are constants (the backward runs on their dequantize(); a gradient
asked of one of their fields raises NotImplementedError).
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

import numpy as np
import torch

from ..ops.declaration import Op, asked, item, quantized_values
from ..ops import given_kind
from ..ops.given_kind import inside_adapter, items
from ..quantized import QuantizedTensor
from ..runtime.frameworks import _torch_dtype, register_adapter

_REGISTERED: dict[str, Any] = {}


def schema_arguments(op: Op) -> list[tuple[str, str]]:
    """(name, schema type) of the custom op's arguments: the arrays in declaration order, then
    the options."""
    selectors = {o.when for o in op.outputs if o.when is not None}
    tensors, options = [], []
    for a in op.arguments:
        if a.kind == "array":
            tensors.append((a.name, "Tensor" if a.default is not None else "Tensor?"))
        elif a.kind == "arrays" and not a.leading:
            tensors.append((a.name, "Tensor[]"))
        elif a.kind == "lists" and a.rebuild is not None:
            tensors += [(name, "Tensor?") for name in a.names]
            options += list(a.parts)
        elif a.kind == "option" and a.name not in selectors:
            if a.schema is None:
                raise NotImplementedError(f"{op.name}: option {a.name} declares no torch schema type")
            options.append((a.name, a.schema))
        elif a.kind != "option":
            raise NotImplementedError(f"{op.name}: a {a.kind!r} argument ({a.name}) has no torch.library form yet")
    return tensors + options


def schema(op: Op) -> str:
    arguments = ", ".join(f"{kind} {name}" for name, kind in schema_arguments(op))
    return f"({arguments}) -> ({', '.join('Tensor' for _ in op.outputs)})"


def custom_op(op: Op):
    """torch.ops.mfa_native.<op.name>, registered once per op."""
    if op.name in _REGISTERED:
        return _REGISTERED[op.name]
    names = [name for name, _ in schema_arguments(op)]
    selectors = {o.when for o in op.outputs if o.when is not None and o.when not in names}

    def implementation(*args):
        values = rebuilt(op, dict(zip(names, args), **{name: True for name in selectors}))
        with inside_adapter():
            result = op.function(**values)
        results = result if isinstance(result, tuple) else (result,)
        returned = iter(results)
        like = values[op.leading[0]]
        return tuple(next(returned) if asked(o, values) else like.new_empty(0, dtype=torch.float32)
                     for o in op.outputs)

    def fake(*args):
        values = dict(zip(names, args))
        outputs = []
        for o in op.outputs:
            if not asked(o, {**values, **{name: True for name in selectors}}):
                outputs.append(values[op.leading[0]].new_empty(0, dtype=torch.float32))
                continue
            shape, dtype = o.fake(values)
            dtype = values[dtype].dtype if dtype in values else _torch_dtype(np.dtype(dtype))
            outputs.append(values[op.leading[0]].new_empty(shape, dtype=dtype))
        return tuple(outputs)

    registered = torch.library.custom_op(f"mfa_native::{op.name}", implementation, mutates_args=(),
                                         schema=schema(op))
    registered.register_fake(fake)
    if op.backward is not None:
        _register_autograd(op, registered, names)
    else:
        registered.register_autograd(_no_gradient(op), setup_context=lambda ctx, inputs, output: None)
    _REGISTERED[op.name] = registered
    return registered


def _register_autograd(op: Op, registered, names: list[str]) -> None:
    backward_op = op.backward_op
    backward = custom_op(backward_op)
    backward_names = [name for name, _ in schema_arguments(backward_op)]
    outputs = [o.name for o in op.outputs]
    tensors = [name for name, kind in schema_arguments(op) if kind.startswith("Tensor")]

    def setup_context(ctx, inputs, output) -> None:
        values = dict(zip(names, inputs))
        ctx.counts = {n: len(values[n]) for n in tensors if isinstance(values[n], (list, tuple))}
        ctx.save_for_backward(*(x for n in tensors for x in items(values[n])), *output)
        ctx.options = {n: v for n, v in values.items() if n not in tensors}
        ctx.mark_non_differentiable(*(out for name, out in zip(outputs, output) if f"d{name}" not in backward_names))

    def gradient(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        values = {n: [next(saved) for _ in range(ctx.counts[n])] if n in ctx.counts else next(saved)
                  for n in tensors}
        values.update({**dict(zip(outputs, saved)), **ctx.options})
        values.update({f"d{name}": g for name, g in zip(outputs, grads)})
        for index, name in enumerate(names):
            if any(items(ctx.needs_input_grad[index])) and name not in op.gradients:   # a Tensor[]'s: a list
                raise NotImplementedError(f"{op.name} gives {name} no gradient; pass {name}.detach()")
        results = dict(zip((o.name for o in backward_op.outputs), backward(*(values[n] for n in backward_names))))
        grads_in = []
        for name in names:
            if name in ctx.counts:   # a Tensor[] gets a list (of no gradients)
                grads_in.append([None] * ctx.counts[name])
                continue
            g = results.get(op.gradients.get(name)) if values.get(name) is not None else None
            grads_in.append(None if g is None else g.to(values[name].dtype))
        return tuple(grads_in)

    registered.register_autograd(gradient, setup_context=setup_context)


def rebuilt(op: Op, values: dict) -> dict:
    """The custom op's arguments by name with each "lists" argument rebuilt from its parts."""
    for a in op.arguments:
        if a.kind == "lists":
            taken = {name: values.pop(name) for name in (*a.names, *(part for part, _ in a.parts))}
            values[a.name] = a.rebuild(taken)
    return values


def taken_apart(op: Op, values: dict) -> dict:
    """A call's arguments by name with each "lists" argument's arrays and parts by theirs."""
    values = dict(values)
    for a in op.arguments:
        if a.kind == "lists" and a.take_apart is not None:
            values.update(a.take_apart(values[a.name]))
    return values


def torch_function(op: Op, example: str = ""):
    """`op` for torch tensors through its custom op: autograd and torch.compile, torch allocates
    the outputs; the same arguments (less `device`: CPU tensors run on the default device,
    MPS tensors on the metal device) and results as the op. The custom op is registered now,
    not at the first call, which torch.compile may be tracing. Its docstring is the op's
    (Op.adapter_docstring) with what differs for torch, and `example`."""
    custom_op(op)
    signature = inspect.Signature([p for p in op.parameters() if p.name != "device"])

    def function(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return torch_call(op, op.resolved(dict(bound.arguments)))

    function.__name__ = function.__qualname__ = op.name
    function.__module__ = "mfa_native.torch"   # where it is public (documentation tools resolve it there)
    function.__signature__ = signature
    function.__doc__ = op.adapter_docstring(summary=f"`mfa_native.{op.name}` for torch tensors, {_autograd(op)[0]}.",
                                            notes=_torch_notes(op), raises=_torch_raises(op), example=example)
    return function


def _autograd(op: Op) -> tuple[str, str]:
    """(in the summary, in the notes) what autograd does with the op."""
    if op.backward is None:
        return ("without a backward", f"A gradient asked through it raises NotImplementedError ({op.no_backward}); "
                                      "its outputs are still tied to the inputs that require grad, so the error "
                                      "is never a silent zero.")
    grads = [a.name for a in op.arguments if a.name in op.gradients]
    return ("differentiable", f"Autograd gives {', '.join(grads[:-1])} and {grads[-1]} their gradients, computed by "
                              f"`mfa_native.{op.backward}`.")


_QUANTIZED = (" (a call whose k or v is a QuantizedTensor runs outside it: the tensor is a constant, its fields get "
              "no gradient, and torch.compile breaks the graph there)")


def _torch_notes(op: Op) -> str:
    return textwrap.fill(f"The same op as `mfa_native.{op.name}`, with its arguments (less device) and results, run through "
            f"the custom op torch.ops.mfa_native.{op.name}: torch allocates the outputs (on q's device), and "
            f"torch.compile traces it without a graph break{_QUANTIZED if any(a.quantized for a in op.arguments) else ''}. "
            f"{_autograd(op)[1]} CPU tensors run on the default "
            "device (the cpu backend, or Metal on a Mac), MPS tensors on the metal device; the array arguments "
            "besides the leading ones may also be numpy arrays. The argument descriptions below are the op's.", 92)


def _torch_raises(op: Op) -> str:
    lines = ["TypeError: an array argument that is neither a torch tensor nor a numpy array (nor None where "
             "optional)."]
    if op.backward is None:
        lines.append(f"NotImplementedError: backward through the result ({op.no_backward}).")
    elif any(a.name == "mask" for a in op.arguments):
        lines.append("NotImplementedError: backward asks a gradient of mask, which gets none (pass mask.detach()).")
    return "\n".join(item(line) for line in lines)


def torch_call(op: Op, values: dict):
    """A call of `op` (every argument by name; `device` is the tensors') through its custom op."""
    try:
        registered = custom_op(op)
    except NotImplementedError as error:
        raise NotImplementedError(f"{op.name} has no torch autograd yet ({error}); call it under torch.no_grad() "
                                  "or on detached tensors") from None
    if quantized_values(op, values):
        return _returned(op, values, _WithQuantizedConstants.apply(op, values, *_tensors(op, values).values()))
    kinds = dict(schema_arguments(op))
    converts = {a.name: a.to_schema for a in op.arguments if a.to_schema is not None}
    like = values[op.leading[0]]
    values = taken_apart(op, values)

    def argument(name: str):
        value = values[name]
        if name in converts:
            return converts[name](value)
        if kinds[name] == "Tensor[]":   # a list of arrays, each as a Tensor argument
            return [argument_of(f"{name}[{i}]", x, "Tensor") for i, x in enumerate(items(value))]
        return argument_of(name, value, kinds[name])

    def argument_of(name: str, value, kind: str):
        if kind.startswith("Tensor") and isinstance(value, np.ndarray):   # numpy beside q's tensors
            return _tensor_of(value).to(like.device)
        if kind.startswith("Tensor") and not isinstance(value, torch.Tensor) and \
                not (value is None and kind.endswith("?")):   # the dispatcher's would be a RuntimeError
            raise TypeError(f"{name} must be a torch tensor{' or None' if kind.endswith('?') else ''}, "
                            f"got {type(value).__name__}")
        return value

    return _returned(op, values, registered(*(argument(n) for n in kinds)))


def _tensor_of(array: np.ndarray):
    """A torch view of a numpy array (its strides kept: a huge broadcast array stays a view, to be
    refused by the op's checks), a copy only where torch has no view (negative strides)."""
    try:
        return torch.from_numpy(array)
    except (TypeError, ValueError):
        return torch.from_numpy(np.ascontiguousarray(array))


def _returned(op: Op, values: dict, results: tuple):
    """What the op returns of all its outputs (`results`, in declaration order) for a call with
    `values`: the output alone, or the tuple of those asked."""
    kept = tuple(r for o, r in zip(op.outputs, results) if asked(o, values))
    return kept[0] if len(kept) == 1 and op.outputs[0].when is None and all(
        o.when is not None for o in op.outputs[1:]) else kept


def _tensors(op: Op, values: dict) -> dict[tuple[str, str | None], torch.Tensor]:
    """The tensors of a call, by (argument, None) or, for a QuantizedTensor's fields,
    (argument, field)."""
    tensors = {}
    for a in op.arguments:
        value = values.get(a.name)
        fields = value.fields() if isinstance(value, QuantizedTensor) else {None: value}
        tensors.update({(a.name, f): x for f, x in fields.items() if isinstance(x, torch.Tensor)})
    return tensors


class _WithQuantizedConstants(torch.autograd.Function):
    """A call of an op whose quantized arguments (k, v) are QuantizedTensors, which no custom op
    schema holds: the op runs directly (torch.compile graph-breaks on it), and its backward op
    runs on their dequantize(), rounded to q's dtype. They are constants of the call: autograd
    asking a gradient of one of their fields raises NotImplementedError, as it does for the
    arguments the op gives none (mask)."""

    @staticmethod
    def forward(ctx, op: Op, values: dict, *tensors: torch.Tensor):
        selectors = {o.when: True for o in op.outputs if o.when in op.option_names}
        with inside_adapter():
            result = op.function(**{**values, **selectors})
        results = result if isinstance(result, tuple) else (result,)
        backward_names = set() if op.backward_op is None else {p.name for p in op.backward_op.parameters()}
        ctx.mark_non_differentiable(*(r for o, r in zip(op.outputs, results) if f"d{o.name}" not in backward_names))
        ctx.op, ctx.values, ctx.names = op, values, list(_tensors(op, values))
        ctx.save_for_backward(*tensors, *results)
        return results

    @staticmethod
    def backward(ctx, *grads):
        op, backward_op = ctx.op, ctx.op.backward_op
        if backward_op is None:
            raise NotImplementedError(op.no_backward)
        for (name, field), needed in zip(ctx.names, ctx.needs_input_grad[2:]):
            if needed and (field is not None or name not in op.gradients):
                what = f"{name}.{field} is a field of a QuantizedTensor, a constant" if field else \
                    f"{op.name} gives {name} no gradient"
                raise NotImplementedError(f"{what}; pass it detached")
        saved = ctx.saved_tensors
        outputs = [o.name for o in op.outputs]
        known = {**ctx.values, **{name: x for (name, field), x in zip(ctx.names, saved) if field is None},
                 **dict(zip(outputs, saved[len(ctx.names):])), **{f"d{n}": g for n, g in zip(outputs, grads)}}
        dtype = known[op.leading[0]].dtype
        known.update({name: x.dequantize().to(dtype) for name, x in quantized_values(op, known).items()})
        names = [p.name for p in backward_op.parameters() if p.name != "device"]
        with inside_adapter():
            results = backward_op.function(**{n: known[n] for n in names})
        by_name = dict(zip((o.name for o in backward_op.outputs), results))
        gradients = [by_name.get(op.gradients.get(name)) if field is None else None for name, field in ctx.names]
        return None, None, *(None if g is None else g.to(x.dtype) for g, x in zip(gradients, saved))


def without_gradient(op: Op, values: dict, result):
    """`result` (of an op without a backward, computed without autograd) with its floating
    outputs tied to the call's tensors that require grad (array lists and QuantizedTensor fields
    included) through a function whose backward raises: a gradient asked through the op is an
    error, never a missing or zero one."""
    inputs = [t for a in op.arguments if a.kind in ("array", "arrays") for x in items(values.get(a.name))
              for t in (x.fields().values() if isinstance(x, QuantizedTensor) else [x])
              if isinstance(t, torch.Tensor) and t.requires_grad]
    parts = result.fields() if isinstance(result, QuantizedTensor) else \
        dict(enumerate(result if isinstance(result, tuple) else (result,)))
    tied = [name for name, x in parts.items() if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not inputs or not tied:
        return result
    through = _Raises.apply(op.no_backward, len(inputs), *inputs,
                            *(parts[name] for name in tied))
    parts = {**parts, **dict(zip(tied, through))}
    if isinstance(result, QuantizedTensor):
        return result.with_fields(**parts)
    return tuple(parts.values()) if isinstance(result, tuple) else parts[0]


class _Raises(torch.autograd.Function):
    """Identity on its outputs, tied to its inputs; its backward raises NotImplementedError."""

    @staticmethod
    def forward(ctx, message: str, count: int, *tensors):
        ctx.message = message
        return tuple(t.clone() for t in tensors[count:])

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(ctx.message)


def _no_gradient(op: Op):
    """The autograd formula of an op without a backward: an error, never a zero gradient."""
    def gradient(ctx, *grads):
        raise NotImplementedError(op.no_backward)
    return gradient


def differentiating(op: Op, values: dict):
    """A call torch may differentiate (runtime.frameworks.adapter): through the op's custom op, or
    for an op without a backward computed directly with its outputs tied to the inputs by a
    function whose backward raises."""
    if op.backward is None:
        with inside_adapter():
            result = given_kind.call(op, values)
        return without_gradient(op, values, result)
    return torch_call(op, values)


register_adapter("torch", differentiating)
