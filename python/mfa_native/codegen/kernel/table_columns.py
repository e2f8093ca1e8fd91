"""The tile tables' columns and their allowed values: the tuner's candidate space.

tables.py's rows (TileRow, BackwardTileRow) document what each column does; here each
column has its domain, by table, and the backward columns the kernel that reads them.
The domains hold metal-flash-attention's published values (its 80- and 128-wide traversal
blocks, 16-feature head blocks; tables.py). The names are stable: the tuner enumerates these
mappings, and a row outside them is refused (`tables.forced_rows`). A value in its domain
may still not fit a problem (say, paged dK and dV of two simdgroups at D 576 exceed 32 KiB
of threadgroup memory); the kernel launch reports that.
"""

from __future__ import annotations

from dataclasses import fields

# The tuner's candidate space: every column's allowed values, by table. A row is valid when
# each of its columns holds one of these (block sizes also fit the row's head dimension).
FORWARD_COLUMNS: dict[str, tuple] = {
    "query_rows": (8, 16, 32),
    "key_block": (16, 32, 64, 80, 128),
    "cache_q": (True, False),
    "stage_apart": (True, False),
    "o_block": (0, 16, 32, 64),
    "tiles16": (True, False),
    "p16": (True, False),
    "stage_kv": (True, False),
    "vector_access": (True, False),
    "tensor_ops": (False, True),   # apple10 only (tables.tensor_ops); elsewhere the same kernel as "no"
}
BACKWARD_COLUMNS: dict[str, tuple] = {
    "query_rows": (8, 16, 32),      # dQ kernel
    "key_block": (16, 32, 64, 80, 128),    # dQ kernel
    "key_rows": (8, 16, 32),        # dK/dV kernel
    "query_block": (16, 32, 64, 80, 128),  # dK/dV kernel
    "cache_q": (True, False),       # dQ kernel
    "cache_dout": (True, False),    # dQ kernel
    "cache_k": (True, False),       # dK/dV kernel
    "cache_v": (True, False),       # dK/dV kernel
    "dq_block": (0, 16, 32, 64),    # dQ kernel
    "dk_block": (0, 16, 32, 64),    # dK/dV kernel
    "dv_block": (0, 16, 32, 64),    # dK/dV kernel
    "tiles16": (True, False),       # both kernels; 16-bit inputs only
    "p16": (True, False),           # both kernels; 16-bit inputs only
    "stage_kv": (True, False),      # dQ kernel
    "stage_q_dout": (True, False),  # dK/dV kernel
    "vector_access": (True, False),  # both kernels
    "tensor_ops": (False, True),     # both kernels; apple10 only (tables.tensor_ops)
}
# Which kernels read a backward column (the forward's columns all apply to the forward kernels).
BACKWARD_KERNEL_COLUMNS = {
    "dq": ("query_rows", "key_block", "cache_q", "cache_dout", "dq_block", "tiles16", "p16", "stage_kv",
           "vector_access", "tensor_ops"),
    "dkdv": ("key_rows", "query_block", "cache_k", "cache_v", "dk_block", "dv_block", "tiles16", "p16",
             "stage_q_dout", "vector_access", "tensor_ops"),
}


def check_row(row, columns: dict[str, tuple], what: str) -> None:
    """ValueError unless every column of `row` named in `columns` holds one of its values."""
    for field in fields(row):
        if field.name in columns and getattr(row, field.name) not in columns[field.name]:
            raise ValueError(f"{what} column {field.name} must be one of {columns[field.name]}, "
                             f"got {getattr(row, field.name)!r}")
