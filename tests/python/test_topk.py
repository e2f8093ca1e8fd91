"""The streaming indexer (`sparse_topk`) at lengths where its blocks, splits and merges
matter: results bit for bit equal to the float64 reference on small-integer inputs (exact
scores, many ties, NaNs), splits of the key range (forced with tuned_as), blocks that enter
the running list and blocks that are skipped, topk above C, device bytes written per call
and the memory of a pass at R = C = 32768, topk = 2048. Outputs are poisoned (conftest)."""

from __future__ import annotations

import numpy as np
import pytest

import mfa_native
from mfa_native.codegen.sparse import topk as codegen_topk
from mfa_native.codegen.sparse.topk_stream import BLOCK_KEYS, STREAM_THREADS, TOPK_LIMIT
from mfa_native.reference import sparse_topk_reference
from mfa_native.runtime.devices import tuned_as
from mfa_native.runtime.templates import evaluate

MANY = 64   # parallel threadgroups that make a few rows split their keys


def integer_inputs(rng, B, Hi, R, C, Di, dtype=np.float32, layout="bhsd"):
    """q, k, weights of small integers: every score exact in float32, many equal."""
    q = rng.integers(-2, 3, (B, Hi, R, Di)).astype(dtype)
    k = rng.integers(-1, 2, (B, 1, C, Di)).astype(dtype)
    w = rng.integers(1, 3, (B, Hi, R)).astype(np.float32)
    if layout == "bshd":
        q, k, w = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), w.transpose(0, 2, 1)
    return q, k, w


def exactly_as_numpy(q, k, w, topk, precision="float", **kwargs):
    indices, scores = mfa_native.sparse_topk(q, k, w, topk, return_scores=True, precision=precision, **kwargs)
    expected, expected_scores = sparse_topk_reference(q, k, w, topk, return_scores=True, **kwargs)
    np.testing.assert_array_equal(indices, expected)
    np.testing.assert_array_equal(scores, expected_scores)   # NaN where NaN, bit for bit elsewhere
    return indices


@pytest.mark.parametrize("case", [
    dict(B=1, Hi=3, R=3, C=2500, Di=8, topk=40),                                  # many blocks, ties
    dict(B=2, Hi=9, R=2, C=2100, Di=12, topk=300, causal=False),                 # topk above a block
    dict(B=1, Hi=2, R=4, C=700, Di=8, topk=900, layout="bshd"),                   # topk above C: pads
    dict(B=1, Hi=4, R=2, C=2300, Di=16, topk=64, dtype=np.float16),
    dict(B=1, Hi=4, R=1, C=2600, Di=8, topk=100, dtype="bfloat16", causal=False),
], ids=lambda c: f"C{c['C']}-topk{c['topk']}")
@pytest.mark.parametrize("splits", [False, True])
def test_the_stream_equals_numpy_bit_for_bit(rng, case, splits):
    case = dict(case)
    dtype = case.pop("dtype", np.float32)
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    topk, kwargs = case.pop("topk"), {n: case.pop(n) for n in ("causal", "layout") if n in case}
    q, k, w = integer_inputs(rng, **case, dtype=dtype, layout=kwargs.get("layout", "bhsd"))
    device = mfa_native.default_device()
    with tuned_as(device, parallel_threadgroups=MANY if splits else 1), mfa_native.profile() as prof:
        exactly_as_numpy(q, k, w, topk, **kwargs)
    stream = prof.records[0]
    assert stream.kernel == "sparse_topk_stream"
    long_rows = case["C"] >= 2 * codegen_topk.MIN_KEYS_PER_SPLIT
    assert (stream.threadgroups > case["B"] * case["R"]) == (splits and long_rows)   # a row over threadgroups


def test_deepseeks_indexer_shape_runs(rng):
    """DeepSeek V3.2's indexer: 64 heads of Di = 128, bfloat16, topk 2048 (here above C: pads)."""
    bfloat16 = pytest.importorskip("ml_dtypes").bfloat16
    q, k, w = integer_inputs(rng, B=1, Hi=64, R=2, C=1100, Di=128, dtype=bfloat16)
    indices = exactly_as_numpy(q, k, w, 2048)
    assert (indices[..., 1100:] == -1).all() and (np.sort(indices[0, 0, -1, :1100]) == np.arange(1100)).all()


