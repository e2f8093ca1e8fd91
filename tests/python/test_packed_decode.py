"""GQA decode with float K/V packs the query heads of a kv head as the rows of the tiles
(rows.PACKED_HEADS, chosen by kernel/packing.PACKING): each K/V row is read once per kv head
and each key tile costs ceil(R * ratio / 8) row tiles, in the one-pass and the split-KV
kernels, with every dense feature. Outputs are poisoned (conftest), so a row the packed
kernel never stores fails."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from test_attention import DTYPES, check, make_inputs

import mfa_native
from mfa_native import codegen
from mfa_native.runtime.devices import tuned_as
from mfa_native.runtime.templates import evaluate
from mfa_native.work import packed_matrix_ops

ONE_PASS, SPLIT = 1, 64   # parallel threadgroups the device is tuned as: no split, split-KV


def _profiled(q, k, v, parallel, **kwargs):
    """check() (output and lse against the float64 reference) on a device tuned to `parallel`
    threadgroups, and the profile of the call."""
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=parallel), mfa_native.profile() as prof:
        out = check(q, k, v, **kwargs)
    kernels = [r.kernel for r in prof.records]
    split = [codegen.PARTIAL_KERNEL_NAME, codegen.COMBINE_KERNEL_NAME]
    assert kernels == (split if parallel == SPLIT else [codegen.KERNEL_NAME]), kernels
    return out, prof


def _kv_bytes_read(prof) -> int:
    return prof.bytes_read.get("k", 0) + prof.bytes_read.get("v", 0)


@pytest.mark.parametrize("parallel", [ONE_PASS, SPLIT], ids=["one pass", "split"])
@pytest.mark.parametrize("heads", [(8, 2), (16, 2)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("R", [1, 4, 16])
def test_decode_reads_kv_once_per_group_and_issues_packed_tiles(rng, heads, R, parallel):
    Hq, Hkv = heads
    C, D = 512, 64
    q, k, v = make_inputs(rng, Hq=Hq, Hkv=Hkv, R=R, C=C, D=D, dtype="float16")
    _, prof = _profiled(q, k, v, parallel)
    assert _kv_bytes_read(prof) <= 1.05 * (k.nbytes + v.nbytes)   # every key is attended
    ratio = Hq // Hkv
    bound = Hkv * -(-R * ratio // 8) * (C // 8) * (D // 8 + D // 8)   # ceil(R * ratio / 8) tiles per key tile
    assert prof.simdgroup_matrix_ops <= bound
    assert prof.simdgroup_matrix_ops == packed_matrix_ops(1, Hkv, ratio, R, C, D, D)


def _sinks(rng, heads, infinite=False):
    sinks = rng.standard_normal(heads).astype(np.float32)
    if infinite:
        sinks[:2] = [-np.inf, np.inf]   # FlashMLA's: no sink, every weight
    return sinks


def _feature_kwargs(rng, name, B, Hq, R, C):
    """The keyword arguments of one feature case (masks and sinks drawn from rng)."""
    per_head = rng.random((B, Hq, R, C)) > 0.4
    per_head[0, 1, 0] = False   # a (query, head) row with no key
    additive = rng.standard_normal((B, Hq, R, C)).astype(np.float32)
    additive[0, 3, :, : C // 2] = -np.inf
    cases = {
        "causal lower right": dict(causal="lower_right"),
        "causal upper left": dict(causal="upper_left"),
        "bool mask (R, C)": dict(mask=rng.random((R, C)) > 0.5),
        "bool mask per head": dict(mask=per_head),
        "additive mask per head": dict(mask=additive),
        "additive key padding (B, 1, 1, C)": dict(mask=np.where(np.arange(C) < C - 100, 0.0, -np.inf)
                                                  .astype(np.float32)[None, None, None, :].repeat(B, 0)),
        "window": dict(window=(100, 0), causal=True),
        "window both sides": dict(window=(40, 3)),
        "sinks": dict(sinks=_sinks(rng, Hq)),
        "infinite sinks": dict(sinks=_sinks(rng, Hq, infinite=True), causal=True),
        "everything": dict(causal=True, window=(200, -1), mask=per_head, sinks=_sinks(rng, Hq), scale=0.3),
    }
    return cases[name]


FEATURES = ["causal lower right", "causal upper left", "bool mask (R, C)", "bool mask per head",
            "additive mask per head", "additive key padding (B, 1, 1, C)", "window", "window both sides", "sinks",
            "infinite sinks", "everything"]


@pytest.mark.parametrize("parallel", [ONE_PASS, SPLIT], ids=["one pass", "split"])
@pytest.mark.parametrize("feature", FEATURES)
def test_packed_decode_with_every_dense_feature(rng, feature, parallel):
    B, Hq, Hkv, R, C = 2, 8, 2, 3, 600
    q, k, v = make_inputs(rng, B=B, Hq=Hq, Hkv=Hkv, R=R, C=C, D=32, Dv=24)
    _, prof = _profiled(q, k, v, parallel, **_feature_kwargs(rng, feature, B, Hq, R, C))
    assert _kv_bytes_read(prof) <= 1.05 * (k.nbytes + v.nbytes)


@pytest.mark.parametrize("parallel", [ONE_PASS, SPLIT], ids=["one pass", "split"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_packed_decode_dtypes_layouts_and_value_dims(rng, dtype, layout, parallel):
    q, k, v = make_inputs(rng, Hq=6, Hkv=2, R=5, C=700, D=40, Dv=16, dtype=dtype, layout=layout)
    sinks = _sinks(rng, 6)
    _, prof = _profiled(q, k, v, parallel, layout=layout, causal=True, sinks=sinks)
    assert _kv_bytes_read(prof) <= 1.05 * (k.nbytes + v.nbytes)


def test_speculative_verification_of_32_queries(rng):
    """R = 32 at GQA ratio 4 fills 128 rows: one threadgroup per kv head, split-KV too."""
    q, k, v = make_inputs(rng, Hq=4, Hkv=1, R=32, C=640, D=16, dtype="bfloat16")
    for parallel in (ONE_PASS, SPLIT):
        _, prof = _profiled(q, k, v, parallel, causal=True)
        assert _kv_bytes_read(prof) <= 1.05 * (k.nbytes + v.nbytes)


def test_backward_after_a_packed_forward_stays_per_head(rng):
    q, k, v = make_inputs(rng, Hq=4, Hkv=2, R=2, C=70, D=16)
    out, lse = mfa_native.attention(q, k, v, causal=True, return_lse=True)
    do = rng.standard_normal(out.shape).astype(np.float32)
    grads = mfa_native.attention_backward(q, k, v, out, lse, do, causal=True)
    expected = mfa_native.reference.attention_backward_reference(q, k, v, do, causal=True, out=out)
    for grad, want in zip(grads, expected):
        assert relative_l2(grad, want) < 1e-4


def _problem(**sizes) -> codegen.AttentionProblem:
    dims = dict(batch=1, q_heads=8, kv_heads=2, q_len=1, kv_len=512, head_dim=64, value_dim=64, dtype="float16")
    return codegen.AttentionProblem(**{**dims, **sizes})


def test_the_packing_table_decides_the_rows():
    assert _problem().rows.packed and _problem(q_len=32).rows.packed        # 4 heads x 32 queries = 128
    assert not _problem(q_len=33).rows.packed                               # 132 pairs: per head
    assert not _problem(q_heads=2, kv_heads=2).rows.packed                  # MHA: nothing to share
    assert codegen.describe(_problem(q_len=4)).query_rows == 16             # 4 x 4 pairs, 2 tiles


def test_templates_hold_only_where_the_table_chose():
    packed = codegen.attention_template(_problem(q_len=32))
    with pytest.raises(ValueError, match=r"R \* 4 <= 128"):
        evaluate(packed, codegen.call_sizes(_problem(q_len=33)))
    per_head = codegen.attention_template(_problem(q_len=33))
    with pytest.raises(ValueError, match=r"!\(R \* 4 <= 128\)"):
        evaluate(per_head, codegen.call_sizes(_problem(q_len=32)))
    other = _problem(batch=3, q_heads=16, kv_heads=4, kv_len=999)
    assert evaluate(codegen.attention_template(_problem()), codegen.call_sizes(other)) == codegen.attention_pass(other)
