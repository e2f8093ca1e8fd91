"""What a kernel stages per step and how it multiplies: whether it stages the blocks it walks,
how many rows a step stages within STAGE_BYTES (beside the tensor-op products' memory), whether
K and V take turns in the stage, and whether its products are Metal 4 tensor ops
(kernel/products.py). The rows facet (rows.py) and the descriptors ask here."""

from __future__ import annotations

from ..kernel.products import SIMDGROUP_MATRIX, TENSOR_OPS, threadgroup_bytes
from ..kernel.tables import tensor_ops, tile_row

STAGE_BYTES = 24 * 1024   # threadgroup memory for staged K/V rows, under the 32 KiB every Apple GPU has
ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
PAIRS_STAGE_BYTES = 8 * 1024   # packed heads with tensor ops: their pairs' Q rows, within STAGE_BYTES


def stages_apart(family: str, dtype: str, head_dim: int, value_dim: int) -> bool:
    """Whether staged K and V rows take turns in one buffer (the tile table's stage_apart)."""
    return tile_row(family, dtype, max(head_dim, value_dim)).stage_apart


def staged_width(p, family: str, shared_kv: bool = False) -> int:
    """Features of one staged key row: K's alone when V is a view of K (MLA's latent), the
    wider of K and V when they take turns, else K's and V's together."""
    if shared_kv:
        return p.head_dim
    if stages_apart(family, p.dtype, p.head_dim, p.value_dim):
        return max(p.head_dim, p.value_dim)
    return p.head_dim + p.value_dim


def stage_rows(p, width: int, block: int, products_rows: int = 0, beside: int = 0) -> int:
    """Rows staged per step: `block` (a table's key or query block), fewer when rows of `width`
    features (K's and V's together) would not fit STAGE_BYTES, beside the memory of the
    tensor-op products of `products_rows` rows if any (products.threadgroup_bytes) and `beside`
    bytes more; a multiple of 8, at least 8 (a row too wide for 8 declares more than it may, and
    its launch says so)."""
    item = ITEM_BYTES[p.dtype]
    fits = [rows for rows in range(8, block + 1, 8)
            if rows * width * item + threadgroup_bytes(products_rows, rows, item) + beside <= STAGE_BYTES]
    return max(fits, default=8)


def stages_blocks(p, asked: bool, rows: int, products: str = SIMDGROUP_MATRIX) -> bool:
    """Whether a per-head kernel whose threadgroups hold `rows` rows stages the blocks it walks
    (tile_row stage_kv, backward stage_kv / stage_q_dout: `asked`): when more than one
    simdgroup shares them and the key-visit facet walks the same blocks for all of them; always
    when its `products` are tensor ops (they read the stage)."""
    return products == TENSOR_OPS or (asked and rows > 8 and p.keys.uniform_walk)


def tensor_ops_fit(p, width: int, rows: int, beside: int = 0) -> bool:
    """Whether tensor-op products of `rows` rows fit STAGE_BYTES beside a stage of at least 8
    rows of `width` features and `beside` bytes more (else the kernel keeps simdgroup matrices)."""
    item = ITEM_BYTES[p.dtype]
    return 8 * width * item + threadgroup_bytes(rows, 8, item) + beside <= STAGE_BYTES


def uses_tensor_ops(p, family: str, row, rows: int, width: int, beside: int = 0) -> bool:
    """Whether a kernel of threadgroups of `rows` rows, staging rows of `width` features, makes
    tensor-op products: where `family`'s `row` asks, every simdgroup walks the same blocks, the
    memory fits (tensor_ops_fit), and the problem is not batch-invariant (whose bits must not
    depend on the shape of the threadgroup's products, which Metal does not promise)."""
    return (tensor_ops(family, row) and p.keys.uniform_walk and not p.batch_invariant
            and tensor_ops_fit(p, width, rows, beside))


def backward_blocks(p, family: str, row, query_rows: int, key_rows: int) -> dict:
    """The backward kernels' products (kernel/products.py) and staged blocks, from their tile
    `row`: tensor ops where the family's row asks and the blocks are walked alike by every
    simdgroup, and then both kernels stage theirs (the products read the stage); the blocks
    (key_block of the dQ kernel, query_block of the dK/dV kernel) shrink to what the stage holds."""
    width = p.head_dim + p.value_dim   # K and V (Q and dO) staged together
    tensor = uses_tensor_ops(p, family, row, max(query_rows, key_rows), width)
    products = TENSOR_OPS if tensor else SIMDGROUP_MATRIX
    stage_kv = stages_blocks(p, row.stage_kv, query_rows, products)
    stage_q_dout = stages_blocks(p, row.stage_q_dout, key_rows, products)
    return dict(products=products, stage_kv=stage_kv, stage_q_dout=stage_q_dout,
                key_block=stage_rows(p, width, row.key_block, query_rows * tensor) if stage_kv else row.key_block,
                query_block=(stage_rows(p, width, row.query_block, key_rows * tensor) if stage_q_dout
                             else row.query_block))
