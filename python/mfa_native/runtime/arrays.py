"""Array plumbing shared by the kernels' host side: the element-type table and memory spans."""

from __future__ import annotations

import numpy as np

from ml_dtypes import bfloat16  # numpy's bfloat16, a runtime dependency

# MSL scalar type -> numpy dtype: the one table of element types.
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

# numpy dtype name -> numpy dtype, for the names pass descriptions use.
DTYPES: dict[str, np.dtype] = {dtype.name: dtype for dtype in MSL_SCALARS.values()}

# numpy dtype name -> the MSL type of its elements in device memory. Boolean
# arrays are read as bytes (uchar): numpy stores a bool in one byte, 0 or 1.
MSL_ELEMENTS: dict[str, str] = {dtype.name: msl for msl, dtype in MSL_SCALARS.items() if msl != "bool"}
MSL_ELEMENTS["bool"] = "uchar"

# The float dtypes attention's tensors may have, by numpy dtype.
FLOAT_DTYPES: dict[np.dtype, str] = {DTYPES[name]: name for name in ("float32", "float16", "bfloat16")}


def msl_vector(type_name: str) -> tuple[np.dtype, int] | None:
    """('float4') -> (float32, 4); ('uint') -> (uint32, 1); None for other types (structs)."""
    base = type_name.rstrip("234")
    width = type_name[len(base):]
    if base not in MSL_SCALARS or len(width) > 1:
        return None
    return MSL_SCALARS[base], int(width or 1)


def span_bytes(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> int:
    """Bytes from an array's first element to one past its last, strides in elements (>= 0)."""
    if 0 in shape:
        return 0
    return itemsize * (1 + sum((n - 1) * s for n, s in zip(shape, strides) if n > 1))

