"""An MLX score_mod traced into the expression the kernels compile
(codegen/attention/score_expression.py), as torch/score_mod.py traces a torch one.

MLX has no tracer to hand over its graph, so `trace(score_mod)` runs the callable once on
stand-ins: its five arguments are `Traced` values whose Python operators and methods append
terms, and, in a copy of the function, the names its code reads that hold `mlx.core` (or
`mlx`) hold a stand-in whose functions (mx.where, mx.tanh, ...) append terms too, the MLX
arrays it captured (a closure cell, a global) become `Captured` stand-ins whose indexing
appends a read, and the Python functions it calls (helpers) are copied the same way. What
falls outside the vocabulary (another mx function, a cast to a 16-bit float, Python
branching on a value) is a ValueError naming it.
"""

from __future__ import annotations

import types

import mlx.core as mx
import numpy as np

from .codegen.attention.score_expression import ARGUMENTS, Builder, Untraceable
from .score_mod_traces import TraceCache, names

_INTEGERS = (mx.int8, mx.int16, mx.int32, mx.int64, mx.uint8, mx.uint16, mx.uint32, mx.uint64)
_UNARY = {"abs": "abs", "exp": "exp", "log": "log", "tanh": "tanh", "sigmoid": "sigmoid", "sqrt": "sqrt",
          "floor": "floor", "ceil": "ceil", "negative": "neg", "logical_not": "not"}
_BINARY = {"add": "add", "subtract": "sub", "multiply": "mul", "divide": "div", "floor_divide": "floordiv",
           "remainder": "mod", "minimum": "minimum", "maximum": "maximum", "equal": "eq", "not_equal": "ne",
           "less": "lt", "less_equal": "le", "greater": "gt", "greater_equal": "ge", "logical_and": "and",
           "logical_or": "or"}
_DTYPES = {"float32", "float16", "bfloat16", "bool_", *(f"{s}int{n}" for s in ("", "u") for n in (8, 16, 32, 64))}


class Traced:
    """A value of the expression: term `index` of `builder`. Its arithmetic, comparison and
    logic operators (and those with a number on the left) append terms (`_OPERATORS`)."""

    __hash__ = None

    def __init__(self, builder: Builder, index: int) -> None:
        self.builder, self.index = builder, index

    def apply(self, op: str, *others, reverse: bool = False) -> Traced:
        """`op` of this value and `others` (with `reverse`, of the one other and this)."""
        args = [self.index, *(_term(self.builder, o) for o in others)]
        if op in ("and", "or", "not") and any(self.builder.terms[a].dtype != "bool" for a in args):
            _refuse(f"'{op}' of a non-boolean value (bitwise integer logic)")
        return Traced(self.builder, self.builder.add(op, args[::-1] if reverse else args))

    def __neg__(self) -> Traced:
        return self.apply("neg")

    def __abs__(self) -> Traced:
        return self.apply("abs")

    def __invert__(self) -> Traced:
        return self.apply("not")

    def __pow__(self, power) -> Traced:
        if not (isinstance(power, int) and 1 <= power <= 4):
            _refuse(f"** {power!r} (small integer powers 1 to 4)")
        result = self
        for _ in range(power - 1):
            result = result.apply("mul", self)
        return result

    def astype(self, dtype) -> Traced:
        if dtype == mx.bool_:
            return self.apply("to_bool")
        if dtype == mx.float32:
            return self.apply("to_float")
        if dtype in _INTEGERS:
            return self.apply("to_int")
        return _refuse(f"astype({dtype}) (the kernels compute scores in float32: cast to float32 or an integer)")

    def square(self) -> Traced:
        return self.apply("mul", self)

    def __bool__(self) -> bool:
        return _refuse("Python branching on a traced value (use mx.where)")


_OPERATORS = {"add": "add", "sub": "sub", "mul": "mul", "truediv": "div", "floordiv": "floordiv", "mod": "mod",
              "and": "and", "or": "or"}
_COMPARISONS = {"lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne"}
for _name, _op in {**_OPERATORS, **_COMPARISONS}.items():
    setattr(Traced, f"__{_name}__", lambda self, other, op=_op: self.apply(op, other))
for _name, _op in _OPERATORS.items():   # a number on the left: the order matters where it does not commute
    setattr(Traced, f"__r{_name}__",
            lambda self, other, op=_op: self.apply(op, other, reverse=op in ("sub", "div", "floordiv", "mod")))
for _name in ("abs", "exp", "log", "sqrt"):
    setattr(Traced, _name, lambda self, op=_name: self.apply(op))
del _name, _op


class Captured:
    """A captured MLX array: indexing it (every axis, by integer values) reads it."""

    def __init__(self, builder: Builder, array: mx.array) -> None:
        self.builder, self.array = builder, array

    def __getitem__(self, index) -> Traced:
        indices = index if isinstance(index, tuple) else (index,)
        dtype = "bool" if self.array.dtype == mx.bool_ else "float" if mx.issubdtype(self.array.dtype, mx.floating) \
            else "int"
        terms = [_term(self.builder, i) for i in indices]
        return Traced(self.builder, self.builder.read(self.array, tuple(self.array.shape), dtype, terms))


