"""`bench serving --section cache`: float16 decode steps as servers make them, through
`attention_with_kvcache` (a paged cache, one appended row per query, split-KV) and
`attention_varlen` (a decode batch of mixed lengths, one query per sequence, max_seqlen_q 1,
heads packed): per call the bytes read from K/V over the bytes attended, the simdgroup ops
issued over the packed bound (work.packed_matrix_ops per sequence) and the time.

The device is tuned as one running 64 threadgroups at once (`tuned_as`), the size of an M-series
GPU: the cpu backend's own count (4) would never split a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..ops.kvcache import attention_with_kvcache
from ..ops.varlen import attention_varlen
from ..runtime.devices import tuned_as
from ..work import packed_matrix_ops
from ._table import Table

PAGE, HEADS, HEAD_DIM, DEVICE_THREADGROUPS = 256, (32, 8), 128, 64
CACHE_STEPS = ((4096, 1), (4096, 4), (32768, 1), (32768, 4))     # (attended keys, queries)
VARLEN_KEYS = (4096, 1, 700, 9000, 33, 2048, 16000, 1)            # a decode batch's key lengths
LONGEST_KERNELS = "append_k+append_v+partial+combine"             # the most a step dispatches


@dataclass(frozen=True)
class Step:
    """One benchmarked call: its label, the call, the K/V bytes it attends and its packed bound."""

    label: str
    call: Callable[[], object]
    attended: int
    bound: int


def cache_label(keys: int, queries: int) -> str:
    return f"kvcache paged{PAGE} H{HEADS[0]}/{HEADS[1]} R{queries} C{keys} D{HEAD_DIM}"


def varlen_label() -> str:
    return f"varlen B{len(VARLEN_KEYS)} H{HEADS[0]}/{HEADS[1]} R1 keys {sum(VARLEN_KEYS)} D{HEAD_DIM}"


def cache_step(keys: int, queries: int, device, **options) -> Step:
    """A paged cache holding keys - queries rows, the queries' rows appended and attended (causal;
    `options` for attention_with_kvcache)."""
    rng = np.random.default_rng(0)
    (hq, hkv), D = HEADS, HEAD_DIM
    pages = -(-keys // PAGE)
    k_cache, v_cache = (rng.standard_normal((pages, PAGE, hkv, D)).astype(np.float16) for _ in "kv")
    table = rng.permutation(pages).astype(np.int32)[None]
    q = rng.standard_normal((1, queries, hq, D)).astype(np.float16)
    k, v = (rng.standard_normal((1, queries, hkv, D)).astype(np.float16) for _ in "kv")
    lengths = np.array([keys - queries], np.int32)

    def call():
        return attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v, block_table=table,
                                      causal=True, device=device, **options)
    return Step(cache_label(keys, queries), call, keys * hkv * D * 2 * 2,
                packed_matrix_ops(1, hkv, hq // hkv, queries, keys, D, D, causal=True))


def varlen_step(device, **options) -> Step:
    """A decode batch of VARLEN_KEYS' sequences, one query each (`options` for attention_varlen)."""
    rng = np.random.default_rng(0)
    (hq, hkv), D = HEADS, HEAD_DIM
    cu_q = np.arange(len(VARLEN_KEYS) + 1, dtype=np.int32)
    cu_k = np.concatenate([[0], np.cumsum(VARLEN_KEYS)]).astype(np.int32)
    q = rng.standard_normal((len(VARLEN_KEYS), hq, D)).astype(np.float16)
    k, v = (rng.standard_normal((int(cu_k[-1]), hkv, D)).astype(np.float16) for _ in "kv")

    def call():
        return attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=1, causal=True, device=device, **options)
    bound = sum(packed_matrix_ops(1, hkv, hq // hkv, 1, n, D, D, causal=True) for n in VARLEN_KEYS)
    return Step(varlen_label(), call, k.nbytes + v.nbytes, bound)


def cache_section(args, device, measured, ratio) -> Table:
    """The table: `measured(call, repeat)` gives (seconds, profile), `ratio` formats a quotient."""
    headers = ["call", "kernels", "K/V bytes read", "K/V bytes attended", "read/attended", "mma issued",
               "packed bound", "issued/bound", "ms"]
    steps = [(keys, r) for keys, r in CACHE_STEPS if not (args.quick and keys > 4096)]

    def rows():
        with tuned_as(device, parallel_threadgroups=DEVICE_THREADGROUPS):
            for step in [cache_step(keys, r, device) for keys, r in steps] + [varlen_step(device)]:
                seconds, prof = measured(step.call, args.repeat)
                counted = all(r.bytes_read is not None for r in prof.records)
                read = prof.bytes_read.get("k", 0) + prof.bytes_read.get("v", 0) if counted else None
                ops = (prof.simdgroup_matrix_ops if all(r.simdgroup_matrix_ops is not None for r in prof.records)
                       else None)
                kernels = "+".join(r.kernel.removeprefix("attention_") for r in prof.records)
                yield [step.label, kernels, "-" if read is None else str(read), str(step.attended),
                       ratio(read, step.attended), "-" if ops is None else str(ops), str(step.bound),
                       ratio(ops, step.bound), f"{seconds * 1e3:.2f}"]

    labels = [cache_label(keys, r) for keys, r in steps] + [varlen_label()]
    return Table(headers, rows(), len(labels),
                 f"decode steps, float16, causal, tuned as {DEVICE_THREADGROUPS} parallel threadgroups",
                 [max(map(len, labels)), len(LONGEST_KERNELS), *[0] * 6, 8])
