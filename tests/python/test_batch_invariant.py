"""deterministic="batch_invariant": one prompt's tokens get bit-identical outputs and lse
whether they are decoded one by one (with the append), verified in chunks of 2..32, or
prefilled whole (attention, attention_varlen at several positions of varlen batches, the cache
call), in batches of different sizes, split over threadgroups or not. The prompt is longer than
the mode's split length, so its keys cross a split; GQA, causal, float32 and a small D keep it
fast. With the mode off the same paths agree within tolerance (and with the float64 reference)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2

import mfa_native
from mfa_native import codegen
from mfa_native.codegen.attention import invariance
from mfa_native.reference import attention_reference
from mfa_native.runtime.devices import tuned_as

L, HQ, HKV, D = 300, 4, 2, 16   # L crosses the mode's split length (checked below)
CAPACITY = 512                  # a decode over it splits in two when the device is tuned to 64 threadgroups
CHUNKS = (2, 5, 32, 8, 13, 3, 16)


def prompt(rng, length=L, d=D):
    """q (length, Hq, d), k and v (length, Hkv, d): one sequence, float32."""
    return (rng.standard_normal((length, HQ, d)).astype(np.float32),
            *(rng.standard_normal((length, HKV, d)).astype(np.float32) for _ in "kv"))


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint32)


class Tokens:
    """Each path's outputs (L, Hq, D) and lse (Hq, L) of the prompt, by path name."""

    def __init__(self) -> None:
        self.results: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def add(self, name: str, o: np.ndarray, lse: np.ndarray) -> None:
        assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse)), name
        self.results[name] = (np.array(o), np.array(lse))


def plain_caches(rng, B, d=D):
    """Contiguous k and v caches of CAPACITY rows, NaN where nothing was appended; no table."""
    return (*(np.full((B, CAPACITY, HKV, d), np.nan, np.float32) for _ in "kv"), None)


def paged_caches(rng, B, d=D, page=16):
    """Paged caches (pages in random order among spare ones, NaN) and their block table."""
    blocks = B * CAPACITY // page + 3
    table = rng.permutation(blocks)[:B * CAPACITY // page].reshape(B, -1).astype(np.int32)
    return (*(np.full((blocks, page, HKV, d), np.nan, np.float32) for _ in "kv"), table)


def quantized_caches(rng, B, d=2 * D):
    """q8_0 caches holding random rows (nothing attended before the appends); no table."""
    return (*(mfa_native.quantize(rng.standard_normal((B, CAPACITY, HKV, d)).astype(np.float32), format="q8_0")
              for _ in "kv"), None)


def _cache_calls(rng, tokens: Tokens, sequences, chunks, name: str, split: bool, caches=plain_caches, **options):
    """The prompt (sequence 0, at batch position 1 when there are others) and the others
    appended to their caches (`caches(rng, B)`), `chunks` rows per call, attending as they go;
    returns the caches and the prompt's batch position."""
    batch = [sequences[1], sequences[0], *sequences[2:]] if len(sequences) > 1 else sequences
    B, target = len(batch), 1 if len(batch) > 1 else 0
    k_cache, v_cache, table = caches(rng, B, batch[0][0].shape[-1])
    seqlens = np.zeros(B, np.int32)
    outs, lses, at = [], [], 0
    for n in chunks:
        q, k, v = (np.stack([s[i][at:at + n] for s in batch]) for i in range(3))
        with tuned_as(mfa_native.default_device(), parallel_threadgroups=64 if split else 1):
            o, lse = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v,
                                                       block_table=table, causal=True, return_lse=True, **options)
        outs.append(o[target]), lses.append(lse[target])
        seqlens += n
        at += n
    tokens.add(name, np.concatenate(outs), np.concatenate(lses, axis=1))
    return k_cache, v_cache, target


def _chunks(sizes, total=L):
    out, at, i = [], 0, 0
    while at < total:
        out.append(min(sizes[i % len(sizes)], total - at))
        at, i = at + out[-1], i + 1
    return out


