"""LaunchPlan: how to dispatch a generated kernel, defined once next to its source.

The operand list is the binding contract: operand i is `[[buffer(i)]]`, and its
name is both the MSL parameter name and the key the host binds it by. The
generator writes the kernel signature from this list and the host builds the
buffer list from it, so indices are never written twice. The grid is written
in terms of the runtime sizes, so the host only supplies their values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .descriptor import Extent


@dataclass(frozen=True)
class Operand:
    name: str        # MSL identifier and binding key
    msl_type: str    # the parameter's type, e.g. "device const half*" or "constant AttentionSizes&"
    purpose: str     # one line for the generated header comment
    scratch: Extent | None = None  # float32 elements of an intermediate buffer the host allocates


@dataclass(frozen=True)
class GridAxis:
    """ceil(extent / per_threadgroup) threadgroups along one grid axis."""

    extent: Extent
    per_threadgroup: int = 1

    def count(self, sizes: Mapping[str, int]) -> int:
        return -(-self.extent.bake(sizes).factor // self.per_threadgroup)

    def describe(self) -> str:
        names = list(self.extent.sizes) + ([str(self.extent.factor)] if self.extent.factor != 1 else [])
        text = " * ".join(names)
        return text if self.per_threadgroup == 1 else f"ceil({text} / {self.per_threadgroup})"


@dataclass(frozen=True)
class LaunchPlan:
    kernel_name: str
    operands: tuple[Operand, ...]
    grid: tuple[GridAxis, GridAxis, GridAxis]
    threads_per_threadgroup: int
    sizes_fields: tuple[str, ...]   # fields of the runtime-size struct, () when sizes are baked

    def index(self, name: str) -> int:
        """The buffer index of operand `name`."""
        for i, operand in enumerate(self.operands):
            if operand.name == name:
                return i
        raise KeyError(f"{self.kernel_name} has no operand {name!r}")

    def threadgroups(self, sizes: Mapping[str, int]) -> tuple[int, int, int]:
        return tuple(axis.count(sizes) for axis in self.grid)  # type: ignore[return-value]

    def sizes_struct(self, sizes: Mapping[str, int]) -> np.ndarray:
        """The runtime-size struct as uint32 fields, in declaration order."""
        return np.array([sizes[name] for name in self.sizes_fields], dtype=np.uint32)

    def buffers(self, bound: Mapping[str, Any]) -> list[Any]:
        """The buffer list for Kernel.__call__, from operand name -> value."""
        missing = [o.name for o in self.operands if o.name not in bound]
        if missing:
            raise KeyError(f"{self.kernel_name}: no value bound for operand(s) {', '.join(missing)}")
        return [bound[o.name] for o in self.operands]

    def describe_grid(self) -> str:
        return f"threadgroups ({', '.join(axis.describe() for axis in self.grid)}), " \
               f"{self.threads_per_threadgroup} threads each"
