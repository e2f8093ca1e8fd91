"""Sizes in generated kernels: element counts written in terms of runtime sizes.

A kernel family names its runtime sizes (attention: B, Hq, Hkv, R, C, ...) with
a line of documentation each. They reach a kernel as the fields of one small
constant struct (bound inline, so a new length reuses the compiled kernel), or,
baked, as literals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

SIZES_OPERAND = "sizes"   # the operand (and pass buffer) holding the runtime-size struct


@dataclass(frozen=True)
class Extent:
    """An element count: `factor` times the product of the named runtime sizes."""

    factor: int
    sizes: tuple[str, ...] = ()

    def times(self, other: Extent) -> Extent:
        return Extent(self.factor * other.factor, self.sizes + other.sizes)

    def value(self, sizes: Mapping[str, int]) -> int:
        result = self.factor
        for name in self.sizes:
            result *= sizes[name]
        return result

    def bake(self, sizes: Mapping[str, int]) -> Extent:
        return Extent(self.value(sizes))


@dataclass(frozen=True)
class RuntimeSizes:
    """The sizes a kernel may read: `docs` lists (name, meaning) in struct order; with
    `baked` = ((name, value), ...) they are literals and no struct is bound."""

    struct: str
    docs: tuple[tuple[str, str], ...]
    baked: tuple[tuple[str, int], ...] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.docs)

    @property
    def fields(self) -> tuple[str, ...]:
        """The struct's fields; () when the sizes are baked."""
        return () if self.baked is not None else self.names

    def words(self, values: Mapping[str, int]) -> tuple[int, ...]:
        """The struct's bytes as uint32 words, in field order."""
        words = tuple(int(values[name]) for name in self.fields)
        if any(not 0 <= w < 2**32 for w in words):
            raise ValueError(f"runtime sizes {dict(zip(self.fields, words))} do not fit in 32 bits")
        return words
