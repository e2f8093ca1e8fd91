"""flash-attn's `cache_batch_idx` and `cache_leftpad` on a contiguous KV cache, as a paged view of
the same memory (so the paged kernels read and append in place, with no kernel of their own).

flash-attn's rules: batch element b uses cache row `cache_batch_idx[b]` (default b) of the
(Bc, Cmax, Hkv, D) cache, and its sequence starts at position `cache_leftpad[b]` (default 0) of
that row: its keys are positions leftpad[b] .. cache_seqlens[b] - 1, then the Rn new rows,
appended at cache_seqlens[b] onwards; causal and the window count from its first key. Both are
for contiguous caches only (flash-attn refuses them with a block table).

- cache_batch_idx alone: each cache row is a page of Cmax rows; batch b's block table is
  [cache_batch_idx[b]].
- With cache_leftpad: each position is a page of one row (page i is position i % rows of cache
  row i // rows, `rows` being the cache's row stride between its batch rows); batch b's pages
  are the positions leftpad[b] onwards of its row, and its length cache_seqlens[b] - leftpad[b].
"""

from __future__ import annotations

import torch


def _indices(x, name: str, batch: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or tuple(x.shape) != (batch,):
        shown = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be an int32 tensor of shape (B,) = ({batch},), got {shown}")
    return x.detach().to("cpu", torch.int64)


def paged_view(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, appended: int):
    """(k_pages, v_pages, block_table, cache_seqlens) that `attention_with_kvcache` reads as the
    contiguous cache indexed by cache_batch_idx and cache_leftpad, `appended` rows (Rn) to be
    appended. Every check raises before anything is written: ValueError naming the argument."""
    if block_table is not None:
        raise ValueError("cache_batch_idx and cache_leftpad are for a contiguous cache (flash-attn's rule): give "
                         "them without block_table")
    for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            raise ValueError(f"{name} must be a (B_cache, Cmax, Hkv, D) torch tensor with cache_batch_idx or "
                             f"cache_leftpad, got {type(cache).__name__}")
    batch, (rows_in_cache, capacity) = q.shape[0], k_cache.shape[:2]
    index = (torch.arange(batch) if cache_batch_idx is None
             else _indices(cache_batch_idx, "cache_batch_idx", batch))
    if ((index < 0) | (index >= rows_in_cache)).any():
        raise ValueError(f"cache_batch_idx must name rows of k_cache (0..{rows_in_cache - 1}), got {index.tolist()}")
    if appended and len(set(index.tolist())) < batch:
        raise ValueError(f"cache_batch_idx repeats a cache row, which two batch elements would append to: "
                         f"{index.tolist()}")
    lengths = (torch.full((batch,), capacity, dtype=torch.int64) if cache_seqlens is None
               else _indices(cache_seqlens, "cache_seqlens", batch))
    beyond = (lengths < 0) | (lengths + appended > capacity)
    if beyond.any():
        b = int(beyond.nonzero()[0, 0])
        raise ValueError(f"cache_seqlens[{b}] + Rn = {int(lengths[b])} + {appended} is beyond the cache's capacity "
                         f"{capacity} (Cmax), or negative")
    if cache_leftpad is None:
        return k_cache, v_cache, index.to(torch.int32)[:, None].contiguous(), cache_seqlens
    start = _indices(cache_leftpad, "cache_leftpad", batch)
    if ((start < 0) | (start > lengths)).any():
        raise ValueError(f"cache_leftpad must lie in 0..cache_seqlens[b] (a sequence starts before it ends), got "
                         f"cache_leftpad {start.tolist()} with cache_seqlens {lengths.tolist()}")
    views = []
    for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        row, position = cache.stride(0), cache.stride(1)
        if rows_in_cache > 1 and (position <= 0 or row % position):
            raise ValueError(f"{name}'s batch rows must be whole positions apart for cache_leftpad, got strides "
                             f"{cache.stride()}")
        rows = row // position if rows_in_cache > 1 else capacity
        pages = (rows_in_cache - 1) * rows + capacity
        views.append((cache.as_strided((pages, 1, *cache.shape[2:]), (position, position, *cache.stride()[2:])),
                      rows))
    (k_pages, rows), (v_pages, v_rows) = views
    if v_rows != rows:
        raise ValueError(f"v_cache's batch rows must be as many positions apart as k_cache's ({rows}), got {v_rows}")
    # Batch b's page j is position start[b] + j of its row; pages past its capacity are never read.
    positions = torch.minimum(start[:, None] + torch.arange(capacity)[None, :], torch.tensor(capacity - 1))
    table = (index[:, None] * rows + positions).to(torch.int32)
    return k_pages, v_pages, table, (lengths - start).to(torch.int32)
