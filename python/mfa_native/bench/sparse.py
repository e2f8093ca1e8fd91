"""Block-sparse and sparse-indexed attention against dense attention:
`python -m mfa_native bench sparse [--keys 16384] [--device cpu]`.

Two masks over R = C = --keys: a document mask (block-diagonal, 8 documents) and a causal
sliding window of 256 keys. Dense attention gets the mask as a boolean array (it skips
the blocks the mask removes after reading them); block-sparse attention gets the
BlockMask that BlockMask.from_mask derives from that same mask once (its time is shown
on its own row), visits only the listed blocks and reads no mask inside full ones.
Per row: the time of one call, the simdgroup matrix work issued, the useful work of the
block lists (every 8x8 tile of a listed block holding an allowed pair), and the device
bytes read from k and v and from the mask (cpu backend: exact; Metal: not counted).

Then token lists (DeepSeek sparse attention): 4 queries of 8 heads sharing one list of 256
of the --keys keys, against dense attention over all keys and against gathering the listed
keys (numpy) and running dense attention on them.

Last, the lightning indexer (`sparse_topk`) at C = 4096, 16384 and 65536 for R = 8 rows: each
kernel's time and device bytes written, and how the time grows with C (--indexer-only: just
this table).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .. import profile
from ..ops.attention import attention
from ..ops.block_mask import BlockMask
from ..ops.block_sparse import block_sparse_attention
from ..ops.sparse import sparse_attention
from ..runtime.devices import resolve_device
from ..work import useful_block_sparse_matrix_ops
from ._indexer import indexer_table
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
    """(result, seconds, issued matrix ops, device bytes read per buffer) of one warm call."""
    call()  # compiles and prepares
    with profile() as recorded:
        start = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - start
    ops = [r.simdgroup_matrix_ops for r in recorded.records]
    counted = all(r.bytes_read is not None for r in recorded.records)
    return result, seconds, None if None in ops else sum(ops), recorded.bytes_read if counted else None


def _mib(traffic, *names) -> str:
    return "-" if traffic is None else f"{sum(traffic.get(n, 0) for n in names) / 2**20:.1f}"


def _token_lists(rng, device, keys: int, d: int, rows: list) -> None:
    """Sparse-indexed attention (8 query heads share each list) against dense attention and
    against a gather of the listed keys followed by dense attention."""
    heads, queries, topk = 8, 4, 256
    q = rng.standard_normal((1, heads, queries, d)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, keys, d)).astype(np.float16) for _ in range(2))
    indices = np.sort(rng.choice(keys, (1, 1, queries, topk)), axis=-1).astype(np.int32)
    name = f"token lists: topk {topk} of {keys}, {heads} heads per list"
    sparse, *sparse_run = _timed(lambda: sparse_attention(q, k, v, indices, device=device))
    _, *dense_run = _timed(lambda: attention(q, k, v, device=device))

    def gather_then_dense():
        gathered_k = k[0, 0, indices[0, 0]][:, None]                 # (R, 1, topk, D): one problem per query
        gathered_v = v[0, 0, indices[0, 0]][:, None]
        out = attention(q[0].transpose(1, 0, 2)[:, :, None], gathered_k, gathered_v, device=device)
        return out[:, :, 0].transpose(1, 0, 2)[None]

    gathered, *gather_run = _timed(gather_then_dense)
    error = float(np.linalg.norm(sparse.astype(np.float64) - gathered) / np.linalg.norm(gathered.astype(np.float64)))
    for kernel, (seconds, ops, traffic) in (("dense", dense_run), ("gather + dense", gather_run),
                                            ("sparse-indexed", sparse_run)):
        rows.append([name, kernel, f"{seconds * 1e3:.1f}", "-" if ops is None else str(ops), "-",
                     _mib(traffic, "k", "v"), "-"])
    rows[-1][0] += f" (rel. L2 to gather + dense {error:.1e})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mfa_native bench sparse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "metal"], help="default: the default device")
    parser.add_argument("--keys", type=int, default=16384, help="R = C (default 16384)")
    parser.add_argument("--head-dim", type=int, default=16, help="D = Dv (default 16, small for the cpu backend)")
    parser.add_argument("--indexer-only", action="store_true", help="only the lightning indexer's table")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    rng = np.random.default_rng(0)
    if args.indexer_only:
        print(indexer_table(rng, device))
        return 0
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
    _token_lists(rng, device, n, d, rows)
    print(f"R = C = {n}, D = {d}, float16, blocks {BLOCK}x{BLOCK}, on {device.kind} ({device.name})")
    print(format_table(["mask", "kernel", "ms", "mma issued", "mma useful (listed blocks)", "k+v read MiB",
                        "mask read MiB"], rows))
    print()
    print(indexer_table(rng, device))
    return 0
