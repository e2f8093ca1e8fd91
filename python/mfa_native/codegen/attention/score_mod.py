"""FlexAttention's score_mod as a case of the score facet: the traced expression
(score_expression.py) written into the kernels' MSL, with its derivative.

The user's score is the scaled score s = x * ln 2 of the kernels' log2-domain logit x; the
result r goes back as r * log2(e), so d(new x)/dx = dr/ds, which the terms give by forward
differentiation (`_derivative`): integer and boolean terms and reads have none, `where` takes
the derivative of the branch it takes, floor and ceil have 0, and minimum, maximum and the
clamps split or route it as torch's autograd does. Captured tensor i is the buffer
`score_mod_i` (float32, or int32 for integer and boolean tensors), contiguous, its shape
baked. A read whose index lies outside the tensor's axis (after a negative index counts from
the end, as in torch) makes the element's score NaN: torch raises there, and NaN propagates.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..kernel.msl import float_literal
from ..kernel.sizes import Extent
from .score_expression import COMPARISONS, Term, parse, reads
from .scores import SCORE_TRANSFORMS, Element, ScoreTransform

MSL = {"float": "float", "int": "int", "bool": "bool"}
_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">",
            "ge": ">=", "and": "&&", "or": "||"}
_CALLS = {"exp": "precise::exp", "log": "precise::log", "tanh": "precise::tanh", "sqrt": "precise::sqrt",
          "abs": "abs"}


def tensor_buffer(index: int) -> str:
    """The buffer name of captured tensor `index`."""
    return f"score_mod_{index}"


@SCORE_TRANSFORMS.register
@dataclass(frozen=True)
class ScoreMod(ScoreTransform):
    """A traced score_mod: `text` its expression's canonical text, `tensors` each captured
    tensor's stored dtype ("float": float32, "int": int32) and shape."""

    text: str
    tensors: tuple[tuple[str, tuple[int, ...]], ...] = ()

    positional = True

    def __post_init__(self) -> None:
        axes = reads(self.terms)
        if set(axes) != set(range(len(self.tensors))) or any(len(self.tensors[t][1]) != n for t, n in axes.items()):
            raise ValueError(f"score_mod: the expression reads tensors {axes} (index: axes), the call gives "
                             f"{len(self.tensors)} of shapes {[shape for _, shape in self.tensors]}")

    @cached_property
    def terms(self) -> tuple[Term, ...]:
        return parse(self.text)

    @property
    def catalog(self) -> dict[str, tuple[str, str]]:
        return {tensor_buffer(i): (MSL[dtype], f"{shape} a tensor score_mod reads")
                for i, (dtype, shape) in enumerate(self.tensors)}

    def inputs(self, spec, batches: str) -> dict:
        return {tensor_buffer(i): spec(f"{dtype}32", tuple(Extent(n) for n in shape),
                                       tuple(Extent(int(s)) for s in _contiguous(shape)), logical=False)
                for i, (dtype, shape) in enumerate(self.tensors)}

    def apply(self, x: str, name: str, at: Element) -> tuple[list[str], str, str | None]:
        lines = [f"bool {name}_ok = true;  // score_mod: every captured read in range"] if self.tensors else []
        values, slopes = [], []
        for i, t in enumerate(self.terms):
            value = f"{name}_{i}"
            lines += _read(t, value, values, self.tensors, name) if t.op == "read" else [
                f"const {MSL[t.dtype]} {value} = {_value(t, values, self.terms, x, at)};"]
            values.append(value)
            slope = _derivative(t, values, slopes, self.terms)
            if slope is not None:
                lines.append(f"const float {value}_d = {slope};")
                slope = f"{value}_d"
            slopes.append(slope)
        result = _as(values[-1], self.terms[-1].dtype, "float")
        result = f"({name}_ok ? {result} : NAN)" if self.tensors else result
        return lines, f"{result} * LOG2E", slopes[-1] or "0.0f"

    def describe(self) -> str:
        tensors = (f"; tensor {i}: {dtype} {list(shape)}" for i, (dtype, shape) in enumerate(self.tensors))
        return f"score_mod {self.text}" + "".join(tensors)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))


def _as(value: str, dtype: str, to: str) -> str:
    """`value` of `dtype` as `to`."""
    if dtype == to:
        return value
    return f"({value} != 0)" if to == "bool" else f"{MSL[to]}({value})"


