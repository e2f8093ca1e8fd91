"""Array plumbing shared by the kernels' host side: dtypes and raw memory spans."""

from __future__ import annotations

import numpy as np

from ml_dtypes import bfloat16  # numpy's bfloat16, a runtime dependency

# MSL scalar type -> numpy dtype, for checking `constant T&` arguments.
MSL_SCALARS: dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_),
    "char": np.dtype(np.int8),
    "uchar": np.dtype(np.uint8),
    "short": np.dtype(np.int16),
    "ushort": np.dtype(np.uint16),
    "int": np.dtype(np.int32),
    "uint": np.dtype(np.uint32),
    "long": np.dtype(np.int64),
    "ulong": np.dtype(np.uint64),
    "half": np.dtype(np.float16),
    "float": np.dtype(np.float32),
    "bfloat": np.dtype(bfloat16),
}


def msl_vector(type_name: str) -> tuple[np.dtype, int] | None:
    """('float4') -> (float32, 4); ('uint') -> (uint32, 1); None for other types (structs)."""
    base = type_name.rstrip("234")
    width = type_name[len(base):]
    if base not in MSL_SCALARS or len(width) > 1:
        return None
    return MSL_SCALARS[base], int(width or 1)


def byte_span(array: np.ndarray) -> tuple[np.ndarray, int]:
    """A 1-D contiguous uint8 view over exactly the memory `array` touches, and
    the byte offset of its first element in that view. No copy is made.

    The last axis must be contiguous (or of length 1) and every stride >= 0;
    stride 0 (broadcast axes) is allowed, so a broadcast mask binds its real
    memory only.
    """
    if array.ndim == 0:
        array = array.reshape(1)
    item = array.dtype.itemsize
    if any(s < 0 for s in array.strides):
        raise ValueError("arrays with negative strides are not supported; pass a copy")
    if array.shape[-1] > 1 and array.strides[-1] != item:
        raise ValueError(
            f"the last dimension must be contiguous (stride {item} bytes), got stride {array.strides[-1]}")
    extent = item + sum((n - 1) * s for n, s in zip(array.shape, array.strides))
    flat = np.lib.stride_tricks.as_strided(array, shape=(extent // item,), strides=(item,))
    return flat.view(np.uint8), 0
