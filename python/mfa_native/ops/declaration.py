"""One declaration per op: its arguments, outputs, pass, reference and backward, written once.

An `Op` is declared with `Arg`s (name, kind, default, what it is) and `Out`s, the function
that prepares a call's pass (`prepare`: every check, the problem, the pass, for the first
call of a signature), its float64 reference, and its backward (the op computing its
gradients) or why it has none. Everything else is derived from the declaration:

- the public function: a real Python function with the declared signature and a docstring
  whose Args section lists the declared arguments (`Op.function`);
- the warm path: a call's signature is its array arguments' types, shapes, strides and
  dtypes, its options and the device; a seen signature runs its prepared pass directly;
- the caller's array kind: numpy in, numpy out; torch in, torch out; MLX in, MLX out
  (given_kind.py);
- the framework adapters (torch.library ops with autograd, MLX custom functions with a
  vjp; torch/library.py, mlx.py), which read the declaration's arguments, outputs and
  backward, and raise for a gradient an op does not have.

Adding an argument to an op is adding one `Arg` to its declaration (and reading it in the
op's `prepare`): the function, its docstring, the warm signature and the adapters follow.
"""

from __future__ import annotations

import atexit
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..codegen.attention.score_expression import OPERATIONS
from ..quantized import QuantizedTensor
from ..runtime.devices import forget_tuning, resolve_device
from . import given_kind
from .rules import ArrayRule, Checks, checks_data, rule_data
from .warm import SignatureCache, signature

REQUIRED = inspect.Parameter.empty
KINDS = ("array", "arrays", "option", "lists")
OPS: dict[str, Op] = {}   # every declared op, by name


@dataclass(frozen=True)
class Arg:
    """One argument: `kind` "array" (numpy, torch or MLX; None when optional), "arrays" (a
    list or tuple of them), "option" (a plain value), or "lists" (an object holding arrays,
    a BlockMask: `expand(value)` gives its arrays and the part of it the kernels depend on)."""

    name: str
    kind: str
    doc: str
    default: Any = REQUIRED
    keyword: bool = True        # keyword-only; False: positional (or keyword)
    leading: bool = False       # its array kind is the call's (q, k, v)
    grad: bool = False          # a framework may differentiate with respect to it
    quantized: bool = False     # it may be a QuantizedTensor
    written_with: str | None = None   # the op writes it in place when this argument is given (a KV cache's append)
    expand: Callable[[Any], tuple[tuple, Any]] | None = None
    names: tuple[str, ...] = ()   # "lists": the names of the arrays `expand` gives, in order
    schema: str | None = None     # an option's type in a torch.library schema ("float?", "str", "int[]?")
    to_schema: Callable[[Any], Any] | None = None   # an option's value as that type (canonical)
    # "lists" in a torch schema: its arrays as `Tensor?` and `parts` (name, schema type) as options;
    # `take_apart(value)` gives both by name, `rebuild(by_name)` the value again.
    parts: tuple[tuple[str, str], ...] = ()
    take_apart: Callable[[Any], dict] | None = None
    rebuild: Callable[[dict], Any] | None = None
    # A form of its value that stands for others (a score_mod function: its text and tensors),
    # turned into them before anything else: values -> values (Op.resolved).
    resolve: Callable[[dict], dict] | None = None
    rule: ArrayRule | None = None   # an array's dtypes, shape and messages, as data (rules.py)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"argument {self.name}: kind must be one of {KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class Out:
    """One output; `when` names the argument that makes the op return it (return_lse, sinks);
    `fake(values)` gives its (shape, dtype) from the arguments' shapes alone (a dtype is a numpy
    dtype name, or the name of the argument whose dtype it has), for tracing frameworks."""

    name: str
    doc: str
    when: str | None = None
    fake: Callable[[dict], tuple[tuple[int, ...], str]] | None = None
    rule: ArrayRule | None = None   # what a C++ caller's array for it must be (it is written in place)


@dataclass(frozen=True)
class Call:
    """A call's arguments by name, as passed (the first call of a signature reads them)."""

    op: Op
    values: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def results(self) -> str | tuple[str, ...]:
        """The outputs this call returns: a name when it is the one output always returned,
        else a tuple of names (an output whose `when` argument is None or False is left out)."""
        names = tuple(o.name for o in self.op.outputs if asked(o, self.values))
        always = [o.name for o in self.op.outputs if o.when is None]
        return names[0] if names == tuple(always) and len(always) == 1 else names