def _term(builder: Builder, value) -> int:
    """The term of an operand: a traced value's, a number's constant, a 0-d captured array's read."""
    if isinstance(value, Traced):
        return value.index
    if isinstance(value, Captured) and value.array.ndim == 0:
        return value[()].index
    if isinstance(value, np.generic):   # a numpy scalar: its Python number
        value = value.item()
    if isinstance(value, (bool, int, float)):
        return builder.add("const", value=value)
    return _refuse(f"an operand {value!r} that is neither a traced value nor a number")


def _refuse(what: str):
    raise Untraceable(f"score_mod uses {what}, which mfa_native cannot compile: the vocabulary is arithmetic, "
                     "comparisons, logic, mx.where, exp, log, tanh, sigmoid, sqrt, abs, minimum, maximum, floor, "
                     "ceil, clip, small integer powers, casts, and captured arrays indexed by b, h, q_idx and kv_idx "
                     "expressions")


class _StandIn:
    """`mlx.core` as the traced function sees it: its dtypes, and the functions of the
    vocabulary on traced values."""

    def __init__(self, builder: Builder) -> None:
        self._builder = builder

    def __getattr__(self, name: str):
        if name in _DTYPES:
            return getattr(mx, name)
        if name in _UNARY:
            return lambda x: Traced(self._builder, self._builder.add(_UNARY[name], (_term(self._builder, x),)))
        if name in _BINARY:
            return lambda x, y: Traced(self._builder, self._builder.add(
                _BINARY[name], (_term(self._builder, x), _term(self._builder, y))))
        if name == "where":
            return lambda c, x, y: Traced(self._builder, self._builder.add(
                "where", tuple(_term(self._builder, v) for v in (c, x, y))))
        if name == "square":
            return lambda x: Traced(self._builder, _term(self._builder, x)).square()
        if name == "clip":
            return self._clip
        if name == "array":
            return lambda value, dtype=None: value if dtype is None else Traced(
                self._builder, _term(self._builder, value)).astype(dtype)
        value = getattr(mx, name, None)
        if isinstance(value, (int, float)):   # mx.inf, mx.pi, mx.e
            return value
        return _refuse(f"mx.{name}")

    def _clip(self, x, a_min=None, a_max=None) -> Traced:
        value = Traced(self._builder, _term(self._builder, x))
        value = value if a_min is None else value.apply("clamp_min", a_min)
        return value if a_max is None else value.apply("clamp_max", a_max)


def trace(score_mod) -> tuple[str, list[mx.array]]:
    """The expression text of an MLX `score_mod(score, b, h, q_idx, kv_idx)` and the arrays it
    reads (in the order the text numbers them); ValueError for what it cannot compile."""
    builder = Builder()
    arguments = [Traced(builder, builder.add(name)) for name in ARGUMENTS]
    if not isinstance(score_mod, types.FunctionType):
        raise TypeError(f"score_mod must be a Python function, got {type(score_mod).__name__}")
    try:
        result = _with_stand_ins(score_mod, builder, {})(*arguments)
    except Untraceable:
        raise
    except Exception as error:   # real mx met a stand-in, a wrong signature, ...
        raise ValueError(f"score_mod could not be traced ({type(error).__name__}: {error}): it must compute with "
                         "mlx.core functions and operators on its arguments, named in its own code") from error
    return builder.text(_term(builder, result)), list(builder.tensors)


def _with_stand_ins(function: types.FunctionType, builder: Builder, copies: dict):
    """A copy of `function` whose globals, closure cells and defaults hold stand-ins in place
    of mlx.core, mlx, MLX arrays and the Python functions it calls (`copies`: those made)."""
    import mlx
    if function in copies:
        return copies[function]
    scope, cells = dict(function.__globals__), tuple(types.CellType() for _ in function.__closure__ or ())
    copy = types.FunctionType(function.__code__, scope, function.__name__, None, cells)
    copies[function] = copy   # before the functions it names, which may name it

    def replaced(value):
        if value is mx:
            return _StandIn(builder)
        if value is mlx:
            return types.SimpleNamespace(core=_StandIn(builder))
        if isinstance(value, mx.array):
            return Captured(builder, value)
        if isinstance(value, types.FunctionType):
            return _with_stand_ins(value, builder, copies)
        return value

    scope.update({name: replaced(scope[name]) for name in names(function.__code__) if name in scope})
    for cell, original in zip(cells, function.__closure__ or ()):
        cell.cell_contents = replaced(original.cell_contents)
    copy.__defaults__ = None if function.__defaults__ is None else tuple(replaced(d) for d in function.__defaults__)
    copy.__kwdefaults__ = {k: replaced(d) for k, d in (function.__kwdefaults__ or {}).items()} or None
    return copy


TRACES = TraceCache(trace, mx.array)
"""The traces kept per plain function (score_mod_traces.py)."""
