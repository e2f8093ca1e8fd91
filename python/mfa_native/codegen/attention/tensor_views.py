"""What the attention kernels' tensor-op products (kernel/products.py) read: their threadgroup
memory, and tensor views of the threadgroup's own rows in place (the forward's and dQ kernel's
Q and dO rows, the dK/dV kernel's K and V rows) and of the step's staged rows (K and V, or Q
and dO). None of it exists when the descriptor's products are simdgroup matrices."""

from __future__ import annotations

from ..kernel.msl import MSL_TYPES
from ..kernel.products import TENSOR_OPS, ThreadgroupProducts, device_rows, staged_rows
from ..kernel.tiles import HeadTensor
from .descriptor import BackwardDescriptor, KernelDescriptor


def forward_products(d: KernelDescriptor) -> ThreadgroupProducts | None:
    """The forward kernels' tensor-op products (None: simdgroup matrices)."""
    return ThreadgroupProducts(d.simdgroups, d.key_block, MSL_TYPES[d.dtype]) if d.products == TENSOR_OPS else None


def backward_products(d: BackwardDescriptor, walks_keys: bool) -> ThreadgroupProducts | None:
    """The tensor-op products of the dQ kernel (`walks_keys`) or the dK/dV kernel (None:
    simdgroup matrices)."""
    if d.products != TENSOR_OPS:
        return None
    rows, block = (d.query_rows, d.key_block) if walks_keys else (d.key_rows, d.query_block)
    return ThreadgroupProducts(rows // 8, block, MSL_TYPES[d.dtype])


def views(products: ThreadgroupProducts | None, d, x: dict[str, HeadTensor], *, own: tuple[str, ...],
          staged: tuple[str, ...], first: str, end: str) -> list[str]:
    """The products' memory and `{name}_rows` views: the `own` tensors' rows of the threadgroup in
    place (from `first`, the first simdgroup's first row, to `end` at most), and the `staged`
    ones' step rows in their stage (x: the tensors, staged ones read from their stage)."""
    if products is None:
        return []
    count = f"clamp(int({end}) - int({first}), 0, {products.rows})"
    lines = products.declare() + [
        device_rows(f"{name}_rows", head=f"{name}_head", layout=getattr(d, name), first=first, count=count,
                    width=x[name].width) for name in own]
    return lines + [staged_rows(f"{name}_rows", stage=x[name].pointer, width=x[name].width, rows=products.block)
                    for name in staged]


def forward_views(d: KernelDescriptor, x: dict[str, HeadTensor]) -> list[str]:
    """The forward kernels' views: Q rows in place, the step's K and V rows staged."""
    return views(forward_products(d), d, x, own=("q",), staged=("k", "v"), first="q_first - simd_index * 8",
                 end=d.keys.bounds.q_end)


def dq_views(d: BackwardDescriptor, x: dict[str, HeadTensor]) -> list[str]:
    """The dQ kernel's views: Q and dO rows in place, the step's K and V rows staged."""
    return views(backward_products(d, walks_keys=True), d, x, own=("q", "dout"), staged=("k", "v"),
                 first="q_first - simd_index * 8", end=d.keys.bounds.q_end)


def dkdv_views(d: BackwardDescriptor, x: dict[str, HeadTensor]) -> list[str]:
    """The dK/dV kernel's views: K and V rows in place, the step's Q and dO rows staged."""
    return views(backward_products(d, walks_keys=False), d, x, own=("k", "v"), staged=("q", "dout"),
                 first="key_first - simd_index * 8", end=d.keys.bounds.k_end)
