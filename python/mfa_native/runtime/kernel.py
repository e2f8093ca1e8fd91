"""`mfa_native.Kernel`: compile any MSL compute kernel and run it on numpy arrays."""

from __future__ import annotations

import numbers
import os
from typing import Any, Mapping, Sequence

import numpy as np

from .. import _core
from . import asan, profiling
from .arrays import msl_vector
from .devices import Device, resolve_device

ConstantValue = bool | int | float


def _constant_list(constants: Mapping[str | int, ConstantValue] | None) -> list[tuple[str | int, ConstantValue]]:
    """Checks function-constant keys and values; the core checks them against the kernel."""
    if constants is None:
        return []
    if not isinstance(constants, Mapping):
        raise TypeError(f"constants must be a mapping of name or index to value, got {type(constants).__name__}")
    out = []
    for key, value in constants.items():
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise TypeError(f"function constant keys are names (str) or indices (int), got {key!r}")
        if isinstance(value, np.generic):
            value = value.item()
        if not isinstance(value, (bool, int, float)):
            raise TypeError(f"function constant {key!r} must be a bool, int or float, got {type(value).__name__}")
        out.append((key, value))
    return out


_DLPACK_CPU = 1
_DLPACK_METAL = _core.DLPACK_METAL  # kDLMetal: DLTensor.data is an id<MTLBuffer>


def _dlpack_device_type(value: Any) -> int | None:
    """The DLPack device type of a non-numpy array that speaks DLPack, else None."""
    if isinstance(value, np.ndarray) or not hasattr(value, "__dlpack_device__"):
        return None
    return int(value.__dlpack_device__()[0])


