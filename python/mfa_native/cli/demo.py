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

    start = time.perf_counter()
    attention(q, k, v, causal=True, device=device)  # the first call also generates and compiles the kernel
    first = time.perf_counter() - start
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
    print(f"  time: first call {first * 1e3:.1f} ms (includes compiling), warm call {warm * 1e3:.1f} ms")
    ops = [r.simdgroup_matrix_ops for r in prof.records]
    if ops and None not in ops:
        print(f"  simdgroup 8x8x8 multiply-accumulates: {sum(ops)}")
    return 0 if ok else 1
