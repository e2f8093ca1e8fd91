"""Context parallelism on torch.distributed (gloo, localhost): ring_attention and sharded_decode
on 1, 2 and 4 processes with shards of any length (0 and 1 too) equal the float64 reference on
the whole sequences, forward and backward; ranks that disagree, or a full cache on the last
rank, raise the same error on every rank; a rank that dies makes the others fail, not hang."""

from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import pytest

from context_cases import B, D, HKV, HQ, DecodeCase, RingCase, check_decode, check_ring, decode_shards, ring_inputs, shard

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

TIMEOUT = 120

CASES = {
    1: (RingCase((4,), (6,), causal=True, window=(2, 0)),),
    2: (RingCase((5, 0), causal=True, sinks=True), RingCase((3, 8), (6, 2), causal="upper_left", layout="bshd"),
        RingCase((6, 1), window=(3, 2), dtype="bfloat16")),
    4: (RingCase((5, 9, 1, 7)),
        RingCase((5, 9, 1, 7), causal=True, sinks=True, layout="bshd"),
        RingCase((5, 9, 1, 7), causal="upper_left", window=(3, -1), dtype="float16"),
        RingCase((3, 0, 6, 2), (5, 9, 1, 7), causal=True, window=(4, 1), sinks=True),
        RingCase((3, 0, 6, 2), (5, 9, 1, 7), causal="upper_left", layout="bshd")),
}
DECODE_CASES = {
    1: (DecodeCase(((7, 3),), causal=True, window=(3, 0), dtype="bfloat16"),),
    2: (DecodeCase(((9, 0), (5, 12)), causal=True, sinks=True, page=8),
        DecodeCase(((16, 3), (1, 9)), appended=2, R=2, causal="upper_left", quantized=True)),
    4: (DecodeCase(((9, 2), (0, 7), (1, 5), (6, 3)), causal=True, window=(10, 0), sinks=True, dtype="float16"),
        DecodeCase(((3, 4), (5, 0), (2, 1), (7, 8)), appended=0, R=3, page=8, quantized=True)),
}
TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def _tensor(x, dtype: str):
    """A numpy array (or QuantizedTensor of them) as torch tensors, float data in `dtype`."""
    if x is None:
        return None
    if hasattr(x, "fields"):
        return x.with_fields(**{name: torch.from_numpy(np.ascontiguousarray(f)) for name, f in x.fields().items()})
    if x.dtype.kind in "iu":
        return torch.from_numpy(x)
    return torch.from_numpy(np.asarray(x, np.float32)).to(getattr(torch, dtype))


def _host(x) -> np.ndarray:
    return (x.detach().float() if x.is_floating_point() else x).numpy()


