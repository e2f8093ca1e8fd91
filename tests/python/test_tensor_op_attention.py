"""Attention whose products are Metal 4 tensor ops (family apple10, the tile tables' tensor_ops
column; codegen/kernel/products.py), run on the cpu backend's shim against the float64
references: float32, float16, bfloat16, D != Dv, odd widths, causal (both alignments), window,
bool and additive masks, sinks, GQA, one query row to many, the split-KV partial kernel, a paged
KV cache, paged O. Outputs start poisoned (conftest).

This process runs under one cooperative-tensor layout (MFA_NATIVE_SHIM_LAYOUT_SEED, default 0);
`test_every_case_holds_under_other_layouts` (the exhaustive step) reruns the file under seed 6,
and ctest's TensorOps suites run the shim's products under seeds 1 and 6, so no kernel can
depend on which thread holds which element of a product."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import relative_l2
from test_attention import make_inputs
from test_attention import check as check_forward
from test_attention_backward import check as check_gradients
from test_head_dims import feature_arguments
from test_int8_attention import case_arguments as int8_arguments

import mfa_native
from mfa_native import codegen
from mfa_native.__main__ import main
from mfa_native.codegen.attention.descriptor import describe, describe_backward
from mfa_native.codegen.attention.rows import PACKED_HEADS
from mfa_native.codegen.kernel.products import TENSOR_OPS
from mfa_native.codegen.kernel.tables import built_in_row, forced_rows, table_family
from mfa_native.int8_reference import int8_attention_emulation
from mfa_native.reference import attention_reference, attention_with_kvcache_reference
from mfa_native.runtime.devices import tuned_as
from mfa_native.work import useful_matrix_ops

FAMILY = "apple10"
SEED = "MFA_NATIVE_SHIM_LAYOUT_SEED"
# The tensor-op path's tolerances (relative L2 against float64): the operands are the inputs'
# type, P rounded to it (as the simdgroup path's p16), products summed in float32.
# Measured here: float32 1.2e-7 .. 2.7e-7, float16 2.2e-4 .. 3.1e-4, bfloat16 1.9e-3 .. 2.5e-3
# (forward and every gradient), about a third of these.
TOLERANCE = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 6e-3}


@contextmanager
def apple10(forward: dict | None = None, backward: dict | None = None):
    """The default device runs as an M5 inside the block: apple10's tables, or its tensor-op rows
    with the `forward` and `backward` columns changed (for every head dimension)."""
    if forward is None and backward is None:
        with tuned_as(mfa_native.default_device(), family=FAMILY):
            yield FAMILY
        return
    rows = {direction: replace(built_in_row(direction, FAMILY, "float16", 64), **columns)
            for direction, columns in (("forward", forward), ("backward", backward)) if columns is not None}
    with forced_rows(FAMILY, **rows) as family, tuned_as(mfa_native.default_device(), family=family):
        yield family


def check(q, k, v, **kwargs):
    """attention (with lse) against the reference, to the tensor-op path's tolerances."""
    return check_forward(q, k, v, tolerances=TOLERANCE, **kwargs)


def check_backward(rng, q, k, v, **kwargs):
    """attention_backward's gradients (dsinks too) against the reference, to the path's tolerances."""
    return check_gradients(rng, q, k, v, tolerances=TOLERANCE, **kwargs)


def products(dtype: str, D: int, Dv: int, Hq: int, Hkv: int, R: int, C: int, family: str = FAMILY) -> str:
    """The products of the forward kernel of such a problem."""
    return describe(codegen.AttentionProblem(1, Hq, Hkv, R, C, D, Dv, dtype=dtype), family=family).products


def case_inputs(rng, case) -> tuple[tuple[np.ndarray, ...], dict]:
    """q, k, v and the keyword arguments (layout, fresh masks and sinks) of a case of CASES."""
    dtype, D, Dv, Hq, Hkv, R, C, layout, kwargs = case
    qkv = make_inputs(rng, Hq=Hq, Hkv=Hkv, R=R, C=C, D=D, Dv=Dv, dtype=dtype, layout=layout)
    return qkv, dict(layout=layout, **feature_arguments(rng, Hq, R, C, kwargs))


