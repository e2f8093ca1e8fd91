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

import itertools
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
from . import _table
from ._table import Table

DOCUMENTS = 8
WINDOW = 256
BLOCK = 128
MASKS = (f"document mask ({DOCUMENTS} documents)", f"sliding window {WINDOW}")
LIST_HEADS, LIST_QUERIES, LIST_TOPK = 8, 4, 256     # token lists: query heads sharing a list, queries, keys listed


def _masks(keys: int) -> dict[str, np.ndarray]:
    document = np.arange(keys) * DOCUMENTS // keys
    i, j = np.arange(keys)[:, None], np.arange(keys)[None, :]
    return dict(zip(MASKS, (document[:, None] == document[None, :], (j <= i) & (j > i - WINDOW))))


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


def _token_lists(rng, device, keys: int, d: int):
    """Sparse-indexed attention (8 query heads share each list) against dense attention and
    against a gather of the listed keys followed by dense attention: a row each."""
    heads, queries, topk = LIST_HEADS, LIST_QUERIES, LIST_TOPK
    q = rng.standard_normal((1, heads, queries, d)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, keys, d)).astype(np.float16) for _ in range(2))
    indices = np.sort(rng.choice(keys, (1, 1, queries, topk)), axis=-1).astype(np.int32)
    name = _token_lists_name(keys)

    def gather_then_dense():
        gathered_k = k[0, 0, indices[0, 0]][:, None]                 # (R, 1, topk, D): one problem per query
        gathered_v = v[0, 0, indices[0, 0]][:, None]
        out = attention(q[0].transpose(1, 0, 2)[:, :, None], gathered_k, gathered_v, device=device)
        return out[:, :, 0].transpose(1, 0, 2)[None]

    _, *dense_run = _timed(lambda: attention(q, k, v, device=device))
    yield _row(name, "dense", dense_run)
    gathered, *gather_run = _timed(gather_then_dense)
    yield _row(name, "gather + dense", gather_run)
    sparse, *sparse_run = _timed(lambda: sparse_attention(q, k, v, indices, device=device))
    error = float(np.linalg.norm(sparse.astype(np.float64) - gathered) / np.linalg.norm(gathered.astype(np.float64)))
    yield _row(f"{name} (rel. L2 to gather + dense {error:.1e})", "sparse-indexed", sparse_run)


def _token_lists_name(keys: int) -> str:
    return f"token lists: topk {LIST_TOPK} of {keys}, {LIST_HEADS} heads per list"


def _row(name: str, kernel: str, run, useful: str = "-") -> list[str]:
    """A kernel's row: its (seconds, issued ops, device bytes read) and the useful ops."""
    seconds, ops, traffic = run
    return [name, kernel, f"{seconds * 1e3:.1f}", "-" if ops is None else str(ops), useful, _mib(traffic, "k", "v"),
            "-" if useful == "-" else _mib(traffic, "mask")]


def _mask_rows(rng, device, n: int, d: int):
    """Per mask: BlockMask.from_mask, dense attention with the mask and block-sparse attention."""
    q, k, v = (rng.standard_normal((1, 1, n, d)).astype(np.float16) for _ in range(3))
    for name, mask in _masks(n).items():
        block_mask, seconds, _, traffic = _timed(lambda: BlockMask.from_mask(mask, R=n, C=n, block_size=BLOCK,
                                                                             device=device))
        yield [name, "BlockMask.from_mask", f"{seconds * 1e3:.1f}", "-", "-", "-", _mib(traffic, "mask")]
        useful = str(useful_block_sparse_matrix_ops(block_mask, 1, 1, n, n, d, d))
        dense, *dense_run = _timed(lambda: attention(q, k, v, mask=mask, device=device))
        yield _row(name, "dense + mask", dense_run, useful)
        sparse, *sparse_run = _timed(lambda: block_sparse_attention(q, k, v, block_mask, mask=mask, device=device))
        error = float(np.linalg.norm(sparse.astype(np.float64) - dense) / np.linalg.norm(dense.astype(np.float64)))
        yield _row(f"{name} (rel. L2 to dense {error:.1e})", "block-sparse", sparse_run, useful)


def main(argv: list[str] | None = None) -> int:
    parser = _table.parser("sparse", __doc__)
    parser.add_argument("--device", choices=["cpu", "metal"], help="default: the default device")
    parser.add_argument("--keys", type=int, default=16384, help="R = C (default 16384)")
    parser.add_argument("--head-dim", type=int, default=16, help="D = Dv (default 16, small for the cpu backend)")
    parser.add_argument("--indexer-only", action="store_true", help="only the lightning indexer's table")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    rng = np.random.default_rng(0)
    tables = []
    if not args.indexer_only:
        n, d = args.keys, args.head_dim
        rows = itertools.chain(_mask_rows(rng, device, n, d), _token_lists(rng, device, n, d))
        names = [f"{name} (rel. L2 to dense 0.0e+00)" for name in MASKS]   # as wide as any error
        names.append(f"{_token_lists_name(n)} (rel. L2 to gather + dense 0.0e+00)")
        tables.append(Table(["mask", "kernel", "ms", "mma issued", "mma useful (listed blocks)", "k+v read MiB",
                             "mask read MiB"], rows, 3 * len(names),
                            f"R = C = {n}, D = {d}, float16, blocks {BLOCK}x{BLOCK}, on {device.kind} ({device.name})",
                            [max(map(len, names)), len("BlockMask.from_mask"), 7]))
    tables.append(indexer_table(rng, device))
    _table.show("sparse", tables, quiet=args.quiet)
    return 0
