"""`mfa_native.attention_with_kvcache`: flash-attn's flash_attn_with_kvcache, contiguous or
paged, with the new rows appended to the caller's cache in place, declared once.

The append is a host write into the caches (numpy arrays, torch CPU tensors: their memory is
the host's), made after every check of the call and before the kernel, on every call; the
attention is the dense forward kernel over each batch's attended length
(codegen/attention/cache.py). Inference only.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import codegen, reference
from ..codegen import CacheKeys
from ..runtime.devices import tuning_facts
from . import arguments as check
from .attention import CAUSAL, LSE, OUTPUT, RETURN_LSE, SCALE, SINKS, WINDOW, Validated, validate
from .declaration import Arg, Call, Op
from .empty import empty_forward
from .warm import prepared_call

Q = Arg("q", "array", leading=True, keyword=False, doc="""
    (B, R, Hq, D) queries ("bshd"), one kind and dtype with the caches (float32, float16,
    bfloat16: numpy or torch CPU tensors, whose memory the append writes).""")
K_CACHE = Arg("k_cache", "array", leading=True, keyword=False, doc="""
    contiguous (B, Cmax, Hkv, D), or with block_table the pages (num_blocks, page_size, Hkv,
    D), page_size a multiple of 8, each page's rows following the previous page's in memory.
    Rows past a batch's attended length are never read (they may hold NaN).""")
V_CACHE = Arg("v_cache", "array", leading=True, keyword=False, doc="like k_cache, Dv wide.")
CACHE_SEQLENS = Arg("cache_seqlens", "array", doc="""
    int32 (B,): each batch's valid cache length before this call (not modified).""")
K_NEW = Arg("k", "array", default=None, doc="""
    (B, Rn, Hkv, D), optional: written into k_cache IN PLACE at positions cache_seqlens[b] ..
    cache_seqlens[b] + Rn - 1 and attended in this call (attended length cache_seqlens[b] + Rn).""")
V_NEW = Arg("v", "array", default=None, doc="(B, Rn, Hkv, Dv): the same for v_cache (given with k).")
BLOCK_TABLE = Arg("block_table", "array", default=None, doc="""
    int32 (B, max_blocks), optional (a paged cache): logical position p of batch b lives in
    page block_table[b, p // page_size] at row p % page_size. Entries of pages no attended
    key lies in are not read.""")
ON_HOST = "the append writes the cache on the host"


def _four(x, name: str, axes: str) -> np.ndarray:
    x = check.as_array(x, name)
    if x.ndim != 4:
        raise ValueError(f"{name} must have 4 dimensions {axes}, got shape {x.shape}")
    return x


def _as_rows(cache: np.ndarray, name: str, batch: int) -> np.ndarray:
    """A paged cache as (B, num_blocks * page_size, Hkv, D) rows, shared by every batch (stride 0)."""
    blocks, page = cache.shape[:2]
    if blocks > 1 and cache.strides[0] != page * cache.strides[1]:
        raise ValueError(f"{name}'s pages must follow each other in memory (stride of axis 0 = page_size * stride "
                         f"of axis 1), got strides {cache.strides}")
    rows = np.lib.stride_tricks.as_strided(cache, (1, blocks * page, *cache.shape[2:]), (0, *cache.strides[1:]))
    return np.broadcast_to(rows, (batch, *rows.shape[1:]))


