"""A static report of one generated kernel, read from its MSL: registers per thread estimated
from the declared tiles and scalars, threadgroup memory, barriers inside loops (per block), the
device accesses in its text, vector ones (tables.py's vector_access) apart, and how it
multiplies (products.py: simdgroup matrices or Metal 4 tensor ops)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .products import SIMDGROUP_MATRIX, TENSOR_OPS, libraries

ELEMENT_BYTES = {"float": 4, "half": 2, "bfloat": 2, "int": 4, "uint": 4, "short": 2, "ushort": 2, "char": 1, "uchar": 1}
_TILES = re.compile(r"simdgroup_(float|half|bfloat)8x8 \w+(?:\[(\d+)\])?[;\s=]")
_SCALARS = re.compile(r"^\s*(?:const )?(?:float|half|bfloat|int|uint|ushort|short|bool)2? \w+ *=", re.M)
_THREADGROUP = re.compile(r"threadgroup (\w+) \w+\[(\d+)\];")
_DEVICE_POINTERS = re.compile(r"device (?:const )?\w+\* (\w+)")      # parameters and locals
_VECTOR_ACCESSES = re.compile(r"\*\(device (?:const )?[a-z]+[234]\*\)\(")  # *(device const half2*)(p + i)


@dataclass(frozen=True)
class KernelReport:
    """`registers`: 32-bit registers per thread, every declared tile counted live (an 8x8
    tile is 64 elements over 32 lanes: two per thread, 4 bytes each for float, 2 for 16-bit)
    plus one per declared scalar; an upper-bound estimate, not the compiler's allocation."""

    entry: str
    registers: int
    tile_registers: int
    scalars: int
    threadgroup_bytes: int
    barriers_per_block: int
    device_accesses: int = 0   # places in the text that load or store device memory (p[i] or a vector cast)
    vector_accesses: int = 0   # of them, vector accesses: one per lane's pair of a row tile instead of two
    products: str = SIMDGROUP_MATRIX   # or TENSOR_OPS: the kernel includes Metal 4's tensor ops


def threadgroup_bytes(source: str) -> int:
    """Bytes of the threadgroup arrays a kernel declares."""
    return sum(ELEMENT_BYTES[t] * int(n) for t, n in _THREADGROUP.findall(source))


def _tile_registers(source: str) -> int:
    return sum((2 if kind == "float" else 1) * int(count or 1) for kind, count in _TILES.findall(source))


def _barriers_in_loops(source: str) -> int:
    """threadgroup_barrier calls inside some for loop of the kernel text (brace depth tracked)."""
    loops, depth, count = [], 0, 0
    for line in source.splitlines():
        if re.match(r"\s*for \(", line):
            loops.append(depth)
        count += bool(loops) and line.count("threadgroup_barrier(")
        depth += line.count("{") - line.count("}")
        while loops and depth <= loops[-1]:
            loops.pop()
    return count


def _device_accesses(source: str) -> tuple[int, int]:
    """(every device access site, the vector ones): p[...] of the device pointers the text
    declares, and the vector casts *(device T2*)(...)."""
    vector = len(_VECTOR_ACCESSES.findall(source))
    scalar = sum(len(re.findall(rf"\b{name}\[", source)) for name in set(_DEVICE_POINTERS.findall(source)))
    return scalar + vector, vector


def report(entry: str, source: str) -> KernelReport:
    """The static report of the kernel `entry` whose MSL is `source`."""
    tiles, scalars = _tile_registers(source), len(_SCALARS.findall(source))
    return KernelReport(entry, tiles + scalars, tiles, scalars, threadgroup_bytes(source), _barriers_in_loops(source),
                        *_device_accesses(source), products=TENSOR_OPS if libraries(source) else SIMDGROUP_MATRIX)
