"""LaunchPlan: how to dispatch a generated kernel, defined once next to its source.

The operand list is the binding contract: operand i is `[[buffer(i)]]`, and its
name is both the MSL parameter name and the name of the pass buffer it binds.
The generator writes the kernel signature from this list and the pass
description (passes.py) is built from it, so indices are never written twice.
The grid is written in terms of the runtime sizes, so a pass only supplies
their values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .sizes import Extent, RuntimeSizes


@dataclass(frozen=True)
class Operand:
    name: str        # MSL identifier and the pass buffer it binds
    msl_type: str    # the parameter's type, e.g. "device const half*" or "constant AttentionSizes&"
    purpose: str     # one line for the generated header comment
    extent: Extent | None = None  # elements of an intermediate the pass allocates on the device

    @property
    def writes(self) -> bool:
        """Whether the kernel may write it (a pointer to non-const)."""
        return self.msl_type.endswith("*") and "const" not in self.msl_type.split()


@dataclass(frozen=True)
class GridAxis:
    """ceil(extent / per_threadgroup) threadgroups along one grid axis."""

    extent: Extent
    per_threadgroup: int = 1

    def count(self, sizes: Mapping[str, int]) -> int:
        return -(-self.extent.value(sizes) // self.per_threadgroup)

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
    sizes: RuntimeSizes   # the sizes the kernel reads: a runtime struct, or literals

    def index(self, name: str) -> int:
        """The buffer index of operand `name`."""
        for i, operand in enumerate(self.operands):
            if operand.name == name:
                return i
        raise KeyError(f"{self.kernel_name} has no operand {name!r}")

    def threadgroups(self, sizes: Mapping[str, int]) -> tuple[int, int, int]:
        return tuple(axis.count(sizes) for axis in self.grid)  # type: ignore[return-value]

    def describe_grid(self) -> str:
        return f"threadgroups ({', '.join(axis.describe() for axis in self.grid)}), " \
               f"{self.threads_per_threadgroup} threads each"