class Cache:
    """The call's cache facts (shapes, capacity) and its checks of contents and append (every call)."""

    def __init__(self, q, k_cache, v_cache, k, v, block_table) -> None:
        self.paged = block_table is not None
        self.batch = q.shape[0]
        axes = "(num_blocks, page_size, Hkv, D)" if self.paged else "(B, Cmax, Hkv, D)"
        k_cache, v_cache = _four(k_cache, "k_cache", axes), _four(v_cache, "v_cache", axes)
        if v_cache.shape[:3] != k_cache.shape[:3]:
            raise ValueError(f"v_cache must have k_cache's leading axes: k_cache {k_cache.shape}, v_cache {v_cache.shape}")
        if (k is None) != (v is None):
            raise ValueError("k and v are appended together: give both or neither")
        self.appended = 0 if k is None else _four(k, "k", "(B, Rn, Hkv, D)").shape[1]
        for new, cache, name in ((k, k_cache, "k"), (v, v_cache, "v")):
            if new is not None and (new.shape[0] != self.batch or new.shape[1] != self.appended
                                    or new.shape[2:] != cache.shape[2:] or new.dtype != q.dtype):
                raise ValueError(f"{name} must be (B, Rn, Hkv, {'D' if name == 'k' else 'Dv'}) = "
                                 f"({self.batch}, {self.appended}, {', '.join(map(str, cache.shape[2:]))}) "
                                 f"of q's dtype {q.dtype}, got {new.shape} {new.dtype}")
        self.page = k_cache.shape[1] if self.paged else None
        if self.paged:
            self.blocks = k_cache.shape[0]
            table = check.as_array(block_table, "block_table")
            if table.dtype != np.int32 or table.ndim != 2 or table.shape[0] != self.batch:
                raise ValueError(f"block_table must be int32 (B, max_blocks) with B = {self.batch}, got "
                                 f"{table.dtype} {table.shape}")
            self.width = table.shape[1]
            self.capacity = self.width * self.page
        elif k_cache.shape[0] != self.batch:
            raise ValueError(f"k_cache must be (B, Cmax, Hkv, D) with q's B = {self.batch}, got {k_cache.shape}")
        else:
            self.capacity = k_cache.shape[1]

    def caches(self, k_cache, v_cache) -> tuple[np.ndarray, np.ndarray]:
        """k and v as the kernel reads them: (B, C, Hkv, D) rows."""
        if not self.paged:
            return check.as_array(k_cache, "k_cache"), check.as_array(v_cache, "v_cache")
        return (_as_rows(check.as_array(k_cache, "k_cache"), "k_cache", self.batch),
                _as_rows(check.as_array(v_cache, "v_cache"), "v_cache", self.batch))

    def keys(self) -> CacheKeys:
        return CacheKeys(self.appended, self.page, self.width if self.paged else None)

    def check(self, cache_seqlens, block_table) -> np.ndarray:
        """cache_seqlens as bound, checked with the block table's pages that must be read."""
        lengths = check.as_array(cache_seqlens, "cache_seqlens")
        if lengths.dtype != np.int32 or lengths.shape != (self.batch,):
            raise ValueError(f"cache_seqlens must be int32 (B,) = ({self.batch},), got {lengths.dtype} {lengths.shape}")
        if lengths.size and lengths.min() < 0:
            raise ValueError(f"cache_seqlens must not be negative, got {lengths.min()}")
        attended = lengths.astype(np.int64) + self.appended
        if attended.size and attended.max() > self.capacity:
            b = int(np.argmax(attended))
            raise ValueError(f"cache_seqlens[{b}] + Rn = {lengths[b]} + {self.appended} is beyond the cache's capacity "
                             f"{self.capacity}{' (max_blocks * page_size)' if self.paged else ' (Cmax)'}")
        if self.paged:
            table = check.as_array(block_table, "block_table")
            needed = np.arange(self.width)[None, :] < -(-attended[:, None] // self.page)
            bad = needed & ((table < 0) | (table >= self.blocks))
            if bad.any():
                b, i = (int(x) for x in np.argwhere(bad)[0])
                raise ValueError(f"block_table[{b}, {i}] = {table[b, i]} is not a page of k_cache (0..{self.blocks - 1}), "
                                 f"and batch {b} reads that page")
        return np.ascontiguousarray(lengths)

    def append(self, k_cache, v_cache, cache_seqlens, k, v, block_table) -> None:
        """Writes k and v into the caches at each batch's positions cache_seqlens[b] + i."""
        if not self.appended:
            return
        lengths = np.asarray(cache_seqlens).astype(np.int64)
        positions = lengths[:, None] + np.arange(self.appended)[None, :]            # (B, Rn)
        for cache, new, name in ((k_cache, k, "k_cache"), (v_cache, v, "v_cache")):
            cache = check.as_array(cache, name)
            if not cache.flags.writeable:
                raise TypeError(f"{name} is read-only here ({type(cache).__name__}): the append writes it in place")
            if self.paged:
                pages = np.take_along_axis(np.asarray(block_table), positions // self.page, axis=1)
                cache[pages, positions % self.page] = check.as_array(new, name[0])
            else:
                cache[np.arange(self.batch)[:, None], positions] = check.as_array(new, name[0])


def _prepare(call: Call, device):
    q = _four(call.q, "q", "(B, R, Hq, D)")
    cache = Cache(q, call.k_cache, call.v_cache, call.k, call.v, call.block_table)
    k4, v4 = cache.caches(call.k_cache, call.v_cache)
    forward = validate((q, k4, v4, None, call.sinks), scale=call.scale, causal=call.causal, window=call.window,
                       layout="bshd", return_lse=call.return_lse)
    p = replace(forward.problem, keys=cache.keys())
    bound, converts = dict(forward.bound), dict(forward.converts)
    converts["k"] = lambda x: check.bindable(cache.caches(x, x)[0])
    converts["v"] = lambda x: check.bindable(cache.caches(x, x)[1])
    bound["cache_seqlens"] = cache.check(call.cache_seqlens, call.block_table)
    converts["cache_seqlens"] = np.ascontiguousarray
    sources = {"k": "k_cache", "v": "v_cache"}
    if cache.paged:
        bound["block_table"], converts["block_table"] = np.ascontiguousarray(call.block_table), np.ascontiguousarray
    names = call.op.array_names
    at = {name: names.index(name) for name in names}

    def check_and_append(arguments) -> None:
        """Every call: the contents checked, then the new rows written (nothing written on an error)."""
        values = {name: arguments[i] for name, i in at.items()}
        cache.check(values["cache_seqlens"], values["block_table"])
        cache.append(values["k_cache"], values["v_cache"], values["cache_seqlens"], values["k"], values["v"],
                     values["block_table"])

    check_and_append([call.values[name] for name in names])
    checked = Validated(p, bound, converts, sources)
    if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        prepared, inputs = empty_forward(p, names, checked)
    else:
        description = codegen.attention_pass(p, family=tuning_facts(device).family)
        prepared, inputs = prepared_call(description, device, checked, names, call.results)
    prepared.check = check_and_append
    return prepared, inputs


ATTENTION_WITH_KVCACHE = Op(
    "attention_with_kvcache",
    "Attention of new queries over a KV cache (flash-attn's flash_attn_with_kvcache), appending k and v to it.",
    arguments=(Q, K_CACHE, V_CACHE, CACHE_SEQLENS, K_NEW, V_NEW, BLOCK_TABLE, SCALE, CAUSAL, WINDOW, SINKS,
               RETURN_LSE),
    outputs=(OUTPUT, LSE),
    prepare=_prepare,
    reference=reference.attention_with_kvcache_reference,
    no_backward="attention_with_kvcache is inference only (use attention or attention_varlen to train)",
    on_metal=ON_HOST,
    details="""
    Batch b's queries attend the cache's first cache_seqlens[b] + Rn keys: causal=True lines
    the last query up with the last attended key; window and sinks as in `attention`.

    Returns:
        out (B, R, Hq, Dv) of q's kind and dtype; with return_lse also lse (B, Hq, R) float32.

    Raises:
        TypeError, ValueError naming the argument (cache_seqlens + Rn beyond the capacity, a
        block_table entry out of range for a page that must be read), before anything is written.
    """)
attention_with_kvcache = ATTENTION_WITH_KVCACHE.function