def _varlen(tokens: Tokens, sequences, position: int, name: str, **options) -> None:
    """attention_varlen prefilling the sequences packed, the prompt (sequence 0) at `position`."""
    order = list(sequences[1:])
    order.insert(position, sequences[0])
    cu = np.concatenate([[0], np.cumsum([len(s[0]) for s in order])]).astype(np.int32)
    q, k, v = (np.concatenate([s[i] for s in order]) for i in range(3))
    o, lse = mfa_native.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True, **options)
    rows = slice(cu[position], cu[position + 1])
    tokens.add(name, o[rows], lse[:, rows])


def _varlen_decode(tokens: Tokens, sequences, name: str, **options) -> None:
    """attention_varlen decoding the prompt token by token, each step a batch of one query per
    sequence (max_seqlen_q 1: heads packed), the prompt's keys so far second, another's first."""
    target, other = sequences
    outs, lses = [], []
    for t in range(L):
        ends = (t + 6, t + 1)   # the other sequence is 5 tokens further on
        q = np.concatenate([other[0][ends[0] - 1:ends[0]], target[0][t:t + 1]])
        k, v = (np.concatenate([other[i][:ends[0]], target[i][:ends[1]]]) for i in (1, 2))
        cu_q, cu_k = np.array([0, 1, 2], np.int32), np.array([0, ends[0], sum(ends)], np.int32)
        o, lse = mfa_native.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=1, causal=True, return_lse=True,
                                             **options)
        outs.append(o[1:]), lses.append(lse[:, 1:])
    tokens.add(name, np.concatenate(outs), np.concatenate(lses, axis=1))


def _dense(tokens: Tokens, sequences, name: str, **options) -> None:
    """attention over (B, L, H, D), the prompt at batch index B - 1, others cut to L."""
    batch = [*sequences[1:], sequences[0]]
    q, k, v = (np.stack([s[i][:L] for s in batch]) for i in range(3))
    o, lse = mfa_native.attention(q, k, v, causal=True, layout="bshd", return_lse=True, **options)
    tokens.add(name, o[-1], lse[-1])


def every_path(rng, **options) -> Tokens:
    """The prompt through every path, each with the options (deterministic or not)."""
    target = prompt(rng)
    others = [prompt(rng, length) for length in (L + 7, 41, L)]
    tokens = Tokens()
    _dense(tokens, [target], "attention B=1", **options)
    _dense(tokens, [target, others[0], others[2]], "attention B=3", **options)
    for position, batch in ((0, [target]), (1, [target, others[0]]), (2, [target, others[1], others[0], others[2]])):
        _varlen(tokens, batch, position, f"varlen at {position} of {len(batch)}", **options)
    _cache_calls(rng, tokens, [target], [1] * L, "decode B=1", split=False, **options)
    _varlen_decode(tokens, [target, others[0]], "varlen decode, B=2", **options)
    _cache_calls(rng, tokens, [target, others[0], others[2]], [1] * L, "decode B=3, split", split=True, **options)
    _cache_calls(rng, tokens, [target, others[0]], _chunks(CHUNKS), "verify 2..32, B=2, split", split=True, **options)
    _cache_calls(rng, tokens, [target], _chunks((7, 2, 32)), "verify B=1, paged", split=False, caches=paged_caches,
                 **options)
    _cache_calls(rng, tokens, [target, others[2]], [1] * L, "decode B=2, paged, split", split=True, caches=paged_caches,
                 **options)
    _cache_calls(rng, tokens, [target, others[2]], [L], "prefill through the cache, B=2", split=False, **options)
    expected, expected_lse = attention_reference(*(x.transpose(1, 0, 2)[None] for x in target), causal=True,
                                                 return_lse=True)
    tokens.add("float64 reference", expected[0].transpose(1, 0, 2), expected_lse[0])
    return tokens


def test_the_prompt_crosses_the_split_length():
    p = codegen.AttentionProblem(batch=1, q_heads=HQ, kv_heads=HKV, q_len=1, kv_len=CAPACITY, head_dim=D,
                                 value_dim=D, batch_invariant=True)
    split_keys = codegen.describe(p).split_keys
    assert split_keys == invariance.split_keys(codegen.describe(p).key_block) and split_keys < L < 2 * split_keys


