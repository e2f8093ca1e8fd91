"""Head dimensions 257..576 (D and Dv independently), forward and backward, dense and
sparse-indexed, against the float64 references: odd widths (partial tiles), D != Dv, the
three dtypes, causal, masks, sinks, GQA (packed-heads decode, whose staged K and V rows take
turns in one buffer at this size), and MLA's shared latent (v = k[..., :512], D 576) with many
query heads on one kv head. DeepSeek's full sparse shape (128 heads, D 576, Dv 512, topk
2048) is built and checked for threadgroup memory and buffer sizes, and run small. Every
output starts poisoned (conftest). Sizes stay small: the cpu backend runs these kernels."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import relative_l2
from test_attention import DTYPES, TOLERANCE, make_inputs
from test_attention import check as check_forward
from test_attention_backward import check as check_backward
from test_sparse import check as check_sparse
from test_sparse import lists

import mfa_native
from mfa_native import codegen
from mfa_native.reference import sparse_attention_backward_reference

THREADGROUP_BYTES = 32 * 1024   # every Apple GPU's threadgroup memory
ITEM = {"float": 4, "half": 2, "bfloat": 2, "int": 4, "uint": 4}

# (D, Dv, dtype, Hq, Hkv, R, C, keyword arguments)
FORWARD = [
    (264, 264, "float32", 2, 2, 9, 20, dict(causal=True)),
    (300, 300, "float16", 2, 1, 5, 17, dict(mask="bool")),
    (384, 384, "bfloat16", 4, 2, 6, 13, dict(sinks=True)),
    (512, 512, "float32", 4, 1, 1, 40, {}),                      # packed decode, K then V staged
    (576, 512, "float16", 4, 1, 3, 24, dict(causal=True)),       # packed heads, MLA's widths
    (576, 576, "float32", 8, 1, 2, 19, dict(sinks=True)),        # the widest stage: 8 rows x 576 floats
    (257, 100, "float32", 2, 2, 7, 11, dict(mask="additive")),
    (40, 333, "bfloat16", 2, 2, 4, 9, dict(causal=True)),
]


def feature_arguments(rng, Hq, R, C, kwargs):
    """A case's keyword arguments with its features' arrays made: sinks (Hq,), a bool mask
    (R, C) or an additive one (Hq, R, C), fresh random values."""
    kwargs = dict(kwargs)
    if kwargs.get("sinks"):
        kwargs["sinks"] = rng.standard_normal(Hq).astype(np.float32)
    if kwargs.get("mask") == "bool":
        kwargs["mask"] = rng.random((R, C)) > 0.3
    elif kwargs.get("mask") == "additive":
        kwargs["mask"] = rng.standard_normal((Hq, R, C)).astype(np.float32)
    return kwargs


@pytest.mark.parametrize("case", FORWARD, ids=[f"D{c[0]}-Dv{c[1]}-{c[2]}" for c in FORWARD])
def test_forward(rng, case):
    D, Dv, dtype, Hq, Hkv, R, C, kwargs = case
    q, k, v = make_inputs(rng, Hq=Hq, Hkv=Hkv, R=R, C=C, D=D, Dv=Dv, dtype=dtype)
    check_forward(q, k, v, **feature_arguments(rng, Hq, R, C, kwargs))


def test_paged_output_and_split_kv_decode(rng):
    """Per-head kernels page O through threadgroup memory (o_block) where the row says so
    (past 256 always; at 576 one simdgroup's 8 rows x Dv floats, within 32 KiB), and keep it
    in registers where MFA caches it; the split-KV partial kernel pages it too, and the
    backward kernels page dQ and dK (dq_block, dk_block)."""
    from test_attention import tuned_as

    p = codegen.AttentionProblem(1, 2, 2, 4096, 4096, 576, 576)
    (kernel,) = codegen.attention_pass(p).kernels
    assert "o_tile_page[4608]" in kernel.source and threadgroup_bytes(kernel.source) == 8 * 576 * 4
    for D, paged in ((128, False), (256, True)):   # float32 apple9: MFA caches O up to 192
        source = codegen.attention_pass(codegen.AttentionProblem(1, 2, 2, 64, 64, D, D)).kernels[0].source
        assert ("o_tile_page" in source) == paged, D
    dq, dkdv = codegen.attention_backward_pass(codegen.AttentionBackwardProblem(
        codegen.AttentionProblem(1, 2, 2, 4096, 4096, 576, 512))).kernels
    assert "dq_tile_page[4608]" in dq.source and threadgroup_bytes(dq.source) == 8 * 576 * 4
    assert "dk_tile_page[4608]" in dkdv.source and "dv_tile_page" not in dkdv.source   # dV stays in registers
    assert threadgroup_bytes(dkdv.source) == 8 * 576 * 4
    q, k, v = make_inputs(rng, Hq=2, Hkv=2, R=1, C=700, D=320, Dv=400)
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=64), mfa_native.profile() as prof:
        check_forward(q, k, v, sinks=rng.standard_normal(2).astype(np.float32))
    assert [r.kernel for r in prof.records] == [codegen.PARTIAL_KERNEL_NAME, codegen.COMBINE_KERNEL_NAME]


BACKWARD = [
    (264, 264, "float32", 2, 2, 9, 11, dict(causal=True)),
    (300, 200, "float16", 2, 1, 5, 9, dict(sinks=True)),
    (384, 384, "bfloat16", 2, 2, 4, 8, dict(mask="bool")),
    (576, 512, "float32", 2, 1, 3, 10, dict(causal=True)),
]


@pytest.mark.parametrize("case", BACKWARD, ids=[f"D{c[0]}-Dv{c[1]}-{c[2]}" for c in BACKWARD])
def test_backward(rng, case):
    D, Dv, dtype, Hq, Hkv, R, C, kwargs = case
    q, k, v = make_inputs(rng, Hq=Hq, Hkv=Hkv, R=R, C=C, D=D, Dv=Dv, dtype=dtype)
    check_backward(rng, q, k, v, **feature_arguments(rng, Hq, R, C, kwargs))


# (D, Dv, dtype, Hq, R, C, topk, shared latent, keyword arguments); one kv head
SPARSE = [
    (576, 512, "float32", 16, 2, 40, 64, False, {}),             # K then V in one buffer
    (576, 512, "bfloat16", 16, 2, 300, 256, True, dict(sinks=True)),
    (576, 512, "float16", 32, 1, 90, 64, True, {}),
    (300, 264, "float16", 12, 3, 30, 24, False, dict(sinks=True)),
    (384, 384, "bfloat16", 8, 2, 50, 40, False, {}),
]


def _sparse(rng, case):
    D, Dv, dtype, Hq, R, C, topk, shared, kwargs = case
    q, k, v = make_inputs(rng, Hq=Hq, Hkv=1, R=R, C=C, D=D, Dv=Dv, dtype=dtype)
    if shared:
        v = k[..., :Dv]     # MLA: v is k's latent, used in place
    kwargs = dict(kwargs)
    if kwargs.get("sinks"):
        kwargs["sinks"] = rng.standard_normal(Hq).astype(np.float32)
    return q, k, v, lists(rng, 1, 1, R, topk, C), kwargs


def _ids(cases):
    return [f"D{c[0]}-Dv{c[1]}-{c[2]}-H{c[3]}-topk{c[6]}{'-mla' if c[7] else ''}" for c in cases]


@pytest.mark.parametrize("case", SPARSE, ids=_ids(SPARSE))
def test_sparse_forward(rng, case):
    q, k, v, indices, kwargs = _sparse(rng, case)
    check_sparse(q, k, v, indices, TOLERANCE[case[2]], **kwargs)


SPARSE_BACKWARD = [SPARSE[0], SPARSE[2], (576, 512, "float32", 16, 2, 70, 128, True, dict(sinks=True)),
                   SPARSE[3]]


@pytest.mark.parametrize("case", SPARSE_BACKWARD, ids=_ids(SPARSE_BACKWARD))
def test_sparse_backward(rng, case):
    q, k, v, indices, kwargs = _sparse(rng, case)
    o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True, **kwargs)
    do = rng.standard_normal(o.shape).astype(q.dtype)
    grads = mfa_native.sparse_attention_backward(q, k, v, indices, o, lse, do, **kwargs)
    expected = sparse_attention_backward_reference(q, k, np.ascontiguousarray(v), do, indices, out=o, **kwargs)
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    for grad, reference in zip(grads, expected):
        assert np.linalg.norm(grad.astype(np.float64) - reference) <= \
            10 * TOLERANCE[case[2]] * np.linalg.norm(reference) + 1e-5


def threadgroup_bytes(source: str) -> int:
    """Bytes of the threadgroup arrays a kernel declares."""
    return sum(ITEM[t] * int(n) for t, n in re.findall(r"threadgroup (\w+) \w+\[(\d+)\];", source))


def deepseek_problem(R: int, C: int, topk: int = 2048) -> codegen.AttentionProblem:
    """DeepSeek V3.2's sparse MLA: 128 query heads on one latent kv head, D 576, Dv 512 (v is
    k's first 512 features, so v has k's strides), bfloat16."""
    k_strides = codegen.contiguous_strides("bhsd", (1, 1, C, 576))
    lists_strides = codegen.contiguous_strides("bhsd", (1, 1, R, topk))
    return codegen.AttentionProblem(1, 128, 1, R, C, 576, 512, dtype="bfloat16", k_strides=k_strides,
                                    v_strides=k_strides, keys=codegen.TokenLists(topk, lists_strides, None, True))


def test_deepseek_shape_fits_threadgroup_memory_and_its_buffers():
    """Built and evaluated, not run: every kernel within 32 KiB of threadgroup memory, the
    stage holding K's rows only (v is k's latent), and buffers of exactly the shape's bytes."""
    R, C, topk = 4, 8192, 2048
    p = deepseek_problem(R, C, topk)
    forward = codegen.attention_pass(p)
    backward = codegen.attention_backward_pass(codegen.AttentionBackwardProblem(p))
    for launch in forward.kernels + backward.kernels:
        assert threadgroup_bytes(launch.source) <= THREADGROUP_BYTES, launch.entry
    (kernel,) = forward.kernels
    dkdv = [launch for launch in backward.kernels if launch.entry == "sparse_backward_dkdv"][0]
    assert threadgroup_bytes(dkdv.source) == 8 * 576 * 4   # dK paged, dV in registers
    assert "v_stage" not in kernel.source and threadgroup_bytes(kernel.source) == 16 * 576 * 2   # 16 K rows
    assert kernel.threadgroups == (R, 1, 1) and kernel.threads_per_threadgroup[0] == 32 * 128 // 8
    bf16 = 2
    assert forward.buffer("q").nbytes == 128 * R * 576 * bf16
    assert forward.buffer("k").nbytes == C * 576 * bf16
    assert forward.buffer("v").nbytes == (C - 1) * 576 * bf16 + 512 * bf16   # the latent view of k
    assert forward.buffer("o").nbytes == 128 * R * 512 * bf16
    assert forward.buffer("indices").nbytes == R * topk * 4
    assert backward.buffer("dq").nbytes == 128 * R * 576 * bf16
    assert backward.buffer("dk").nbytes == C * 576 * bf16 and backward.buffer("dv").nbytes == C * 512 * bf16
    assert backward.buffer("p_slots").nbytes == 128 * R * topk * 4


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_large_stages_fit_threadgroup_memory(dtype):
    """The widest rows any kernel stages, for every dtype and family: within 32 KiB."""
    lists_strides = codegen.contiguous_strides("bhsd", (1, 1, 1, 64))
    for family in ("apple7", "apple9"):
        for shared in (False, True):
            p = codegen.AttentionProblem(1, 16, 1, 1, 64, 576, 576 if not shared else 512, dtype=dtype,
                                         keys=codegen.TokenLists(64, lists_strides, None, shared))
            assert threadgroup_bytes(codegen.attention_pass(p, family=family).kernels[0].source) <= THREADGROUP_BYTES
        packed = codegen.AttentionProblem(1, 8, 1, 1, 64, 576, 576, dtype=dtype)
        assert threadgroup_bytes(codegen.attention_pass(packed, family=family).kernels[0].source) <= THREADGROUP_BYTES


