"""The forward kernels' two products, S = Q K^T and O += P V, by the descriptor's products facet
(kernel/products.py): simdgroup matrices (tiles.py), or Metal 4 tensor ops of the whole
threadgroup over its Q rows in place and the step's staged K and V rows."""

from __future__ import annotations

from ..kernel.accumulators import Accumulator
from ..kernel.msl import MSL_TYPES
from ..kernel.products import TENSOR_OPS, ThreadgroupProducts, device_rows, staged_rows
from ..kernel.tiles import HeadTensor, Rows, accumulate, scores, tiles
from .descriptor import KernelDescriptor


def _products(d: KernelDescriptor) -> ThreadgroupProducts:
    """The threadgroup's tensor-op products (d.products == TENSOR_OPS)."""
    return ThreadgroupProducts(d.simdgroups, d.key_block, MSL_TYPES[d.dtype])


def views(d: KernelDescriptor, x: dict[str, HeadTensor]) -> list[str]:
    """With tensor-op products, their memory and the tensors they read: the threadgroup's Q rows
    in place, each step's K and V rows in the stage."""
    if d.products != TENSOR_OPS:
        return []
    first = f"group.x * {d.query_rows}"
    rows = f"clamp(int({d.keys.bounds.q_end}) - int({first}), 0, {d.query_rows})"
    return _products(d).declare() + [
        device_rows("q_rows", head="q_head", layout=d.q, first=first, count=rows, width=d.head_dim),
        staged_rows("k_rows", stage=x["k"].pointer, width=d.head_dim, rows=d.key_block),
        staged_rows("v_rows", stage=x["v"].pointer, width=d.value_dim, rows=d.key_block)]


def scores_step(d: KernelDescriptor, x: dict[str, HeadTensor], first: str, positions) -> list[str]:
    """S = Q K^T into p_tile, by the descriptor's products."""
    key_tiles = d.key_block // 8
    if d.products == TENSOR_OPS:
        return _products(d).scores("p_tile", lhs="q_rows", rhs="k_rows", count=key_tiles)
    return scores("p_tile", count=key_tiles, lhs=Rows(x["q"], "row_read", "q_tile" if d.cache_q else None, "q_i"),
                  rhs=x["k"], rhs_tile="k_tile", rhs_comment="K^T: rows are head dims, columns are keys",
                  position="key", first=first, positions=positions,
                  reread="re-read: Q does not stay in registers at this head dimension")


def values_step(d: KernelDescriptor, x: dict[str, HeadTensor], first: str, positions,
                output: Accumulator) -> list[str]:
    """O += P V into `output`, by the descriptor's products, a page of O at a time where O is paged."""
    key_tiles = d.key_block // 8
    if d.products == TENSOR_OPS:
        products = _products(d)
        return products.stage_weights("p_tile", count=key_tiles) + output.blocks(
            lambda features: products.accumulate("o_tile", rhs="v_rows", features=features or (0, tiles(d.value_dim)))
        )
    return output.blocks(lambda features: accumulate(
        "o_tile", weights="p_tile", count=key_tiles, rhs=x["v"], rhs_tile="v_tile",
        rhs_comment="rows are keys, columns are value dims", position="key", first=first, positions=positions,
        features=features))
