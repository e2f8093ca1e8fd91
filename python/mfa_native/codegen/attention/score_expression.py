"""A score_mod as data: the expression a FlexAttention `score_mod(score, b, h, q_idx, kv_idx)`
was traced into (torch/score_mod.py), framework-free, with one canonical text.

An expression is a tuple of `Term`s in evaluation order, the last its result; a term names
its operation, the earlier terms it reads (`args`, by index), its dtype ("float", "int" or
"bool") and, for a constant its value, for a read the captured tensor it reads. The text
(`expression_text`) is the expression's identity: it is what a kernel bakes, what a cache
key and a template's facts hold, and `parse` gives the terms back from it.

The vocabulary (`OPERATIONS`): the five arguments, constants, reads of captured tensors
indexed by integer terms (torch's indexing: a negative index counts from the end), the
arithmetic of floats and integers (integer division and remainder round as Python's),
comparisons, logic, `where`, exp, log, tanh, sigmoid, sqrt, abs, floor, ceil, minimum,
maximum, clamps and casts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ARGUMENTS = {"score": "float", "b": "int", "h": "int", "q_idx": "int", "kv_idx": "int"}
"""score_mod's arguments and their dtypes (FlexAttention's: the scaled score, float32; integers)."""

# operation -> its arity (None: any; a read has one index per axis of its tensor).
OPERATIONS = {
    **{name: 0 for name in ARGUMENTS}, "const": 0, "read": None,
    **{name: 1 for name in ("neg", "abs", "exp", "log", "tanh", "sigmoid", "sqrt", "floor", "ceil", "not",
                             "to_float", "to_int", "to_bool")},
    **{name: 2 for name in ("add", "sub", "mul", "div", "floordiv", "mod", "minimum", "maximum", "clamp_min",
                             "clamp_max", "eq", "ne", "lt", "le", "gt", "ge", "and", "or")},
    "where": 3,
}
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
FLOAT_ONLY = ("exp", "log", "tanh", "sigmoid", "sqrt", "div")
DTYPES = ("float", "int", "bool")


@dataclass(frozen=True)
class Term:
    """One operation of an expression: `op` (an OPERATIONS name), the indices of the earlier
    terms it reads, its dtype; a constant's value, or a read's tensor index."""

    op: str
    args: tuple[int, ...]
    dtype: str
    value: float | int | bool | None = None


def result_dtype(op: str, dtypes: tuple[str, ...]) -> str:
    """The dtype of `op` applied to terms of `dtypes` (torch's promotion among float, int, bool)."""
    if op in COMPARISONS or op in ("and", "or", "not", "to_bool"):
        return "bool"
    if op in FLOAT_ONLY or op == "to_float":
        return "float"
    if op == "to_int":
        return "int"
    operands = dtypes[1:] if op == "where" else dtypes
    if "float" in operands:
        return "float"
    return "bool" if op in ("where", "minimum", "maximum") and set(operands) == {"bool"} else "int"


def term(op: str, args: tuple[int, ...], dtypes: tuple[str, ...], value=None) -> Term:
    """The term of `op` on terms of `dtypes`, its dtype derived."""
    if op == "const":
        return Term(op, (), "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "float",
                    value)
    if op in ARGUMENTS:
        return Term(op, (), ARGUMENTS[op])
    return Term(op, tuple(args), result_dtype(op, tuple(dtypes)), value)


def expression_text(terms: tuple[Term, ...]) -> str:
    """The canonical text: one `dtype op[value](args)` per term, joined by "; "."""
    return "; ".join(f"{t.dtype} {t.op}{'' if t.value is None else f'[{t.value!r}]'}({','.join(map(str, t.args))})"
                     for t in terms)


class Untraceable(ValueError):
    """What a score_mod tracer cannot compile (a ValueError naming it)."""


class Builder:
    """The terms a tracer builds (torch/score_mod.py, mlx_score_mod.py), and the captured
    tensors they read, each once, by identity."""

    def __init__(self) -> None:
        self.terms: list[Term] = []
        self.tensors: list = []

    def add(self, op: str, args=(), value=None) -> int:
        """Appends `op` on the terms `args` (or a constant `value`); its index."""
        self.terms.append(term(op, tuple(args), tuple(self.terms[a].dtype for a in args), value))
        return len(self.terms) - 1

    def read(self, tensor, shape: tuple[int, ...], dtype: str, indices: list[int]) -> int:
        """A read of captured `tensor` (of `shape`; its elements' dtype "float", "int" or
        "bool") at the index terms; ValueError unless every axis is indexed by an integer."""
        if len(indices) != len(shape):
            raise Untraceable(f"score_mod: a captured tensor of shape {tuple(shape)} is indexed by "
                             f"{len(indices)} index(es): index every axis with b, h, q_idx, kv_idx expressions")
        if any(self.terms[i].dtype == "float" for i in indices):
            raise Untraceable("score_mod: a captured tensor is indexed by a float expression: cast it to an integer")
        number = next((i for i, t in enumerate(self.tensors) if t is tensor), len(self.tensors))
        if number == len(self.tensors):
            self.tensors.append(tensor)
        self.terms.append(Term("read", tuple(indices), dtype, number))
        return len(self.terms) - 1

    def text(self, result: int) -> str:
        """The canonical text with term `result` last (an earlier term repeated, plus 0)."""
        if result != len(self.terms) - 1:
            self.add("add", (result, self.add("const", value=0)))
        return expression_text(tuple(self.terms))


# A term of the canonical text: `dtype op[value](args)`, the value (optional) True, False, an
# integer or a float as repr prints it, the args term indices; ASCII only. The C++ core reads
# the same grammar (src/core/score_expression.cpp).
_NUMBER = r"True|False|-?\d+|-?(?:\d+\.\d*(?:e[+-]\d+)?|\d+e[+-]\d+|inf)|nan"
_TERM = re.compile(rf"(float|int|bool) (\w+)(?:\[({_NUMBER})\])?\(((?:\d+(?:,\d+)*)?)\)", re.ASCII)


def parse(text: str) -> tuple[Term, ...]:
    """The terms of an expression's canonical text; ValueError naming what is not one (a part
    off the grammar, an operation not in OPERATIONS, a read without a tensor index, a term
    read before it is computed, operands not the operation's arity)."""
    terms = []
    for index, part in enumerate(text.split("; ")):
        match = _TERM.fullmatch(part)
        if (match is None or match.group(2) not in OPERATIONS
                or (match.group(2) == "read" and not (match.group(3) or "").isdigit())):
            raise ValueError(f"score_mod: term {index} of the expression text is not a term: {part!r}")
        dtype, op, value, args = match.groups()
        args = tuple(int(a) for a in args.split(",")) if args else ()
        if any(a >= index for a in args):
            raise ValueError(f"score_mod: term {index} ({part!r}) reads a term not before it")
        if OPERATIONS[op] is not None and len(args) != OPERATIONS[op]:
            raise ValueError(f"score_mod: term {index} ({part!r}) gives {op} {len(args)} operands; it takes "
                             f"{OPERATIONS[op]}")
        terms.append(Term(op, args, dtype, None if value is None else _value(value)))
    return tuple(terms)


def _value(text: str) -> float | int | bool:
    if text in ("True", "False"):
        return text == "True"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return float(text)


def reads(terms: tuple[Term, ...]) -> dict[int, int]:
    """The captured tensors the expression reads: tensor index -> its axis count."""
    return {t.value: len(t.args) for t in terms if t.op == "read"}