def test_deepseek_shape_runs_small(rng):
    """The DeepSeek form at 128 heads, small: 2 queries, topk 64 of 80 latent rows."""
    R, C, topk = 2, 80, 64
    q, k, _ = make_inputs(rng, Hq=128, Hkv=1, R=R, C=C, D=576, dtype="bfloat16")
    v = k[..., :512]
    indices = lists(rng, 1, 1, R, topk, C)
    out, lse = check_sparse(q, k, v, indices, TOLERANCE["bfloat16"])
    assert out.shape == (1, 128, R, 512)


def test_head_dims_above_576_are_refused(rng):
    q, k, v = make_inputs(rng, R=2, C=3, D=577, Dv=8)
    with pytest.raises(ValueError, match="1..576"):
        mfa_native.attention(q, k, v)


def test_kernels_up_to_256_keep_their_tiles():
    """D <= 256 keeps its table rows: the large-head-dim row applies only past 256."""
    from mfa_native.codegen.kernel.tables import tile_row

    for family in ("apple7", "apple9"):
        for dtype in ("float32", "float16"):
            assert not tile_row(family, dtype, 256).stage_apart and tile_row(family, dtype, 257).stage_apart


BLOCK_SPARSE = [
    dict(dims=dict(R=20, C=40, D=320, Dv=264), blocks=(8, 16), full=True, given=False, kwargs=dict(causal=True)),
    dict(dims=dict(Hq=4, Hkv=2, R=9, C=30, D=576, Dv=512, dtype="bfloat16"), blocks=(8, 8), full=True, given=True,
         kwargs=dict(sinks=True)),
]


