"""Op outputs in device memory: numpy arrays over Buffers of a device's pool.

An output is `np.ndarray(shape, dtype, buffer)` over a core Buffer from the device's pool
(shared storage on Metal, host memory on the cpu backend), so the kernels write it in place
and the caller reads it with no copy. The array's base is the Buffer: the memory stays the
caller's while any view of it lives and returns to the pool when the last one dies. Binding
such an array (or a view of it) to a pass of the same device binds the Buffer itself
(bind_pass.cpp): no wrapping, no staging.
"""

from __future__ import annotations

import math

import numpy as np

from .devices import Device


def empty(shape: tuple[int, ...], dtype: np.dtype, device: Device | None) -> np.ndarray:
    """An uninitialized C-contiguous array over a Buffer of `device`'s pool; host memory
    (np.empty) for `device` None, a call that runs no kernel."""
    if device is None:
        return np.empty(shape, dtype)
    return np.ndarray(shape, dtype, device.new_buffer(math.prod(shape) * dtype.itemsize))
