"""A simdgroup's 8-row accumulators (O, dQ, dK, dV): 8x8 float register tiles, or paged
through threadgroup memory (MFA's cachedOperands false), as MSL lines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .msl import indent, loop
from .tiles import tiles, zeroed


@dataclass(frozen=True)
class Accumulator:
    """A simdgroup's 8-row accumulator `name` (O, dQ, ...), `width` features wide: 8x8 tiles
    in registers (`block` 0), or paged (MFA's cachedOperands false): held in threadgroup
    memory, each lane keeping its own two elements of every tile (no barrier: no lane reads
    another's), and brought into registers `block` features at a time around each product.
    `simdgroups`: how many pages the threadgroup holds."""

    name: str
    width: int
    block: int = 0
    simdgroups: int = 1

    @property
    def lane_page(self) -> str:
        return f"{self.name}_lane"

    def bytes(self) -> int:
        """Threadgroup memory of the pages."""
        return self.simdgroups * tiles(self.width) * 64 * 4 if self.block else 0

    def declare(self, comment: str) -> list[str]:
        """The accumulator, all zero. Reads simd_index, lane (paged)."""
        if not self.block:
            return zeroed(self.name, tiles(self.width), comment)
        n = tiles(self.width)
        return ([f"threadgroup float {self.name}_page[{self.simdgroups * n * 64}];  // {comment}: paged, "
                 f"{self.block} features at a time in registers",
                 f"threadgroup float* {self.lane_page} = {self.name}_page + simd_index * {n * 64} + lane * 2;"
                 "  // the lane's elements: tile t at [t * 64]"]
                + loop(f"ushort t = 0; t < {n}; ++t", [f"{self.element('t', e)} = 0.0f;" for e in (0, 1)]))

    def element(self, t: str, e: int) -> str:
        """Element e (0, 1) of the lane's share of tile t."""
        if not self.block:
            return f"{self.name}[{t}].thread_elements()[{e}]"
        return f"{self.lane_page}[{t} * 64{f' + {e}' if e else ''}]"

    def scale(self, factor: str) -> list[str]:
        """Every element *= factor."""
        return loop(f"ushort t = 0; t < {tiles(self.width)}; ++t",
                    [f"{self.element('t', e)} *= {factor};" for e in (0, 1)])

    def blocks(self, product: Callable[[tuple[int, int] | None], list[str]]) -> list[str]:
        """`product(features)` accumulating into the register tiles `name`[t]: once over every
        tile (features None), or, paged, once per block (first tile, count) between its load
        from the page and its store back."""
        if not self.block:
            return product(None)
        lines, per, n = [], self.block // 8, tiles(self.width)
        for first in range(0, n, per):
            count = min(per, n - first)
            pairs = [self._pair(first, e) for e in (0, 1)]
            page_in = loop(f"ushort t = 0; t < {count}; ++t", [f"{tile} = {page};" for tile, page in pairs])
            page_out = loop(f"ushort t = 0; t < {count}; ++t", [f"{page} = {tile};" for tile, page in pairs])
            body = [f"simdgroup_float8x8 {self.name}[{count}];"] + page_in + product((first, count)) + page_out
            lines += [f"{{  // features [{first * 8}, {(first + count) * 8}) of the paged accumulator"] + indent(body) + ["}"]
        return lines

    def _pair(self, first: int, e: int) -> tuple[str, str]:
        """(register element, page element) of element e of block tile t (feature tile first + t)."""
        return (f"{self.name}[t].thread_elements()[{e}]",
                f"{self.lane_page}[({first} + t) * 64{f' + {e}' if e else ''}]")
