"""Size expressions: the small integer language of pass templates (templates.py).

A template keeps its sizes symbolic, so its grids, extents, strides, derived sizes and
guards are expressions over named sizes, written as C would: integer literals, names,
`+ - * / %` (division and remainder of non-negative integers, rounding down), the
comparisons `== != < <= > >=` and `&& || !` (1 or 0), parentheses, and the functions
`min(a, b, ...)`, `max(a, b, ...)` and `cdiv(a, b)` (division rounding up). The grammar is
small on purpose: the C++ core evaluates the same text (the bundles read templates).

>>> evaluate("cdiv(R * 4, 32) * B", {"R": 9, "B": 2})
4
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping

_BINARY = (("||",), ("&&",), ("==", "!="), ("<", "<=", ">", ">="), ("+", "-"), ("*", "/", "%"))
_FUNCTIONS = {"min": (1, None), "max": (1, None), "cdiv": (2, 2)}


def _tokens(text: str) -> list[str]:
    tokens, i = [], 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c.isdigit() or c.isalpha() or c == "_":
            j = i
            while j < len(text) and (text[j].isalnum() or text[j] == "_"):
                j += 1
            tokens.append(text[i:j])
            i = j
        elif text[i:i + 2] in ("||", "&&", "==", "!=", "<=", ">="):
            tokens.append(text[i:i + 2])
            i += 2
        elif c in "+-*/%<>!(),":
            tokens.append(c)
            i += 1
        else:
            raise ValueError(f"size expression {text!r}: unexpected {c!r}")
    return tokens


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.tokens, self.at = text, _tokens(text), 0

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise ValueError(f"size expression {self.text!r}: expected {expected or 'more'}, got {token!r}")
        self.at += 1
        return token

    def binary(self, level: int = 0):
        if level == len(_BINARY):
            return self.unary()
        node = self.binary(level + 1)
        while self.peek() in _BINARY[level]:
            node = (self.take(), node, self.binary(level + 1))
        return node

    def unary(self):
        if self.peek() in ("!", "-"):
            return ("neg" if self.take() == "-" else "!", self.unary())
        return self.primary()

    def primary(self):
        token = self.take()
        if token == "(":
            node = self.binary()
            self.take(")")
            return node
        if token.isdigit():
            return int(token)
        if not (token[0].isalpha() or token[0] == "_"):
            raise ValueError(f"size expression {self.text!r}: unexpected {token!r}")
        if self.peek() != "(":
            return token
        self.take("(")
        arguments = [self.binary()]
        while self.peek() == ",":
            self.take(",")
            arguments.append(self.binary())
        self.take(")")
        low, high = _FUNCTIONS.get(token, (None, None))
        if low is None or len(arguments) < low or (high is not None and len(arguments) > high):
            raise ValueError(f"size expression {self.text!r}: unknown function or arity {token}/{len(arguments)}")
        return (token, *arguments)


@lru_cache(maxsize=4096)
def parse(text: str):
    """The expression's tree (cached): ints, names, and (operator, operands...) tuples."""
    parser = _Parser(text)
    node = parser.binary()
    if parser.peek() is not None:
        raise ValueError(f"size expression {text!r}: unexpected {parser.peek()!r}")
    return node


def _value(node, sizes: Mapping[str, int]) -> int:
    if isinstance(node, int):
        return node
    if isinstance(node, str):
        if node not in sizes:
            raise ValueError(f"size {node!r} is not given")
        return sizes[node]
    op, *args = node
    if op == "&&":
        return int(bool(_value(args[0], sizes)) and bool(_value(args[1], sizes)))
    if op == "||":
        return int(bool(_value(args[0], sizes)) or bool(_value(args[1], sizes)))
    values = [_value(a, sizes) for a in args]
    if op in ("/", "%", "cdiv") and values[1] <= 0:
        raise ValueError(f"size expression divides by {values[1]}")
    return {
        "neg": lambda: -values[0], "!": lambda: int(not values[0]),
        "+": lambda: values[0] + values[1], "-": lambda: values[0] - values[1], "*": lambda: values[0] * values[1],
        "/": lambda: values[0] // values[1], "%": lambda: values[0] % values[1],
        "cdiv": lambda: -(-values[0] // values[1]),
        "==": lambda: int(values[0] == values[1]), "!=": lambda: int(values[0] != values[1]),
        "<": lambda: int(values[0] < values[1]), "<=": lambda: int(values[0] <= values[1]),
        ">": lambda: int(values[0] > values[1]), ">=": lambda: int(values[0] >= values[1]),
        "min": lambda: min(values), "max": lambda: max(values),
    }[op]()


def evaluate(text: str, sizes: Mapping[str, int]) -> int:
    """The value of size expression `text` for `sizes` (ValueError for a size not given)."""
    return _value(parse(text), sizes)
