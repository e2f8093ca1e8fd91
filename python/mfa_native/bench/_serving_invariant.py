"""`bench serving --section invariant`: what deterministic="batch_invariant" costs. The same
float16 calls as servers make them, each timed with the mode off and on: decode and
verification steps through a paged `attention_with_kvcache` (the cache section's steps), a
decode batch through `attention_varlen`, and a causal prefill through `attention`; per call the
kernels each dispatches, the milliseconds and their ratio. The mode keeps the split-KV pair
where the device would split (fixed splits of invariance.SPLIT_KEYS keys, merged in order),
never packs heads for plain K/V and merges the splits in the one-pass kernel too.

The device is tuned as one running 64 threadgroups at once, as in the cache section.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..ops.attention import attention
from ..runtime.devices import tuned_as
from ._serving_cache import (DEVICE_THREADGROUPS, HEAD_DIM, HEADS, LONGEST_KERNELS, cache_label, cache_step,
                             varlen_label, varlen_step)
from ._table import Table

STEPS = ((4096, 1), (4096, 16), (32768, 1))   # (attended keys, queries) of the cache steps
PREFILL = (2048, 512)                           # its length, and with --quick
MODES = (False, "batch_invariant")


def _prefill(length: int, device) -> tuple[str, Callable[[bool | str], Callable[[], object]]]:
    """A causal prefill of `length` tokens through attention, as (label, mode -> call)."""
    rng = np.random.default_rng(0)
    (hq, hkv), D = HEADS, HEAD_DIM
    q = rng.standard_normal((1, length, hq, D)).astype(np.float16)
    k, v = (rng.standard_normal((1, length, hkv, D)).astype(np.float16) for _ in "kv")

    def call(mode):
        return lambda: attention(q, k, v, causal=True, layout="bshd", device=device, deterministic=mode)
    return f"attention prefill H{hq}/{hkv} R{length} C{length} D{D}", call


def _calls(args, device) -> list[tuple[str, Callable[[bool | str], Callable[[], object]]]]:
    """(label, mode -> warm call) of every benchmarked call."""
    steps = [(keys, r) for keys, r in STEPS if not (args.quick and keys > 4096)]
    calls = [(cache_label(keys, r), lambda mode, keys=keys, r=r: cache_step(keys, r, device, deterministic=mode).call)
             for keys, r in steps]
    calls.append((varlen_label(), lambda mode: varlen_step(device, deterministic=mode).call))
    return calls + [_prefill(PREFILL[1 if args.quick else 0], device)]


def invariant_section(args, device, measured) -> Table:
    """The table: `measured(call, repeat)` gives (seconds, profile)."""
    headers = ["call", "kernels off", "ms off", "kernels invariant", "ms invariant", "invariant/off"]
    calls = _calls(args, device)

    def rows():
        with tuned_as(device, parallel_threadgroups=DEVICE_THREADGROUPS):
            for label, call in calls:
                cells = []
                for mode in MODES:
                    seconds, prof = measured(call(mode), args.repeat)
                    cells.append(("+".join(r.kernel.removeprefix("attention_") for r in prof.records), seconds))
                (off_kernels, off), (on_kernels, on) = cells
                yield [label, off_kernels, f"{off * 1e3:.2f}", on_kernels, f"{on * 1e3:.2f}", f"{on / off:.2f}"]

    return Table(headers, rows(), len(calls),
                 f"deterministic=\"batch_invariant\" against the default, float16, causal, tuned as "
                 f"{DEVICE_THREADGROUPS} parallel threadgroups",
                 [max(len(label) for label, _ in calls), len(LONGEST_KERNELS), 8, len(LONGEST_KERNELS), 8])
