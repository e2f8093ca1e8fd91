"""The lightning indexer's table of `bench sparse`: `sparse_topk` at growing C for a fixed
number of rows, each kernel's time and device bytes written (cpu backend: its profiler; Metal:
wall time only), and the ratio of each row's total time to the previous row's (C grows 4x per
row: linear work gives 4x), for precision="float" and "int8", with int8's recall: the share of
the float top-k that int8 keeps. Default shapes are small (Hi = 4, Di = 64, topk = 256) so the
cpu backend runs them in seconds; the real indexer is Hi = 64, Di = 128, topk = 2048."""

from __future__ import annotations

import time

import numpy as np

from .. import profile
from ..ops.topk import sparse_topk
from ._table import Table

LENGTHS = (4096, 16384, 65536)
ROWS, HEADS, HEAD_DIM, TOPK = 8, 4, 64, 256


def _run(device, inputs, precision: str) -> tuple[np.ndarray, float, list]:
    """(indices, wall seconds, per-kernel profile records) of one warm causal call."""
    sparse_topk(*inputs, TOPK, precision=precision, device=device)          # compiles and prepares
    with profile() as recorded:
        start = time.perf_counter()
        indices = sparse_topk(*inputs, TOPK, precision=precision, device=device)
        seconds = time.perf_counter() - start
    return indices, seconds, recorded.records


def _recall(found: np.ndarray, wanted: np.ndarray) -> float:
    """The share of `wanted`'s kept keys (not padding) that `found` keeps too, over all rows."""
    rows = wanted.reshape(-1, wanted.shape[-1]), found.reshape(-1, found.shape[-1])
    hits = sum(np.intersect1d(f, w[w >= 0]).size for w, f in zip(*rows))
    return hits / max(int((wanted >= 0).sum()), 1)


KERNELS = ("sparse_topk_stream", "sparse_topk_merge")   # what one call dispatches: a row each


def indexer_table(rng, device) -> Table:
    """The table, with its title line."""
    def rows():
        previous = {}
        for C in LENGTHS:
            inputs = (rng.standard_normal((1, HEADS, ROWS, HEAD_DIM)).astype(np.float16),
                      rng.standard_normal((1, 1, C, HEAD_DIM)).astype(np.float16),
                      rng.random((1, HEADS, ROWS)).astype(np.float32))
            chosen = {}
            for precision in ("float", "int8"):
                chosen[precision], seconds, records = _run(device, inputs, precision)
                kernel_seconds = [r.seconds for r in records]
                total = sum(kernel_seconds) if None not in kernel_seconds else seconds
                ratio = f"{total / previous[precision]:.2f}x" if precision in previous else "-"
                previous[precision] = total
                recall = f"{_recall(chosen['int8'], chosen['float']):.3f}" if precision == "int8" else "-"
                for i, record in enumerate(records):
                    written = record.bytes_written
                    yield [str(C) if i == 0 else "", precision if i == 0 else "", record.kernel,
                           str(record.threadgroups), "-" if record.seconds is None else f"{record.seconds * 1e3:.1f}",
                           "-" if written is None else str(sum(written.values())),
                           ratio if i == 0 else "", recall if i == 0 else ""]
    bound = 16 * ROWS * TOPK * 8 + 64 * 1024
    title = (f"lightning indexer (sparse_topk, streaming top-k): B = 1, R = {ROWS}, Hi = {HEADS}, Di = {HEAD_DIM}, "
             f"topk = {TOPK}, float16, causal (small shapes for the cpu backend; real: Hi 64, Di 128, topk 2048); "
             f"bytes bound 16 * B * R * topk * 8 + 64 KiB = {bound}")
    headers = ["C", "precision", "kernel", "threadgroups", "ms", "device bytes written", "time vs previous C",
               "recall of float top-k"]
    widths = [len(str(max(LENGTHS))), 0, max(map(len, KERNELS)), 0, 7]
    return Table(headers, rows(), len(LENGTHS) * 2 * len(KERNELS), title, widths)