# (dtype, D, Dv, Hq, Hkv, R, C, layout, keyword arguments)
CASES = [
    ("float16", 64, 64, 2, 2, 40, 70, "bhsd", dict(causal=True)),
    ("bfloat16", 96, 80, 4, 2, 80, 33, "bshd", dict(causal="upper_left", sinks=True)),
    ("float32", 33, 17, 2, 1, 90, 90, "bhsd", dict(window=(7, 3), mask="bool")),
    ("float16", 128, 128, 2, 2, 1, 200, "bhsd", dict(mask="additive")),
    ("bfloat16", 256, 200, 1, 1, 24, 48, "bshd", dict()),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-D{c[1]}-Dv{c[2]}-R{c[5]}" for c in CASES])
def test_forward(rng, case):
    assert products(*case[:7]) == TENSOR_OPS
    (q, k, v), kwargs = case_inputs(rng, case)
    with apple10():
        check(q, k, v, **kwargs)


def backward_products(dtype: str, D: int, Dv: int, Hq: int, Hkv: int, R: int, C: int) -> str:
    """The products of the backward kernels of such a problem."""
    problem = codegen.AttentionProblem(1, Hq, Hkv, R, C, D, Dv, dtype=dtype)
    return describe_backward(codegen.AttentionBackwardProblem(problem), family=FAMILY).products


# (dtype, D, Dv, Hq, Hkv, R, C, layout, keyword arguments)
BACKWARD_CASES = [
    ("float16", 64, 64, 2, 2, 40, 70, "bhsd", dict(causal=True)),
    ("bfloat16", 96, 80, 4, 2, 33, 45, "bshd", dict(causal="upper_left", sinks=True)),
    ("float32", 33, 17, 2, 1, 29, 90, "bhsd", dict(window=(7, 3), mask="bool")),
    ("float16", 256, 128, 1, 1, 20, 24, "bhsd", dict(mask="additive")),
]


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=[f"{c[0]}-D{c[1]}-Dv{c[2]}" for c in BACKWARD_CASES])
def test_backward(rng, case):
    """dQ, dK, dV (and dsinks) whose both kernels' products are tensor ops."""
    assert backward_products(*case[:7]) == TENSOR_OPS
    (q, k, v), kwargs = case_inputs(rng, case)
    with apple10():
        check_backward(rng, q, k, v, **kwargs)


def test_the_kernels_are_tensor_op_kernels():
    """apple10's forward rows make tensor-op products, which stage their key blocks, and so do its
    backward rows up to head dim 256; wider backward heads and other families keep simdgroup
    matrices."""
    problem = codegen.AttentionProblem(1, 2, 2, 40, 70, 64, 64, dtype="float16")
    source = codegen.attention_source(problem, family=FAMILY)
    assert "mpp::tensor_ops::matmul2d<" in source and "#include <metal_tensor>" in source
    assert "simdgroup_multiply_accumulate" not in source and "k_stage" in source
    assert "matmul2d" not in codegen.attention_source(problem, family="apple9")
    assert products("float16", 576, 512, 1, 1, 8, 8) == TENSOR_OPS
    assert backward_products("float16", 256, 256, 1, 1, 8, 8) == TENSOR_OPS
    assert backward_products("float16", 576, 512, 1, 1, 8, 8) != TENSOR_OPS


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.exhaustive)])
def test_mla_head_dims(rng, dtype):
    """D 576 / Dv 512 (DeepSeek's MLA) through tensor ops: the forward's own row, and the
    backward's tensor-op row forced (its table keeps simdgroup matrices there)."""
    q, k, v = make_inputs(rng, Hq=1, Hkv=1, R=12, C=40, D=576, Dv=512, dtype=dtype)
    with apple10():
        check(q, k, v, causal=True)
    staged = dict(query_rows=8, key_rows=8, key_block=16, query_block=16, stage_kv=True, stage_q_dout=True)
    with apple10(backward=staged) as family:
        problem = codegen.AttentionBackwardProblem(codegen.AttentionProblem(1, 1, 1, 12, 40, 576, 512, dtype=dtype))
        assert describe_backward(problem, family=family).products == TENSOR_OPS
        check_backward(rng, q, k, v, causal=True)


@pytest.mark.parametrize("columns", [dict(query_rows=32, key_block=32), dict(query_rows=8, stage_apart=True),
                                     dict(o_block=16, key_block=128)], ids=["rows32", "rows8-apart", "paged-o"])
def test_other_tiles(rng, columns):
    """Other rows of the tensor-op column: four simdgroups, one (its own product scope), K and V
    taking turns in the stage, O paged through threadgroup memory."""
    q, k, v = make_inputs(rng, Hq=2, Hkv=2, R=37, C=150, D=72, Dv=48, dtype="float16")
    with apple10(forward=columns) as family:
        assert products("float16", 72, 48, 2, 2, 37, 150, family) == TENSOR_OPS
        check(q, k, v, causal=True, sinks=rng.standard_normal(2).astype(np.float32))