def _constant(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if np.isnan(value):
        return "NAN"
    return float_literal(value) if np.isfinite(value) else ("INFINITY" if value > 0 else "-INFINITY")


def _value(t: Term, values: list[str], terms, x: str, at: Element) -> str:
    """The MSL expression of term `t`, its operands the MSL names `values` of the terms before it."""
    positions = {"score": f"({x} * LN2)", "b": f"int({at.batch})", "h": f"int({at.head})",
                 "q_idx": f"(int({at.query}) - {at.first_query})", "kv_idx": f"(int({at.key}) - {at.first_key})"}
    if t.op in positions:
        return positions[t.op]
    if t.op == "const":
        return _constant(t.value)
    if t.op in ("to_float", "to_int", "to_bool", "not"):
        a = values[t.args[0]]
        source = terms[t.args[0]].dtype
        return f"(!{_as(a, source, 'bool')})" if t.op == "not" else _as(a, source, t.op[3:])
    operands = [terms[i].dtype for i in t.args]
    if t.op == "where":
        c, a, b = (_as(values[i], d, to) for i, d, to in zip(t.args, operands, ("bool", t.dtype, t.dtype)))
        return f"({c} ? {a} : {b})"
    operand_type = ("float" if "float" in operands else "int") if t.op in COMPARISONS else t.dtype
    a, *rest = (_as(values[i], d, operand_type) for i, d in zip(t.args, operands))
    return _operation(t.op, t.dtype, operand_type, a, rest[0] if rest else None)


def _operation(op: str, dtype: str, operand_type: str, a: str, b: str | None) -> str:
    floating = operand_type == "float"
    if op in _SYMBOLS:
        return f"({a} {_SYMBOLS[op]} {b})"
    if op in _CALLS:
        return f"{_CALLS[op]}({a})"
    simple = {"neg": f"(-{a})", "sigmoid": f"(1.0f / (1.0f + precise::exp(-{a})))",
              "floor": f"floor({a})" if floating else a, "ceil": f"ceil({a})" if floating else a}
    if op in simple:
        return simple[op]
    if op == "div":
        return f"precise::divide({a}, {b})"
    if op in ("minimum", "maximum", "clamp_min", "clamp_max"):
        pick = "min" if op in ("minimum", "clamp_max") else "max"
        if dtype == "bool":
            return f"({a} {'&&' if pick == 'min' else '||'} {b})"
        return f"((isnan({a}) || isnan({b})) ? NAN : {pick}({a}, {b}))" if floating else f"{pick}({a}, {b})"
    if op == "floordiv":
        if floating:
            return f"floor(precise::divide({a}, {b}))"
        return f"({a} / {b} - (({a} % {b} != 0 && (({a} < 0) != ({b} < 0))) ? 1 : 0))"
    if floating:   # mod: Python's remainder, the divisor's sign
        return f"({a} - {b} * floor(precise::divide({a}, {b})))"
    return f"(({a} % {b} != 0 && (({a} % {b} < 0) != ({b} < 0))) ? {a} % {b} + {b} : {a} % {b})"


def _read(t: Term, value: str, values: list[str], tensors, name: str) -> list[str]:
    """A read of captured tensor t.value at the terms `t.args`: in range after torch's negative
    wrap, else the element's score is NaN (`name`_ok false)."""
    shape = tensors[t.value][1]
    lines, inside, offset = [], [], []
    for axis, (index, size, stride) in enumerate(zip(t.args, shape, _contiguous(shape))):
        wrapped = f"{value}_i{axis}"
        lines.append(f"const int {wrapped} = {values[index]} < 0 ? {values[index]} + {size} : {values[index]};")
        inside.append(f"uint({wrapped}) < {size}u")
        offset.append(f"{wrapped} * {stride}")
    lines += [f"const bool {value}_in = {' && '.join(inside) or 'true'};", f"{name}_ok = {name}_ok && {value}_in;",
              f"const {MSL[t.dtype]} {value} = {tensor_buffer(t.value)}[{value}_in ? {' + '.join(offset) or '0'} : 0];"]
    return lines


def _derivative(t: Term, values: list[str], slopes: list[str | None], terms) -> str | None:
    """d(term)/d(score) as an MSL expression, None where it is 0 (no dependence, or an integer,
    boolean, floor or ceil term). `values` includes t's own."""
    if t.op == "score":
        return "1.0f"
    if t.dtype != "float" or t.op in ("floor", "ceil", "floordiv", "read"):
        return None
    d = [slopes[i] for i in t.args]
    if all(s is None for s in d):
        return None
    v = [_as(values[i], terms[i].dtype, "float") for i in t.args]
    da, db = (s or "0.0f" for s in (d + [None, None])[:2])
    r = values[-1]
    rules = {
        "add": lambda: f"{da} + {db}", "sub": lambda: f"{da} - {db}", "neg": lambda: f"-{da}",
        "mul": lambda: f"{da} * {v[1]} + {v[0]} * {db}", "div": lambda: f"precise::divide({da} - {r} * {db}, {v[1]})",
        "exp": lambda: f"{r} * {da}", "log": lambda: f"precise::divide({da}, {v[0]})",
        "tanh": lambda: f"(1.0f - {r} * {r}) * {da}", "sigmoid": lambda: f"{r} * (1.0f - {r}) * {da}",
        "sqrt": lambda: f"precise::divide({da}, 2.0f * {r})", "abs": lambda: f"sign({v[0]}) * {da}",
        "to_float": lambda: da, "mod": lambda: f"{da} - floor(precise::divide({v[0]}, {v[1]})) * {db}",
        "minimum": lambda: f"({v[0]} == {v[1]} ? 0.5f * ({da} + {db}) : {v[0]} < {v[1]} ? {da} : {db})",
        "maximum": lambda: f"({v[0]} == {v[1]} ? 0.5f * ({da} + {db}) : {v[0]} > {v[1]} ? {da} : {db})",
        "clamp_min": lambda: f"({v[0]} >= {v[1]} ? {da} : {db})",
        "clamp_max": lambda: f"({v[0]} <= {v[1]} ? {da} : {db})",
    }
    if t.op == "where":
        da, db = (s or "0.0f" for s in d[1:])
        return f"({values[t.args[0]]} ? {da} : {db})"
    return rules[t.op]()
