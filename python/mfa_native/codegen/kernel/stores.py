"""Register tiles stored to device rows: the last step of every kernel that writes O, dQ, dK
or dV (tiles.py's lane layout: a lane holds columns tc and tc + 1 of row tr)."""

from __future__ import annotations

from typing import Callable

from .msl import loop
from .tiles import pair_at, tiles


def store_rows(target: str, acc: str, width: int, cast: str | None = None, factor: str | None = None,
               element: Callable[[str, int], str] | None = None, vector: bool = False) -> list[str]:
    """target[col] = acc tiles (times `factor`, converted to `cast`) for the lane's row and
    columns < width; `target` points at the row. `element(t, e)`: where element e of tile t
    is (an Accumulator's), else the register tile acc[t]. With `vector` (an even width, the
    row's pairs aligned), the lane's two elements are one vector store of `cast`2 (float2)."""
    values = []
    for e in (0, 1):
        value = (element("t", e) if element else f"{acc}[t].thread_elements()[{e}]") + (f" * {factor}" if factor else "")
        values.append(f"{cast}({value})" if cast else value)
    if vector:
        pair = f"{cast or 'float'}2"
        writes = [(f"{pair_at(target, 'col', pair, const=False)} = {pair}({values[0]}, {values[1]});", "col")]
    else:
        writes = [(f"{target}[col] = {values[0]};", "col"), (f"{target}[col + 1] = {values[1]};", "col + 1")]
    store = ["const uint col = t * 8 + tc;"]
    store += [f"if ({col} < {width}) {{ {write} }}" if width % 8 else write for write, col in writes]
    return loop(f"ushort t = 0; t < {tiles(width)}; ++t", store)
