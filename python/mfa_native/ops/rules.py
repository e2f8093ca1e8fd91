"""What an op's array arguments must be, as plain data both Python and the C++ core read.

An array argument (or output) declares an `ArrayRule`: its dtype set (or the argument whose
dtype it has), its shape as size names in logical order (the layout option orders the axes
of a `layout` rule; one of lower rank than the layout's order takes the order of its axes:
(B, Hq, R) is (B, R, Hq) in "bshd"), whether it binds the sizes or is checked against them, whether it may
broadcast, whether the op writes it in place, and the messages a call breaking the rule
gets. An op's `Checks` add what holds between sizes (`Require`: a size expression,
runtime/expressions.py's grammar, and its message) and sizes derived from others.

An array checked against sizes already bound binds the size names its shape adds (a token
list's `topk`), may carry requirements on them (checked once it is), may need other arguments given with it
(`needs`: each name and the message its absence gets), and may declare checks of its contents
(`Content`: int32 values read on every call, before anything is written; a kind of CONTENTS,
bounded by a size expression where it compares with one, applying where its `when` expression
holds). Some kinds compare with per-row counts another array gives (`Lengths`, an op's Checks
names them: a batch's cached keys plus the rows appended, a sequence's keys from seqused_k or
cu_seqlens_k's steps): the lengths fit a bound ("fits"), the array's entries lie within them
("within"), or a block table's entries that the rows read name one of `bound` pages ("pages").
`check_arrays` checks a call's arrays in declaration order, every form before any contents, as
the C++ binder does. An op's `own` arrays are checked after those it shares with attention
(Python's `validate`).

A shape may start with `...` (LEADING): any number of leading axes, the call's (an array
(..., D) of any rank, its rows): the binding array declaring them gives them, every other
array declaring them must have the same (a rule with leading axes has no layout). The op may
give texts of its own (its options, as `{format}`), which fill messages and may stand for a
dtype (`dtypes=("{data_dtype}",)`: a dtype the options choose).

A list argument (kind "arrays") declares the rule of each element; element i is named
`{name}[i]` (`{outputs[0].shape}`), and the element being checked is `{name}` too, with
`{name.element}` its name. A binding list's first element binds; every other element is
checked by the rule, or, when it declares `unlike_error`, must have the first's dtype and
shape (a ValueError naming both: one message for a list of one kind).

Messages are templates: `{q.shape}`, `{q.dtype}`, `{q.axes}` (its size names in the
layout's order), `{q.expected}` (the shape it must have), in a content message the entry
breaking it (`{q.index}`, `{q.value}`; `{q.min}`, the smallest, for "nonnegative";
`{q.prior_index}` and `{q.prior}`, the entry before, for "nondecreasing"; `{q.limit}`, the
length it passes, for "within"; `{q.row}`, `{q.column}` and `{q.last}`, bound - 1, for
"pages"; for "fits", `{q.index}` and `{q.value}` are the longest row's; `{q.source}`, the
array the lengths came from), `{layout}` and any
bound size (`{Hq}`, or `{k_D}`: the extent a binding array gave a name). A dtype outside an
array's set raises its `dtype_raises` (TypeError unless it says ValueError). `Binding` runs
the checks in Python; a bundle carries `Op.declaration_data()` (the same data as JSON) and
the C++ binder (src/core/binder.cpp) runs them there, so both give the same message for the
same call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from ..runtime.expressions import evaluate

ERRORS = {"TypeError": TypeError, "ValueError": ValueError}
READS = ("strided", "strided_broadcast", "contiguous")   # how the kernels address it (view_packing.hpp)
LEADING = "..."   # a shape's first entry: the call's leading axes, any number
# The content checks (Content.kind): "nonnegative", no entry below 0; "first" and "last", the
# first and last entries equal to the bound; "nondecreasing", no entry below the one before it;
# "fits", no length above the bound; "within", entry i no more than length i; "pages", entry
# j of a table's row b (its last axis' rows) in 0 .. bound - 1 where row b reads it
# (j < cdiv(length b, page)).
CONTENTS = ("nonnegative", "first", "last", "nondecreasing", "fits", "within", "pages")
BOUNDED = ("first", "last", "fits", "pages")   # the kinds that take a bound
OF_LENGTHS = ("fits", "within", "pages")   # the kinds that read lengths


@dataclass(frozen=True)
class Content:
    """A check of an int32 array's values: `kind` one of CONTENTS, `message` the template of
    its refusal (a ValueError), `bound` the size expression a bounded kind compares with,
    `when` a size expression: the check applies where it holds (None: always), `lengths` the
    Lengths a kind of OF_LENGTHS reads (by its name in the op's Checks), and `page` the size
    expression of the rows a "pages" table's entry holds."""

    kind: str
    message: str
    bound: str | None = None
    when: str | None = None
    lengths: str | None = None
    page: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in CONTENTS:
            raise ValueError(f"a content check's kind must be one of {CONTENTS}, got {self.kind!r}")
        if (self.bound is None) == (self.kind in BOUNDED):
            raise ValueError(f"a content check of kind {self.kind!r} takes a bound if and only if it is one of "
                             f"{BOUNDED}")
        if (self.lengths is None) == (self.kind in OF_LENGTHS) or (self.page is None) == (self.kind == "pages"):
            raise ValueError(f"a content check of kind {self.kind!r} takes lengths if and only if it is one of "
                             f"{OF_LENGTHS}, and a page if and only if it is 'pages'")


@dataclass(frozen=True)
class Lengths:
    """Per-row counts some content checks read: the entries of the first of `sources` the call
    gives (an array's name, (name, True) for its steps: entry i + 1 less entry i, a cu_seqlens'
    rows), plus the entries of array `plus` where it names one, plus the size expression
    `offset`; or, when it gives none, `fill` for each of `rows` rows (no fill: the checks
    reading them are skipped)."""

    sources: tuple[tuple[str, bool], ...]
    offset: str = "0"
    plus: str | None = None
    fill: str | None = None
    rows: str | None = None

    def __post_init__(self) -> None:
        if (self.fill is None) != (self.rows is None):
            raise ValueError("Lengths take a fill and its rows together")


def content_failure(kind: str, values: np.ndarray, bound: int | None, lengths: np.ndarray | None = None,
                    page: int | None = None) -> dict[str, int] | None:
    """The fields of the first entry of `values` (int32, C order) breaking a content check of
    `kind` (None: it holds): `index` and `value`; "nonnegative" adds `min` (the smallest
    entry, at `index`), "nondecreasing" the entry before, `prior_index` and `prior`; "fits"
    gives the longest of `lengths` (int64) where it is above `bound`; "within" adds `limit`,
    the length entry `index` passes; "pages" gives the `row`, `column` and `value` of a
    table's first entry outside 0 .. `last` (bound - 1) among those row b reads (its rows: those
    of its last axis, in C order), the first cdiv(lengths[b], page) (at most its width)."""
    if kind in OF_LENGTHS:
        return _lengths_failure(kind, values, bound, lengths, page)
    flat = values.reshape(-1)   # each kind's common case first: a warm call runs it on every call
    if flat.size == 0:
        return None
    if kind == "nonnegative":
        if flat.min() >= 0:
            return None
        at = int(np.argmin(flat))
        return {"index": at, "value": int(flat[at]), "min": int(flat[at])}
    if kind in BOUNDED:
        at = 0 if kind == "first" else flat.size - 1
        return None if flat[at] == bound else {"index": at, "value": int(flat[at])}
    if (flat[1:] >= flat[:-1]).all():   # "nondecreasing"
        return None
    at = int(np.argmin(np.diff(flat.astype(np.int64))))   # the first of the largest drops
    return {"index": at + 1, "value": int(flat[at + 1]), "prior_index": at, "prior": int(flat[at])}


def _lengths_failure(kind: str, values: np.ndarray, bound: int | None, lengths: np.ndarray,
                     page: int | None) -> dict[str, int] | None:
    """content_failure's kinds that read lengths."""
    if kind == "fits":
        if not lengths.size or lengths.max() <= bound:
            return None
        at = int(np.argmax(lengths))
        return {"index": at, "value": int(lengths[at])}
    if kind == "within":
        beyond = np.flatnonzero(values.reshape(-1) > lengths)
        if not beyond.size:
            return None
        at = int(beyond[0])
        return {"index": at, "value": int(values.reshape(-1)[at]), "limit": int(lengths[at])}
    if page < 1:   # "pages": rows of the last axis, each reading its first entries
        raise ValueError(f"a page must hold at least one row, got {page}")
    if not values.size:
        return None
    table = values.reshape(-1, values.shape[-1])
    if table.min() >= 0 and table.max() < bound:   # the common case first: every entry, read or not, is a page
        return None
    read = -(-np.maximum(lengths, 0) // page)
    bad = (np.arange(table.shape[1])[None, :] < read[:, None]) & ((table < 0) | (table >= bound))
    if not bad.any():
        return None
    row, column = (int(x) for x in np.argwhere(bad)[0])
    return {"row": row, "column": column, "value": int(table[row, column]), "last": bound - 1}


@dataclass(frozen=True)
class Require:
    """A size expression that must hold (non-zero) once the binding arrays are bound."""

    check: str
    message: str
    error: str = "ValueError"


@dataclass(frozen=True)
class ArrayRule:
    """The plain-data checks of one array argument or output (see the module docstring)."""

    dtypes: tuple[str, ...] = ()          # the dtypes allowed (numpy's names); () with dtype_of: that array's
    dtype_of: str | None = None           # it has this array's dtype
    shapes: tuple[tuple[str, ...], ...] = ()   # alternatives, each size names / expressions in logical order
    layout: bool = False                  # the layout option orders its axes (bhsd or bshd)
    binds: bool = False                   # its extents bind the size names (else they are checked)
    broadcast: bool = False               # it may broadcast to its shape (size-1 or missing leading axes)
    written: bool = False                 # the op writes it in place (an output the caller gives)
    reads: str = "strided"                # how the kernels address it: one of READS
    stride_axes: tuple[str, ...] = ()     # its runtime strides' names by logical axis ({buffer}_{axis}_stride);
                                          # (): batch, head, row, key
    called: str | None = None             # its name in the C++ API and C ABI, when not the declaration's
    buffer: str | None = None             # the pass buffer it binds, when not its name
    needs: tuple[tuple[str, str], ...] = ()   # the arguments it may be given only with, each with its message
    expands: bool = False                 # bound as its first shape (an axis of extent 1 read with stride 0)
    own: bool = False                     # the op's own: checked after the arrays it shares with attention
    unlike_error: str = ""                # a list's: an element after the first unlike the first (a ValueError)
    requires: tuple[Require, ...] = ()    # once it is checked (over the sizes it binds too)
    contents: tuple[Content, ...] = ()    # of its values, every call
    dtype_raises: str = "TypeError"       # the error a dtype outside its set raises (one of ERRORS)
    dtype_error: str = ""
    rank_error: str = ""                  # a rank other than the shape's (a checked array: optional)
    shape_error: str = ""

    def __post_init__(self) -> None:
        if self.reads not in READS:
            raise ValueError(f"reads must be one of {READS}, got {self.reads!r}")
        if self.dtype_raises not in ERRORS:
            raise ValueError(f"dtype_raises must be one of {tuple(ERRORS)}, got {self.dtype_raises!r}")
        if any(LEADING in shape[1:] or (self.layout and LEADING in shape) for shape in self.shapes):
            raise ValueError(f"{LEADING!r} may only start a shape, of a rule without layout")


@dataclass(frozen=True)
class Checks:
    """An op's checks between sizes: the layouts' axis orders, sizes derived from the bound
    ones (name, expression; a caller may bind them first), requirements in order, and the
    Lengths its content checks read, by name."""

    requires: tuple[Require, ...] = ()
    derived: tuple[tuple[str, str], ...] = ()
    lengths: dict[str, Lengths] = field(default_factory=dict)
    layouts: dict[str, tuple[int, ...]] = field(default_factory=lambda: {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3)})


def int32_table(name: str, shape: tuple[str, ...], form: str, **more) -> ArrayRule:
    """An int32 table read contiguous (lengths, a block table): a dtype, rank or shape other
    than `shape` refused with one ValueError naming both ("{name} must be int32 {form}, got
    ..."); `more`, its other fields."""
    message = f"{name} must be int32 {form}, got {{{name}.dtype}} {{{name}.shape}}"
    return ArrayRule(dtypes=("int32",), dtype_raises="ValueError", shapes=(shape,), reads="contiguous",
                     dtype_error=message, rank_error=message, shape_error=message, **more)


def shape_text(shape: tuple[int, ...]) -> str:
    """A shape as Python prints a tuple of ints."""
    return str(tuple(int(n) for n in shape))


def rule_data(name: str, rule: ArrayRule, role: str, optional: bool, each: bool = False) -> dict[str, Any]:
    """One array's rule as the JSON a bundle carries, its templates naming it (`each`: the rule
    of each element of a list argument)."""
    called = rule.called or name
    return {"name": called, "buffer": rule.buffer or name, "role": role, "optional": optional, "each": each,
            "unlike_error": rule.unlike_error,
            "dtypes": list(rule.dtypes), "dtype_of": rule.dtype_of, "shapes": [list(s) for s in rule.shapes],
            "layout": rule.layout, "binds": rule.binds, "broadcast": rule.broadcast, "written": rule.written,
            "reads": rule.reads, "stride_axes": list(rule.stride_axes), "needs": [list(n) for n in rule.needs], "expands": rule.expands,
            "own": rule.own, "requires": requires_data(rule.requires),
            "contents": [{"kind": c.kind, "message": c.message, "bound": c.bound, "when": c.when,
                          "lengths": c.lengths, "page": c.page} for c in rule.contents],
            "dtype_raises": rule.dtype_raises, "dtype_error": rule.dtype_error, "rank_error": rule.rank_error,
            "shape_error": rule.shape_error}


def requires_data(requires: tuple[Require, ...]) -> list[dict[str, str]]:
    return [{"check": r.check, "message": r.message, "error": r.error} for r in requires]


def checks_data(checks: Checks) -> dict[str, Any]:
    """An op's Checks as the JSON a bundle carries."""
    return {"requires": requires_data(checks.requires),
            "derived": [list(d) for d in checks.derived],
            "lengths": {name: {"sources": [list(s) for s in l.sources], "offset": l.offset, "plus": l.plus,
                               "fill": l.fill, "rows": l.rows} for name, l in checks.lengths.items()},
            "layouts": {name: list(order) for name, order in checks.layouts.items()}}


_FIELD = re.compile(r"\{([A-Za-z0-9_.\[\]]+)\}")


class Binding:
    """One call's checks against an op's rules: `bind` the binding arrays (their dtypes, then
    their ranks and sizes, then the requirements), then `check` each other array given."""

    def __init__(self, rules: dict[str, ArrayRule], checks: Checks, layout: str,
                 sizes: dict[str, int] | None = None, texts: dict[str, str] | None = None) -> None:
        self.rules, self.checks, self.layout = rules, checks, layout
        self.sizes: dict[str, int] = dict(sizes or {})
        self.leading: tuple[int, ...] = ()   # the call's leading axes (LEADING), once bound
        self._texts: dict[str, str] = {"layout": layout, **(texts or {})}
        self._contents: dict[str, list[tuple[Content, int | None, int | None]]] = {}   # _applying's, by array
        self._with_contents = tuple(name for name, rule in rules.items() if rule.contents)
        self._values_of: dict[str, int] = {}   # _evaluated's, by expression

    def with_rules(self, rules: dict[str, ArrayRule]) -> Binding:
        """A binding of the same sizes (and the arrays seen) that checks by `rules`."""
        binding = Binding(rules, self.checks, self.layout, self.sizes, self._texts)
        binding.leading = self.leading
        return binding

    def bind(self, arrays: dict[str, tuple[tuple[int, ...], str | None]]) -> dict[str, int]:
        """Checks the binding arrays, (shape, dtype name or None: not checked) by name, and
        the requirements; returns the sizes."""
        for name, (shape, dtype) in arrays.items():
            self._note(name, shape, dtype)
        for name, (shape, dtype) in arrays.items():
            self._check_dtype(name, dtype)
        for name, (shape, _) in arrays.items():
            rule = self._rule(name)
            extents = _trailing(rule.shapes[0], shape)
            if extents is None:
                self._fail(ValueError, rule.rank_error, name)
            if rule.shapes[0][:1] == (LEADING,):
                self.leading = tuple(int(n) for n in shape[:len(shape) - len(extents)])
            for size, extent in zip(_named(rule.shapes[0]), self._logical(rule, extents)):
                self.sizes[f"{name}_{size}"] = int(extent)
                self.sizes.setdefault(size, int(extent))
        self._require(self.checks.requires)
        for size, expression in self.checks.derived:
            self.sizes.setdefault(size, evaluate(expression, self.sizes))
        return self.sizes

    def check(self, name: str, shape: tuple[int, ...], dtype: str | None) -> int:
        """Checks an array that does not bind sizes (binding the size names only its shape
        has), then its requirements; returns the index of the shape it has."""
        self._note(name, shape, dtype)
        rule = self._rule(name)
        if rule.unlike_error and not name.endswith("[0]"):
            return self._check_like_first(name, shape, dtype)
        self._check_dtype(name, dtype)
        if rule.rank_error and _trailing(rule.shapes[0], shape) is None:
            self._fail(ValueError, rule.rank_error, name)
        for index in range(len(rule.shapes)):
            sizes = self._with_new_sizes(rule, index, shape)
            expected = self._shape(rule, index, sizes)
            if shape == expected or (rule.broadcast and _broadcasts(shape, expected)):
                self.sizes = sizes
                self._require(rule.requires)
                return index
        self.sizes = self._with_new_sizes(rule, 0, shape)   # {name.expected} with the sizes it gives
        self._fail(ValueError, rule.shape_error, name)

    def check_arrays(self, arrays: dict[str, np.ndarray | None]) -> None:
        """Checks the arrays given (not None) among `arrays` (numpy arrays by name) that do not
        bind sizes: every one's form, then every one's contents (the C++ binder's order)."""
        self.check_forms(arrays)
        self.check_contents_of(arrays)

    def check_forms(self, arrays: dict[str, np.ndarray | None]) -> None:
        """Checks the arrays given among `arrays` that do not bind sizes, in the rules' order:
        each one's needs (the arguments it is given with), dtype, shape and requirements."""
        for name in self.rules:
            if arrays.get(name) is not None and not self.rules[name].binds:
                for needed, message in self.rules[name].needs:
                    if arrays.get(needed) is None:
                        raise ValueError(self._format(message))
                self.check(name, arrays[name].shape, str(arrays[name].dtype))

    def check_contents_of(self, arrays: dict[str, np.ndarray | None]) -> None:
        """The contents checks of the arrays given among `arrays`, in the rules' order (a warm
        call's: their forms are its signature's); the Lengths they read come from `arrays`. A
        call's state stays in this call (warm calls of one signature share the binding)."""
        read: dict[str, tuple[np.ndarray | None, str]] = {}
        for name in self._with_contents:
            if arrays.get(name) is not None:
                self._check_contents(name, arrays[name], arrays, read)

    def check_contents(self, name: str, values: np.ndarray) -> None:
        """Checks one array's values by its rule's `contents` (which read no other array)."""
        self._check_contents(name, values, {name: values}, {})

    def lengths(self, name: str, arrays: dict[str, np.ndarray | None]) -> np.ndarray | None:
        """The Lengths `name` for the call's `arrays` (int64; None where none gives them and they
        have no fill): what its content checks read."""
        return self._lengths(name, arrays, {})[0]

    def _check_contents(self, name: str, values: np.ndarray, arrays: dict, read: dict) -> None:
        """`name`'s content checks, in order; a failure's fields (content_failure) fill
        `{name.index}`, `{name.value}`, ... and `{name.source}` in its message."""
        for content, bound, page in self._applying(name):
            lengths, source = (None, "") if content.lengths is None else self._lengths(content.lengths, arrays, read)
            if content.lengths is not None and lengths is None:
                continue
            width = values.shape[-1] if content.kind == "pages" else 1   # "within": one length an entry
            if content.kind in ("within", "pages") and lengths.size * width != values.size:
                raise ValueError(f"the declaration's {content.kind} check of {name} reads {content.lengths}, "
                                 f"{lengths.size} rows, which {name} does not have")
            failure = content_failure(content.kind, values, bound, lengths, page)
            if failure is not None:
                fields = {f"{name}.{key}": str(value) for key, value in failure.items()}
                raise ValueError(self._format(content.message, {**fields, f"{name}.source": source}))

    def _lengths(self, name: str, arrays: dict, read: dict) -> tuple[np.ndarray | None, str]:
        """The Lengths `name` for `arrays` and the array they came from ("": the fill), read once
        a call (`read`); their size expressions are evaluated once, as `_applying`'s are."""
        if name not in read:
            read[name] = self._read_lengths(name, arrays)
        return read[name]

    def _read_lengths(self, name: str, arrays: dict) -> tuple[np.ndarray | None, str]:
        lengths = self.checks.lengths[name]
        for source, steps in lengths.sources:
            values = arrays.get(source)
            if values is not None:
                entries = values.reshape(-1).astype(np.int64)
                entries = (np.diff(entries) if steps else entries) + self._evaluated(lengths.offset)
                if lengths.plus is not None:
                    plus = arrays.get(lengths.plus)
                    if plus is None or plus.size != entries.size:
                        raise ValueError(f"the declaration's lengths {name} add {lengths.plus}, which this call does "
                                         "not give as many entries")
                    entries = entries + plus.reshape(-1)
                return entries, source
        if lengths.fill is None:
            return None, ""
        return np.full(self._evaluated(lengths.rows), self._evaluated(lengths.fill), np.int64), ""

    def _evaluated(self, expression: str) -> int:
        """A size expression's value, evaluated once (the sizes a content check reads do not change)."""
        if expression not in self._values_of:
            self._values_of[expression] = evaluate(expression, self.sizes)
        return self._values_of[expression]

    def _applying(self, name: str) -> list[tuple[Content, int | None, int | None]]:
        """`name`'s content checks that apply, with their bounds and pages: the sizes they read
        are bound (or given, as the KV cache's per_row) before the first contents are checked and
        do not change, so warm calls reuse the first call's."""
        applying = self._contents.get(name)
        if applying is None:
            applying = self._contents[name] = [
                (c, None if c.bound is None else evaluate(c.bound, self.sizes),
                 None if c.page is None else evaluate(c.page, self.sizes)) for c in self._rule(name).contents
                if c.when is None or evaluate(c.when, self.sizes)]
        return applying

    def _with_new_sizes(self, rule: ArrayRule, index: int, shape: tuple[int, ...]) -> dict[str, int]:
        """The sizes with those shape `index` of `rule` names but nothing bound yet taken from
        `shape`'s extents (when its rank is the shape's)."""
        sizes = dict(self.sizes)
        names = rule.shapes[index]
        extents = _trailing(names, shape)
        if extents is not None:
            for size, extent in zip(_named(names), self._logical(rule, extents)):
                if size.isidentifier() and size not in sizes:
                    sizes[size] = int(extent)
        return sizes

    def _require(self, requires: tuple[Require, ...]) -> None:
        for require in requires:
            if not evaluate(require.check, self.sizes):
                raise ERRORS[require.error](self._format(require.message))

    def expected(self, name: str, index: int = 0) -> tuple[int, ...]:
        """The shape `name` must have (its `index`th alternative), in memory order."""
        return self._shape(self._rule(name), index, self.sizes)

    def _shape(self, rule: ArrayRule, index: int, sizes: dict[str, int]) -> tuple[int, ...]:
        """Shape `index` of `rule` for `sizes`, in memory order (the call's leading axes first
        where it declares them)."""
        names = rule.shapes[index]
        shape = self._ordered(rule, tuple(evaluate(size, sizes) for size in _named(names)))
        return self.leading + shape if names[:1] == (LEADING,) else shape

    def _rule(self, name: str) -> ArrayRule:
        """The rule of array `name`, or of the list whose element it is (`outputs[1]`)."""
        return self.rules[name] if name in self.rules else self.rules[name[:name.index("[")]]

    def _check_like_first(self, name: str, shape: tuple[int, ...], dtype: str | None) -> int:
        """A list's element after the first: the first's dtype and shape, else its unlike_error."""
        first = name[:name.index("[")] + "[0]"
        if dtype != self._texts[f"{first}.dtype"] or shape_text(shape) != self._texts[f"{first}.shape"]:
            raise ValueError(self._format(self._rule(name).unlike_error))
        return 0

    def _note(self, name: str, shape: tuple[int, ...], dtype: str | None) -> None:
        rule = self._rule(name)
        texts = {"shape": shape_text(shape), "dtype": str(dtype),
                 "axes": ", ".join(self._ordered(rule, rule.shapes[0]))}
        names = (name, name[:name.index("[")]) if "[" in name else (name,)   # an element: its list's too
        self._texts.update({f"{n}.{key}": text for n in names for key, text in texts.items()})
        self._texts[f"{names[-1]}.element"] = name

    def _check_dtype(self, name: str, dtype: str | None) -> None:
        rule = self._rule(name)
        if dtype is None:
            return
        allowed = tuple(self._format(d) if "{" in d else d for d in rule.dtypes) or \
            (self._texts[f"{rule.dtype_of}.dtype"],)
        if dtype not in allowed:
            self._fail(ERRORS[rule.dtype_raises], rule.dtype_error, name)

    def _order(self, rule: ArrayRule, rank: int) -> tuple[int, ...] | None:
        """The logical axis of each memory axis of a `rank`-d array of `rule` (None: memory
        order is logical): the layout's order of the axes below `rank`."""
        if not rule.layout:
            return None
        order = self.checks.layouts[self.layout]
        return tuple(axis for axis in order if axis < rank) if rank <= len(order) else None

    def _ordered(self, rule: ArrayRule, logical: tuple) -> tuple:
        """Logical-order values in memory order: memory axis i holds logical axis order[i]."""
        order = self._order(rule, len(logical))
        return tuple(logical) if order is None else tuple(logical[axis] for axis in order)

    def _logical(self, rule: ArrayRule, shape: tuple) -> tuple:
        """Memory-order values in logical order."""
        order = self._order(rule, len(shape))
        if order is None:
            return tuple(shape)
        logical = [0] * len(shape)
        for memory, axis in enumerate(order):
            logical[axis] = shape[memory]
        return tuple(logical)

    def _fail(self, error: type, template: str, name: str) -> NoReturn:
        for key in {name, name.split("[")[0]}:   # an element's expected shape is its list's field too
            if "{" + key + ".expected}" in template:
                self._texts[f"{key}.expected"] = shape_text(self.expected(name))
        raise error(self._format(template))

    def _format(self, template: str, fields: dict[str, str] | None = None) -> str:
        """`template` filled from `fields`, the call's texts, then the sizes."""
        texts = {**self._texts, **fields} if fields else self._texts

        def text(match: re.Match) -> str:
            key = match.group(1)
            return texts[key] if key in texts else str(self.sizes[key])
        return _FIELD.sub(text, template)


def _named(names: tuple[str, ...]) -> tuple[str, ...]:
    """A shape's size names without its leading axes."""
    return names[1:] if names[:1] == (LEADING,) else names


def _trailing(names: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The extents of `shape` that shape `names` names (its last ones, after leading axes),
    or None when its rank does not fit."""
    named = _named(names)
    if len(shape) == len(named) or (len(named) < len(names) and len(shape) > len(named)):
        return tuple(shape[len(shape) - len(named):])
    return None


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether numpy broadcasts `shape` to `target`."""
    if len(shape) > len(target):
        return False
    return all(n in (1, t) for n, t in zip(shape, target[len(target) - len(shape):]))