@dataclass(eq=False)
class Op:
    """A public op, declared once (see the module docstring)."""

    name: str
    summary: str
    arguments: tuple[Arg, ...]
    outputs: tuple[Out, ...]
    prepare: Callable[[Call, Any], tuple[Any, list]]   # (call, device) -> (PreparedCall, this call's inputs)
    details: str = ""                                  # the docstring's text after the Args section
    returns: str = ""                                  # its Returns section: one item (its first line, then more)
    raises: str = ""                                   # its Raises section: "SomeError: when" items
    example: str = ""                                  # python code run as written (tests/python/test_docstring_examples.py)
    reference: Callable | None = None
    backward: str | None = None                        # the name of the op computing its gradients
    gradients: dict[str, str] = field(default_factory=dict)   # argument -> the backward's output
    no_backward: str | None = None                     # why there is none: the error a gradient asked gets, one
                                                       # sentence starting with the op's name
    wrap: Callable[[Any, Call], Any] | None = None     # the result as the op returns it (e.g. a BlockMask)
    key: Callable[[dict], tuple] | None = None         # what else the kernels depend on (v aliasing k)
    # Arguments a value carries, filled in before anything else (a BlockMask's rule): values -> values.
    resolve: Callable[[dict], dict] | None = None
    takes_device: bool = True
    checks: Checks | None = None                       # the checks between its arrays' sizes (rules.py)
    on_metal: str | None = None                        # why Metal-resident arrays are refused, if they are
    calls: SignatureCache = field(default_factory=SignatureCache, repr=False)

    def __post_init__(self) -> None:
        if self.name in OPS:
            raise ValueError(f"op {self.name!r} is declared twice")
        if self.no_backward is not None and not self.no_backward.startswith(self.name + " "):
            raise ValueError(f"op {self.name!r}: no_backward is the whole error, starting with the op's name")
        OPS[self.name] = self
        # The array arguments in signature order (a "lists" argument's arrays by their names).
        self.array_names = tuple(n for a in self.arguments for n in ((a.name,) if a.kind == "array" else a.names))
        self.option_names = tuple(a.name for a in self.arguments if a.kind == "option")
        self._simple = all(a.kind in ("array", "option") for a in self.arguments)
        # Each argument's resolve, then the op's (`resolved`).
        self._resolves = tuple(a.resolve for a in self.arguments if a.resolve is not None) + \
            ((self.resolve,) if self.resolve is not None else ())
        self.function = self._function()

    # -- calls ------------------------------------------------------------------------------

    def call(self, values: dict[str, Any]):
        """A call with every argument by name (defaults filled in)."""
        device, arrays, key, prepared = self._lookup(values)
        if prepared is not None:
            return prepared(arrays)
        prepared, inputs = self.prepare(Call(self, values), device)
        self.calls.put(key, prepared)
        return prepared.run(inputs)

    def resolved(self, values: dict[str, Any]) -> dict[str, Any]:
        """The arguments by name with those a value carries filled in (each argument's `resolve`,
        then the op's), as every entry point (the public function, the framework adapters,
        precompile) takes them first."""
        for resolve in self._resolves:
            values = resolve(values)
        return values

    def precompile(self, values: dict[str, Any]) -> None:
        """Prepares a call with every argument by name (defaults filled in) without running it:
        every check, the pass, its kernels compiled; a later call of the same signature is warm."""
        values = self.resolved(values)
        device, _, key, prepared = self._lookup(values)
        if prepared is None:
            self.calls.put(key, self.prepare(Call(self, values), device)[0])

    def _lookup(self, values: dict[str, Any]) -> tuple:
        """(device, the signature's arrays, the signature, its PreparedCall or None)."""
        device = resolve_device(values.get("device"))
        arrays, options = self._signature_parts(values)
        key = signature(arrays, options, device)
        return device, arrays, key, self.calls.get(key)

    def _signature_parts(self, values: dict[str, Any]) -> tuple[tuple, tuple]:
        """The arrays and options that make a call's signature (and the warm path's arguments)."""
        if self._simple and self.key is None:
            return tuple(values[n] for n in self.array_names), tuple(values[n] for n in self.option_names)
        arrays, options = [], []
        for a in self.arguments:
            value = values[a.name]
            if a.kind == "array":
                arrays.append(value)
            elif a.kind == "option":
                options.append(value)
            elif a.kind == "arrays":
                items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
                arrays += items
                options.append((type(value), len(items)))
            else:
                expanded, structure = a.expand(value)
                arrays += expanded
                options.append(structure)
        if self.key is not None:
            options += self.key(values)
        return tuple(arrays), tuple(options)

    def numpy_call(self, values: dict[str, Any]):
        result = self.call(values)
        return result if self.wrap is None else self.wrap(result, Call(self, values))

    def bound(self, values: dict[str, Any]) -> Call:
        return Call(self, values)

    # -- the public function ----------------------------------------------------------------

    def parameters(self) -> list[inspect.Parameter]:
        kinds = {False: inspect.Parameter.POSITIONAL_OR_KEYWORD, True: inspect.Parameter.KEYWORD_ONLY}
        params = [inspect.Parameter(a.name, kinds[a.keyword], default=a.default) for a in self.arguments]
        if self.takes_device:
            params.append(inspect.Parameter("device", inspect.Parameter.KEYWORD_ONLY, default=None))
        return params

    def docstring(self) -> str:
        """The public function's docstring (Google style, as the API reference renders it): the
        summary, Args (the declared arguments, then device), the details, Returns, Raises (the
        declared ones, then the device's) and Example."""
        device = [("device", 'a Device, "cpu", "metal" or None for the default device (MFA_NATIVE_DEVICE,\n'
                             'else Metal where available, else cpu); another string is a ValueError.')]
        raises = _dedented(self.raises) + ("\n" + item('DeviceUnavailableError: device is "metal" (or the '
                                                               'default device is) where Metal is not available.')
                                                  if self.takes_device else "")
        return document(self.summary, [(a.name, a.doc) for a in self.arguments] + (device if self.takes_device else []),
                        self.details, self.returns, raises.strip() if self.raises or self.takes_device else "",
                        self.example)

    def adapter_docstring(self, *, summary: str, notes: str, raises: str, example: str) -> str:
        """The docstring of this op's function in a framework adapter (mfa_native.torch,
        mfa_native.mlx), which takes the op's arguments less `device` and returns its results:
        `summary` and `notes` say what differs (autograd, arrays, devices), Args and Returns are
        the op's own (one source), Raises the op's then the adapter's, and `example` its own."""
        return document(summary, [(a.name, a.doc) for a in self.arguments], self.details, self.returns,
                        _dedented(self.raises) + "\n" + _dedented(raises), example,
                        intro=notes)

    def _function(self) -> Callable:
        """The public function, written out (so a warm call costs what a hand-written one does):
        numpy leading arrays go straight to `numpy_call`, other kinds through given_kind."""
        params = self.parameters()
        defaults = {f"_default_{p.name}": p.default for p in params if p.default is not REQUIRED}
        text, star = [], False
        for p in params:
            if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
                text.append("*")
                star = True
            text.append(p.name if p.default is REQUIRED else f"{p.name}=_default_{p.name}")
        leading = [a for a in self.arguments if a.leading]
        fast = " and ".join(f"(type({a.name}) is _ndarray" + (f" or _host_quantized({a.name}))" if a.quantized else ")")
                            for a in leading) or "True"
        values = "{" + ", ".join(f"'{p.name}': {p.name}" for p in params) + "}"
        if self._resolves:
            values = f"_resolve({values})"
        source = (f"def {self.name}({', '.join(text)}):\n"
                  f"    if {fast}:\n"
                  f"        return _op.numpy_call({values})\n"
                  f"    return _given_kind(_op, {values})\n")
        namespace = {"_op": self, "_ndarray": np.ndarray, "_host_quantized": _host_quantized,
                     "_given_kind": given_kind.call, "_resolve": self.resolved, **defaults}
        exec(compile(source, f"<mfa_native.{self.name}>", "exec"), namespace)
        function = namespace[self.name]
        function.__doc__ = self.docstring()
        function.__signature__ = inspect.Signature(params)
        function.__qualname__ = self.name
        function.__module__ = "mfa_native"
        function.declaration = self
        return function

    def declaration_data(self) -> dict[str, Any]:
        """What the C++ core reads of this declaration (a bundle carries it): the rules of its
        array arguments (optional: default None) and outputs (optional: returned on request),
        in declaration order, its size checks, and, for an op taking a score_mod, the
        operations its expression text may name and their arities (null: any)."""
        if self.checks is None:
            raise ValueError(f"op {self.name!r} declares no checks as data")
        arrays = [rule_data(a.name, a.rule, "input", a.default is None, a.kind == "arrays")
                  for a in self.arguments if a.rule]
        arrays += [rule_data(o.name, o.rule, "output", o.when is not None) for o in self.outputs if o.rule]
        takes_score_mod = any(a.name == "score_mod" for a in self.arguments)
        scores = {"score_operations": dict(OPERATIONS)} if takes_score_mod else {}
        return {"op": self.name, "arrays": arrays, **checks_data(self.checks), **scores}

    @property
    def backward_op(self) -> Op | None:
        """The declaration of the op computing this one's gradients (None: it has none)."""
        return None if self.backward is None else OPS[self.backward]

    @property
    def leading(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.arguments if a.leading)

    @property
    def others(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.arguments if a.kind in ("array", "arrays") and not a.leading)


