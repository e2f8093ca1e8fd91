"""Run a multi-head causal attention on the default device and check it against the reference."""

from __future__ import annotations

import argparse
import time

import numpy as np

from .. import profile
from ..runtime.devices import resolve_device
from ..ops.attention import attention
from ..reference import attention_reference

TOLERANCE = 2e-2  # relative L2 error allowed for float16 inputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "metal"], help="default: the default device")
    parser.add_argument("--seq", type=int, default=256, help="sequence length (queries and keys)")
    parser.add_argument("--heads", type=int, default=4, help="query heads (2 query heads share each kv head)")
    parser.add_argument("--head-dim", type=int, default=64)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    heads, kv_heads = args.heads, max(1, args.heads // 2)
    rng = np.random.default_rng()
    q = rng.standard_normal((1, heads, args.seq, args.head_dim)).astype(np.float16)
    k = rng.standard_normal((1, kv_heads, args.seq, args.head_dim)).astype(np.float16)
    v = rng.standard_normal((1, kv_heads, args.seq, args.head_dim)).astype(np.float16)

    before = _kernel_counts(device)
    start = time.perf_counter()
    attention(q, k, v, causal=True, device=device)  # the first call also generates the kernel and builds it
    first = time.perf_counter() - start
    after = _kernel_counts(device)
    with profile() as prof:
        start = time.perf_counter()
        out = attention(q, k, v, causal=True, device=device)
        warm = time.perf_counter() - start
    expected = attention_reference(q, k, v, causal=True)
    error = float(np.linalg.norm(out.astype(np.float64) - expected) / np.linalg.norm(expected))
    ok = bool(np.all(np.isfinite(out))) and error < TOLERANCE

    print(f"mfa_native attention demo on {device.kind} ({device.name})")
    print(f"  q {q.shape}, k {k.shape}, v {v.shape}, float16, causal (lower right), GQA {heads}/{kv_heads}")
    print(f"  output {out.shape} {out.dtype}")
    print(f"  relative L2 error vs float64 reference: {error:.2e} ({'ok' if ok else 'FAILED'}, limit {TOLERANCE:g})")
    print(f"  time: first call {first * 1e3:.1f} ms ({_first_call(before, after)}), warm call {warm * 1e3:.1f} ms")
    ops = [r.simdgroup_matrix_ops for r in prof.records]
    if ops and None not in ops:
        print(f"  simdgroup 8x8x8 multiply-accumulates: {sum(ops)}")
    return 0 if ok else 1


def _kernel_counts(device) -> dict[str, int]:
    """Kernels built so far: compiled, loaded from the cpu backend's disk cache, pipelines made."""
    properties = device.properties
    return {"compiled": int(properties.get("kernels_compiled", 0)),
            "from disk": int(properties.get("kernels_from_disk_cache", 0)),
            "pipelines": device.cache_stats()["pipeline_misses"]}


def _first_call(before: dict[str, int], after: dict[str, int]) -> str:
    """What the first call spent its time on besides the kernel, from the counters' change."""
    made = {name: after[name] - before[name] for name in before}
    if made["compiled"]:
        return f"includes compiling {made['compiled']} kernel{'s' if made['compiled'] > 1 else ''}"
    if made["from disk"]:
        return "kernel loaded from the disk cache"
    return "includes building the pipeline" if made["pipelines"] else "kernel already built in this process"
