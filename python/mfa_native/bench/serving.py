"""Serving benchmark: decode and speculative-decode verification against a KV cache, the device
bytes read from K/V per call and the matrix work issued: `python -m mfa_native bench serving
[--quick] [--device cpu] [--repeat 1] [--section decode]`.

Section "decode": float16 GQA decode (Hq/Hkv 32/8 and 64/8, D 128, C 4096 and 32768, R 1, 4
and 16 queries per call). Per call: the bytes read from k and v over the bytes of the keys and
values attended (1.00 when every K/V row is read once per kv head, as packed heads do; Hq/Hkv
when each query head reads its own copy), the simdgroup 8x8x8 multiply-accumulates issued over
the packed bound (ceil(R * ratio / 8) row tiles per key tile, work.packed_matrix_ops), the
kernels and the time. --quick runs C 4096 only (the full table takes minutes on the cpu
backend, whose traffic counters are exact; Metal counts no bytes).

Section "varlen": a causal prefill of packed sequences of mixed lengths (attention_varlen) against
the same sequences padded to the longest and run as one dense batch: the matrix work each issues
and the time (varlen issues each sequence's work and nothing for the padding).

Section "cache" (_serving_cache.py): decode steps through attention_with_kvcache (a paged cache,
the new rows appended, split-KV at C 32768) and attention_varlen (a decode batch, heads packed).

Section "invariant" (_serving_invariant.py): the cost of deterministic="batch_invariant": decode,
verification and prefill calls timed with the mode off and on.

A section is a function from the parsed options and the device to a titled table (SECTIONS).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from .. import profile
from ..ops.attention import attention
from ..ops.varlen import attention_varlen
from ..runtime.devices import resolve_device
from ..work import packed_matrix_ops
from . import _table
from ._table import Table
from ._serving_cache import cache_section
from ._serving_invariant import invariant_section


@dataclass(frozen=True)
class Decode:
    """One decode call: B batches, Hq query heads over Hkv kv heads, R new queries, C cached keys."""

    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int = 128
    batch: int = 1

    @property
    def shape(self) -> str:
        return f"B{self.batch} H{self.q_heads}/{self.kv_heads} R{self.q_len} C{self.kv_len} D{self.head_dim}"


HEADS = ((32, 8), (64, 8))
QUERIES = (1, 4, 16)
KEYS = (4096, 32768)
QUICK_KEYS = (4096,)


def decode_configs(keys=KEYS) -> list[Decode]:
    return [Decode(hq, hkv, r, c) for c in keys for hq, hkv in HEADS for r in QUERIES]


def _decode_call(config: Decode, device) -> tuple[Callable[[], object], int]:
    """The warm call of `config` (causal, as decode and verification are) and the bytes of
    the K/V rows it attends (all of them)."""
    rng = np.random.default_rng(0)
    B, D = config.batch, config.head_dim
    q = rng.standard_normal((B, config.q_heads, config.q_len, D)).astype(np.float16)
    k, v = (rng.standard_normal((B, config.kv_heads, config.kv_len, D)).astype(np.float16) for _ in range(2))
    return (lambda: attention(q, k, v, causal=True, device=device)), k.nbytes + v.nbytes


def _measured(call, repeat: int):
    """(median seconds, the last call's profile): device time where the backend reports it."""
    call()  # compile and warm up
    times, last = [], None
    for _ in range(repeat):
        with profile() as last:
            start = time.perf_counter()
            call()
            wall = time.perf_counter() - start
        times.append(last.seconds or wall)
    return float(np.median(times)), last


def _ratio(numerator, denominator) -> str:
    return "-" if numerator is None else f"{numerator / denominator:.3f}"


MS_WIDTH = 8                            # "%.2f" milliseconds up to 99999.99
KERNELS_WIDTH = len("partial+combine")  # the longest list of kernels a decode call dispatches (split-KV)


def decode_section(args, device) -> Table:
    headers = ["shape", "kernels", "K/V bytes read", "K/V bytes attended", "read/attended", "mma issued",
               "packed bound", "issued/bound", "ms"]
    configs = decode_configs(QUICK_KEYS if args.quick else KEYS)

    def rows():
        for config in configs:
            call, attended = _decode_call(config, device)
            seconds, prof = _measured(call, args.repeat)
            counted = all(r.bytes_read is not None for r in prof.records)
            read = prof.bytes_read.get("k", 0) + prof.bytes_read.get("v", 0) if counted else None
            ops = (prof.simdgroup_matrix_ops if all(r.simdgroup_matrix_ops is not None for r in prof.records)
                   else None)
            bound = packed_matrix_ops(config.batch, config.kv_heads, config.q_heads // config.kv_heads,
                                      config.q_len, config.kv_len, config.head_dim, config.head_dim, causal=True)
            kernels = "+".join(r.kernel.removeprefix("attention_") for r in prof.records)
            yield [config.shape, kernels, "-" if read is None else str(read), str(attended),
                   _ratio(read, attended), "-" if ops is None else str(ops), str(bound), _ratio(ops, bound),
                   f"{seconds * 1e3:.2f}"]
    widths = [max(len(c.shape) for c in configs), KERNELS_WIDTH, *[0] * 6, MS_WIDTH]
    return Table(headers, rows(), len(configs), "decode, float16 K/V, causal", widths)


PREFILL_LENGTHS = ((1024, 64, 1, 300, 17, 512, 128, 8), (256, 16, 1, 100, 5, 64))   # full, --quick
PREFILL_HEADS, PREFILL_HEAD_DIM = (8, 2), 64


def _prefill_calls(lengths, device) -> tuple[Callable[[], object], Callable[[], object]]:
    """The varlen call over sequences of `lengths` and the padded dense call over the same rows."""
    rng = np.random.default_rng(0)
    (hq, hkv), D, total = PREFILL_HEADS, PREFILL_HEAD_DIM, sum(lengths)
    q = rng.standard_normal((total, hq, D)).astype(np.float16)
    k, v = (rng.standard_normal((total, hkv, D)).astype(np.float16) for _ in range(2))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    longest = max(lengths)
    padded = [np.zeros((len(lengths), longest, h, D), np.float16) for h in (hq, hkv, hkv)]
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        for target, source in zip(padded, (q, k, v)):
            target[b, :end - start] = source[start:end]
    return (lambda: attention_varlen(q, k, v, cu, cu, causal=True, device=device),
            lambda: attention(*padded, causal=True, layout="bshd", device=device))


def varlen_section(args, device) -> Table:
    lengths = PREFILL_LENGTHS[1 if args.quick else 0]
    headers = ["call", "rows", "mma issued", "vs varlen", "ms"]

    def rows():
        varlen, padded = _prefill_calls(lengths, device)
        issued = {}
        for name, call, count in (("attention_varlen", varlen, sum(lengths)),
                                  ("padded attention", padded, len(lengths) * max(lengths))):
            seconds, prof = _measured(call, args.repeat)
            ops = (prof.simdgroup_matrix_ops if all(r.simdgroup_matrix_ops is not None for r in prof.records)
                   else None)
            issued[name] = ops
            base = issued["attention_varlen"]
            yield [name, str(count), "-" if ops is None else str(ops), _ratio(ops, base) if base else "-",
                   f"{seconds * 1e3:.2f}"]
    title = (f"varlen prefill, causal, float16, H{PREFILL_HEADS[0]}/{PREFILL_HEADS[1]} D{PREFILL_HEAD_DIM}, "
             f"lengths {', '.join(map(str, lengths))}")
    return Table(headers, rows(), 2, title, [len("padded attention"), 0, 0, 0, MS_WIDTH])


# Each section: (parsed options, device) -> its titled table, measured as it is printed.
SECTIONS: dict[str, Callable] = {"decode": decode_section, "varlen": varlen_section,
                                 "cache": lambda args, device: cache_section(args, device, _measured, _ratio),
                                 "invariant": lambda args, device: invariant_section(args, device, _measured)}


def main(argv: list[str]) -> int:
    parser = _table.parser("serving", __doc__)
    parser.add_argument("--device", choices=["cpu", "metal"], help="default: the default device")
    parser.add_argument("--repeat", type=int, default=1, help="timed calls per configuration (median)")
    parser.add_argument("--quick", action="store_true", help=f"C {QUICK_KEYS[0]} only (the cpu backend's minutes)")
    parser.add_argument("--section", choices=list(SECTIONS), action="append",
                        help="run this section (repeatable); default: all")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    started = time.perf_counter()
    tables = [SECTIONS[name](args, device) for name in args.section or list(SECTIONS)]
    _table.show("serving", [replace(table, title=f"{table.title} on {device.kind} ({device.name}), median of "
                                                 f"{args.repeat} warm call(s)") for table in tables],
                quiet=args.quiet)
    print(f"\n({time.perf_counter() - started:.0f} s in all)")
    return 0