@pytest.mark.parametrize("case", BLOCK_SPARSE, ids=lambda c: f"D{c['dims']['D']}-Dv{c['dims']['Dv']}")
def test_block_sparse(rng, case):
    """Block lists at large head dimension, forward and backward (test_block_sparse's checks)."""
    from test_block_sparse import test_backward_matches_the_dense_reference, test_forward_matches_the_dense_reference

    test_forward_matches_the_dense_reference(rng, case)
    test_backward_matches_the_dense_reference(rng, case)


QUANTIZED = [
    dict(D=576, Dv=512, dtype="float32", Hq=4, Hkv=1, R=1, k_format=("affine", 4, 64), v_format=("q8_0", None, None)),
    dict(D=320, Dv=384, dtype="float16", Hq=4, Hkv=2, R=3, k_format=("q4_0", None, None), v_format=("affine", 8, 32)),
]


@pytest.mark.parametrize("case", QUANTIZED, ids=lambda c: f"D{c['D']}-Dv{c['Dv']}-{c['dtype']}")
def test_quantized_kv(rng, case):
    """Quantized K/V (packed heads; its decoded K and V rows take turns in the stage)."""
    from test_quantized_attention import check as check_quantized
    from test_quantized_attention import tensors

    q, k, v = tensors(rng, C=40, **case)
    check_quantized(q, k, v, causal=True)