def document(summary: str, arguments: list[tuple[str, str]], details: str = "", returns: str = "",
             raises: str = "", example: str = "", *, intro: str = "") -> str:
    """A Google-style docstring (mkdocstrings renders it as Markdown; griffe parses it): the
    summary, the intro (free text), Args (name, text) with continuation lines indented, the
    details (free text), Returns as one item, Raises as "SomeError: when" items (theirs
    continued by an indented line), and Example, a fenced python block."""
    def indented(text: str, first: str, rest: str) -> list[str]:
        lines = inspect.cleandoc(text).splitlines()
        return [first + lines[0].strip()] + [rest + line if line.strip() else "" for line in lines[1:]]

    parts = [summary.strip()] + ([inspect.cleandoc(intro)] if intro else [])
    if arguments:
        lines = ["Args:"]
        for name, text in arguments:
            lines += indented(text, f"    {name}: ", " " * 8)
        parts.append("\n".join(lines))
    if details:
        parts.append(inspect.cleandoc(details))
    if returns:
        parts.append("\n".join(["Returns:"] + indented(returns, " " * 4, " " * 8)))
    if raises:
        parts.append("\n".join(["Raises:"] + [" " * 4 + line for line in _dedented(raises).splitlines()
                                               if line.strip()]))
    if example:
        code = inspect.cleandoc(example).splitlines()
        parts.append("\n".join(["Example:", "    ```python"] + [" " * 4 + line if line.strip() else ""
                                                              for line in code] + ["    ```"]))
    return "\n\n".join(parts)


