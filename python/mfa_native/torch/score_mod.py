"""FlexAttention's score_mod traced into an expression the kernels compile
(codegen/attention/score_expression.py).

`trace(score_mod)` runs the callable once under torch's make_fx on one-element tensors (the
score float32; b, h, q_idx, kv_idx int32, as FlexAttention's vmap hands them), so Python
operators and torch functions alike arrive as aten operations, and translates each into a
term; a tensor the callable captured becomes a read of that tensor, indexed by the terms its
index expressions gave (every axis indexed). An aten operation outside the vocabulary is a
ValueError naming it.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..codegen.attention.score_expression import ARGUMENTS, Builder
from ..score_mod_traces import TraceCache

aten = torch.ops.aten

# aten overload packet -> the term's operation, its operands in order.
_DIRECT = {
    aten.add: "add", aten.sub: "sub", aten.mul: "mul", aten.div: "div", aten.neg: "neg", aten.abs: "abs",
    aten.exp: "exp", aten.log: "log", aten.tanh: "tanh", aten.sigmoid: "sigmoid", aten.sqrt: "sqrt",
    aten.floor: "floor", aten.ceil: "ceil", aten.minimum: "minimum", aten.maximum: "maximum",
    aten.floor_divide: "floordiv", aten.remainder: "mod", aten.clamp_min: "clamp_min", aten.clamp_max: "clamp_max",
    aten.eq: "eq", aten.ne: "ne", aten.lt: "lt", aten.le: "le", aten.gt: "gt", aten.ge: "ge",
    aten.logical_and: "and", aten.logical_or: "or", aten.logical_not: "not", aten.bitwise_and: "and",
    aten.bitwise_or: "or", aten.bitwise_not: "not", aten.where: "where",
}
_BITWISE = (aten.bitwise_and, aten.bitwise_or, aten.bitwise_not)   # the logic of booleans only

# Shape bookkeeping on the one-element tensors, and copies: the value passes through.
_SAME = (aten.view, aten._unsafe_view, aten.reshape, aten.squeeze, aten.unsqueeze, aten.expand, aten.alias,
         aten.clone, aten.detach, aten.lift_fresh_copy, aten.contiguous)


class _Expression(Builder):
    """The terms being built from a torch.fx graph, and the captured tensors they read."""

    def operand(self, value, nodes: dict) -> int:
        """The term of an operation's operand: a traced node's, or a constant's."""
        if isinstance(value, torch.fx.Node):
            found = nodes[value]
            if isinstance(found, torch.Tensor):
                return self.read_tensor(found, [])
            return found
        if isinstance(value, (bool, int, float)):
            return self.add("const", value=value)
        raise ValueError(f"score_mod: an operand {value!r} is neither a traced value nor a number")

    def read_tensor(self, tensor: torch.Tensor, indices: list[int]) -> int:
        """A read of captured `tensor` (the same tensor, one buffer) at the index terms."""
        dtype = "float" if tensor.is_floating_point() else "bool" if tensor.dtype == torch.bool else "int"
        return self.read(tensor, tuple(tensor.shape), dtype, indices)


def trace(score_mod) -> tuple[str, list[torch.Tensor]]:
    """The expression text of `score_mod(score, b, h, q_idx, kv_idx)` and the tensors it reads
    (in the order the text numbers them); ValueError for an operation it cannot compile."""
    example = (torch.zeros(1), *(torch.zeros(1, dtype=torch.int32) for _ in range(4)))
    try:
        graph = make_fx(score_mod)(*example).graph
    except Exception as error:   # data-dependent Python control flow, a wrong signature, ...
        raise ValueError(f"score_mod could not be traced ({type(error).__name__}: {error}): it must compute with "
                         "torch operations on its arguments, without Python branches on their values") from error
    expression, nodes = _Expression(), {}
    placeholders = iter(ARGUMENTS)
    for node in graph.nodes:
        if node.op == "placeholder":
            nodes[node] = expression.add(next(placeholders))
        elif node.op == "get_attr":
            nodes[node] = getattr(graph.owning_module, node.target)
        elif node.op == "call_function":
            nodes[node] = _translate(node, nodes, expression)
        elif node.op == "output":
            (result,) = node.args
            text = expression.text(expression.operand(result, nodes))
    return text, expression.tensors


def _translate(node, nodes: dict, expression: _Expression):
    """The term (or captured tensor) of one aten call."""
    packet, args, kwargs = node.target.overloadpacket, node.args, node.kwargs
    operand = lambda value: expression.operand(value, nodes)   # noqa: E731
    if packet in _SAME:
        return nodes[args[0]]
    if packet is aten.index:
        tensor, indices = nodes[args[0]], args[1]
        if not isinstance(tensor, torch.Tensor) or any(i is None for i in indices):
            raise ValueError("score_mod: only captured tensors are indexed, at every axis, by index expressions")
        return expression.read_tensor(tensor, [operand(i) for i in indices])
    if packet in (aten.scalar_tensor, aten.full_like, aten.zeros_like, aten.ones_like):
        value = {aten.zeros_like: 0, aten.ones_like: 1}.get(packet, args[-1] if packet is not aten.scalar_tensor
                                                          else args[0])
        return expression.add("const", value=float(value) if _floating(node) else value)
    if packet is aten._to_copy:
        dtype = kwargs.get("dtype")
        if dtype is None:   # a device or layout move: the value passes through
            return nodes[args[0]]
        kind = "to_bool" if dtype is torch.bool else "to_float" if dtype.is_floating_point else "to_int"
        return expression.add(kind, (operand(args[0]),))
    if packet is aten.clamp:
        low, high = (list(args[1:]) + [None, None])[:2]
        value = operand(args[0])
        value = value if low is None else expression.add("clamp_min", (value, operand(low)))
        return value if high is None else expression.add("clamp_max", (value, operand(high)))
    if packet is aten.rsub:
        return expression.add("sub", (operand(args[1]), operand(args[0])))
    if packet is aten.pow and isinstance(args[1], int) and 1 <= args[1] <= 4:
        base = operand(args[0])
        power = base
        for _ in range(args[1] - 1):
            power = expression.add("mul", (power, base))
        return power
    logical = packet not in _BITWISE or all(expression.terms[operand(a)].dtype == "bool" for a in args)
    if packet in _DIRECT and logical and kwargs.get("alpha", 1) == 1 and kwargs.get("rounding_mode") in (None, "floor"):
        op = "floordiv" if kwargs.get("rounding_mode") == "floor" else _DIRECT[packet]
        return expression.add(op, tuple(operand(a) for a in args))
    raise ValueError(f"score_mod uses {node.target}, which mfa_native cannot compile: the vocabulary is "
                     "arithmetic, comparisons, logic, where, exp, log, tanh, sigmoid, sqrt, abs, minimum, maximum, "
                     "floor, ceil, clamp, small integer powers, casts, and captured tensors indexed by b, h, q_idx "
                     "and kv_idx expressions")


def _floating(node) -> bool:
    value = node.meta.get("val")
    return value is not None and value.is_floating_point()


TRACES = TraceCache(trace, torch.Tensor)
"""The traces kept per plain function (score_mod_traces.py)."""
