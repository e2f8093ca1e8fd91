"""Block-sparse attention against dense attention with the same mask:
`python -m mfa_native bench sparse [--keys 16384] [--device cpu]`.

Two masks over R = C = --keys: a document mask (block-diagonal, 8 documents) and a causal
sliding window of 256 keys. Dense attention gets the mask as a boolean array (it skips
the blocks the mask removes after reading them); block-sparse attention gets the
BlockMask that BlockMask.from_mask derives from that same mask once (its time is shown
on its own row), visits only the listed blocks and reads no mask inside full ones.
Per row: the time of one call, the simdgroup matrix work issued, the useful work of the
block lists (every 8x8 tile of a listed block holding an allowed pair), and the device
bytes read from k and v and from the mask (cpu backend: exact; Metal: not counted).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .. import profile
from ..ops.attention import attention
from ..ops.block_mask import BlockMask
from ..ops.block_sparse import block_sparse_attention
from ..runtime.devices import resolve_device
from ..work import useful_block_sparse_matrix_ops
from ._table import format_table

DOCUMENTS = 8
WINDOW = 256
BLOCK = 128


def _masks(keys: int) -> dict[str, np.ndarray]:
    document = np.arange(keys) * DOCUMENTS // keys
    i, j = np.arange(keys)[:, None], np.arange(keys)[None, :]
    return {f"document mask ({DOCUMENTS} documents)": document[:, None] == document[None, :],
            f"sliding window {WINDOW}": (j <= i) & (j > i - WINDOW)}


def _timed(call):
    """(result, seconds, issued matrix ops, device bytes read per buffer) of one call."""
    with profile() as recorded:
        start = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - start
    ops = [r.simdgroup_matrix_ops for r in recorded.records]
    counted = all(r.bytes_read is not None for r in recorded.records)
    return result, seconds, None if None in ops else sum(ops), recorded.bytes_read if counted else None


def _mib(traffic, *names) -> str:
    return "-" if traffic is None else f"{sum(traffic.get(n, 0) for n in names) / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mfa_native bench sparse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "metal"], help="default: the default device")
    parser.add_argument("--keys", type=int, default=16384, help="R = C (default 16384)")
    parser.add_argument("--head-dim", type=int, default=16, help="D = Dv (default 16, small for the cpu backend)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    rng = np.random.default_rng(0)
    n, d = args.keys, args.head_dim
    q, k, v = (rng.standard_normal((1, 1, n, d)).astype(np.float16) for _ in range(3))
    rows = []
    for name, mask in _masks(n).items():
        block_mask, seconds, _, traffic = _timed(lambda: BlockMask.from_mask(mask, R=n, C=n, block_size=BLOCK,
                                                                             device=device))
        rows.append([name, "BlockMask.from_mask", f"{seconds * 1e3:.1f}", "-", "-", "-", _mib(traffic, "mask")])
        useful = useful_block_sparse_matrix_ops(block_mask, 1, 1, n, n, d, d)
        dense, *dense_run = _timed(lambda: attention(q, k, v, mask=mask, device=device))
        sparse, *sparse_run = _timed(lambda: block_sparse_attention(q, k, v, block_mask, mask=mask, device=device))
        error = float(np.linalg.norm(sparse.astype(np.float64) - dense) / np.linalg.norm(dense.astype(np.float64)))
        for kernel, (seconds, ops, traffic) in (("dense + mask", dense_run), ("block-sparse", sparse_run)):
            rows.append([name, kernel, f"{seconds * 1e3:.1f}", "-" if ops is None else str(ops), str(useful),
                         _mib(traffic, "k", "v"), _mib(traffic, "mask")])
        rows[-1][0] += f" (rel. L2 to dense {error:.1e})"
    print(f"R = C = {n}, D = {d}, float16, blocks {BLOCK}x{BLOCK}, on {device.kind} ({device.name})")
    print(format_table(["mask", "kernel", "ms", "mma issued", "mma useful (listed blocks)", "k+v read MiB",
                        "mask read MiB"], rows))
    return 0
