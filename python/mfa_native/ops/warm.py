"""The warm path: a call whose signature was seen before runs its prepared pass directly.

A signature is everything argument validation and code generation depend on:
the type, shape, strides, dtype and alignment of every array argument, the type and value
of every other argument, the device, its tuning facts and the tuned tables' generation (codegen/kernel/tuned.py). Calls that share one
cannot differ in anything but array contents, so the first call's checks,
problem, pass description and prepared pass all hold for them; only checks of
contents (the block lists of block-sparse attention) run again.

Only numpy arrays make a signature, and QuantizedTensors of numpy arrays (other array types
go the full way each time).
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np

from ..quantized import QuantizedTensor
from ..codegen.kernel import tuned
from ..runtime.devices import Device, tuning_facts
from ..runtime.runner import PreparedPass, readable

MAX_SIGNATURES = 512

Convert = Callable[[np.ndarray], np.ndarray]


_SEQUENCES = (tuple, list)


def _strict(value):
    """A key for a non-array argument that tells apart values Python calls equal but
    validation does not (True and 1, 1 and 1.0, a list and a tuple)."""
    if type(value) in _SEQUENCES:
        return (type(value), tuple(_strict(v) for v in value))
    return (type(value), value)


def alignment(a: np.ndarray) -> int:
    """Where a's first element sits modulo 16 bytes (codegen vectorizes the accesses of aligned
    arrays: AttentionProblem.aligned): 0 for an array owning its memory (numpy allocates it
    aligned), so only views pay for reading their address."""
    return 0 if a.flags.owndata else a.ctypes.data % 16


def signature(arrays: Sequence, options: Sequence, device: Device) -> tuple | None:
    """The signature of a call, or None when it has none (an array argument that is not
    numpy). It may still be unhashable (an option that is); the cache then does not keep it."""
    key = [device, tuning_facts(device), tuned.generation()]
    for a in arrays:
        if a is None:
            key.append(None)
        elif type(a) is np.ndarray:
            key.append((a.shape, a.strides, a.dtype, alignment(a)))
        elif type(a) is QuantizedTensor and type(a.data) is np.ndarray:
            key.append(a.signature)
        else:
            return None
    key += [_strict(o) if type(o) in _SEQUENCES else (type(o), o) for o in options]
    return tuple(key)


class Checked:
    """An op's checked arguments: the arrays to bind, by pass input name; how a warm call turns
    its argument into each (None: bound as given); and, for inputs that are not an argument
    of their own (a quantized k's scales), the argument they come from."""

    def __init__(self, bound: dict[str, np.ndarray], converts: dict[str, Convert | None],
                 sources: dict[str, str] | None = None) -> None:
        self.bound = bound
        self.converts = converts
        self.sources = sources or {}


class PreparedCall:
    """One signature's prepared pass, and how a call's arguments become its inputs.

    picks[i] = (position of the call argument that fills pass input i, its conversion or
    None when the argument is bound as given); `finish` turns the pass's outputs into the
    op's result; `check`, if any, checks contents across arguments first."""

    __slots__ = ("pass_", "picks", "finish", "check")

    def __init__(self, pass_: PreparedPass, picks: tuple[tuple[int, Convert | None], ...],
                 finish: Callable[[list[np.ndarray]], object],
                 check: Callable[[Sequence], None] | None = None) -> None:
        self.pass_ = pass_
        self.picks = picks
        self.finish = finish
        self.check = check   # a check of contents that spans several arguments (block lists)

    def __call__(self, arguments: Sequence):
        """A warm call: the arguments (numpy arrays of this signature) checked, picked and converted."""
        if self.check is not None:
            self.check(arguments)
        return self.run([arguments[i] if convert is None else convert(arguments[i]) for i, convert in self.picks])

    def run(self, inputs: list[np.ndarray]):
        """Runs the pass on its inputs (in `input_names` order, built from the description by
        the op's checks or a warm call's picks, so not checked again) and finishes the result."""
        return self.finish(self.pass_.run_unchecked(inputs))


class SignatureCache:
    """Signature -> PreparedCall, the oldest dropped past MAX_SIGNATURES. Thread-safe."""

    def __init__(self) -> None:
        self._calls: dict[tuple, PreparedCall] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple | None) -> PreparedCall | None:
        if key is None:
            return None
        try:
            return self._calls.get(key)
        except TypeError:  # an unhashable option: no warm path for this call
            return None

    def put(self, key: tuple | None, call: PreparedCall) -> None:
        if key is None:
            return
        try:
            hash(key)
        except TypeError:
            return
        with self._lock:
            if len(self._calls) >= MAX_SIGNATURES:
                self._calls.pop(next(iter(self._calls)))
            self._calls[key] = call

    def clear(self) -> None:
        with self._lock:
            self._calls.clear()


def pick(inputs: Sequence[str], arguments: Sequence[str], converts: dict[str, Convert | None],
         sources: dict[str, str] | None = None) -> tuple:
    """PreparedCall.picks for the pass inputs `inputs` of an op whose array arguments are
    `arguments` (names, in call order), with each input's conversion (None: as given); an
    input named in `sources` comes from that argument (a quantized k's scales from k)."""
    sources = sources or {}
    return tuple((arguments.index(sources.get(name, name)), converts[name]) for name in inputs)


def same_memory(raw, bound: np.ndarray) -> bool:
    """Whether `bound` (what validation made of a call argument) reads the argument's own
    memory from its first element with its dtype, so the warm path can bind the argument as given."""
    return (type(raw) is np.ndarray and raw.dtype == bound.dtype
            and raw.__array_interface__["data"][0] == bound.__array_interface__["data"][0])


def _checking(finish: Callable, check_outputs: Callable[[dict[str, np.ndarray]], None],
              names: Sequence[str]) -> Callable:
    """`finish` after `check_outputs` has seen the outputs by name."""

    def checked(outputs):
        check_outputs({name: readable(out) for name, out in zip(names, outputs)})
        return finish(outputs)
    return checked


def prepared_call(description, device: Device, checked, arguments: Sequence[str], results: str | tuple[str, ...],
                  check: Callable[[Sequence], None] | None = None,
                  check_outputs: Callable[[dict[str, np.ndarray]], None] | None = None
                  ) -> tuple[PreparedCall, list[np.ndarray]]:
    """The PreparedCall that runs `description` for `checked` (an op's Checked arguments), and
    this call's inputs. `arguments` names the op's
    array arguments in call order; `results` the outputs it returns: a name for one array, a
    tuple of names for a tuple; `check` checks the arguments' contents before the pass runs,
    `check_outputs` the pass's outputs (by name) after it, before the results are returned."""
    prepared = PreparedPass(description, device)
    if isinstance(results, str):
        index = prepared.output_names.index(results)

        def finish(outputs):
            return outputs[index]
    else:
        order = tuple(prepared.output_names.index(name) for name in results)

        def finish(outputs):
            return tuple(outputs[i] for i in order)
    if check_outputs is not None:
        finish = _checking(finish, check_outputs, prepared.output_names)
    call = PreparedCall(prepared, pick(prepared.input_names, arguments, checked.converts, checked.sources), finish,
                        check)
    return call, [checked.bound[name] for name in prepared.input_names]