def _ring_call(rank: int, size: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Every case of this world size on this rank: its o and gradients."""
    from mfa_native.torch import ring_attention

    out = []
    for index, case in enumerate(CASES[size]):
        arrays = ring_inputs(seed + index, case)
        q, do = (_tensor(shard(arrays[n], case.q_lens, rank, case.axis), case.dtype) for n in ("q", "do"))
        k, v = (_tensor(shard(arrays[n], case.kv, rank, case.axis), case.dtype) for n in ("k", "v"))
        sinks = torch.from_numpy(arrays["sinks"]) if case.sinks else None
        leaves = {"q": q, "k": k, "v": v, **({"sinks": sinks} if case.sinks else {})}
        for x in leaves.values():
            x.requires_grad_()
        o = ring_attention(q, k, v, causal=case.causal, window=case.window, sinks=sinks, layout=case.layout)
        o.backward(do)
        out.append({"o": _host(o), **{f"d{n}": _host(x.grad) for n, x in leaves.items()}})
    return out


def _decode_call(rank: int, size: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Every sharded decode case of this world size on this rank: out, lse and its caches after."""
    from mfa_native.torch import sharded_decode

    out = []
    for index, case in enumerate(DECODE_CASES[size]):
        s = decode_shards(seed + index, case, rank)
        caches = [_tensor(s[n], case.dtype) for n in ("k_cache", "v_cache")]
        new = [_tensor(s[n], case.dtype) if case.appended else None for n in ("k", "v")]
        o, lse = sharded_decode(_tensor(s["q"], case.dtype), *caches, torch.from_numpy(s["lengths"]), k=new[0],
                                v=new[1], block_table=_tensor(s["table"], case.dtype), causal=case.causal,
                                window=case.window, sinks=None if s["sinks"] is None else torch.from_numpy(s["sinks"]),
                                return_lse=True)
        fields = {f"{which}.{name}": _host(x) for which, c in zip("kv", caches)
                  for name, x in (c.fields() if hasattr(c, "fields") else {"data": c}).items()}
        out.append({"o": _host(o), "lse": _host(lse), **fields})
    return out


def _worker(rank: int, size: int, port: int, work: Callable, args: tuple, results, timeout: int = TIMEOUT) -> None:
    """One rank: joins the gloo group and reports (rank, what `work` returned or its traceback)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout))
    try:
        results.put((rank, work(rank, size, *args)))
    except Exception:  # noqa: BLE001 - the parent reports it
        results.put((rank, RuntimeError(traceback.format_exc())))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(size: int, work: Callable, *args: Any) -> list[Any]:
    """What `work(rank, size, *args)` returned on each of `size` spawned gloo ranks."""
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    workers = [context.Process(target=_worker, args=(rank, size, port, work, args, results)) for rank in range(size)]
    for w in workers:
        w.start()
    try:
        by_rank = dict(results.get(timeout=TIMEOUT) for _ in range(size))
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
    failed = [result for result in by_rank.values() if isinstance(result, RuntimeError)]
    assert not failed, failed[0]
    assert all(w.exitcode == 0 for w in workers)
    return [by_rank[rank] for rank in range(size)]


# One rank (no exchange, 11 s cold) and four (45 s) run in the exhaustive step; two in the default run.
@pytest.mark.parametrize("size", [pytest.param(1, marks=pytest.mark.exhaustive), 2,
                                  pytest.param(4, marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("op", ["ring_attention", "sharded_decode"])
def test_context_parallel_calls_equal_the_reference_on_unequal_shards(rng, op, size):
    """ring_attention (output and gradients) and sharded_decode (output, lse, caches) on every rank."""
    work, cases, check = (_ring_call, CASES, check_ring) if op == "ring_attention" else \
        (_decode_call, DECODE_CASES, check_decode)
    seed = int(rng.integers(1 << 31))
    by_rank = _launch(size, work, seed)
    for index, case in enumerate(cases[size]):
        check(seed + index, case, [by_rank[rank][index] for rank in range(size)])


def _disagreeing_calls(rank: int, size: int) -> list[tuple[str, str]]:
    """Calls whose arguments differ on rank 1: what each raised (type name, message)."""
    from mfa_native.torch import ring_attention

    heads = HQ if rank == 0 else 2 * HQ
    calls = ((torch.randn(B, heads, 3, D), torch.randn(B, HKV, 3, D), {}),
             (torch.randn(B, HQ, 3, D), torch.randn(B, HKV, 3, D), {"causal": rank == 1}),
             (torch.randn(B, HQ, 3, D), torch.randn(B, HKV, 3, D), {"window": (-2, 0) if rank else None}))
    raised = []
    for q, k, options in calls:
        try:
            ring_attention(q, k, k, **options)
        except (TypeError, ValueError) as error:
            raised.append((type(error).__name__, str(error)))
    return raised + _refused_decodes(rank, size)


def _refused_decodes(rank: int, size: int) -> list[tuple[str, str]]:
    """Sharded decodes that must raise on every rank before any cache is written: the last rank's
    cache is full; rank 1's q differs. What each raised, and whether its caches kept their bytes."""
    from mfa_native.torch import sharded_decode

    raised = []
    for full, heads in ((True, HQ), (False, HQ + (rank == 1))):
        q, new = torch.randn(1, 1, heads, 32), torch.randn(1, 1, 2, 32)
        k_cache, v_cache = torch.randn(1, 8, 2, 32), torch.randn(1, 8, 2, 32)
        before = (k_cache.clone(), v_cache.clone())
        lengths = torch.tensor([8 if full and rank == size - 1 else 3], dtype=torch.int32)
        try:
            sharded_decode(q, k_cache, v_cache, lengths, k=new, v=new)
        except (TypeError, ValueError) as error:
            raised.append((type(error).__name__, str(error)))
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "a refused call wrote"
    return raised


def test_ranks_that_disagree_all_raise_the_same_error():
    raised = _launch(2, _disagreeing_calls)
    assert raised[0] == raised[1] and [kind for kind, _ in raised[0]] == ["ValueError"] * 5, raised
    heads, causal, window, full, decode_heads = (message for _, message in raised[0])
    assert "the heads (Hq, Hkv)" in heads and "rank 1 has (8, 2)" in heads
    assert "causal" in causal and "rank 1: window left must be >= 0" in window
    assert full.startswith("sharded_decode: rank 1: ") and "beyond the cache's capacity Cmax = 8" in full
    assert "q's shape" in decode_heads and "rank 1 has (1, 1, 5, 32)" in decode_heads


def _dying_rank(rank: int, size: int) -> str:
    """Rank 1 dies in the middle of the ring (at its second message); the others report what they raised."""
    from mfa_native.context.torch_group import TorchGroup
    from mfa_native.torch import ring_attention

    shift, calls = TorchGroup.shift, []

    def dying(self, *args):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            os._exit(17)
        return shift(self, *args)

    TorchGroup.shift = dying
    q = torch.randn(B, HQ, 6, D)
    try:
        ring_attention(q, q[:, :HKV], q[:, :HKV])
    except RuntimeError as error:   # gloo's: the peer closed the connection, or the timeout
        return f"{type(error).__name__}: {error}"
    return "returned"


def test_a_rank_that_dies_makes_the_others_fail_not_hang():
    context = torch.multiprocessing.get_context("spawn")
    results, port = context.Queue(), _free_port()
    workers = [context.Process(target=_worker, args=(rank, 3, port, _dying_rank, (), results, 20)) for rank in range(3)]
    for w in workers:
        w.start()
    try:
        reports = dict(results.get(timeout=TIMEOUT) for _ in range(2))
    finally:
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    assert workers[1].exitcode == 17 and set(reports) == {0, 2}, reports
    assert all(report.startswith("RuntimeError") for report in reports.values()), reports