def _extent(name: str, value: int | Sequence[int]) -> tuple[int, int, int]:
    """An int or 1..3 ints -> (x, y, z), every axis >= 1."""
    if isinstance(value, (numbers.Integral,)) and not isinstance(value, bool):
        dims = [int(value)]
    elif isinstance(value, (tuple, list)) and 1 <= len(value) <= 3 and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value
    ):
        dims = [int(v) for v in value]
    else:
        raise TypeError(f"{name} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if any(d < 1 for d in dims):
        raise ValueError(f"{name} must be at least 1 on every axis, got {value!r}")
    if any(d >= 2**32 for d in dims):
        raise ValueError(f"{name} must fit in 32 bits on every axis, got {value!r}")
    return tuple(dims + [1] * (3 - len(dims)))  # type: ignore[return-value]


class Kernel:
    """An MSL compute kernel compiled for one device.

    Args:
        source: MSL source text holding the kernel.
        name: the kernel function's name.
        constants: values of its ``[[function_constant(i)]]`` declarations, keyed
            by name or index.
        device: a Device, ``"cpu"``, ``"metal"`` or None for the default device.
        bounds_check: cpu backend only: check every access to a device buffer, a
            threadgroup array (and ``[[threadgroup(i)]]`` memory) and a thread-local
            array, and raise ``DispatchError`` naming the array, its size, the index
            and the ``.metal`` line of one out of bounds (MFA_NATIVE_BOUNDS_CHECK=1
            turns it on for every kernel of the process).
        sanitize: cpu backend only: ``"race"`` records every threadgroup-memory
            access and raises ``DispatchError`` naming both lines and threads
            of a data race (two threads, one writing, no
            ``threadgroup_barrier(mem_flags::mem_threadgroup)`` between them);
            ``"address"`` runs each call of the kernel built with AddressSanitizer
            in a child process and raises ``DispatchError`` with ASan's report on
            an out-of-bounds stack or threadgroup-array access (the call then
            returns None: the stats stay in the child).
            None takes ``MFA_NATIVE_SANITIZE`` (``race`` applies to every op,
            ``address`` to every Kernel).

    Compiling is cached in memory (per source and constants) and, on the cpu
    backend, on disk, so building the same Kernel again is cheap. Call the kernel
    (`kernel(buffers, threadgroups=..., threads_per_threadgroup=...)`) to run it once.

    Raises:
        CompileError: the source does not compile (its `.log` holds the compiler's output).
        TypeError: source or name is not a str; a function constant of the wrong type.
        ValueError: the source has no kernel `name`; an unknown function constant; sanitize
            is not None, "race" or "address"; an unknown device string.
        DeviceUnavailableError: device is "metal" where Metal is not available.

    Example:
        ```python
        import numpy as np
        import mfa_native

        source = '''
        #include <metal_stdlib>
        using namespace metal;
        kernel void add(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                        device float* out [[buffer(2)]], uint i [[thread_position_in_grid]]) {
            out[i] = a[i] + b[i];
        }
        '''
        kernel = mfa_native.Kernel(source, "add", device="cpu")
        a, b = np.arange(64, dtype=np.float32), np.ones(64, dtype=np.float32)
        out = np.empty(64, dtype=np.float32)
        stats = kernel([a, b, out], threadgroups=2, threads_per_threadgroup=32)
        assert np.array_equal(out, a + b)
        print(stats.threadgroups, stats.bytes_written)   # 2 {'a': 0, 'b': 0, 'out': 256}
        ```
    """

    def __init__(
        self,
        source: str,
        name: str,
        *,
        constants: Mapping[str | int, ConstantValue] | None = None,
        device: Device | str | None = None,
        bounds_check: bool = False,
        sanitize: str | None = None,
    ) -> None:
        if not isinstance(source, str):
            raise TypeError(f"source must be a str of MSL, got {type(source).__name__}")
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if sanitize not in (None, "race", "address"):
            raise ValueError(f"sanitize must be None, 'race' or 'address', got {sanitize!r}")
        self.device: Device = resolve_device(device)
        if sanitize is None and self.device.kind == "cpu" and os.environ.get("MFA_NATIVE_SANITIZE") == "address":
            sanitize = "address"
        library = self.device.library(source, bounds_check=bool(bounds_check), sanitize=sanitize or "")
        self._constants = _constant_list(constants)
        self.pipeline = self.device.pipeline(library, name, self._constants)
        self.name = name
        # In the parent, an "address" kernel runs in a child (asan.py) with these.
        self._runs_in_child = (source, bool(bounds_check)) if sanitize == "address" and not asan.in_child() else None
        self._buffers = {a.index: a for a in self.pipeline.function.arguments if a.kind == "buffer"}

    @property
    def arguments(self) -> list:
        """The kernel's parameters, as reflection reads them from the source."""
        return list(self.pipeline.function.arguments)

    def __repr__(self) -> str:
        return f"<mfa_native.Kernel {self.name!r} on {self.device.kind}>"

    def __call__(
        self,
        buffers: Sequence[Any],
        *,
        threadgroups: int | Sequence[int],
        threads_per_threadgroup: int | Sequence[int],
        threadgroup_memory: Sequence[int] = (),
    ) -> _core.DispatchStats | None:
        """Runs the kernel once and waits for it.

        ``buffers[i]`` binds ``[[buffer(i)]]``: a C-contiguous numpy array (or a
        CPU array that speaks DLPack) is read and written in place (results are
        visible on return); on the metal device, a Metal tensor from PyTorch MPS
        or MLX (DLPack device kDLMetal) is used in place too, once its
        framework has finished writing it; a numpy
        scalar, a Python number or a small numpy array (plain or structured)
        serves a ``constant T&`` argument. ``threadgroup_memory[i]`` is the byte
        length of ``[[threadgroup(i)]]``. Returns the dispatch's stats
        (``.threadgroups``, ``.simdgroup_matrix_ops``, ``.seconds``, and per
        argument name ``.bytes_read`` / ``.bytes_written``), or None for a
        ``sanitize="address"`` kernel (it ran in a child process).

        Args:
            buffers: ``buffers[i]`` binds ``[[buffer(i)]]`` (see above); None leaves an
                index the kernel does not declare unbound.
            threadgroups: the grid, in threadgroups: an int or 1 to 3 ints.
            threads_per_threadgroup: the threadgroup's size: an int or 1 to 3 ints.
            threadgroup_memory: byte lengths of the ``[[threadgroup(i)]]`` arguments.

        Returns:
            The dispatch's DispatchStats (None for a ``sanitize="address"`` kernel).

        Raises:
            TypeError: a buffer of the wrong kind or element type, or sizes that are not ints.
            ValueError: a buffer the kernel does not declare or one it needs missing, a
                non-contiguous array, sizes below 1 or beyond 32 bits.
            DispatchError: the kernel failed while running (with bounds_check or sanitize:
                an out-of-bounds access or a data race, named).
        """
        if self._runs_in_child:
            grid, group, memory, arrays, inline, _ = self._bindings(buffers, threadgroups, threads_per_threadgroup,
                                                                    threadgroup_memory)
            source, bounds_check = self._runs_in_child
            asan.run_in_child(self.device, source, self.name, self._constants, bounds_check, arrays, inline,
                              grid, group, memory)
            return None
        batch = _core.CommandBatch(self.device)
        keepalive = self.encode(batch, buffers, threadgroups=threadgroups,
                                threads_per_threadgroup=threads_per_threadgroup,
                                threadgroup_memory=threadgroup_memory)
        batch.commit()
        (stats,) = batch.wait()
        del keepalive
        profiling.record(stats)
        return stats

    def encode(
        self,
        batch: _core.CommandBatch,
        buffers: Sequence[Any],
        *,
        threadgroups: int | Sequence[int],
        threads_per_threadgroup: int | Sequence[int],
        threadgroup_memory: Sequence[int] = (),
    ) -> list[np.ndarray]:
        """Records one dispatch into `batch`. Returns the arrays the batch uses:
        keep them alive until the batch has been waited for."""
        if self._runs_in_child:
            raise ValueError(f"kernel {self.name!r} has sanitize='address': it runs in a child process "
                             "when called, and cannot be encoded into a batch")
        grid, group, memory, arrays, inline, device_buffers = self._bindings(
            buffers, threadgroups, threads_per_threadgroup, threadgroup_memory)
        host = [(index, a.ctypes.data, a.nbytes, bool(a.flags.writeable)) for index, a in arrays]
        batch.dispatch(self.pipeline, grid, group, host, inline, device_buffers, memory)
        return [a for _, a in arrays] + [value for value in buffers if _dlpack_device_type(value) == _DLPACK_METAL]

    def _bindings(self, buffers, threadgroups, threads_per_threadgroup, threadgroup_memory):
        """Checks a dispatch's arguments: (grid, group, threadgroup memory lengths,
        [(index, array)] of pointer arguments, [(index, bytes)] of `constant T&`
        ones, [(index, Metal buffer, offset)])."""
        if isinstance(buffers, (np.ndarray, str, bytes)) or not isinstance(buffers, Sequence):
            raise TypeError("buffers must be a sequence (list or tuple) whose item i binds [[buffer(i)]]")
        grid = _extent("threadgroups", threadgroups)
        group = _extent("threads_per_threadgroup", threads_per_threadgroup)
        memory = [int(n) for n in threadgroup_memory]
        if any(n < 0 for n in memory):
            raise ValueError(f"threadgroup_memory lengths must be >= 0, got {list(threadgroup_memory)}")

        arrays, inline, device_buffers = [], [], []
        for index, value in enumerate(buffers):
            if value is None:
                continue
            argument = self._buffers.get(index)
            if argument is None:
                have = ", ".join(str(i) for i in sorted(self._buffers)) or "none"
                raise ValueError(f"kernel {self.name!r} has no [[buffer({index})]] (its buffer indices: {have})")
            if not argument.is_pointer:
                inline.append((index, self._bytes_for(index, argument, value)))
            elif _dlpack_device_type(value) == _DLPACK_METAL:
                device_buffers.append((index, self._metal_buffer_for(index, argument, value), 0))
            else:
                arrays.append((index, self._array_for(index, argument, value)))
        for index, argument in self._buffers.items():
            if index >= len(buffers) or buffers[index] is None:
                raise ValueError(f"kernel {self.name!r}: [[buffer({index})]] {argument.name!r} is not bound; "
                                 f"pass buffers[{index}]")
        return grid, group, memory, arrays, inline, device_buffers

    def _metal_buffer_for(self, index: int, argument, value: Any) -> _core.Buffer:
        """A Metal tensor (PyTorch MPS, MLX) bound in place through DLPack. The
        caller synchronizes: its framework's pending work on the tensor must be
        done (torch.mps.synchronize(), mx.eval) before the call."""
        if self.device.kind != "metal":
            raise ValueError(f"buffers[{index}] ({argument.name!r}) is a Metal tensor, but kernel {self.name!r} "
                             f"runs on the {self.device.kind} device")
        return _core.metal_buffer_from_dlpack(self.device, value.__dlpack__())

    def _array_for(self, index: int, argument, value: Any) -> np.ndarray:
        """The array bound to a pointer argument, checked for layout and element type.
        CPU arrays that speak DLPack (other than numpy) are viewed through numpy, without a copy."""
        what = f"buffers[{index}] ({argument.name!r}, {argument.type}*)"
        if not isinstance(value, np.ndarray) and _dlpack_device_type(value) == _DLPACK_CPU:
            value = np.from_dlpack(value)
        if not isinstance(value, np.ndarray):
            raise TypeError(f"{what} must be a numpy array, got {type(value).__name__}")
        if not value.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous; pass np.ascontiguousarray(...)")
        element = msl_vector(argument.type)
        if element is not None and value.dtype != element[0] and value.dtype != np.uint8:
            raise TypeError(f"{what} holds {element[0]} elements, got an array of {value.dtype} "
                            "(a uint8 array binds raw bytes)")
        return value

    def _bytes_for(self, index: int, argument, value: Any) -> bytes:
        """The bytes of a value bound to a `constant T&` argument."""
        what = f"buffers[{index}] ({argument.name!r}, {argument.type}&)"
        element = msl_vector(argument.type)
        if isinstance(value, (bool, int, float)) and not isinstance(value, np.generic):
            if element is None or element[1] != 1:
                raise TypeError(f"{what} needs a numpy value of its type, not a Python {type(value).__name__}")
            return np.array(value, dtype=element[0]).tobytes()
        if isinstance(value, (np.generic, np.ndarray)):
            data = np.ascontiguousarray(value)
            if element is not None and data.dtype.fields is None and data.dtype != element[0]:
                raise TypeError(f"{what} must be {element[0]}, got {data.dtype}")
            size = self.pipeline.argument_size(index)
            if size and data.nbytes != size:
                raise ValueError(f"{what} is {size} bytes, got {data.nbytes} bytes")
            return data.tobytes()
        raise TypeError(f"{what} must be a number, a numpy scalar or a small numpy array, "
                        f"got {type(value).__name__}")