def test_every_path_gives_the_same_bits(rng):
    tokens = every_path(rng, deterministic="batch_invariant")
    expected_o, expected_lse = tokens.results.pop("float64 reference")
    base_name, (base_o, base_lse) = next(iter(tokens.results.items()))
    assert relative_l2(base_o, expected_o) < 1e-5 and relative_l2(base_lse, expected_lse) < 1e-5
    for name, (o, lse) in tokens.results.items():
        assert np.array_equal(bits(o), bits(base_o)), f"{name}: outputs differ from {base_name}'s bits"
        assert np.array_equal(bits(lse), bits(base_lse)), f"{name}: lse differs from {base_name}'s bits"


def test_mode_off_paths_agree_within_tolerance(rng):
    tokens = every_path(rng)
    expected_o, expected_lse = tokens.results.pop("float64 reference")
    for name, (o, lse) in tokens.results.items():
        assert relative_l2(o, expected_o) < 1e-5, name
        assert relative_l2(lse, expected_lse) < 1e-5, name


def test_a_quantized_cache_gives_the_same_bits_decoded_verified_or_prefilled(rng):
    """q8_0 k and v caches (packed heads, staged): every path reads the same stored integers."""
    target, other = prompt(rng, d=2 * D), prompt(rng, L + 5, d=2 * D)
    tokens = Tokens()
    _cache_calls(rng, tokens, [target, other], [1] * L, "decode B=2, split", split=True, caches=quantized_caches,
                 deterministic="batch_invariant")
    _cache_calls(rng, tokens, [target], _chunks(CHUNKS), "verify 2..32, B=1", split=False, caches=quantized_caches,
                 deterministic="batch_invariant")
    k_cache, v_cache, _ = _cache_calls(rng, tokens, [target], [L], "prefill, B=1", split=False, caches=quantized_caches,
                                       deterministic="batch_invariant")
    stored = (x.dequantize()[:, :L].transpose(0, 2, 1, 3) for x in (k_cache, v_cache))
    expected, expected_lse = attention_reference(target[0].transpose(1, 0, 2)[None], *stored, causal=True,
                                                 return_lse=True)
    (base_o, base_lse), *others = tokens.results.values()
    assert relative_l2(base_o, expected[0].transpose(1, 0, 2)) < 1e-5 and relative_l2(base_lse, expected_lse[0]) < 1e-5
    for name, (o, lse) in list(tokens.results.items())[1:]:
        assert np.array_equal(bits(o), bits(base_o)) and np.array_equal(bits(lse), bits(base_lse)), name


@pytest.mark.parametrize("dtype, d, window, with_sinks",
                         [(np.float16, 64, (37, -1), True), (np.float32, 16, (100, 0), False),
                          (np.float32, 256, None, False)],
                         ids=["float16-window-sinks", "float32-window", "float32-D256-paged-O"])
def test_windows_sinks_and_float16_keep_the_bits(rng, dtype, d, window, with_sinks):
    """Decoded token by token (split over threadgroups every other token) or prefilled: a
    window's first key is not a block's (the walk starts at the block grid), a sink starts the
    merged state; at D 256 the prefill pages O through threadgroup memory (and so the merged
    total), the decode packs heads with O in registers."""
    q, k, v = (x.astype(dtype)[None] for x in prompt(rng, d=d))
    options = dict(causal=True, window=window, return_lse=True, deterministic="batch_invariant",
                   sinks=rng.standard_normal(HQ).astype(np.float32) if with_sinks else None)
    prefill, lse = mfa_native.attention(q, k, v, layout="bshd", **options)
    expected, expected_lse = attention_reference(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), causal=True,
                                                 window=window, sinks=options["sinks"], return_lse=True)
    assert relative_l2(prefill.transpose(0, 2, 1, 3), expected) < 2e-3 and relative_l2(lse, expected_lse) < 1e-5
    k_cache, v_cache = (np.full((1, CAPACITY, HKV, d), np.nan, dtype) for _ in "kv")
    seqlens = np.zeros(1, np.int32)
    for t in range(L):
        with tuned_as(mfa_native.default_device(), parallel_threadgroups=64 if t % 2 else 1):
            o, lse_t = mfa_native.attention_with_kvcache(q[:, t:t + 1], k_cache, v_cache, cache_seqlens=seqlens,
                                                         k=k[:, t:t + 1], v=v[:, t:t + 1], **options)
        seqlens += 1
        assert np.array_equal(o[0, 0].view(np.uint16), prefill[0, t].view(np.uint16)), t
        assert np.array_equal(bits(lse_t[0, :, 0]), bits(lse[0, :, t])), t


