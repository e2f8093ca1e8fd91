"""ring_attention on torch.distributed (gloo, localhost): 2 and 4 processes with shards of any
length equal the float64 reference on the concatenated sequences, forward and backward; ranks
that disagree all raise the same error."""

from __future__ import annotations

import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import pytest

from conftest import relative_l2
from mfa_native.reference import allowed_keys, attention_backward_reference, attention_reference

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
from mfa_native.torch.ring import _band, _pair  # noqa: E402 - needs torch

B, HQ, HKV, D = 1, 4, 2, 8
TIMEOUT = 120


@dataclass(frozen=True)
class Case:
    """One ring call: each rank's q and k/v shard lengths (k/v: those of q if None) and the options."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...] | None = None
    causal: bool | str = False
    window: tuple[int, int] | None = None
    sinks: bool = False
    layout: str = "bhsd"

    @property
    def kv(self) -> tuple[int, ...]:
        return self.q_lens if self.kv_lens is None else self.kv_lens


CASES = {
    1: (Case((4,), (6,), causal=True, window=(2, 0)),),
    2: (Case((5, 0), causal=True, sinks=True), Case((3, 8), (6, 2), causal="upper_left", layout="bshd")),
    4: (Case((5, 9, 1, 7)),
        Case((5, 9, 1, 7), causal=True, sinks=True, layout="bshd"),
        Case((5, 9, 1, 7), causal="upper_left", window=(3, -1)),
        Case((3, 0, 6, 2), (5, 9, 1, 7), causal=True, window=(4, 1), sinks=True),
        Case((3, 0, 6, 2), (5, 9, 1, 7), causal="upper_left", layout="bshd")),
}


def _axis(layout: str) -> int:
    return 2 if layout == "bhsd" else 1


def _inputs(seed: int, case: Case) -> dict[str, np.ndarray]:
    """The global q, k, v, do (and sinks) of a case, float32, in its layout."""
    rng = np.random.default_rng(seed)
    R, C = sum(case.q_lens), sum(case.kv)
    shapes = {"q": (B, HQ, R, D), "k": (B, HKV, C, D), "v": (B, HKV, C, D), "do": (B, HQ, R, D)}
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    if case.layout == "bshd":
        arrays = {name: x.transpose(0, 2, 1, 3).copy() for name, x in arrays.items()}
    if case.sinks:
        arrays["sinks"] = rng.standard_normal(HQ).astype(np.float32)
    return arrays


def _shard(x: np.ndarray, lens: tuple[int, ...], rank: int, axis: int) -> np.ndarray:
    start = sum(lens[:rank])
    return np.take(x, range(start, start + lens[rank]), axis=axis)


def _ring_call(rank: int, size: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Every case of this world size on this rank: its o and gradients."""
    from mfa_native.torch import ring_attention

    out = []
    for index, case in enumerate(CASES[size]):
        arrays, axis = _inputs(seed + index, case), _axis(case.layout)
        q, do = (torch.from_numpy(_shard(arrays[n], case.q_lens, rank, axis)) for n in ("q", "do"))
        k, v = (torch.from_numpy(_shard(arrays[n], case.kv, rank, axis)) for n in ("k", "v"))
        sinks = torch.from_numpy(arrays["sinks"]) if case.sinks else None
        leaves = {"q": q, "k": k, "v": v, **({"sinks": sinks} if case.sinks else {})}
        for x in leaves.values():
            x.requires_grad_()
        o = ring_attention(q, k, v, causal=case.causal, window=case.window, sinks=sinks, layout=case.layout)
        o.backward(do)
        out.append({"o": o.detach().numpy(), **{f"d{n}": x.grad.numpy() for n, x in leaves.items()}})
    return out


def _worker(rank: int, size: int, port: int, work: Callable, args: tuple, results) -> None:
    """One rank: joins the gloo group and reports (rank, what `work` returned or its traceback)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=TIMEOUT))
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


@pytest.mark.parametrize("size", [1, 2, 4])
def test_ring_attention_equals_the_reference_on_unequal_shards(rng, size):
    seed = int(rng.integers(1 << 31))
    by_rank = _launch(size, _ring_call, seed)
    for index, case in enumerate(CASES[size]):
        arrays, axis = _inputs(seed + index, case), _axis(case.layout)
        options = dict(causal=case.causal, window=case.window, sinks=arrays.get("sinks"), layout=case.layout)
        o = attention_reference(arrays["q"], arrays["k"], arrays["v"], **options)
        grads = attention_backward_reference(arrays["q"], arrays["k"], arrays["v"], arrays["do"], **options)
        expected = {"o": o, **dict(zip(("dq", "dk", "dv", "dsinks"), grads))}
        for name, want in expected.items():
            parts = [by_rank[rank][index][name] for rank in range(size)]
            got = sum(parts) if name == "dsinks" else np.concatenate(parts, axis=axis)  # dsinks: each rank's rows
            assert relative_l2(got, want) <= 1e-5, (name, case)


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
    return raised


def test_ranks_that_disagree_all_raise_the_same_error():
    raised = _launch(2, _disagreeing_calls)
    assert raised[0] == raised[1] and [kind for kind, _ in raised[0]] == ["ValueError"] * 3, raised
    heads, causal, window = (message for _, message in raised[0])
    assert "the heads (Hq, Hkv)" in heads and "rank 1 has (8, 2)" in heads
    assert "causal" in causal and "rank 1: window left must be >= 0" in window


def test_each_pair_of_shards_is_the_global_band(rng):
    """The (rows, keys, window) call of every pair of shards allows exactly the keys that causal
    and window allow on the concatenated sequences (single process, no kernels)."""
    for _ in range(300):
        size = int(rng.integers(1, 5))
        q_lens, kv_lens = rng.integers(0, 7, size), rng.integers(0, 7, size)
        R, C = int(q_lens.sum()), int(kv_lens.sum())
        causal = [False, "lower_right", "upper_left"][rng.integers(3)]
        window = None if rng.random() < 0.3 else tuple(int(side) for side in rng.integers(-1, 6, 2))
        allowed = allowed_keys(R, C, causal, window)
        band = _band({False: "none"}.get(causal, causal), window, R, C)
        q_offsets, kv_offsets = np.cumsum([0, *q_lens]), np.cumsum([0, *kv_lens])
        for r in range(size):
            for s in range(size):
                want = allowed[q_offsets[r]:q_offsets[r + 1], kv_offsets[s]:kv_offsets[s + 1]]
                pair = _pair(band, int(q_offsets[r]), int(q_lens[r]), int(kv_offsets[s]), int(kv_lens[s]))
                got = np.zeros_like(want)
                if pair is not None:
                    got[:pair.rows, :pair.keys] = allowed_keys(pair.rows, pair.keys, False, pair.window)
                assert (got == want).all() and (pair is None or got.any()), (q_lens, kv_lens, causal, window, r, s)
