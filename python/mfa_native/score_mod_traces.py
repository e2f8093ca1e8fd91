"""A score_mod traced once, not on every call: a `TraceCache` keeps a function's trace (by a
framework's tracer: torch/score_mod.py, mlx_score_mod.py) while everything the function can
see is what it saw then.

What a plain Python function sees is its code, its defaults, its closure's cells and the
module globals its code names (and those of functions it names, recursively). Each is
fingerprinted: an array of the framework by its identity, shape, dtype and device (its values
are read by the kernels at each call, so in-place updates, an optimizer's steps, need no new
trace); a number, string or None by its value; a function by its own fingerprint; a module by
its identity; a tuple or list by its items. A function that sees anything else (an object
whose attributes it may read, such as an nn.Module's `self`), or a callable that is not a
plain function, has no fingerprint and is traced on every call, so rebinding what it reads can
never leave a stale trace in use.
"""

from __future__ import annotations

import types
import weakref
from typing import Callable

_PLAIN = (bool, int, float, complex, str, bytes, type(None))


class _Unknown(Exception):
    """Something a function sees that no fingerprint can stand for."""


def names(code: types.CodeType) -> set[str]:
    """The names a code object and the code objects it holds (nested functions) look up."""
    found = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            found |= names(constant)
    return found


class TraceCache:
    """`traced(score_mod)`: `trace(score_mod)` (text, arrays), kept per plain function while it
    sees what it saw then; `arrays` is the framework's array type."""

    def __init__(self, trace: Callable, arrays: type) -> None:
        self.trace, self.arrays = trace, arrays
        self._traces = weakref.WeakKeyDictionary()   # function -> (fingerprint, seen, text, arrays)

    def traced(self, score_mod) -> tuple[str, list]:
        if not isinstance(score_mod, types.FunctionType):
            return self.trace(score_mod)
        seen: list = [score_mod.__code__]
        try:
            fingerprint = self._function_print(score_mod, seen)
        except (_Unknown, ValueError):   # ValueError: an empty cell
            return self.trace(score_mod)
        kept = self._traces.get(score_mod)
        if kept is not None and kept[0] == fingerprint:
            return kept[2], kept[3]
        text, arrays = self.trace(score_mod)
        self._traces[score_mod] = (fingerprint, seen, text, arrays)
        return text, arrays

    def _print(self, value, seen: list, depth: int):
        """The fingerprint of one value a function sees; `seen` keeps the values alive, so no
        identity in a fingerprint is reused while its trace is kept."""
        seen.append(value)
        if isinstance(value, self.arrays):
            return ("array", id(value), tuple(value.shape), value.dtype, getattr(value, "device", None))
        if isinstance(value, _PLAIN):
            return (type(value), value)
        if isinstance(value, types.ModuleType):
            return ("module", id(value))
        if isinstance(value, types.FunctionType):
            return self._function_print(value, seen, depth + 1)
        if isinstance(value, (tuple, list)):
            return (type(value), tuple(self._print(item, seen, depth) for item in value))
        raise _Unknown

    def _function_print(self, function: types.FunctionType, seen: list, depth: int = 0):
        if depth > 8:
            raise _Unknown
        scope = function.__globals__
        return (id(function.__code__), self._print(function.__defaults__, seen, depth),
                tuple(self._print(cell.cell_contents, seen, depth) for cell in function.__closure__ or ()),
                tuple((name, self._print(scope[name], seen, depth)) for name in sorted(names(function.__code__))
                      if name in scope))