def test_a_nan_key_makes_the_rows_that_see_it_nan(rng):
    """NaN propagates through the merges: in the one-pass kernel and through the split pair."""
    q, k, v = (x[None] for x in prompt(rng))
    k[0, 5, 0, 3] = np.nan   # kv head 0: query heads 0 and 1
    o, lse = mfa_native.attention(q, k, v, causal=True, layout="bshd", return_lse=True,
                                  deterministic="batch_invariant")
    assert np.isnan(o[0, 5:, :2]).all() and np.isnan(lse[0, :2, 5:]).all()
    assert np.isfinite(o[0, :5]).all() and np.isfinite(o[0, :, 2:]).all() and np.isfinite(lse[0, 2:]).all()
    k_cache, v_cache = (np.concatenate([x, np.zeros((1, CAPACITY - L, HKV, D), np.float32)], axis=1) for x in (k, v))
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=64):
        o, lse = mfa_native.attention_with_kvcache(q[:, -1:], k_cache, v_cache, cache_seqlens=np.array([L], np.int32),
                                                   causal=True, return_lse=True, deterministic="batch_invariant")
    assert np.isnan(o[0, 0, :2]).all() and np.isnan(lse[0, :2]).all() and np.isfinite(o[0, 0, 2:]).all()


def test_the_torch_face_takes_the_mode(rng):
    torch = pytest.importorskip("torch")
    import mfa_native.torch as mt

    q, k, v = (x.transpose(1, 0, 2)[None] for x in prompt(rng, 40))
    expected = mfa_native.attention(q, k, v, causal=True, deterministic="batch_invariant")
    o = mt.attention(*(torch.from_numpy(x) for x in (q, k, v)), causal=True, deterministic="batch_invariant")
    assert np.array_equal(bits(o.numpy()), bits(expected))


def test_the_mlx_cache_call_takes_the_mode(rng):
    mx = pytest.importorskip("mlx.core")
    import mfa_native.mlx as mm

    q, k, v = (x[None] for x in prompt(rng, 40))
    prefill = mfa_native.attention(q, k, v, causal=True, layout="bshd", deterministic="batch_invariant")
    k_cache, v_cache = (mx.array(np.concatenate([x[:, :39], np.zeros((1, 9, HKV, D), np.float32)], axis=1))
                        for x in (k, v))
    o = mm.attention_with_kvcache(mx.array(q[:, 39:]), k_cache, v_cache, cache_seqlens=mx.array([39], mx.int32),
                                  k=mx.array(k[:, 39:]), v=mx.array(v[:, 39:]), causal=True,
                                  deterministic="batch_invariant")
    assert np.array_equal(bits(np.array(o)[0, 0]), bits(prefill[0, 39]))


def test_calls_in_and_out_of_the_mode_keep_their_own_passes(rng):
    """The option is part of a call's signature: alternating calls of one shape take each mode's
    pass again (a split decode, whose bits the mode changes here)."""
    q = rng.standard_normal((2, 1, HQ, D)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((2, CAPACITY, HKV, D)).astype(np.float32) for _ in "kv")
    results = []
    for mode in (False, "batch_invariant", False, "batch_invariant"):
        with tuned_as(mfa_native.default_device(), parallel_threadgroups=64):
            results.append(bits(mfa_native.attention_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=np.array([L, CAPACITY - 12], np.int32), causal=True,
                deterministic=mode)))
    assert not np.array_equal(results[0], results[1])
    assert np.array_equal(results[0], results[2]) and np.array_equal(results[1], results[3])


@pytest.mark.parametrize("deterministic", [False, True, "batch_invariant"])
def test_the_option_is_part_of_the_call(rng, deterministic):
    q, k, v = (x.transpose(1, 0, 2)[None] for x in prompt(rng, 24))
    o = mfa_native.attention(q, k, v, causal=True, deterministic=deterministic)
    assert relative_l2(o, attention_reference(q, k, v, causal=True)) < 1e-5


@pytest.mark.parametrize("bad", ["batch-invariant", 1, None])
def test_a_bad_mode_is_refused(rng, bad):
    q = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="deterministic"):
        mfa_native.attention(q, q, q, deterministic=bad)
