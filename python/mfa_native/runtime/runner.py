"""The pass runner: every op runs its pass description (passes.py) through here.

`PreparedPass(description, device)` compiles the kernels once (the core's caches
make a second preparation cheap) and resolves every binding into the core's
PreparedPass. `run(inputs)` then allocates the outputs, and the core takes the
intermediates from the device pool and encodes the whole pass into one command
batch: one commit, one wait, dependent dispatches ordered by the core.
Intermediates never exist as host arrays.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Protocol, Sequence

import numpy as np

from .. import _core
from . import profiling
from .arrays import DTYPES
from .devices import Device
from .passes import PassDescription

_allocate = np.empty  # outputs; tests poison them by replacing this
_caller = threading.local()  # .arrays: the CallerArrays of the enclosing `caller_arrays` block


class CallerArrays(Protocol):
    """The caller's framework, for one op call (runtime/frameworks.FrameworkCall)."""

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An output: a numpy view (or stand-in) of an array the framework allocated."""

    def bind(self, arrays: Sequence[np.ndarray], device: Device) -> list:
        """The arrays to run on, with the stand-ins of device memory replaced by core Buffers."""


def allocate(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An op's output array: from the enclosing `caller_arrays` block's framework, else numpy."""
    return (getattr(_caller, "arrays", None) or _allocate)(shape, dtype)


@contextmanager
def caller_arrays(arrays: CallerArrays) -> Iterator[None]:
    """Inside the block (on this thread), op outputs are allocated by the caller's framework
    and passes bind the arrays `arrays.bind` gives."""
    outer = getattr(_caller, "arrays", None)
    _caller.arrays = arrays
    try:
        yield
    finally:
        _caller.arrays = outer


class PreparedPass:
    """A pass description made ready to run on one device.

    Attributes:
        description: the PassDescription.
        input_names: the inputs, in the order `run` takes them.
        output_names: the outputs, in the order `run` returns them.
    """

    def __init__(self, description: PassDescription, device: Device) -> None:
        self.description = description
        self.device = device
        inputs, outputs = description.inputs, description.outputs
        self.input_names = tuple(b.name for b in inputs)
        self.output_names = tuple(b.name for b in outputs)
        self._outputs = tuple((b.shape, DTYPES[b.dtype]) for b in outputs)
        slots = {b.name: ("array", i) for i, b in enumerate(inputs + outputs)}
        intermediates = description.of_role("intermediate")
        slots.update({b.name: ("intermediate", i) for i, b in enumerate(intermediates)})
        constants = description.of_role("constant")
        slots.update({b.name: ("constant", i) for i, b in enumerate(constants)})
        dispatches = []
        for kernel in description.kernels:
            pipeline = device.pipeline(device.library(kernel.source), kernel.entry, [])
            bindings = [(index, *slots[name]) for index, name in enumerate(kernel.buffers)]
            dispatches.append((pipeline, kernel.threadgroups, kernel.threads_per_threadgroup, bindings, []))
        self._core = _core.PreparedPass(
            device, dispatches, [(b.name, b.role == "output") for b in inputs + outputs],
            [b.nbytes for b in intermediates],
            [np.asarray(b.value, dtype=np.uint32).tobytes() for b in constants])

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Runs the pass on `inputs` (numpy arrays in `input_names` order, laid out as the
        description declares them) and returns the outputs in `output_names` order."""
        caller = getattr(_caller, "arrays", None)
        if caller is None:
            outputs = [_allocate(shape, dtype) for shape, dtype in self._outputs]
            stats = self._core.run([*inputs, *outputs])
        else:
            outputs = [caller(shape, dtype) for shape, dtype in self._outputs]
            stats = self._core.run(caller.bind([*inputs, *outputs], self.device))
        if profiling.recording():
            for s in stats:
                profiling.record(s)
        return outputs