@pytest.mark.parametrize("causal", [False, True])
def test_nan_scores_enter_first_from_any_block_and_split(rng, causal):
    """NaN keys in late blocks of every split still rank above every number (lower key first)."""
    q, k, w = integer_inputs(rng, 1, 3, 3, 2500, 8)
    for key in (3, 700, 1500, 2490, 2491):
        k[0, 0, key, key % 8] = np.nan
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=MANY):
        indices = exactly_as_numpy(q, k, w, 20, causal=causal)
    assert (indices[0, 0, -1, :5] == [3, 700, 1500, 2490, 2491]).all()


@pytest.mark.parametrize("direction", [1, -1])
def test_rising_and_falling_scores(rng, direction):
    """Rising scores: every block enters and pushes the last one out; falling scores: after
    the first blocks none enters (the skipped merge). Both give numpy's answer."""
    C = 6 * BLOCK_KEYS + 17
    q = np.ones((1, 1, 2, 8), np.float32)
    ramp = np.arange(C, dtype=np.float32)[::direction] % 4096 + rng.integers(0, 2, C)   # ties between neighbours
    k = np.zeros((1, 1, C, 8), np.float32)
    k[0, 0, :, 0] = ramp
    exactly_as_numpy(q, k, np.ones((1, 1, 2), np.float32), BLOCK_KEYS + 3, causal=False)


def test_a_long_row_keeps_2048(rng):
    """topk = TOPK_LIMIT over 8192 keys: the running list at its capacity, split and not."""
    q, k, w = integer_inputs(rng, 1, 4, 2, 8192, 8)
    exactly_as_numpy(q, k, w, TOPK_LIMIT)
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=MANY):
        exactly_as_numpy(q, k, w, TOPK_LIMIT, causal=False)


def test_random_normal_inputs_stay_within_the_tolerance(rng):
    q = rng.standard_normal((1, 5, 3, 24)).astype(np.float32)
    k = rng.standard_normal((1, 1, 1800, 24)).astype(np.float32)
    w = rng.standard_normal((1, 5, 3)).astype(np.float32)
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=MANY):
        indices, scores = mfa_native.sparse_topk(q, k, w, 200, return_scores=True)
    expected, expected_scores = sparse_topk_reference(q, k, w, 200, return_scores=True)
    np.testing.assert_array_equal(indices, expected)
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-4, atol=1e-4)


def test_device_bytes_written_do_not_grow_with_c(rng):
    """Each split writes its run of L entries and the merge the K outputs: nothing per key."""
    B, R, topk = 1, 3, 50
    for C, P in ((1100, 1), (4400, 1), (4400, MANY)):
        q, k, w = integer_inputs(rng, B, 2, R, C, 8)
        with tuned_as(mfa_native.default_device(), parallel_threadgroups=P), mfa_native.profile() as prof:
            mfa_native.sparse_topk(q, k, w, topk)
        written = prof.bytes_written
        if not written:
            pytest.skip("this backend does not count traffic")
        splits = prof.records[0].threadgroups // (B * R)
        assert splits == (1 if P == 1 else 4)
        assert sum(written.values()) == (splits + 1) * B * R * topk * 8   # the runs, then the output


def test_a_real_prefill_pass_allocates_no_scores_matrix():
    """R = C = 32768, topk = 2048 (Hi = 64, Di = 128): its buffers are bounded by the runs and
    outputs, (S + 1) * B * R * topk entries of 8 bytes with S <= 15; evaluated, not run."""
    B, R, C, topk = 1, 32768, 32768, 2048
    shape = dict(B=B, Hi=64, R=R, C=C, K=topk, Di=128)
    strides = dict(q=(64 * R * 128, R * 128, 128, 1), k=(C * 128, 0, 128, 1), weights=(64 * R, R, 1, 0))
    descriptor = codegen_topk.describe_topk(dtype="bfloat16", shape=shape, strides=strides, layout="bhsd", causal=True)
    template = codegen_topk.topk_template(descriptor)
    for P in (1, 4096):
        description = evaluate(template, dict(shape, P=P))
        allocated = sum(b.nbytes for b in description.buffers if b.role in ("intermediate", "output"))
        assert allocated <= 16 * B * R * topk * 8 + 64 * 1024
        assert max(b.nbytes for b in description.buffers) < B * R * C * 4


