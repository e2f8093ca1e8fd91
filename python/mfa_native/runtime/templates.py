"""Pass templates: a pass as a program over named sizes, and the evaluator that turns one
into the concrete PassDescription (passes.py) of a call.

A template holds what codegen wrote for a family of calls: the kernels (MSL source, entry
point, threads per threadgroup, which buffer each `[[buffer(i)]]` binds) and every buffer,
with the grids, shapes, strides and constant words as size expressions (expressions.py).
It names the runtime sizes a caller gives (`sizes`: B, Hq, Hkv, R, C, list widths, and the
device's parallel threadgroups P where a choice depends on it), the sizes it derives from
them in order (`derived`: block counts, split-KV's splits), the guards under which it is
valid (`guards`: tile choices that depend on a length, the GQA ratio its kernels bake), the
facts it was generated for (`valid_for`: dtypes, head dims, layout, features), its compile
options, and the schema version. It round-trips through JSON.

`evaluate(template, sizes)` is small and pure, written so that the C++ core can implement
the same rules: the derived sizes in order, every guard, then each expression. Inputs'
strides are those the kernels were compiled for, with 0 on axes of extent 1 (such an axis
never moves); `nbytes` is what the kernels may touch from the first element: an input's
span, an output's contiguous size, an intermediate's extent.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Mapping

from .arrays import DTYPES, span_bytes
from .expressions import evaluate as value_of
from .passes import CALLER_ROLES, BufferDecl, KernelLaunch, PassDescription

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class KernelTemplate:
    entry: str
    source: str
    threadgroups: tuple[str, str, str]               # size expressions
    threads_per_threadgroup: tuple[int, int, int]
    buffers: tuple[str, ...]                         # [[buffer(i)]] binds the buffer named buffers[i]


@dataclass(frozen=True)
class BufferTemplate:
    name: str
    role: str                                # as in passes.ROLES
    dtype: str
    shape: tuple[str, ...]                   # size expressions, physical axis order
    readers: tuple[int, ...]
    writers: tuple[int, ...]
    strides: tuple[str, ...] | None = None   # inputs: the element strides the kernels were compiled for
    value: tuple[str, ...] | None = None     # constants: one size expression per uint32 word


@dataclass(frozen=True)
class PassTemplate:
    name: str
    sizes: tuple[str, ...]                   # the runtime sizes a caller gives
    derived: tuple[tuple[str, str], ...]     # (name, expression), evaluated in order
    guards: tuple[str, ...]                  # expressions that must hold (non-zero)
    valid_for: tuple[tuple[str, object], ...]   # the facts it was generated for
    kernels: tuple[KernelTemplate, ...]
    buffers: tuple[BufferTemplate, ...]
    compile_options: tuple[tuple[str, object], ...] = ()
    schema: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> PassTemplate:
        data = json.loads(text)
        if data.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"pass template schema {data.get('schema')!r}; this version reads {SCHEMA_VERSION}")
        kernels = tuple(KernelTemplate(**_tuples(k)) for k in data.pop("kernels"))
        buffers = tuple(BufferTemplate(**_tuples(b)) for b in data.pop("buffers"))
        fields = _tuples(data)
        for key in ("derived", "valid_for", "compile_options"):
            fields[key] = tuple(tuple(pair) for pair in data[key])
        return cls(kernels=kernels, buffers=buffers, **fields)


def _tuples(record: dict) -> dict:
    """JSON lists back to the tuples the dataclasses hold (one level deep)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in record.items()}


def evaluate(template: PassTemplate, sizes: Mapping[str, int]) -> PassDescription:
    """The concrete pass of `template` for a call's `sizes` (every name in template.sizes);
    ValueError when one is missing or a guard does not hold."""
    missing = [name for name in template.sizes if name not in sizes]
    if missing:
        raise ValueError(f"pass {template.name!r} needs sizes {missing}")
    env = {name: int(sizes[name]) for name in template.sizes}
    for name, expression in template.derived:
        env[name] = value_of(expression, env)
    for guard in template.guards:
        if not value_of(guard, env):
            raise ValueError(f"pass {template.name!r} is not valid for sizes {dict(sizes)}: {guard} does not hold")
    kernels = tuple(KernelLaunch(k.entry, k.source, tuple(value_of(e, env) for e in k.threadgroups),
                                 k.threads_per_threadgroup, k.buffers) for k in template.kernels)
    return PassDescription(template.name, kernels, tuple(_buffer(b, env) for b in template.buffers))


def _buffer(b: BufferTemplate, env: dict[str, int]) -> BufferDecl:
    shape = tuple(value_of(e, env) for e in b.shape)
    itemsize = DTYPES[b.dtype].itemsize
    strides = value = None
    if b.role in CALLER_ROLES:
        strides = tuple(0 if n == 1 else value_of(e, env) for n, e in zip(shape, b.strides))
        nbytes = span_bytes(shape, strides, itemsize)
    elif b.role == "constant":
        value = tuple(value_of(e, env) for e in b.value)
        if any(not 0 <= w < 2**32 for w in value):
            raise ValueError(f"buffer {b.name!r}: {value} do not fit in 32 bits")
        nbytes = 4 * len(value)
    else:
        nbytes = math.prod(shape) * itemsize
    return BufferDecl(b.name, b.role, b.dtype, shape, nbytes, b.readers, b.writers, strides=strides, value=value)
