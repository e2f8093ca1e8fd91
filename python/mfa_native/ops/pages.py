"""Paged K/V, shared by the ops that read it (attention_with_kvcache, attention_varlen): the
pages' layout and their rows as the kernels bind them (the block table's form and contents
are the ops' rules: kvcache_rules.py, varlen_rules.py).

Pages (num_blocks, page_size, Hkv, D) are bound as one run of rows: page i's first row is
row i * page_rows, page_rows being page_size where the pages follow each other and more where
other data lies between them (HND pages, K and V stacked per page), so any page size and any
layout whose pages are whole rows apart is read in place.
"""

from __future__ import annotations

import numpy as np

from ..quantized import QuantizedTensor


def page_rows(pages, name: str) -> int:
    """How many rows (of axis 1's stride) one page's start is from the next's: page_size where
    the pages follow each other, more where other data lies between them (a page-major HND
    cache `x.transpose(0, 2, 1, 3)`: Hkv * page_size; K or V of FlashInfer's stacked (num_pages,
    2, page_size, Hkv, D) cache: 2 * page_size). Every field of a QuantizedTensor must agree."""
    if isinstance(pages, QuantizedTensor):
        found = {field: page_rows(x, f"{name}.{field}") for field, x in pages.arrays().items()}
        if len(set(found.values())) > 1:
            raise ValueError(f"{name}'s fields must lay their pages out alike, got pages {found} rows apart")
        return next(iter(found.values()))
    blocks, page = pages.shape[:2]
    if blocks <= 1 or page == 1:   # one page, or one row a page: the page stride is the row stride
        return page
    between, row = pages.strides[:2]
    if row <= 0 or between % row or between // row < page:
        raise ValueError(f"{name}'s pages must be whole rows apart, without overlapping (stride of axis 0 a "
                         f"multiple, at least page_size, of axis 1's), got strides {pages.strides}")
    return between // row


def as_rows(pages, batch: int, rows_apart: int):
    """Pages as (B, rows, Hkv, D), every page's rows among them (page i's first is row i *
    `rows_apart`), shared by every batch (stride 0); a QuantizedTensor's fields each so."""
    if isinstance(pages, QuantizedTensor):
        return pages.with_fields(**{field: as_rows(x, batch, rows_apart) for field, x in pages.arrays().items()})
    if pages.dtype.isbuiltin != 1:   # as_strided cannot name every ml_dtypes type (float8_e5m2): its bits, then it
        return as_rows(pages.view(f"u{pages.dtype.itemsize}"), batch, rows_apart).view(pages.dtype)
    blocks, page = pages.shape[:2]
    row = pages.strides[0] if page == 1 else pages.strides[1]
    # as_strided keeps the pages writable (broadcast_to would not): the append kernels write them. The
    # rows end at the last page's last one: nothing past the caller's memory is in the view.
    rows = (blocks - 1) * rows_apart + page if blocks else 0
    return np.lib.stride_tricks.as_strided(pages, (batch, rows, *pages.shape[2:]), (0, row, *pages.strides[2:]))