def test_split_kv_decode_and_a_paged_cache(rng):
    """The split-KV partial kernel's products are tensor ops too; a paged cache's rows reach them
    through the stage."""
    q, k, v = make_inputs(rng, Hq=2, Hkv=2, R=3, C=900, D=64, dtype="bfloat16")
    with apple10(), tuned_as(mfa_native.default_device(), parallel_threadgroups=64):
        check(q, k, v, causal=True)
    B, Hkv, D, page, pages = 2, 2, 64, 16, 12
    k_cache = rng.standard_normal((pages, page, Hkv, D)).astype(np.float16)
    v_cache = rng.standard_normal((pages, page, Hkv, D)).astype(np.float16)
    table = rng.permutation(pages).reshape(B, pages // B).astype(np.int32)
    lengths = np.array([70, 95], np.int32)
    q = rng.standard_normal((B, 5, Hkv, D)).astype(np.float16)
    with apple10():
        out = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table,
                                                causal=True)
    expected = attention_with_kvcache_reference(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table,
                                                causal=True)
    assert relative_l2(out, expected) < TOLERANCE["float16"]


def under_other_layouts(*arguments: str) -> None:
    """pytest `arguments` (this file, node ids, -m) again in a child process under another
    cooperative-tensor layout (the shim's seed 6; ctest's TensorOps suites run seeds 1 and 6);
    skipped in such a child."""
    if os.environ.get(SEED, "0") != "0":
        pytest.skip("this process already runs under another layout")
    if mfa_native.default_device().kind != "cpu":
        pytest.skip("layouts are the cpu shim's: Metal has its own")
    root = Path(__file__).resolve().parents[2]
    for seed in ("6",):
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *arguments],
                                cwd=root, env=dict(os.environ, **{SEED: seed}), capture_output=True, text=True,
                                timeout=1200)
        assert result.returncode == 0 and " passed" in result.stdout, result.stdout[-3000:]


@pytest.mark.exhaustive   # the default run checks layouts through ctest's TensorOps suites (seeds 1 and 6)
def test_every_case_holds_under_other_layouts():
    """Every case of this file, the exhaustive ones too, under another layout."""
    under_other_layouts(__file__, "-m", "not slow")


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_long_queries(rng, dtype):
    """R = 4096 (256 threadgroups of 16 rows), causal, forward and backward."""
    q, k, v = make_inputs(rng, Hq=1, Hkv=1, R=4096, C=160, D=64, dtype=dtype)
    with apple10():
        check(q, k, v, causal=True)
        check_backward(rng, q, k, v, causal=True)


def test_a_device_runs_apple10_rows_only_with_tensor_ops():
    """An M5 before macOS 26.2 (or with MFA_NATIVE_TENSOR_OPS=off) runs apple9's simdgroup rows;
    any device with tensor ops (the cpu device under MFA_NATIVE_TENSOR_OPS=on) runs apple10's."""
    assert table_family("apple10", True) == table_family("apple9", True) == FAMILY
    assert table_family("apple10", False) == "apple9"
    assert table_family("apple7", False) == "apple7"


def issued_work(q, k, v, backward: bool = False, **kwargs) -> list[int]:
    """simdgroup_matrix_ops of each dispatch of a forward (and backward) call."""
    with mfa_native.profile() as prof:
        out, lse = mfa_native.attention(q, k, v, return_lse=True, **kwargs)
        if backward:
            mfa_native.attention_backward(q, k, v, out, lse, out, **kwargs)
    return [record.simdgroup_matrix_ops for record in prof.records]


@pytest.mark.parametrize("kwargs", [pytest.param(dict(), marks=pytest.mark.exhaustive), dict(causal=True),
                                    pytest.param(dict(window=(20, 5)), marks=pytest.mark.exhaustive)],
                         ids=["dense", "causal", "window"])
