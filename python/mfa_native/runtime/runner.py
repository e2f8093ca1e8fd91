"""The pass runner: every op runs its pass description (passes.py) through here.

`PreparedPass(description, device)` compiles the kernels once, several side by side
(compiling.py; the core's caches make a second preparation cheap) and resolves every binding into the core's
PreparedPass. `run(inputs)` then checks the inputs against their declarations
(an array the kernels were not built for would be read out of bounds), allocates
the outputs (numpy arrays over Buffers of the device's pool, pool_arrays.py, which the
core binds with no copy), and the core takes the intermediates from the device pool and
encodes the whole pass into one command batch: one commit, one wait, dependent
dispatches ordered by the core. Intermediates never exist as host arrays.
`run_unchecked(inputs)` skips the checks, for callers that built the inputs from
the description themselves (the ops' warm path).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Protocol, Sequence

import numpy as np

from .. import _core
from . import compiling, frameworks, pool_arrays, profiling
from .arrays import DTYPES
from .devices import Device
from .passes import BufferDecl, PassDescription

WRITTEN = ("inout", "output")   # caller arrays the kernels write: bound writable (copied back where staged)

_allocate = pool_arrays.empty  # outputs: (shape, dtype, device) -> array; tests poison them by replacing this
_caller = threading.local()  # .arrays: the CallerArrays of the enclosing `caller_arrays` block


class CallerArrays(Protocol):
    """The caller's framework, for one op call (runtime/frameworks.FrameworkCall)."""

    wraps_host: bool  # whether outputs are the framework's arrays over host arrays the runner allocates

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype, host: np.ndarray | None) -> np.ndarray:
        """An output: `host` (allocated by the runner when `wraps_host`) under a framework array
        over it, else a numpy view (or stand-in) of an array the framework allocated."""

    def readable(self, output: np.ndarray) -> np.ndarray:
        """An output made by __call__, as numpy the host can read."""

    def bind(self, arrays: Sequence[np.ndarray], device: Device) -> list:
        """The arrays to run on, with the stand-ins of device memory replaced by core Buffers."""


def allocate(shape: tuple[int, ...], dtype: np.dtype, device: Device | None = None) -> np.ndarray:
    """An op's output array: memory of `device`'s pool (host memory for None: a call that runs
    no kernel), under the enclosing `caller_arrays` block's framework array where it wraps
    host memory; else the framework's own array."""
    return _output(getattr(_caller, "arrays", None), shape, dtype, device)


def _output(caller: CallerArrays | None, shape: tuple[int, ...], dtype: np.dtype,
            device: Device | None) -> np.ndarray:
    """`allocate` with the enclosing block's CallerArrays (or None) already looked up."""
    if caller is None:
        return _allocate(shape, dtype, device)
    return caller(shape, dtype, _allocate(shape, dtype, device) if caller.wraps_host else None)


def readable(output: np.ndarray) -> np.ndarray:
    """An op's output as numpy the host can read (the enclosing `caller_arrays` framework may
    have allocated it on the GPU, behind a stand-in)."""
    caller = getattr(_caller, "arrays", None)
    return output if caller is None else caller.readable(output)


@contextmanager
def scoped(local: threading.local, name: str, value) -> Iterator[None]:
    """Inside the block (on this thread), `local.<name>` is `value`; the outer value after it."""
    outer = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, outer)


def caller_arrays(arrays: CallerArrays):
    """Inside the block (on this thread), op outputs are allocated by the caller's framework
    and passes bind the arrays `arrays.bind` gives."""
    return scoped(_caller, "arrays", arrays)


