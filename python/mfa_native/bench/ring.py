"""Context parallelism benchmark: N processes on this machine run a causal ring-attention prefill
and a sharded-KV decode step: `python -m mfa_native bench ring [--framework torch|mlx]
[--ranks 2 4] [--prefill-tokens 16384] [--decode-tokens 131072] [--quick]`.

Per rank (the largest over the ranks): the bytes it sent around the ring and contributed to
all-gathers, the call's time, and how much of the ring's communication the compute hid: the
ring's messages are replayed alone afterwards (same sizes, no compute), and hidden = 1 - (time
blocked waiting for messages in the call) / (the replay's time). A decode step has no ring (one
all-gather after the compute, hidden by nothing); its bytes do not grow with the context. The
prefill's work column is the largest rank's (query, key) pairs over the mean (zig-zag: 1.00).
On the cpu backend the numbers are about bytes and overlap, not speed. Heads 2/1, D 64, float32.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from . import _table
from ._table import Table

RANK_SCRIPT = Path(__file__).with_name("_ring_rank.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(framework: str, workload: str, tokens: int, ranks: int) -> list[dict]:
    """Every rank's measurements of one workload on `ranks` processes."""
    with tempfile.TemporaryDirectory() as out:
        arguments = [str(RANK_SCRIPT), framework, workload, str(tokens), out]
        if framework == "mlx":
            launcher = shutil.which("mlx.launch") or "mlx.launch"
            subprocess.run([launcher, "--backend", "ring", "-n", str(ranks), "--hosts", "127.0.0.1", "--python",
                            sys.executable, *arguments], check=True, capture_output=True, timeout=3600)
        else:
            port = str(_free_port())
            processes = [subprocess.Popen([sys.executable, *arguments], env={
                **os.environ, "RANK": str(r), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port}) for r in range(ranks)]
            if any(p.wait(timeout=3600) for p in processes):
                raise RuntimeError(f"a bench ring rank failed ({framework} {workload}, {ranks} ranks)")
        found = [Path(out, f"rank{r}.json") for r in range(ranks)]
        if not all(f.exists() for f in found):
            raise RuntimeError(f"bench ring: a rank wrote no result ({framework} {workload}, {ranks} ranks)")
        return [json.loads(f.read_text()) for f in found]


def _row(framework: str, workload: str, tokens: int, ranks: int, results: list[dict]) -> list[object]:
    alone = max(r["ring_alone"] for r in results)
    waited = max(r["waited"] for r in results)
    hidden = "-" if not any(r["shifts"] for r in results) else f"{max(0.0, 1 - waited / alone):.0%}"
    works = [r["work"] for r in results if r["work"] is not None]
    balance = f"{max(works) / (sum(works) / len(works)):.2f}" if works and sum(works) else "-"
    return [framework, workload, tokens, ranks, f"{max(r['sent'] for r in results):,}",
            f"{max(r['gathered'] for r in results):,}", f"{max(r['seconds'] for r in results):.3f}",
            f"{alone:.3f}", f"{waited:.3f}", hidden, f"{max(r['gathering'] for r in results):.3f}", balance]


def main(argv: list[str]) -> int:
    parser = _table.parser("ring", __doc__)
    parser.add_argument("--framework", choices=("torch", "mlx"), default="torch")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--prefill-tokens", type=int, default=16384)
    parser.add_argument("--decode-tokens", type=int, default=131072)
    parser.add_argument("--quick", action="store_true", help="1,024-token prefill, 8,192-token decode")
    args = parser.parse_args(argv)
    prefill, decoded = (1024, 8192) if args.quick else (args.prefill_tokens, args.decode_tokens)
    runs = [(ranks, workload, tokens) for ranks in args.ranks for workload, tokens in (("prefill", prefill),
                                                                                       ("decode", decoded))]
    rows = (_row(args.framework, workload, tokens, ranks, _run(args.framework, workload, tokens, ranks))
            for ranks, workload, tokens in runs)
    headers = ["framework", "workload", "tokens", "ranks", "ring bytes sent", "all-gathered bytes", "call s",
               "ring alone s", "waited s", "hidden", "all-gather s", "work max/mean"]
    widths = [0, 0, len(str(max(prefill, decoded))), len(str(max(args.ranks))), 0, 0, len("100.000")]
    _table.show("ring", [Table(headers, rows, len(runs), widths=widths)], quiet=args.quiet)
    return 0
