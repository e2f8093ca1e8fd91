"""One rank of the MLX context-parallel tests, started by `mlx.launch --backend ring`: runs the
cases of test_context_mlx.py on this rank and saves what it got to OUT/rank<r>.npz.

    python mlx_context_worker.py OUT SEED SIZE [MODE]

MODE "refusals": calls that must raise on every rank (OUT/rank<r>.txt: what each raised);
"dying": rank 1 dies in the middle of a ring call (at its first K/V message) (the others write what they raised).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import context_cases as cases
import mfa_native.mlx as mm
from mfa_native.quantized import QuantizedTensor
from test_context_mlx import DECODE_CASES, RING_CASES

MLX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _mlx(x, dtype: str):
    if x is None:
        return None
    if isinstance(x, QuantizedTensor):
        return x.with_fields(**{name: mx.array(f) for name, f in x.fields().items()})
    if x.dtype.kind in "iu":
        return mx.array(x)
    return mx.array(np.asarray(x, np.float32)).astype(MLX_DTYPES[dtype])


def _host(x) -> np.ndarray:
    return np.array(x.astype(mx.float32)) if x.dtype != mx.int32 else np.array(x)


def _fields(cache) -> dict[str, np.ndarray]:
    fields = cache.fields() if isinstance(cache, QuantizedTensor) else {"data": cache}
    return {name: _host(x) for name, x in fields.items()}


def ring_case(rank: int, seed: int, case: cases.RingCase) -> dict[str, np.ndarray]:
    arrays = cases.ring_inputs(seed, case)
    q, k, v, do = (_mlx(cases.shard(arrays[n], case.q_lens if n in ("q", "do") else case.kv, rank, case.axis), case.dtype)
                   for n in ("q", "k", "v", "do"))
    sinks = None if "sinks" not in arrays else mx.array(arrays["sinks"])
    options = dict(causal=case.causal, window=case.window, layout=case.layout)

    def loss(q, k, v, *s):
        return (mm.ring_attention(q, k, v, sinks=s[0] if s else None, **options).astype(mx.float32)
                * do.astype(mx.float32)).sum()

    o = mm.ring_attention(q, k, v, sinks=sinks, **options)
    primals = [q, k, v, *([] if sinks is None else [sinks])]
    grads = mx.grad(loss, argnums=tuple(range(len(primals))))(*primals)
    names = ("dq", "dk", "dv", "dsinks")
    return {"o": _host(o), **{name: _host(g) for name, g in zip(names, grads)}}


def decode_case(rank: int, seed: int, case: cases.DecodeCase) -> dict[str, np.ndarray]:
    s = cases.decode_shards(seed, case, rank)
    caches = [_mlx(s[n], case.dtype) for n in ("k_cache", "v_cache")]
    new = [_mlx(s[n], case.dtype) if case.appended else None for n in ("k", "v")]
    o, lse = mm.sharded_decode(_mlx(s["q"], case.dtype), *caches, mx.array(s["lengths"]), k=new[0], v=new[1],
                               block_table=_mlx(s["table"], case.dtype), causal=case.causal, window=case.window,
                               sinks=None if s["sinks"] is None else mx.array(s["sinks"]), return_lse=True)
    fields = {f"{which}.{name}": x for which, c in zip("kv", caches) for name, x in _fields(c).items()}
    return {"o": _host(o), "lse": _host(lse), **fields}


def refusals(rank: int, size: int) -> list[str]:
    """Calls whose arguments differ on rank 1, or whose last rank's cache is full: what each raised,
    and that no cache was written."""
    q = mx.random.normal((1, 4, 3, 8))
    raised = []
    for options in ({"causal": rank == 1}, {"window": (-2, 0) if rank else None}):
        try:
            mm.ring_attention(q, q[:, :2], q[:, :2], **options)
        except (TypeError, ValueError) as error:
            raised.append(f"{type(error).__name__}: {error}")
    for full in (True, False):
        q, new = mx.random.normal((1, 1, 4 + (not full and rank == 1), 32)), mx.random.normal((1, 1, 2, 32))
        k_cache = mx.random.normal((1, 8, 2, 32))
        before = np.array(k_cache)
        lengths = mx.array([8 if full and rank == size - 1 else 3], mx.int32)
        try:
            mm.sharded_decode(q, k_cache, k_cache, lengths, k=new, v=new)
        except (TypeError, ValueError) as error:
            raised.append(f"{type(error).__name__}: {error}")
        raised.append(f"written: {not np.array_equal(before, np.array(k_cache))}")
    return raised


def dying(rank: int) -> list[str]:
    from mfa_native.context.mlx_group import MlxGroup

    shift = MlxGroup.shift

    def dies(self, *args):
        if rank == 1:
            os._exit(17)
        return shift(self, *args)

    MlxGroup.shift = dies
    q = mx.random.normal((1, 4, 6, 8))
    try:
        mm.ring_attention(q, q[:, :2], q[:, :2])
    except RuntimeError as error:
        return [f"{type(error).__name__}: {error}"]
    return ["returned"]


def main(out: str, seed: int, size: int, mode: str) -> None:
    group = mx.distributed.init(backend="ring", strict=size > 1)   # one rank runs without mlx.launch
    assert group.size() == size, (group.size(), size)
    rank = group.rank()
    if mode != "cases":
        lines = refusals(rank, size) if mode == "refusals" else dying(rank)
        Path(out, f"rank{rank}.txt").write_text("\n".join(lines))
        return
    results = {}
    for index, case in enumerate(RING_CASES[size]):
        results.update({f"ring{index}.{k}": x for k, x in ring_case(rank, seed + index, case).items()})
    for index, case in enumerate(DECODE_CASES[size]):
        results.update({f"decode{index}.{k}": x for k, x in decode_case(rank, seed + 100 + index, case).items()})
    np.savez(f"{out}/rank{rank}.npz", **results)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "cases")
