"""Quantized K/V against float16 K/V: `python -m mfa_native bench attention --quantized`.

For each configuration (decode shapes, where reading K/V is the cost) and each storage of
K and V (float16, MLX affine 8- and 4-bit, GGUF q8_0, q4_0, q4_1, q5_0 and q5_1): the warm time per call and
the device bytes read from K and V (every field: data, scales, biases) against their stored
size and against the float16 run. The cpu backend counts bytes exactly; Metal reports no
counts (the columns show "-") but its times are the point there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import profile
from ..ops.attention import attention
from ..ops.quantize import quantize
from ._table import Table


@dataclass(frozen=True)
class Storage:
    name: str
    format: str | None     # None: float16, as given
    bits: int | None = None
    group_size: int | None = None


STORAGES = (Storage("float16", None), Storage("affine 8-bit g64", "affine", 8, 64),
            Storage("affine 4-bit g64", "affine", 4, 64), *(Storage(f, f) for f in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")))


def _stored(x: np.ndarray, storage: Storage, device):
    """x as the benchmark stores it: as given (float16), or quantized on the device."""
    if storage.format is None:
        return x
    sizes = {} if storage.bits is None else dict(bits=storage.bits, group_size=storage.group_size)
    return quantize(x, storage.format, **sizes, device=device)


def _read(prof, name: str) -> int | None:
    counted = [prof.bytes_read.get(b) for b in (name, f"{name}_scales", f"{name}_biases") if b in prof.bytes_read]
    return None if not counted or None in counted else sum(counted)


def table(configs, device, repeat: int, measure, shape, inputs) -> Table:
    """The table: one row per (configuration, storage). `measure`, `shape` and `inputs` are the
    attention benchmark's (bench/attention.py)."""
    headers = ["config", "shape", "K/V storage", "ms", "K+V bytes read", "K+V stored", "read/stored",
               "read vs float16"]

    def rows():
        for config in configs:
            q, k, v, sinks = inputs(config, np.random.default_rng(0))
            float_read = None
            for storage in STORAGES:
                ks, vs = _stored(k, storage, device), _stored(v, storage, device)

                def call():
                    return attention(q, ks, vs, causal=config.causal, window=config.window, sinks=sinks,
                                     device=device)

                seconds, _ = measure(call, repeat)
                with profile() as prof:
                    call()
                read_k, read_v = _read(prof, "k"), _read(prof, "v")
                read = None if read_k is None or read_v is None else read_k + read_v
                stored = ks.nbytes + vs.nbytes
                if storage.format is None:
                    float_read = read
                yield [config.name, shape(config), storage.name, f"{seconds * 1e3:.2f}",
                       "-" if read is None else str(read), str(stored),
                       "-" if read is None else f"{read / stored:.3f}",
                       "-" if read is None or not float_read else f"{read / float_read:.3f}"]

    widths = [max((len(c.name) for c in configs), default=0), max((len(shape(c)) for c in configs), default=0),
              max(len(s.name) for s in STORAGES), 8]
    return Table(headers, rows(), len(configs) * len(STORAGES), widths=widths)