def test_a_decode_row_splits_its_keys_over_the_device():
    shape = dict(B=1, Hi=64, R=1, C=131072, K=2048, Di=128)
    strides = dict(q=(64 * 128, 128, 128, 1), k=(131072 * 128, 0, 128, 1), weights=(64, 1, 1, 0))
    descriptor = codegen_topk.describe_topk(dtype="float16", shape=shape, strides=strides, layout="bhsd", causal=True)
    description = evaluate(codegen_topk.topk_template(descriptor), dict(shape, P=256))
    assert description.kernels[0].threadgroups == (codegen_topk.MAX_SPLITS, 1, 1)


def test_the_running_list_fits_threadgroup_memory():
    """The stream kernel's threadgroup arrays: the list, the block and a flag per simdgroup."""
    used = TOPK_LIMIT * 8 + BLOCK_KEYS * 8 + STREAM_THREADS // 32 * 4
    assert used <= mfa_native.default_device().limits["max_threadgroup_memory"] and used <= 32 * 1024


def test_topk_above_the_limit_is_refused(rng):
    q, k, w = integer_inputs(rng, 1, 2, 1, TOPK_LIMIT + 1, 8)
    with pytest.raises(ValueError, match="topk is 2049"):
        mfa_native.sparse_topk(q, k, w, TOPK_LIMIT + 1)
    q, k, w = integer_inputs(rng, 1, 2, 1, 30, 8)
    assert (mfa_native.sparse_topk(q, k, w, TOPK_LIMIT + 1)[..., 30:] == -1).all()   # min(topk, C) counts


def _quantized(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 attention's per-token symmetric quantizer in numpy: float32 scale absmax / 127, the
    integer nearest the exact quotient (halfway to even), clamped to +-127."""
    scale = (np.abs(x.astype(np.float32)).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    ints = np.clip(np.rint(x.astype(np.float64) / np.where(scale > 0, scale, 1)), -127, 127)
    return np.where(scale > 0, ints, 0), scale.astype(np.float64)


def test_int8_scores_are_the_quantized_products(rng):
    """precision="int8": scores from per-token int8 q and k, integer products, dequantized by
    both scales; against a numpy emulation of the quantizer, and exactly the float result
    where quantizing is exact (every row's absmax 127, integer values)."""
    B, Hi, R, C, Di, topk = 1, 9, 3, 2300, 24, 64
    q = rng.standard_normal((B, Hi, R, Di)).astype(np.float16)
    k = rng.standard_normal((B, 1, C, Di)).astype(np.float16)
    w = rng.random((B, Hi, R)).astype(np.float32)
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=MANY):
        indices, scores = mfa_native.sparse_topk(q, k, w, topk, precision="int8", return_scores=True)
    (qi, qs), (ki, ks) = _quantized(q), _quantized(k)
    products = np.einsum("bhrd,bcd->bhrc", qi, ki[:, 0]) * qs * ks[:, 0, :, 0][:, None, None]
    emulated = np.einsum("bhr,bhrc->brc", w.astype(np.float64), np.maximum(products, 0.0))
    n = np.arange(R) + C - R + 1
    picked = np.take_along_axis(emulated[:, :, :], indices[:, 0].astype(np.int64), axis=-1)
    np.testing.assert_allclose(scores[:, 0], picked, rtol=1e-5)
    for r in range(R):   # the kept scores are the emulation's best of the row's candidates
        best = np.sort(emulated[0, r, :n[r]])[::-1][:topk]
        np.testing.assert_allclose(scores[0, 0, r], best, rtol=1e-5)
    float_indices = mfa_native.sparse_topk(q, k, w, topk)
    recall = np.mean([np.intersect1d(indices[0, 0, r], float_indices[0, 0, r]).size / topk for r in range(R)])
    assert recall > 0.9

    q = rng.integers(-127, 128, (B, Hi, R, Di)).astype(np.float32)
    k = rng.integers(-127, 128, (B, 1, C, Di)).astype(np.float32)
    q[..., 0], k[..., 1] = 127, -127
    exactly_as_numpy(q, k, rng.integers(1, 3, (B, Hi, R)).astype(np.float32), topk, precision="int8")


def test_precision_is_checked(rng):
    q, k, w = integer_inputs(rng, 1, 2, 1, 30, 8)
    with pytest.raises(ValueError, match="precision must be"):
        mfa_native.sparse_topk(q, k, w, 4, precision="int4")
