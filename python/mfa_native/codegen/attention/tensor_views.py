"""What the attention kernels' tensor-op products (kernel/products.py) read: their threadgroup
memory, the threadgroup's own rows in place (the forward's and dQ kernel's Q and dO rows, the
dK/dV kernel's K and V rows; packed heads' Q rows, which no strided view holds, staged once),
and the step's staged rows (K and V, or Q and dO). None of it exists when the descriptor's
products are simdgroup matrices."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..kernel.msl import BARRIER, MSL_TYPES, loop
from ..kernel.products import TENSOR_OPS, RowsView, ThreadgroupProducts, device_rows, staged_rows
from ..kernel.tiles import HeadTensor, index
from .descriptor import BackwardDescriptor, KernelDescriptor


@dataclass(frozen=True)
class Views:
    """A kernel's tensor-op products (None: simdgroup matrices), the lines that declare what
    they read (at the kernel's top level) and the views of it by tensor name."""

    products: ThreadgroupProducts | None = None
    lines: list[str] = field(default_factory=list)
    rows: dict[str, RowsView] = field(default_factory=dict)

    def pair(self, lhs: str, rhs: str) -> tuple[RowsView, RowsView] | None:
        """The views of a product's two operands (None without tensor ops)."""
        return (self.rows[lhs], self.rows[rhs]) if self.products else None

    def of(self, name: str) -> RowsView | None:
        return self.rows[name] if self.products else None


def _views(products: ThreadgroupProducts, d, x: dict[str, HeadTensor], *, staged: tuple[str, ...],
           own: tuple[str, ...] = (), first: str = "", end: str = "") -> Views:
    """The products' memory and views: the `own` tensors' rows of the threadgroup in place (from
    `first`, the first simdgroup's first row, below `end`), and the `staged` ones' step rows in
    their stage (x: the tensors, staged ones read from their stage)."""
    lines, rows = products.declare(), {}
    for name in own:
        declared, rows[name] = device_rows(f"{name}_rows", head=f"{name}_head", element=MSL_TYPES[d.dtype],
                                           layout=getattr(d, name), first=first, width=x[name].width,
                                           rows=f"clamp(int({end}) - int({first}), 0, {products.rows})")
        lines += declared
    for name in staged:
        rows[name] = staged_rows(x[name].pointer, width=x[name].width, rows=products.block)
    return Views(products, lines, rows)


def _pairs_stage(d: KernelDescriptor, products: ThreadgroupProducts) -> Views:
    """Packed heads: the (query, head) pairs' Q rows, staged once (the 4 lanes of each row copy
    every 4th feature)."""
    t, width = MSL_TYPES[d.dtype], d.head_dim
    copy = f"q_pairs[(simd_index * 8 + tr) * {width} + f] = q_head[{index('row_read', d.q.strides[2], 'f')}];"
    lines = (["", "// The pairs' Q rows, staged once: the 4 lanes of each row copy every 4th feature.",
              f"threadgroup {t} q_pairs[{products.rows * width}];"]
             + loop(f"uint f = tc / 2; f < {width}; f += 4", [copy], unroll=False) + [BARRIER])
    return Views(products, lines, {"q": staged_rows("q_pairs", width=width, rows=products.rows)})


def forward_views(d: KernelDescriptor, x: dict[str, HeadTensor]) -> Views:
    """The forward kernels' views: the step's K and V rows staged, and Q's rows in place, or with
    packed heads staged once."""
    if d.products != TENSOR_OPS:
        return Views()
    products = ThreadgroupProducts(d.simdgroups, d.key_block, MSL_TYPES[d.dtype])
    if not d.rows.packed:
        return _views(products, d, x, own=("q",), staged=("k", "v"), first="q_first - simd_index * 8",
                      end=d.keys.bounds.q_end)
    staged, pairs = _views(products, d, x, staged=("k", "v")), _pairs_stage(d, products)
    return Views(products, staged.lines + pairs.lines, staged.rows | pairs.rows)


def backward_views(d: BackwardDescriptor, x: dict[str, HeadTensor], walks_keys: bool) -> Views:
    """The views of the dQ kernel (`walks_keys`: Q and dO rows in place, the step's K and V rows
    staged) or the dK/dV kernel (K and V rows in place, the step's Q and dO rows staged)."""
    if d.products != TENSOR_OPS:
        return Views()
    rows, block = (d.query_rows, d.key_block) if walks_keys else (d.key_rows, d.query_block)
    products = ThreadgroupProducts(rows // 8, block, MSL_TYPES[d.dtype])
    if walks_keys:
        return _views(products, d, x, own=("q", "dout"), staged=("k", "v"), first="q_first - simd_index * 8",
                      end=d.keys.bounds.q_end)
    return _views(products, d, x, own=("k", "v"), staged=("q", "dout"), first="key_first - simd_index * 8",
                  end=d.keys.bounds.k_end)
