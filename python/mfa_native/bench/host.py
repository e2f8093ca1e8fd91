"""Host overhead of warm calls: `python -m mfa_native bench host [--device cpu] [--calls 300]`.

Per case: the host time of a warm call (the median over `--calls` calls of its wall
time minus the seconds its dispatches report, so what is left is Python, the
binding, encoding and waiting, not the kernels; recording a dispatch for profile()
is part of it), the kernel time, the command
batches per call, and the bytes of the pass's intermediates, which stay on the
device, against the bytes of caller memory staged between host and device per call
(0 where the backend binds host memory in place).

Targets (issue "one pass runner"): at most 20 us for the tiny forward, 40 us for
the tiny backward and the tiny split-KV decode; a quantized decode (k and v
QuantizedTensors of numpy arrays) holds the tiny forward's 20 us; the indexer
(sparse_topk, 2 dispatches) and BlockMask.from_mask (3 dispatches) 40 us.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import codegen
from ..ops.attention import attention
from ..ops.attention_backward import attention_backward
from ..ops.block_mask import BlockMask
from ..ops.topk import sparse_topk
from ..ops.quantize import quantize
from ..codegen import QuantizedStorage, contiguous_strides
from ..quant_formats import QuantFormat
from ..runtime import profiling
from ..runtime.devices import Device, resolve_device, tuned_as, tuning_facts
from . import _table
from ._table import Table


@dataclass(frozen=True)
class Case:
    name: str
    shape: str
    budget_us: float | None
    make: Callable[[np.random.Generator, Device], Callable[[], object]]
    intermediates: Callable[[Device], int]  # bytes of the pass's intermediates


def _qkv(rng, B, Hq, Hkv, R, C, D, dtype=np.float32):
    def tensor(h, n):
        return rng.standard_normal((B, h, n, D)).astype(dtype)
    return tensor(Hq, R), tensor(Hkv, C), tensor(Hkv, C)


def _forward(dims, dtype=np.float32, **kwargs):
    def make(rng, device):
        q, k, v = _qkv(rng, *dims, dtype=dtype)
        return lambda: attention(q, k, v, device=device, **kwargs)
    return make


def _backward(dims):
    def make(rng, device):
        q, k, v = _qkv(rng, *dims)
        o, lse = attention(q, k, v, return_lse=True, device=device)
        do = rng.standard_normal(o.shape).astype(o.dtype)
        return lambda: attention_backward(q, k, v, o, lse, do, device=device)
    return make


def _topk(rng, device):
    q = rng.standard_normal((1, 4, 2, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 64, 16)).astype(np.float32)
    weights = rng.standard_normal((1, 4, 2)).astype(np.float32)
    return lambda: sparse_topk(q, k, weights, 8, device=device)


def _from_mask(rng, device):
    mask = rng.random((64, 64)) > 0.5
    return lambda: BlockMask.from_mask(mask, causal=True, R=64, C=64, block_size=16, device=device)


def _quantized_forward(dims, format: str):
    """attention over k and v quantized (once, before the timed calls) in `format`."""
    def make(rng, device):
        q, k, v = _qkv(rng, *dims)
        k, v = (quantize(x, format, device=device) for x in (k, v))
        return lambda: attention(q, k, v, device=device)
    return make


def _quantized_problem(dims, format: str):
    B, Hq, Hkv, R, C, D = dims
    f = QuantFormat.of(format)
    rows = contiguous_strides("bhsd", (B, Hkv, C, f.data_width(D)))
    scales = contiguous_strides("bhsd", (B, Hkv, C, f.groups(D))) if f.affine else None
    storage = QuantizedStorage(f, rows, "float32" if f.affine else None, scales, scales)
    return _problem(dims, k_storage=storage, v_storage=storage)


def _problem(dims, dtype="float32", **kwargs):
    B, Hq, Hkv, R, C, D = dims
    return codegen.AttentionProblem(B, Hq, Hkv, R, C, D, D, dtype=dtype, **kwargs)


def _scratch(description) -> int:
    return sum(b.nbytes for b in description.of_role("intermediate"))


TINY = (1, 1, 1, 8, 8, 16)
DECODE = (1, 1, 1, 1, 2048, 16)
GQA = (1, 8, 2, 128, 128, 64)
QUANTIZED_DECODE = (1, 8, 2, 1, 32, 64)
CASES = (
    Case("tiny forward", "B1 H1 R8 C8 D16 f32", 20.0, _forward(TINY),
         lambda device: _scratch(codegen.attention_pass(_problem(TINY)))),
    Case("tiny backward", "B1 H1 R8 C8 D16 f32", 40.0, _backward(TINY),
         lambda device: _scratch(codegen.attention_backward_pass(codegen.AttentionBackwardProblem(_problem(TINY))))),
    Case("tiny split-KV decode", "B1 H1 R1 C2048 D16 f32", 40.0, _forward(DECODE),
         lambda device: _scratch(codegen.attention_pass(
             _problem(DECODE), parallel_threadgroups=tuning_facts(device).parallel_threadgroups))),
    Case("tiny quantized decode", "B1 H8/2 R1 C32 D64 q4_0", 20.0, _quantized_forward(QUANTIZED_DECODE, "q4_0"),
         lambda device: _scratch(codegen.attention_pass(_quantized_problem(QUANTIZED_DECODE, "q4_0")))),
    Case("sparse_topk (indexer)", "B1 Hi4 R2 C64 Di16 topk 8 f32", 40.0, _topk, lambda device: 0),
    Case("BlockMask.from_mask", "R64 C64 blocks 16, bool mask, causal", 40.0, _from_mask, lambda device: 0),
    Case("GQA prefill causal", "B1 H8/2 R128 C128 D64 f16", None, _forward(GQA, np.float16, causal=True),
         lambda device: _scratch(codegen.attention_pass(_problem(GQA, "float16", causal="lower_right")))),
)


def measure(call: Callable[[], object], device: Device, calls: int) -> dict[str, float]:
    """Host and kernel time (median over `calls` warm calls of wall time minus the call's
    dispatch seconds) and per-call batch counts."""
    for _ in range(20):
        call()  # compile, prepare, warm the caches
    walls, kernels = [], []
    before = device.batch_stats()
    with profiling.profile() as recorded:
        for _ in range(calls):
            first = len(recorded.records)
            start = time.perf_counter()
            call()
            walls.append(time.perf_counter() - start)
            kernels.append(sum(r.seconds or 0.0 for r in recorded.records[first:]))
    after = device.batch_stats()
    staged = (after["bytes_staged_in"] - before["bytes_staged_in"]
              + after["bytes_copied_back"] - before["bytes_copied_back"])
    return {"host": float(np.median(np.subtract(walls, kernels))), "kernel": float(np.median(kernels)),
            "batches": (after["committed"] - before["committed"]) / calls, "staged": staged / calls,
            "dispatches": len(recorded.records) / calls}


def main(argv: list[str] | None = None) -> int:
    parser = _table.parser("host", __doc__)
    parser.add_argument("--device", choices=["cpu", "metal"], help="default: the default device")
    parser.add_argument("--calls", type=int, default=300, help="warm calls per case (default 300)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)

    def rows():
        rng = np.random.default_rng(0)
        # The decode case needs room for several threadgroups to split; give every device the same.
        with tuned_as(device, parallel_threadgroups=max(tuning_facts(device).parallel_threadgroups, 4)):
            for case in CASES:
                m = measure(case.make(rng, device), device, args.calls)
                budget = "-" if case.budget_us is None else f"{case.budget_us:.0f}"
                yield [case.name, case.shape, f"{m['host'] * 1e6:.1f}", budget, f"{m['kernel'] * 1e6:.1f}",
                       f"{m['dispatches']:g}", f"{m['batches']:g}", str(case.intermediates(device)),
                       f"{m['staged']:g}"]
    headers = ["case", "shape", "host us", "budget us", "kernel us", "dispatches", "batches",
               "intermediate bytes (device)", "bytes staged host<->device"]
    widths = [max(len(case.name) for case in CASES), max(len(case.shape) for case in CASES)]
    _table.show("host", [Table(headers, rows(), len(CASES), f"device: {device.name}, {args.calls} warm calls per "
                               "case, medians", widths)], quiet=args.quiet)
    return 0
