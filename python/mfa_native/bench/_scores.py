"""Score transforms against none: `python -m mfa_native bench attention --scores`.

For each configuration and each chain of score transforms (none, softcap, ALiBi, both): the
forward and backward warm times, the simdgroup multiply-accumulates the forward issued, and
the device bytes it read: all of them, and from the transforms' own buffers (alibi_slopes).
The cpu backend counts both exactly; Metal reports no counts (the columns show "-").
"""

from __future__ import annotations

import numpy as np

from .. import profile
from ..ops.attention import attention
from ..ops.attention_backward import attention_backward
from ._table import Table

TRANSFORMS = {"none": {}, "softcap 30": {"softcap": 30.0}, "ALiBi": {"alibi_slopes": True},
              "softcap + ALiBi": {"softcap": 30.0, "alibi_slopes": True}}


def _options(config, transform: dict, sinks) -> dict:
    """The call's options: the configuration's masking, and the transform's (BLOOM's slopes)."""
    options = dict(causal=config.causal, window=config.window, sinks=sinks, **transform)
    if transform.get("alibi_slopes"):
        options["alibi_slopes"] = (2.0 ** (-8.0 * np.arange(1, config.q_heads + 1) / config.q_heads)).astype(np.float32)
    return options


def _counted(prof, buffers=None) -> int | None:
    """Bytes read, by every buffer or those of `buffers`; None where the backend counts none."""
    read = {name: n for name, n in prof.bytes_read.items() if buffers is None or name in buffers}
    return None if None in read.values() else sum(read.values())


def table(configs, device, repeat: int, measure, shape, inputs) -> Table:
    """One row per (configuration, transform). `measure`, `shape` and `inputs` are the attention
    benchmark's (bench/attention.py)."""
    headers = ["config", "shape", "scores", "fwd ms", "bwd ms", "mma issued", "bytes read", "of them, transforms'"]

    def rows():
        for config in configs:
            rng = np.random.default_rng(0)
            q, k, v, sinks = inputs(config, rng)
            do = rng.standard_normal((*q.shape[:-1], config.value_dim)).astype(q.dtype)
            for name, transform in TRANSFORMS.items():
                options = _options(config, transform, sinks)
                forward = lambda options=options: attention(q, k, v, return_lse=True, device=device, **options)
                seconds, issued = measure(forward, repeat)
                o, lse = forward()
                backward_seconds, _ = measure(lambda: attention_backward(q, k, v, o, lse, do, device=device, **options),
                                              repeat)
                with profile() as prof:
                    forward()
                total, own = _counted(prof), _counted(prof, {"alibi_slopes"})
                yield [config.name, shape(config), name, f"{seconds * 1e3:.2f}", f"{backward_seconds * 1e3:.2f}",
                       "-" if issued is None else str(issued), "-" if total is None else str(total),
                       "-" if own is None else str(own)]
    widths = [max(len(c.name) for c in configs), max(len(shape(c)) for c in configs), max(map(len, TRANSFORMS)),
              8, 8, 10, 12, len(headers[-1])]
    return Table(headers, rows(), len(configs) * len(TRANSFORMS), widths=widths)
