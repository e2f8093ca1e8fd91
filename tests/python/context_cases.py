"""Problems for the context-parallel tests, shared by the torch (gloo) and MLX (mlx.launch) runs:
each case's global arrays from a seed, each rank's shard of them, and the float64 reference on
the whole sequences. numpy only: the workers turn the shards into their framework's arrays."""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

import mfa_native
from mfa_native.reference import attention_backward_reference, attention_reference, \
    attention_with_kvcache_reference

B, HQ, HKV, D = 1, 4, 2, 8
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
TOLERANCE = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}   # relative L2 against float64
LSE_TOLERANCE = 1e-4   # absolute: lse comes from the rounded inputs in float32 whatever the dtype


@dataclass(frozen=True)
class RingCase:
    """One ring call: each rank's q and k/v shard lengths (k/v: those of q if None) and the options."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...] | None = None
    causal: bool | str = False
    window: tuple[int, int] | None = None
    sinks: bool = False
    layout: str = "bhsd"
    dtype: str = "float32"

    @property
    def kv(self) -> tuple[int, ...]:
        return self.q_lens if self.kv_lens is None else self.kv_lens

    @property
    def axis(self) -> int:
        return 2 if self.layout == "bhsd" else 1


def ring_inputs(seed: int, case: RingCase) -> dict[str, np.ndarray]:
    """The global q, k, v, do (and sinks) of a case, rounded to its dtype (held as float32), in its layout."""
    rng = np.random.default_rng(seed)
    R, C = sum(case.q_lens), sum(case.kv)
    shapes = {"q": (B, HQ, R, D), "k": (B, HKV, C, D), "v": (B, HKV, C, D), "do": (B, HQ, R, D)}
    arrays = {name: rounded(rng.standard_normal(shape), case.dtype) for name, shape in shapes.items()}
    if case.layout == "bshd":
        arrays = {name: x.transpose(0, 2, 1, 3).copy() for name, x in arrays.items()}
    if case.sinks:
        arrays["sinks"] = rng.standard_normal(HQ).astype(np.float32)
    return arrays


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(x, np.float32).astype(DTYPES[dtype]).astype(np.float32)


def shard(x: np.ndarray, lens: tuple[int, ...], rank: int, axis: int) -> np.ndarray:
    start = sum(lens[:rank])
    return np.take(x, range(start, start + lens[rank]), axis=axis)


def ring_expected(seed: int, case: RingCase) -> dict[str, np.ndarray]:
    """The float64 o, dq, dk, dv (and dsinks) on the whole sequences."""
    arrays = ring_inputs(seed, case)
    options = dict(causal=case.causal, window=case.window, sinks=arrays.get("sinks"), layout=case.layout)
    o = attention_reference(arrays["q"], arrays["k"], arrays["v"], **options)
    grads = attention_backward_reference(arrays["q"], arrays["k"], arrays["v"], arrays["do"], **options)
    return {"o": o, **dict(zip(("dq", "dk", "dv", "dsinks"), grads))}


@dataclass(frozen=True)
class DecodeCase:
    """A sharded decode step: local[r][b] is rank r's length of sequence b; `appended` new rows
    (0: none) go to the last rank; R queries; a paged cache with `page`; a q8_0 cache."""

    local: tuple[tuple[int, ...], ...]
    appended: int = 1
    R: int = 1
    causal: bool | str = False
    window: tuple[int, int] | None = None
    sinks: bool = False
    page: int | None = None
    quantized: bool = False
    dtype: str = "float32"
    dims: tuple[int, int, int, int] = field(default=(4, 2, 32, 32))   # Hq, Hkv, D, Dv

    @property
    def batch(self) -> int:
        return len(self.local[0])


def _capacity(case: DecodeCase, rank: int) -> int:
    need = max(case.local[rank]) + (case.appended if rank == len(case.local) - 1 else 0)
    page = case.page or 8
    return max(page, -(-need // page) * page)


def decode_shards(seed: int, case: DecodeCase, rank: int) -> dict:
    """Rank `rank`'s arrays: q, k, v (the same on every rank), its caches (poisoned past its
    lengths: NaN, or random where quantized) as numpy or QuantizedTensors, lengths, block table."""
    g = decode_global(seed, case)
    Hq, Hkv, D, Dv = case.dims
    rng = np.random.default_rng(seed + 1 + rank)
    capacity, lengths = _capacity(case, rank), np.array(case.local[rank], np.int32)
    offsets = np.sum(case.local[:rank], axis=0).astype(int) if rank else np.zeros(case.batch, int)
    caches = {}
    for name, width in (("k_cache", D), ("v_cache", Dv)):
        fill = rng.standard_normal if case.quantized else (lambda shape: np.full(shape, np.nan))
        cache = fill((case.batch, capacity, Hkv, width)).astype(np.float32)
        for b in range(case.batch):
            cache[b, :lengths[b]] = g[name][b, offsets[b]:offsets[b] + lengths[b]]
        cache = rounded(cache, case.dtype).astype(DTYPES[case.dtype])
        caches[name] = cache
    table = None
    if case.page is not None:
        per = capacity // case.page
        order = rng.permutation(case.batch * per + 1)[:case.batch * per]
        table = order.reshape(case.batch, per).astype(np.int32)
        for name in caches:
            pages = np.zeros((case.batch * per + 1, case.page, *caches[name].shape[2:]), caches[name].dtype)
            pages[table.reshape(-1)] = caches[name].reshape(case.batch * per, case.page, *caches[name].shape[2:])
            caches[name] = pages
    if case.quantized:
        caches = {name: mfa_native.quantize(x, format="q8_0") for name, x in caches.items()}
    return dict(q=g["q"], k=g["k"], v=g["v"], lengths=lengths, table=table, sinks=g.get("sinks"), **caches)


def decode_global(seed: int, case: DecodeCase) -> dict[str, np.ndarray]:
    """The whole sequences' caches (B, sum of lengths, Hkv, D), q, the new rows, sinks; in the
    case's dtype (quantized: the cache rows as their q8_0 rows dequantize)."""
    rng = np.random.default_rng(seed)
    Hq, Hkv, D, Dv = case.dims
    total = int(np.sum(case.local))
    dtype = DTYPES[case.dtype]
    g = {"q": rng.standard_normal((case.batch, case.R, Hq, D)),
         "k_cache": rng.standard_normal((case.batch, total, Hkv, D)),
         "v_cache": rng.standard_normal((case.batch, total, Hkv, Dv)),
         "k": rng.standard_normal((case.batch, case.appended, Hkv, D)),
         "v": rng.standard_normal((case.batch, case.appended, Hkv, Dv))}
    g = {name: rounded(x, case.dtype).astype(dtype) for name, x in g.items()}
    if case.sinks:
        g["sinks"] = rng.standard_normal(Hq).astype(np.float32)
    return g