def test_deepseek_form_backward_at_128_heads(rng):
    """The MLA form's gradients at 128 query heads (16 head tiles in the tiled dK/dV), small."""
    q, k, v, indices, kwargs = _sparse(rng, (576, 512, "float32", 128, 2, 40, 64, True, {}))
    o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True)
    do = rng.standard_normal(o.shape).astype(q.dtype)
    grads = mfa_native.sparse_attention_backward(q, k, v, indices, o, lse, do)
    expected = sparse_attention_backward_reference(q, k, np.ascontiguousarray(v), do, indices, out=o)
    for grad, reference in zip(grads, expected):
        assert relative_l2(grad, reference) < TOLERANCE["float32"]


def test_every_table_row_that_pages_fits_threadgroup_memory():
    """A row's pages (one simdgroup's 8 rows x max_head_dim floats each, per simdgroup of the
    threadgroup) fit 32 KiB: the forward's O, the dQ kernel's dQ, the dK/dV kernel's dK and dV."""
    from mfa_native.codegen.kernel.tables import BACKWARD_TABLES, TABLES

    page = lambda rows, block, width: (rows // 8) * 8 * width * 4 if block else 0   # noqa: E731
    for family, rows in TABLES.items():
        for row in rows:
            assert page(row.query_rows, row.o_block, row.max_head_dim) <= THREADGROUP_BYTES, (family, row)
    for family, rows in BACKWARD_TABLES.items():
        for row in rows:
            assert page(row.query_rows, row.dq_block, row.max_head_dim) <= THREADGROUP_BYTES, (family, row)
            assert page(row.key_rows, row.dk_block, row.max_head_dim) + \
                page(row.key_rows, row.dv_block, row.max_head_dim) <= THREADGROUP_BYTES, (family, row)


def test_the_apple7_rows(rng):
    """Apple7's 576 rows (16-key steps, paged O, dQ and dK) run and match too: forward,
    backward, packed decode and sparse-indexed."""
    from test_attention import tuned_as

    with tuned_as(mfa_native.default_device(), family="apple7"):
        q, k, v = make_inputs(rng, Hq=2, Hkv=1, R=9, C=21, D=400, Dv=312, dtype="float16")
        check_backward(rng, q, k, v, causal=True)
        q, k, v = make_inputs(rng, Hq=8, Hkv=1, R=1, C=30, D=576, Dv=512)
        check_forward(q, k, v)
        q, k, v, indices, kwargs = _sparse(rng, (576, 512, "bfloat16", 16, 2, 40, 32, True, {}))
        check_sparse(q, k, v, indices, TOLERANCE["bfloat16"])
