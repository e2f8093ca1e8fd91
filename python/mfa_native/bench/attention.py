"""Attention forward benchmark: `python -m mfa_native bench attention [--device cpu] [--repeat 3]`.

For each configuration: the warm time per call, the simdgroup 8x8x8
multiply-accumulates the kernel issued against the useful minimum (every 8x8
tile of S that holds an allowed key, times the tiles of Q K^T and P V), and on
Metal the achieved TFLOPS and the share of the chip's peak.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from .. import profile, reference
from .._arrays import bfloat16
from .._devices import resolve_device
from ..attention import attention
from ._table import format_table


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


def useful_matrix_ops(batch: int, q_heads: int, q_len: int, kv_len: int, head_dim: int, value_dim: int,
                      causal=False, window=None) -> int:
    """8x8x8 multiply-accumulates a perfect kernel needs: for each 8x8 tile of S that holds an
    allowed (query, key) pair, ceil(D/8) for S = Q K^T and ceil(Dv/8) for O += P V."""
    allowed = reference.allowed_keys(q_len, kv_len, causal, window)
    rows, cols = -(-q_len // 8) * 8, -(-kv_len // 8) * 8
    padded = np.zeros((rows, cols), dtype=bool)
    padded[:q_len, :kv_len] = allowed
    tiles = padded.reshape(rows // 8, 8, cols // 8, 8).any(axis=(1, 3)).sum()
    return int(tiles) * batch * q_heads * (-(-head_dim // 8) + -(-value_dim // 8))


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


def _measure(config: Config, device, repeat: int) -> tuple[float, int | None]:
    """Median seconds of warm calls (device time where the backend reports it) and the ops issued."""
    q, k, v, sinks = _inputs(config, np.random.default_rng(0))

    def call():
        return attention(q, k, v, causal=config.causal, window=config.window, sinks=sinks, device=device)

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


def _shape(config: Config) -> str:
    heads = f"{config.q_heads}" if config.q_heads == config.kv_heads else f"{config.q_heads}/{config.kv_heads}"
    dims = f"{config.head_dim}" if config.head_dim == config.value_dim else f"{config.head_dim}/{config.value_dim}"
    return f"B{config.batch} H{heads} R{config.q_len} C{config.kv_len} D{dims}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mfa_native bench attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "metal"], help="default: the default device")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per configuration (median)")
    parser.add_argument("--only", help="run the configurations whose name contains this text")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    on_metal = device.kind == "metal"
    configs = [c for c in (METAL_CONFIGS if on_metal else CPU_CONFIGS) if not args.only or args.only in c.name]
    peak = peak_tflops(device.name) if on_metal else None

    headers = ["config", "shape", "dtype", "ms", "mma issued", "mma useful", "issued/useful"]
    if on_metal:
        headers += ["TFLOPS", "% peak"]
    rows = []
    for config in configs:
        seconds, issued = _measure(config, device, args.repeat)
        useful = useful_matrix_ops(config.batch, config.q_heads, config.q_len, config.kv_len,
                                   config.head_dim, config.value_dim, config.causal, config.window)
        row = [config.name, _shape(config), config.dtype, f"{seconds * 1e3:.2f}",
               "-" if issued is None else str(issued), str(useful),
               "-" if issued is None else f"{issued / useful:.3f}"]
        if on_metal:
            tflops = 2 * allowed_pairs(config) * (config.head_dim + config.value_dim) / seconds / 1e12
            row += [f"{tflops:.2f}", "-" if peak is None else f"{100 * tflops / peak:.0f}%"]
        rows.append(row)
        print(f"  {config.name}: {seconds * 1e3:.2f} ms", flush=True)
    print(f"\nattention forward on {device.kind} ({device.name}), median of {args.repeat} warm calls")
    print(format_table(headers, rows))
    return 0
