"""One rank of `bench ring`, started by it (torch: with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set; MLX: by mlx.launch): runs a causal ring prefill or a sharded decode once to
warm up, then once measured, then replays the measured call's ring messages alone, and writes
OUT/rank<r>.json.

    python _ring_rank.py FRAMEWORK WORKLOAD TOKENS OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

HEADS, KV_HEADS, DIM = 2, 1, 64


def _group(framework: str):
    if framework == "torch":
        import torch.distributed as dist

        from mfa_native.context.torch_group import TorchGroup

        dist.init_process_group("gloo")
        return TorchGroup(None)
    import mlx.core as mx

    from mfa_native.context.mlx_group import MlxGroup

    return MlxGroup(mx.distributed.init(backend="ring", strict=True))


def _array(framework: str, x: np.ndarray):
    if framework == "torch":
        import torch

        return torch.from_numpy(x)
    import mlx.core as mx

    return mx.array(x)


def _prefill(group, framework: str, tokens: int):
    from mfa_native.context import ring

    n = tokens // group.size + (group.rank < tokens % group.size)
    rng = np.random.default_rng(group.rank)
    q, k, v = (_array(framework, rng.standard_normal((1, h, n, DIM)).astype(np.float32))
               for h in (HEADS, KV_HEADS, KV_HEADS))

    def call():
        plan = ring.plan(group, "ring_attention", q, k, v, None, True, None, None, "bhsd")
        ring.forward(plan, q, k, v, None)
        return plan

    return call


def _decode(group, framework: str, tokens: int):
    from mfa_native.context import decode
    from mfa_native.ops.kvcache import ATTENTION_WITH_KVCACHE

    n = tokens // group.size
    rng = np.random.default_rng(group.rank)
    k_cache, v_cache = (_array(framework, rng.standard_normal((1, n + 8, KV_HEADS, DIM)).astype(np.float32))
                        for _ in "kv")
    q = _array(framework, rng.standard_normal((1, 1, HEADS, DIM)).astype(np.float32))
    lengths = _array(framework, np.array([n], np.int32))
    if framework == "torch":
        attend = ATTENTION_WITH_KVCACHE.function
    else:
        from mfa_native.mlx import attention_with_kvcache as attend
    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lengths, k=None, v=None, block_table=None)

    def call():
        decode.sharded_decode(group, attend, arrays, decode.Options(None, True, None, None, False))

    return call


def _leave(framework: str, group) -> None:
    """Every rank waits for the others before leaving; torch's gloo group is then taken down,
    so no rank exits while a peer's gloo threads still talk to it (that aborts the peer with
    'terminate called without an active exception')."""
    group.gather_objects(None)
    if framework == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()


def main(framework: str, workload: str, tokens: int, out: str) -> None:
    group = _group(framework)
    _measure(group, framework, workload, tokens, out)
    _leave(framework, group)  # not after a failure: the others may never reach it


def _measure(group, framework: str, workload: str, tokens: int, out: str) -> None:
    from mfa_native.context.group import Traffic

    call = (_prefill if workload == "prefill" else _decode)(group, framework, tokens)
    call()                                   # compiles the kernels
    group.traffic = Traffic()
    group.gather_objects(None)               # every rank starts together
    start = time.perf_counter()
    plan = call()
    seconds = time.perf_counter() - start
    measured = group.traffic
    group.traffic = Traffic()
    group.gather_objects(None)
    start = time.perf_counter()
    for arrays, incoming, like in measured.shifts:   # the same messages, no compute
        group.shift(arrays, incoming, like)()
    alone = time.perf_counter() - start
    work = plan.work(group.rank) if workload == "prefill" else None
    Path(out, f"rank{group.rank}.json").write_text(json.dumps(dict(
        seconds=seconds, sent=measured.sent, gathered=measured.gathered, waited=measured.waited,
        gathering=measured.gathering, shifts=len(measured.shifts),
        ring_alone=alone, work=work)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
