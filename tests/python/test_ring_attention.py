"""ring_attention on torch.distributed (gloo, localhost): 2 and 4 processes equal one process's attention."""

from __future__ import annotations

import socket
from datetime import timedelta

import numpy as np
import pytest

import mfa_native
from conftest import relative_l2

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

B, HQ, HKV, S, D = 1, 4, 2, 48, 16
CASES = ((False, "bhsd"), (True, "bshd"))  # (causal, layout), each run by every worker
TIMEOUT = 120


def _inputs(seed: int, layout: str):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal(shape).astype(np.float32)
                   for shape in ((B, HQ, S, D), (B, HKV, S, D), (B, HKV, S, D), (B, HQ, S, D)))
    if layout == "bshd":
        q, k, v, do = (x.transpose(0, 2, 1, 3).copy() for x in (q, k, v, do))
    return q, k, v, do


def _shard(x: np.ndarray, rank: int, size: int, layout: str) -> np.ndarray:
    axis = 2 if layout == "bhsd" else 1
    n = x.shape[axis] // size
    return np.take(x, range(rank * n, (rank + 1) * n), axis=axis)


def _worker(rank: int, size: int, port: int, seed: int, results) -> None:
    from mfa_native.torch import ring_attention

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=TIMEOUT))
    try:
        out = []
        for causal, layout in CASES:
            q, k, v, do = (torch.from_numpy(_shard(x, rank, size, layout)) for x in _inputs(seed, layout))
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            o = ring_attention(q, k, v, causal=causal, layout=layout)
            o.backward(do)
            out.append(tuple(x.detach().numpy() for x in (o, q.grad, k.grad, v.grad)))
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("size", [2, 4])
def test_ring_attention_equals_one_process(rng, size):
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    seed = int(rng.integers(1 << 31))
    port = _free_port()
    workers = [context.Process(target=_worker, args=(rank, size, port, seed, results)) for rank in range(size)]
    for w in workers:
        w.start()
    try:
        by_rank = dict(results.get(timeout=TIMEOUT) for _ in range(size))
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
    assert all(w.exitcode == 0 for w in workers)
    for case, (causal, layout) in enumerate(CASES):
        q, k, v, do = _inputs(seed, layout)
        mode = "upper_left" if causal else False
        o, lse = mfa_native.attention(q, k, v, causal=mode, layout=layout, return_lse=True)
        expected = (o, *mfa_native.attention_backward(q, k, v, o, lse, do, causal=mode, layout=layout))
        for name, index in (("o", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
            got = np.concatenate([by_rank[r][case][index] for r in range(size)], axis=2 if layout == "bhsd" else 1)
            assert relative_l2(got, expected[index]) <= 1e-5, (name, causal, layout)
