"""The lightning indexer's table of `bench sparse`: `sparse_topk` at growing C for a fixed
number of rows, each kernel's time and device bytes written (cpu backend: its profiler; Metal:
wall time only), and the ratio of each row's total time to the previous row's (C grows 4x per
row: linear work gives 4x). Default shapes are small (Hi = 4, Di = 64, topk = 256) so the
cpu backend runs them in seconds; the real indexer is Hi = 64, Di = 128, topk = 2048."""

from __future__ import annotations

import time

import numpy as np

from .. import profile
from ..ops.topk import sparse_topk
from ._table import format_table

LENGTHS = (4096, 16384, 65536)
ROWS, HEADS, HEAD_DIM, TOPK = 8, 4, 64, 256


def _run(rng, device, C: int) -> tuple[float, list]:
    """(wall seconds, per-kernel profile records) of one warm causal call at C keys."""
    q = rng.standard_normal((1, HEADS, ROWS, HEAD_DIM)).astype(np.float16)
    k = rng.standard_normal((1, 1, C, HEAD_DIM)).astype(np.float16)
    w = rng.random((1, HEADS, ROWS)).astype(np.float32)
    sparse_topk(q, k, w, TOPK, device=device)          # compiles and prepares
    with profile() as recorded:
        start = time.perf_counter()
        sparse_topk(q, k, w, TOPK, device=device)
        seconds = time.perf_counter() - start
    return seconds, recorded.records


def indexer_table(rng, device) -> str:
    """The table, with its title line."""
    rows, previous = [], None
    for C in LENGTHS:
        seconds, records = _run(rng, device, C)
        kernel_seconds = [r.seconds for r in records]
        total = sum(kernel_seconds) if None not in kernel_seconds else seconds
        ratio = "-" if previous is None else f"{total / previous:.2f}x"
        previous = total
        for i, record in enumerate(records):
            written = record.bytes_written
            rows.append([str(C) if i == 0 else "", record.kernel, str(record.threadgroups),
                         "-" if record.seconds is None else f"{record.seconds * 1e3:.1f}",
                         "-" if written is None else str(sum(written.values())), ratio if i == 0 else ""])
    bound = 16 * ROWS * TOPK * 8 + 64 * 1024
    title = (f"lightning indexer (sparse_topk, streaming top-k): B = 1, R = {ROWS}, Hi = {HEADS}, Di = {HEAD_DIM}, "
             f"topk = {TOPK}, float16, causal (small shapes for the cpu backend; real: Hi 64, Di 128, topk 2048); "
             f"bytes bound 16 * B * R * topk * 8 + 64 KiB = {bound}")
    return title + "\n" + format_table(["C", "kernel", "threadgroups", "ms", "device bytes written",
                                        "time vs previous C"], rows)