def test_issued_work_is_the_staged_simdgroup_paths(rng, kwargs):
    """A tensor-op kernel issues what a simdgroup kernel staging the same blocks issues, forward
    and backward (each product as wide as the step's key tiles, K from the operand); without a
    mask on full tiles that is the useful minimum."""
    if mfa_native.default_device().kind != "cpu":
        pytest.skip("only the cpu backend counts the work a dispatch issues")
    q, k, v = make_inputs(rng, Hq=2, Hkv=2, R=48, C=136, D=40, Dv=24, dtype="float16")
    tiles = dict(query_rows=16, key_block=64, stage_kv=True, cache_q=False)
    backward_tiles = dict(query_rows=16, key_rows=16, key_block=64, query_block=64, stage_kv=True,
                          stage_q_dout=True)
    counts = {}
    for tensor in (True, False):
        with apple10(forward=dict(tiles, tensor_ops=tensor), backward=dict(backward_tiles, tensor_ops=tensor)):
            counts[tensor] = issued_work(q, k, v, backward=True, **kwargs)
    assert counts[True] == counts[False]
    if not kwargs:   # full tiles: the staged path's work is the useful minimum
        assert counts[True][0] == useful_matrix_ops(1, 2, 48, 136, 40, 24)


INT8_CASES = [(dict(causal=True), dict(qk_scale="token", smooth_k=True, pv="int8")),
              (dict(dims=dict(Hq=4, Hkv=2, D=72, Dv=40, R=33, C=129), mask="additive", sinks=True),
               dict(qk_scale="tile", smooth_k=False, pv="int8")),
              (dict(window=(30, 2), layout="bshd"), dict(qk_scale="token", smooth_k=True, pv="float"))]


@pytest.mark.parametrize("case, options", INT8_CASES, ids=["causal", "mask-sinks", "window-pv-float"])
def test_int8_products_are_exact(rng, capsys, case, options):
    """int8 attention's integer products as tensor ops (int8 operands, int32 sums) give the
    simdgroup path's bits exactly, and the numpy emulation of the pipeline."""
    (q, k, v), kwargs = int8_arguments(rng, case)
    with apple10():
        out, lse = mfa_native.int8_attention(q, k, v, return_lse=True, **options, **kwargs)
    with tuned_as(mfa_native.default_device(), family="apple9"):
        simdgroup_out, simdgroup_lse = mfa_native.int8_attention(q, k, v, return_lse=True, **options, **kwargs)
    np.testing.assert_array_equal(out, simdgroup_out)
    np.testing.assert_array_equal(lse, simdgroup_lse)
    expected = int8_attention_emulation(q, k, v, **options, **kwargs)
    assert relative_l2(out, expected) <= 1e-4
    emitted = ["emit", "int8-attention", "--head-dim", str(q.shape[-1]), "--pv", options["pv"], "--family", FAMILY]
    assert main(emitted) == 0 and "mpp::tensor_ops::matmul2d<" in capsys.readouterr().out


@pytest.mark.parametrize("dtype, Hq, R, quantized", [("float16", 8, 1, False), ("bfloat16", 8, 4, False),
                                                     ("float16", 4, 1, True)],
                         ids=["decode", "speculative", "q8_0-cache"])
def test_packed_heads_decode(rng, capsys, dtype, Hq, R, quantized):
    """Grouped-query decode packs the (query, head) pairs of a kv head as rows; their Q rows are
    staged once for the tensor-op products. A q8_0 cache (always packed) decodes into the stage."""
    q, k, v = make_inputs(rng, Hq=Hq, Hkv=2, R=R, C=300, D=64, Dv=32, dtype=dtype)
    emitted = ["emit", "attention", "--head-dim", "64", "--value-dim", "32", "--dtype", dtype, "--q-heads", str(Hq),
               "--kv-heads", "2", "--q-len", str(R), "--kv-len", "300", "--family", FAMILY]
    assert main(emitted) == 0
    source = capsys.readouterr().out
    assert "(query, head) pairs" in source and "mpp::tensor_ops::matmul2d<" in source and "q_pairs" in source
    # A quantized cache always packs; the storage does not enter the products' choice.
    assert PACKED_HEADS.products(codegen.AttentionProblem(1, Hq, 2, R, 300, 64, 32, dtype=dtype), FAMILY) == TENSOR_OPS
    sinks = rng.standard_normal(Hq).astype(np.float32)
    with apple10():
        if not quantized:
            check(q, k, v, causal=True, sinks=sinks)
            return
        k_cache, v_cache = (mfa_native.quantize(x, format="q8_0") for x in (k, v))
        out = mfa_native.attention(q, k_cache, v_cache, sinks=sinks)
    expected = attention_reference(q, k_cache.dequantize().astype(q.dtype), v_cache.dequantize().astype(q.dtype),
                                   sinks=sinks)
    assert relative_l2(out, expected) < TOLERANCE[dtype]
