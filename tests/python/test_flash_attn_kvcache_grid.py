"""flash-attn 2's `test_flash_attn_kvcache` grid, run through `mfa_native.torch.flash_attn_with_kvcache`:
its parameters (cache_batch_idx, cache_leftpad, paged block sizes, rotary fraction 0 / 0.5 / 1
interleaved or not, new rows as many as the queries or fewer, causal, local, ALiBi slopes
(rand * 0.3 per batch and head), MHA / MQA / GQA, float16 and bfloat16), its skips, its random lengths, and its tolerance: the output's largest
error against a float64 reference at most twice that of PyTorch computing in the same dtype
(plus 1e-5); the appended v rows exact, and k's too unless turned, then within a unit in the last
place of the reference's turned rows rounded to the dtype (flash-attn: 1e-3 against its own
rotation in the dtype).

The sizes are flash-attn's scaled down. The default run takes cases that hold every value of
every parameter; -m exhaustive, cases that hold every pair of values of two parameters (the
whole grid is some 20,000 cases)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from mfa_native.reference import attention_reference, rotary_reference
from test_varlen import cu_of
from test_varlen_paged import low_precision_attention

torch = pytest.importorskip("torch")
from mfa_native.torch import flash_attn_with_kvcache  # noqa: E402

GRID = dict(
    seqlens=[(1, 40), (3, 64), (8, 24), (12, 8)],   # (seqlen_q, seqlen_k)
    has_batch_idx=[False, True],
    has_leftpad=[False, True],
    paged_kv_block_size=[None, 8, 1],
    rotary_fraction=[0.0, 0.5, 1.0],
    rotary_interleaved=[False, True],
    seqlen_new_eq_seqlen_q=[True, False],
    causal=[False, True],
    local=[False, True],
    alibi=[False, True],
    new_kv=[False, True],
    mha_type=["mha", "mqa", "gqa"],
    dtype=["float16", "bfloat16"],
)
D, BATCH, HEADS = 32, 3, 6


def skipped(case: dict) -> bool:
    """flash-attn's own skips: more new rows than cache, rotary without new rows, and batch
    indices or a left pad with a paged cache."""
    seqlen_q, seqlen_k = case["seqlens"]
    return ((seqlen_q > seqlen_k and case["new_kv"]) or (not case["new_kv"] and case["rotary_fraction"] > 0)
            or (case["paged_kv_block_size"] is not None and (case["has_batch_idx"] or case["has_leftpad"])))


def every_case() -> list[dict]:
    cases = [dict(zip(GRID, values)) for values in itertools.product(*GRID.values())]
    return [c for c in cases if not skipped(c)]


def cover(strength: int) -> list[dict]:
    """Cases holding every value of every parameter (strength 1) or every pair of values of two
    parameters (strength 2) that some case holds: a greedy cover, in a fixed order."""
    cases, chosen, seen = every_case(), [], set()
    rng = np.random.default_rng(3)
    for index in rng.permutation(len(cases)):
        values = sorted((k, repr(v)) for k, v in cases[index].items())
        tuples = set(itertools.combinations(values, strength))
        if tuples - seen:
            chosen.append(cases[index])
            seen |= tuples
    return chosen


def case_id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items() if v not in (False, None))


def run(case: dict) -> None:
    torch.manual_seed(0)
    dtype = getattr(torch, case["dtype"])
    seqlen_q, seqlen_k = case["seqlens"]
    heads_k = {"mha": HEADS, "mqa": 1, "gqa": 3}[case["mha_type"]]
    rows_cache = 2 * BATCH if case["has_batch_idx"] else BATCH
    rotary_dim = math.floor(int(case["rotary_fraction"] * D) / 16) * 16
    new = (seqlen_q if case["seqlen_new_eq_seqlen_q"] else int(torch.randint(1, seqlen_q + 1, ()))) \
        if case["new_kv"] else 0
    q = torch.randn(BATCH, seqlen_q, HEADS, D).to(dtype)
    k, v = (torch.randn(BATCH, new, heads_k, D).to(dtype) for _ in "kv") if new else (None, None)
    window = tuple(torch.randint(0, seqlen_k, (2,)).tolist()) if case["local"] else None
    k_rows, v_rows = (torch.randn(rows_cache, seqlen_k, heads_k, D).to(dtype) for _ in "kv")
    block = case["paged_kv_block_size"]
    lengths = torch.randint(0 if new else 1, (seqlen_k - (seqlen_q if (case["causal"] or case["local"]) and rotary_dim
                                                          else new) + 1) if new else seqlen_k + 1,
                            (BATCH,), dtype=torch.int32)
    start = torch.tensor([int(torch.randint(0, int(n), ())) if n > 0 else 0 for n in lengths], dtype=torch.int32) \
        if case["has_leftpad"] else torch.zeros(BATCH, dtype=torch.int32)
    index = torch.randperm(rows_cache)[:BATCH].to(torch.int32) if case["has_batch_idx"] else torch.arange(BATCH)
    slopes = torch.rand(BATCH, HEADS) * 0.3 if case["alibi"] else None
    cos = sin = None
    if rotary_dim:
        angle = torch.rand(seqlen_k, rotary_dim // 2) * 2 * math.pi
        cos, sin = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
    # The reference: the cache rows each batch uses, with its new rows (turned) written, in float64.
    k_ref, v_ref = (x[index.long()].double().numpy() for x in (k_rows, v_rows))
    q_ref = q.double().numpy()
    positions = lengths.numpy().astype(np.int64)[:, None]
    if rotary_dim:
        rows = np.arange(seqlen_q) if case["causal"] or case["local"] else np.zeros(seqlen_q, np.int64)
        q_ref = rotary_reference(q_ref, cos.double().numpy(), sin.double().numpy(), positions + rows, case["rotary_interleaved"])
    if new:
        turned = k.double().numpy()
        if rotary_dim:
            turned = rotary_reference(turned, cos.double().numpy(), sin.double().numpy(), positions + np.arange(new),
                                      case["rotary_interleaved"])
        for b in range(BATCH):
            k_ref[b, lengths[b]:lengths[b] + new], v_ref[b, lengths[b]:lengths[b] + new] = turned[b], v[b].double().numpy()
    valid = [slice(int(start[b]), int(lengths[b]) + new) for b in range(BATCH)]
    reference = np.concatenate([attention_reference(q_ref[b:b + 1], k_ref[b:b + 1, valid[b]], v_ref[b:b + 1, valid[b]],
                                                    layout="bshd", causal=case["causal"], window=window,
                                                    alibi_slopes=None if slopes is None else slopes[b].numpy())
                                for b in range(BATCH)])
    # The baseline of flash-attn's tolerance: the batches as packed sequences, in the low dtype.
    packed = [torch.from_numpy(np.concatenate([x[b, valid[b]] for b in range(BATCH)])).to(dtype) for x in (k_ref, v_ref)]
    low = low_precision_attention(torch, torch.from_numpy(q_ref.reshape(-1, HEADS, D)).to(dtype), *packed,
                                  cu_of([seqlen_q] * BATCH), cu_of([s.stop - s.start for s in valid]), case["causal"],
                                  window, slopes).double().numpy().reshape(q_ref.shape)
    # The call, on flash-attn's layout of the caches.
    if block is None:
        k_cache, v_cache, table = k_rows.clone(), v_rows.clone(), None
    else:
        blocks = BATCH * -(-seqlen_k // block)
        order = torch.randperm(blocks)
        k_cache, v_cache = (torch.zeros(blocks, block, heads_k, D, dtype=dtype) for _ in "kv")
        table = order.reshape(BATCH, -1).to(torch.int32)
        for cache, rows in ((k_cache, k_rows), (v_cache, v_rows)):
            padded = torch.zeros(BATCH, blocks // BATCH * block, heads_k, D, dtype=dtype)
            padded[:, :seqlen_k] = rows[:BATCH]
            cache[order] = padded.reshape(blocks, block, heads_k, D)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                                  cache_seqlens=lengths, cache_batch_idx=index.to(torch.int32) if case["has_batch_idx"]
                                  else None, cache_leftpad=start if case["has_leftpad"] else None, block_table=table,
                                  causal=case["causal"], window_size=window or (-1, -1), alibi_slopes=slopes,
                                  rotary_interleaved=case["rotary_interleaved"])
    error = np.abs(out.double().numpy() - reference).max()
    assert error <= 2 * np.abs(low - reference).max() + 1e-5, (error, np.abs(low - reference).max())
    if new:   # the appended rows, read back from the caller's caches
        for b in range(BATCH):
            at = torch.arange(int(lengths[b]), int(lengths[b]) + new)
            if block is None:
                got_k, got_v = k_cache[int(index[b]), at], v_cache[int(index[b]), at]
            else:
                got_k, got_v = k_cache[table[b, at // block].long(), at % block], v_cache[table[b, at // block].long(),
                                                                                           at % block]
            if rotary_dim:   # turned in float32 and rounded once: within a unit in the last place of the dtype
                want = torch.from_numpy(k_ref[b, at.numpy()]).to(dtype).double()
                assert torch.allclose(got_k.double(), want, rtol=torch.finfo(dtype).eps, atol=1e-3)
            else:
                assert torch.equal(got_k, k[b])
            assert torch.equal(got_v, v[b])


@pytest.mark.parametrize("case", cover(1), ids=case_id)
def test_flash_attn_kvcache_sample(case):
    run(case)


@pytest.mark.exhaustive
@pytest.mark.parametrize("case", cover(2), ids=case_id)
def test_flash_attn_kvcache_pairs(case):
    run(case)
