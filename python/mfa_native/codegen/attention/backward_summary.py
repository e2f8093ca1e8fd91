"""The header lines of the backward kernels (backward.py): sizes, masking rules, and what the
tile row chose: rows and blocks, which row operands stay in registers, paged accumulators,
staged blocks, operand tiles."""

from __future__ import annotations

from . import staged_steps
from .scores import describe as describe_scores


def _kept(cached: bool) -> str:
    return "in registers" if cached else "re-read per block"


def lines(d, dq: bool) -> list[str]:
    """The header lines of the dQ kernel (`dq`) or the dK/dV kernel of BackwardDescriptor `d`:
    sizes, masking rules, tiles."""
    if dq:
        tile = (f"{d.query_rows} query rows per threadgroup, {d.key_block} keys per block, "
                + (f"Q and dO {_kept(d.cache_q)}" if d.cache_q == d.cache_dout
                   else f"Q {_kept(d.cache_q)}, dO {_kept(d.cache_dout)}")
                + (f", dQ paged {d.dq_block} features at a time" if d.dq_block else ""))
    else:
        tile = (f"{d.key_rows} keys per threadgroup, {d.query_block} queries per block, "
                + (f"K and V {_kept(d.cache_k)}" if d.cache_k == d.cache_v
                   else f"K {_kept(d.cache_k)}, V {_kept(d.cache_v)}")
                + "".join(f", {name} paged {block} features at a time"
                          for name, block in (("dK", d.dk_block), ("dV", d.dv_block)) if block))
    staged = staged_steps.backward_staged(d, walks_keys=dq)
    tile += f", {' and '.join(staged_steps.LABELS[t.name] for t in staged)} staged in threadgroup memory" if staged else ""
    tile += f", {d.tile_type} operand tiles" if d.tile_type != "float" else ""
    if d.weight_tile_type != "float":
        rounded = "dS" if dq else "P and dS"
        tile += f", {rounded} rounded to {d.weight_tile_type} for the accumulated products"
    return [f"{d.dtype}, D = {d.head_dim}, Dv = {d.value_dim}, GQA ratio {d.gqa_ratio}" + d.keys.summary(),
            f"{d.rules.describe()}, sinks {'yes' if d.sinks else 'no'}{describe_scores(d.scores)}",
            f"tiles ({d.gpu_family}): {tile}"]