def _dedented(text: str) -> str:
    """Text without its common indentation (all lines alike: an item's continuation lines keep
    theirs, which inspect.cleandoc, treating the first line apart, would take)."""
    return textwrap.dedent(text).strip("\n")


def item(text: str) -> str:
    """One item of a Raises (or Args) section, wrapped, its continuation lines indented as
    Google style continues an item."""
    return textwrap.fill(" ".join(text.split()), 92, subsequent_indent="    ", break_long_words=False,
                         break_on_hyphens=False)


def asked(output: Out, values: dict) -> bool:
    """Whether a call with `values` asks for `output`: it has no `when`, or its `when` argument
    is an array given or a true option."""
    value = values.get(output.when) if output.when is not None else True
    return value is not None and value is not False


def quantized_values(op: Op, values: dict) -> dict[str, QuantizedTensor]:
    """The arguments of a call that are QuantizedTensors (those its op declares `quantized`), by
    name. The adapters take them for constants: a backward runs on their `dequantize()`."""
    return {a.name: values[a.name] for a in op.arguments
            if a.quantized and isinstance(values.get(a.name), QuantizedTensor)}


def _host_quantized(x) -> bool:
    """Whether x is a QuantizedTensor of numpy fields (numpy arrays are told apart inline)."""
    return type(x) is QuantizedTensor and type(x.data) is np.ndarray


def release_caches() -> None:
    """Drops every op's prepared calls and the devices' tuning facts: the core objects they hold.
    Called at exit: a framework may keep the ops alive past interpreter teardown (torch's op
    registry), and the core objects with them."""
    for op in OPS.values():
        op.calls.clear()
    forget_tuning()


atexit.register(release_caches)


def declared(function: Callable) -> Op:
    """The declaration of a public op function."""
    return function.declaration