class PreparedPass:
    """A pass description made ready to run on one device.

    Attributes:
        description: the PassDescription.
        input_names: the inputs and inouts (caller memory, "inout" written in place), in the
            order `run` takes them.
        output_names: the outputs, in the order `run` returns them.
    """

    def __init__(self, description: PassDescription, device: Device) -> None:
        self.description = description
        self.device = device
        inputs, outputs = description.inputs, description.outputs
        self.input_names = tuple(b.name for b in inputs)
        self.output_names = tuple(b.name for b in outputs)
        self._inputs = inputs
        self._outputs = tuple((b.shape, DTYPES[b.dtype]) for b in outputs)
        slots = {b.name: ("array", i) for i, b in enumerate(inputs + outputs)}
        intermediates = description.of_role("intermediate")
        slots.update({b.name: ("intermediate", i) for i, b in enumerate(intermediates)})
        constants = description.of_role("constant")
        slots.update({b.name: ("constant", i) for i, b in enumerate(constants)})
        dispatches = []
        for kernel, pipeline in zip(description.kernels, compiling.pipelines(device, description.kernels)):
            bindings = [(index, *slots[name]) for index, name in enumerate(kernel.buffers)]
            dispatches.append((pipeline, kernel.threadgroups, kernel.threads_per_threadgroup, bindings, []))
        self._core = _core.PreparedPass(
            device, dispatches, [(b.name, b.role in WRITTEN) for b in inputs + outputs],
            [b.nbytes for b in intermediates],
            [np.asarray(b.value, dtype=np.uint32).tobytes() for b in constants])

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Runs the pass on `inputs` (numpy arrays in `input_names` order, laid out as the
        description declares them) and returns the outputs in `output_names` order.

        Raises TypeError (not a list of numpy arrays) or ValueError (wrong count, dtype,
        shape or strides, or too small for the bytes the kernels read), naming the input."""
        check_inputs(self._inputs, inputs)
        return self.run_unchecked(inputs)

    def run_unchecked(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """`run` without checking the inputs, for callers that built them from the description
        (an input the kernels were not built for is read out of bounds). Only their count is
        checked, by the core."""
        caller = getattr(_caller, "arrays", None)
        outputs = [_output(caller, shape, dtype, self.device) for shape, dtype in self._outputs]
        if caller is None:
            stats = self._core.run([*inputs, *outputs])
        else:
            stats = self._core.run(caller.bind([*inputs, *outputs], self.device))
        if profiling.recording():
            for s in stats:
                profiling.record(s)
        return outputs


def check_inputs(decls: Sequence[BufferDecl], inputs: Sequence) -> None:
    """Raises unless `inputs` are numpy arrays laid out as `decls` (a pass's inputs) declare:
    TypeError for what is not a list or tuple of numpy arrays, ValueError for a wrong count,
    dtype, shape or strides, or an array that does not cover the bytes the kernels read."""
    names = ", ".join(d.name for d in decls)
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"PreparedPass.run: inputs must be a list or tuple of numpy arrays ({names}), "
                        f"got {type(inputs).__name__}")
    if len(inputs) != len(decls):
        raise ValueError(f"PreparedPass.run: this pass takes {len(decls)} inputs ({names}), got {len(inputs)}")
    for decl, x in zip(decls, inputs):
        _check_input(decl, x)


def _check_input(decl: BufferDecl, x) -> None:
    """Raises unless x is a numpy array with `decl`'s dtype, shape and strides (any stride on an
    axis of extent 1) that covers `decl.nbytes` from its first element."""
    where = f"PreparedPass.run: input {decl.name!r}"
    if not isinstance(x, np.ndarray):
        raise _not_numpy(where, x)
    if x.dtype != DTYPES[decl.dtype]:
        raise ValueError(f"{where} has dtype {x.dtype}; this pass was built for {decl.dtype}")
    if x.shape != decl.shape:
        raise ValueError(f"{where} has shape {x.shape}; this pass was built for {decl.shape}")
    if 0 in x.shape:
        return
    itemsize = x.itemsize
    if any(n != 1 and s != e * itemsize for n, s, e in zip(x.shape, x.strides, decl.strides)):
        strides = tuple(s // itemsize if s % itemsize == 0 else s / itemsize for s in x.strides)
        raise ValueError(f"{where} has strides {strides} (elements); this pass was built for {decl.strides} "
                         "(any stride on an axis of extent 1)")
    span = itemsize + sum((n - 1) * s for n, s in zip(x.shape, x.strides) if n > 1)
    if span < decl.nbytes:
        raise ValueError(f"{where} spans {span} bytes from its first element; this pass reads {decl.nbytes}")


def _not_numpy(where: str, x) -> TypeError:
    """The error for an input that is not a numpy array: a framework's array (named, with its
    device) is read through the ops, which view it or bind its device memory."""
    framework = frameworks.framework_of(x)
    if framework is None:
        module = type(x).__module__
        kind = type(x).__qualname__ if module == "builtins" else f"{module}.{type(x).__qualname__}"
        return TypeError(f"{where} is a {kind}, not a numpy array")
    device = getattr(x, "device", None)
    on = "" if device is None else f" on {device}"
    return TypeError(f"{where} is a {framework.name} array{on}; PreparedPass.run reads numpy arrays: view it "
                     f"as one, or call the op, which takes {framework.name} arrays")
