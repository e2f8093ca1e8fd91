"""Attention benchmark: `python -m mfa_native bench attention [--backward | --quantized] [--device cpu]
[--repeat 3]`.

For each configuration: the warm time per call, the simdgroup 8x8x8
multiply-accumulates the kernel issued against the useful minimum (every 8x8
tile of S that holds an allowed key, times the tiles of Q K^T and P V), and on
Metal the achieved TFLOPS and the share of the chip's peak.

With --backward: the forward (with lse) and backward times, and the backward's
issued against useful multiply-accumulates (both kernels: the 7 products of
the two-kernel algorithm on every allowed tile). Its TFLOPS count the 5
products a backward pass needs (2.5 times the forward's FLOPs when D = Dv):
the two that each kernel recomputes, so that neither needs atomics, are overhead.

With --quantized: decode shapes with K and V stored as float16, MLX affine 8/4-bit and GGUF
q8_0/q4_0/q4_1/q5_0/q5_1 (bench/_quantized.py): time, and the bytes read from K and V against their stored
size and against the float16 run.

With --scores: each configuration without a score transform, with softcap, with ALiBi and with
both (bench/_scores.py): forward and backward times, the forward's issued multiply-accumulates
and the bytes it read, and how many of them the transforms' own buffers took.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from .. import profile, progress, reference
from ..work import useful_backward_matrix_ops, useful_matrix_ops
from ..runtime.arrays import bfloat16
from ..runtime.devices import resolve_device
from ..ops.attention import attention
from ..ops.attention_backward import attention_backward
from . import _plot, _quantized, _scores, _table


@dataclass(frozen=True)
class Config:
    name: str
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    dtype: str
    causal: bool | str = False
    window: tuple[int, int] | None = None
    sinks: bool = False


# Small enough for the cpu backend (about 0.3-0.5 us per multiply-accumulate).
CPU_CONFIGS = (
    Config("prefill", 1, 4, 4, 256, 256, 64, 64, "float16"),
    Config("prefill causal", 1, 4, 4, 256, 256, 64, 64, "float16", causal=True),
    Config("GQA 8/2 causal", 1, 8, 2, 128, 128, 128, 128, "bfloat16", causal=True),
    Config("window 64 + sinks", 1, 4, 4, 512, 512, 64, 64, "float16", window=(64, 0), sinks=True),
    Config("decode", 1, 8, 8, 1, 2048, 64, 64, "float16"),
    Config("decode 1 head (split-KV)", 1, 1, 1, 1, 8192, 64, 64, "float16"),
    Config("D 192 / Dv 128", 1, 2, 2, 128, 128, 192, 128, "float32"),
)

# Decode, where reading K/V is the cost (--quantized).
CPU_DECODE_CONFIGS = (
    Config("decode GQA 32/8", 1, 32, 8, 1, 2048, 128, 128, "float16"),
    Config("decode MQA 16/1", 1, 16, 1, 1, 4096, 64, 64, "float16", causal=True),
    Config("decode 4 rows GQA 8/2", 1, 8, 2, 4, 4096, 128, 128, "float16", causal=True),
)
METAL_DECODE_CONFIGS = (
    Config("decode GQA 32/8", 8, 32, 8, 1, 8192, 128, 128, "float16"),
    Config("decode B1 GQA 32/8 (split-KV)", 1, 32, 8, 1, 32768, 128, 128, "float16"),
    Config("decode MQA 32/1", 4, 32, 1, 1, 16384, 64, 64, "float16", causal=True),
)

METAL_CONFIGS = (
    Config("prefill", 4, 16, 16, 2048, 2048, 64, 64, "float16"),
    Config("prefill causal", 4, 16, 16, 2048, 2048, 64, 64, "float16", causal=True),
    Config("prefill D128", 2, 32, 8, 4096, 4096, 128, 128, "bfloat16", causal=True),
    Config("window 128 + sinks", 1, 64, 8, 8192, 8192, 64, 64, "bfloat16", window=(128, 0), sinks=True),
    Config("decode", 8, 32, 8, 1, 8192, 128, 128, "float16"),
    Config("decode B1 (split-KV)", 1, 32, 8, 1, 16384, 128, 128, "float16"),
    Config("D 192 / Dv 128", 2, 16, 16, 2048, 2048, 192, 128, "float16", causal=True),
    Config("D 256", 2, 8, 8, 2048, 2048, 256, 256, "float16"),
)

# Approximate FP16/FP32 simdgroup-matrix peak of Apple GPUs (TFLOPS), by chip name.
PEAK_TFLOPS = {
    "M1 Ultra": 21.2, "M1 Max": 10.6, "M1 Pro": 5.3, "M1": 2.6,
    "M2 Ultra": 27.2, "M2 Max": 13.6, "M2 Pro": 6.8, "M2": 3.6,
    "M3 Ultra": 28.4, "M3 Max": 16.4, "M3 Pro": 7.4, "M3": 4.1,
    "M4 Max": 18.4, "M4 Pro": 9.2, "M4": 4.3,
}


def peak_tflops(device_name: str) -> float | None:
    """The longest chip name in PEAK_TFLOPS that the device name contains."""
    for chip in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if chip in device_name:
            return PEAK_TFLOPS[chip]
    return None


def allowed_pairs(config: Config) -> int:
    allowed = reference.allowed_keys(config.q_len, config.kv_len, config.causal, config.window)
    return int(allowed.sum()) * config.batch * config.q_heads


def _inputs(config: Config, rng: np.random.Generator):
    dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}[config.dtype]

    def tensor(heads, length, dim):
        return rng.standard_normal((config.batch, heads, length, dim)).astype(dtype)

    q = tensor(config.q_heads, config.q_len, config.head_dim)
    k = tensor(config.kv_heads, config.kv_len, config.head_dim)
    v = tensor(config.kv_heads, config.kv_len, config.value_dim)
    sinks = rng.standard_normal(config.q_heads).astype(np.float32) if config.sinks else None
    return q, k, v, sinks


def _measure(call, repeat: int) -> tuple[float, int | None]:
    """Median seconds of warm calls (device time where the backend reports it) and the ops issued."""
    call()  # compile and warm up
    times, ops = [], None
    for _ in range(repeat):
        with profile() as prof:
            start = time.perf_counter()
            call()
            wall = time.perf_counter() - start
        times.append(prof.seconds or wall)
        counted = [r.simdgroup_matrix_ops for r in prof.records]
        ops = None if None in counted else sum(counted)
    return float(np.median(times)), ops


def _forward(config: Config, device):
    q, k, v, sinks = _inputs(config, np.random.default_rng(0))
    return lambda: attention(q, k, v, causal=config.causal, window=config.window, sinks=sinks, device=device)


def _backward_pair(config: Config, device):
    """(forward with lse, backward) calls on the same inputs."""
    rng = np.random.default_rng(0)
    q, k, v, sinks = _inputs(config, rng)
    do = rng.standard_normal((config.batch, config.q_heads, config.q_len, config.value_dim)).astype(q.dtype)
    options = dict(causal=config.causal, window=config.window, sinks=sinks, device=device)
    o, lse = attention(q, k, v, return_lse=True, **options)
    return (lambda: attention(q, k, v, return_lse=True, **options),
            lambda: attention_backward(q, k, v, o, lse, do, **options))


def _shape(config: Config) -> str:
    heads = f"{config.q_heads}" if config.q_heads == config.kv_heads else f"{config.q_heads}/{config.kv_heads}"
    dims = f"{config.head_dim}" if config.head_dim == config.value_dim else f"{config.head_dim}/{config.value_dim}"
    return f"B{config.batch} H{heads} R{config.q_len} C{config.kv_len} D{dims}"


def main(argv: list[str]) -> int:
    parser = _table.parser("attention", __doc__)
    parser.add_argument("--device", choices=["cpu", "metal"], help="default: the default device")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per configuration (median)")
    parser.add_argument("--only", help="run the configurations whose name contains this text")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--backward", action="store_true", help="time the backward pass (and the forward with lse)")
    what.add_argument("--quantized", action="store_true", help="decode with quantized K/V against float16 K/V")
    what.add_argument("--scores", action="store_true", help="softcap and ALiBi against no score transform")
    what.add_argument("--plot", metavar="FILE.png",
                      help="draw charts against head dimension (forward and backward, every precision) with "
                           "matplotlib: throughput on Metal; issued work and device bytes on the cpu backend")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(_plot.HEAD_DIMS), help="with --plot")
    args = parser.parse_args(argv)
    if args.plot:
        return _plot_main(args)

    device = resolve_device(args.device)
    on_metal = device.kind == "metal"
    if args.quantized:
        configs = METAL_DECODE_CONFIGS if on_metal else CPU_DECODE_CONFIGS
    else:
        configs = METAL_CONFIGS if on_metal else CPU_CONFIGS
    configs = [c for c in configs if not args.only or args.only in c.name]
    peak = peak_tflops(device.name) if on_metal else None
    if args.quantized:
        table = _quantized.table(configs, device, args.repeat, _measure, _shape, _inputs)
        what = "attention forward, quantized K/V"
    elif args.scores:
        table = _scores.table(configs, device, args.repeat, _measure, _shape, _inputs)
        what = "attention with score transforms"
    else:
        table = (_backward_table if args.backward else _forward_table)(configs, device, args.repeat,
                                                                       rates=on_metal, peak=peak)
        what = "attention backward (and forward with lse)" if args.backward else "attention forward"
    title = f"{what} on {device.kind} ({device.name}), median of {args.repeat} warm calls"
    _table.show("attention", [replace(table, title=title)], quiet=args.quiet)
    return 0


def _ratio(issued: int | None, useful: int) -> list[str]:
    return ["-" if issued is None else str(issued), str(useful), "-" if issued is None else f"{issued / useful:.3f}"]


def _rate(flops: float, seconds: float, peak: float | None) -> list[str]:
    tflops = flops / seconds / 1e12
    return [f"{tflops:.2f}", "-" if peak is None else f"{100 * tflops / peak:.0f}%"]


MS_WIDTH = 8   # "%.2f" milliseconds up to 99999.99


def _widths(configs, useful: list[int], ms_columns: int) -> list[int]:
    """Column widths of a configuration table: names, shapes, dtypes, times, then the ops."""
    ops = len(str(2 * max(useful, default=0)))   # issued: near useful, room for twice it
    return [max((len(c.name) for c in configs), default=0), max((len(_shape(c)) for c in configs), default=0),
            len("bfloat16"), *[MS_WIDTH] * ms_columns, ops, ops]


def _forward_table(configs, device, repeat: int, *, rates: bool, peak: float | None) -> _table.Table:
    """One row per configuration; with `rates` (Metal), TFLOPS and the share of `peak`."""
    headers = ["config", "shape", "dtype", "ms", "mma issued", "mma useful", "issued/useful"]
    headers += ["TFLOPS", "% peak"] if rates else []
    useful = [useful_matrix_ops(c.batch, c.q_heads, c.q_len, c.kv_len, c.head_dim, c.value_dim, c.causal, c.window)
              for c in configs]

    def rows():
        for config, ops in zip(configs, useful):
            seconds, issued = _measure(_forward(config, device), repeat)
            row = [config.name, _shape(config), config.dtype, f"{seconds * 1e3:.2f}", *_ratio(issued, ops)]
            if rates:
                row += _rate(2 * allowed_pairs(config) * (config.head_dim + config.value_dim), seconds, peak)
            yield row
    return _table.Table(headers, rows(), len(configs), widths=_widths(configs, useful, 1))


def _backward_table(configs, device, repeat: int, *, rates: bool, peak: float | None) -> _table.Table:
    headers = ["config", "shape", "dtype", "fwd ms", "bwd ms", "bwd mma issued", "bwd mma useful", "issued/useful"]
    headers += ["bwd TFLOPS", "% peak"] if rates else []
    useful = [sum(useful_backward_matrix_ops(c.batch, c.q_heads, c.q_len, c.kv_len, c.head_dim, c.value_dim,
                                             c.causal, c.window)) for c in configs]

    def rows():
        for config, ops in zip(configs, useful):
            forward, backward = _backward_pair(config, device)
            forward_seconds, _ = _measure(forward, repeat)
            seconds, issued = _measure(backward, repeat)
            row = [config.name, _shape(config), config.dtype, f"{forward_seconds * 1e3:.2f}",
                   f"{seconds * 1e3:.2f}", *_ratio(issued, ops)]
            if rates:
                row += _rate(2 * allowed_pairs(config) * (3 * config.head_dim + 2 * config.value_dim), seconds, peak)
            yield row
    return _table.Table(headers, rows(), len(configs), widths=_widths(configs, useful, 2))


def _plot_main(args: argparse.Namespace) -> int:
    """--plot: one problem per (direction, precision, head dim), B1 H2 R C 64 on the cpu backend
    (1024 and 8 heads on Metal), measured best of --repeat, drawn to args.plot."""
    device = resolve_device(args.device)
    on_metal = device.kind == "metal"
    length, heads = (1024, 8) if on_metal else (64, 2)
    points = {}
    total = len(_plot.DIRECTIONS) * len(_plot.DTYPES) * len(args.head_dims)
    with progress.bar(total, "bench attention --plot", unit="point", quiet=args.quiet) as shown:
        for direction in _plot.DIRECTIONS:
            for dtype in _plot.DTYPES:
                for d in args.head_dims:
                    shown.set_postfix_str(f"{direction} {dtype} D{d}", refresh=False)
                    config = Config("plot", 1, heads, heads, length, length, d, d, dtype)
                    call = _forward(config, device) if direction == "forward" else _backward_pair(config, device)[1]
                    macs = heads * length * length * 2 * d * (1 if direction == "forward" else 2.5)
                    ops = (useful_matrix_ops(1, heads, length, length, d, d) if direction == "forward"
                           else sum(useful_backward_matrix_ops(1, heads, length, length, d, d)))
                    points[(direction, dtype, d)] = (_plot.measure(call, args.repeat), macs, ops)
                    shown.update()
    title = (f"attention on {device.name}: B1 H{heads} R=C={length}" +
             ("" if on_metal else " (cpu backend: issued work and traffic, not speed)"))
    try:
        _plot.draw(args.plot, title, points, on_metal)
    except ModuleNotFoundError as error:
        print(f"bench attention: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.plot}")
    return 0