def decode_expected(seed: int, case: DecodeCase) -> tuple[np.ndarray, np.ndarray]:
    """float64 (out, lse) of the whole sequences' attention_with_kvcache."""
    g = decode_global(seed, case)
    lengths = np.sum(case.local, axis=0).astype(np.int32)
    caches, new = [g["k_cache"], g["v_cache"]], [g["k"], g["v"]]
    if case.quantized:
        caches = [mfa_native.quantize(np.ascontiguousarray(x), format="q8_0").dequantize() for x in caches]
        new = [mfa_native.quantize(np.ascontiguousarray(x), format="q8_0").dequantize() for x in new]
    return attention_with_kvcache_reference(g["q"], *caches, lengths, *(new if case.appended else (None, None)),
                                            causal=case.causal, window=case.window, sinks=g.get("sinks"),
                                            return_lse=True)


def relative_l2(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30))


def check_ring(seed: int, case: RingCase, by_rank: list[dict[str, np.ndarray]]) -> None:
    """Every rank's output and gradient shards, put together, equal the float64 reference."""
    for name, want in ring_expected(seed, case).items():
        parts = [r[name] for r in by_rank]
        got = sum(parts) if name == "dsinks" else np.concatenate(parts, axis=case.axis)  # dsinks: each rank's rows
        assert relative_l2(got, want) <= TOLERANCE[case.dtype], (name, case, relative_l2(got, want))


def check_decode(seed: int, case: DecodeCase, by_rank: list[dict[str, np.ndarray]]) -> None:
    """Every rank got the whole sequences' output and lse; only the last rank's cache changed, by
    the append's rows (as a single-process append writes them)."""
    out, lse = decode_expected(seed, case)
    for rank, got in enumerate(by_rank):
        assert relative_l2(got["o"], out) <= TOLERANCE[case.dtype], (rank, case, relative_l2(got["o"], out))
        finite = np.isfinite(lse)
        assert (np.isneginf(got["lse"]) == np.isneginf(lse)).all(), (rank, case)
        assert np.abs(got["lse"][finite] - lse[finite]).max() <= LSE_TOLERANCE, (rank, case)
        assert (got["o"] == by_rank[0]["o"]).all(), "every rank returns the same bits"
        fresh = decode_shards(seed, case, rank)
        if rank == len(by_rank) - 1 and case.appended:
            mfa_native.attention_with_kvcache(fresh["q"], fresh["k_cache"], fresh["v_cache"], cache_seqlens=fresh["lengths"],
                                              k=fresh["k"], v=fresh["v"], block_table=fresh["table"])
        for which in "kv":
            cache = fresh[f"{which}_cache"]
            fields = cache.fields() if hasattr(cache, "fields") else {"data": cache}
            for name, want in fields.items():
                want = np.asarray(want, np.float32) if want.dtype.kind == "f" or want.dtype == DTYPES["bfloat16"] \
                    else np.asarray(want)
                assert np.array_equal(got[f"{which}.{name}"], want, equal_nan=True), (rank, which, name, case)
