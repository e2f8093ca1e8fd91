"""PassDescription: everything one call runs, as one plain value.

Codegen turns a problem into a pass description: the kernels in order (source,
entry point, launch geometry, which buffer each `[[buffer(i)]]` binds) and every
buffer the pass touches, declared once with its role, dtype, shape and extent
and the kernels that read and write it. The runner (runner.py) executes it; the
C++ bundles and the framework adapters replay the same value, so nothing about
a pass lives only in Python code. `to_json` / `from_json` round-trip it.

Roles:
- "input": caller memory, read in place from its first element; `shape` and
  `strides` (elements, physical axis order) are what the kernels were built for.
- "inout": caller memory like an input (same `shape`, `strides`, `nbytes`), which some
  kernels also write in place (a KV cache's append); never allocated, never returned.
  The runner binds it writable: on a backend that stages host memory (Metal, for memory
  it cannot wrap), the core copies a writable binding back after the batch.
- "output": allocated per call with `shape` and `dtype` (C-contiguous) and
  returned to the caller.
- "intermediate": device memory from the pool, alive for one call; never a
  host array.
- "constant": small bytes bound inline (Metal's setBytes), `value` as uint32 words.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

ROLES = ("input", "inout", "output", "intermediate", "constant")
CALLER_ROLES = ("input", "inout")   # the caller's memory, bound in place


@dataclass(frozen=True)
class BufferDecl:
    name: str                       # the binding key, and the MSL parameter name in every kernel
    role: str                       # one of ROLES
    dtype: str                      # numpy dtype name: "float16", "bfloat16", "float32", "bool", "uint32", ...
    shape: tuple[int, ...]          # physical axis order
    nbytes: int                     # bytes the kernels may touch, from the first element
    readers: tuple[int, ...]        # indices of the kernels that read it
    writers: tuple[int, ...]        # indices of the kernels that write it
    strides: tuple[int, ...] | None = None  # inputs, inouts: element strides the kernels were compiled for
    value: tuple[int, ...] | None = None    # constants: the bytes, as uint32 words


@dataclass(frozen=True)
class KernelLaunch:
    entry: str                                 # the kernel function's name
    source: str                                # its MSL
    threadgroups: tuple[int, int, int]
    threads_per_threadgroup: tuple[int, int, int]
    buffers: tuple[str, ...]                   # [[buffer(i)]] binds the buffer named buffers[i]


@dataclass(frozen=True)
class PassDescription:
    """Everything one call of an op runs, as one plain value: its kernels in order and every
    buffer they touch.

    Codegen makes one per problem (`mfa_native.codegen.attention_pass(problem)` and the other
    ops' builders); the runner executes it, and the C++ bundles replay the same value, so
    nothing about a pass lives only in Python code. `to_json` and `from_json` round-trip it.

    Args:
        name: the pass's name (the op's, with its variant).
        kernels: the KernelLaunch of each kernel, in order: entry point, MSL source, grid
            (threadgroups, threads_per_threadgroup) and the buffer each `[[buffer(i)]]` binds.
        buffers: the BufferDecl of every buffer, each declared once: name, role ("input",
            "inout", "output", "intermediate", "constant"), dtype, shape, byte extent,
            strides (inputs), value (constants), and which kernels read and write it.

    Raises:
        ValueError: a buffer declared twice, a kernel binding an undeclared buffer, or an
            unknown role.

    Example:
        ```python
        import mfa_native
        from mfa_native import codegen

        problem = codegen.AttentionProblem(1, 2, 2, 16, 16, 32, 32)   # B, Hq, Hkv, R, C, D, Dv
        description = codegen.attention_pass(problem)
        print([kernel.entry for kernel in description.kernels])
        print([(buffer.name, buffer.role) for buffer in description.inputs + description.outputs])
        assert mfa_native.PassDescription.from_json(description.to_json()) == description
        ```
    """

    name: str
    kernels: tuple[KernelLaunch, ...]
    buffers: tuple[BufferDecl, ...]

    def __post_init__(self) -> None:
        names = [b.name for b in self.buffers]
        if len(set(names)) != len(names):
            raise ValueError(f"pass {self.name!r} declares a buffer twice: {names}")
        declared = set(names)
        for kernel in self.kernels:
            unknown = [name for name in kernel.buffers if name not in declared]
            if unknown:
                raise ValueError(f"pass {self.name!r}: kernel {kernel.entry!r} binds undeclared {unknown}")
        for b in self.buffers:
            if b.role not in ROLES:
                raise ValueError(f"buffer {b.name!r} has role {b.role!r}; roles are {ROLES}")

    def buffer(self, name: str) -> BufferDecl:
        """The buffer declared as `name` (KeyError if none is)."""
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(f"pass {self.name!r} has no buffer {name!r}")

    def of_role(self, role: str) -> tuple[BufferDecl, ...]:
        """The buffers of one role ("input", "inout", "output", "intermediate", "constant")."""
        return tuple(b for b in self.buffers if b.role == role)

    @property
    def inputs(self) -> tuple[BufferDecl, ...]:
        """The buffers the caller gives (inputs and inouts), in declaration order."""
        return tuple(b for b in self.buffers if b.role in CALLER_ROLES)

    @property
    def outputs(self) -> tuple[BufferDecl, ...]:
        """The buffers allocated per call and returned to the caller, in declaration order."""
        return self.of_role("output")

    def to_json(self) -> str:
        """The description as JSON text (`from_json` reads it back)."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> PassDescription:
        """The description `to_json` wrote."""
        data = json.loads(text)
        kernels = tuple(KernelLaunch(**{k: _tuples(v) for k, v in kernel.items()}) for kernel in data["kernels"])
        buffers = tuple(BufferDecl(**{k: _tuples(v) for k, v in buffer.items()}) for buffer in data["buffers"])
        return cls(data["name"], kernels, buffers)


def _tuples(value):
    """JSON lists back to the tuples the dataclasses hold."""
    return tuple(value) if isinstance(value, list) else value
