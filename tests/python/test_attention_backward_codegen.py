"""Backward code generation without running anything: MSL rules, bindings, literals, tables."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_codegen import UNSUFFIXED_FLOAT, code_of, kernel_of, signature_buffers

from mfa_native import codegen
from mfa_native.codegen import AttentionBackwardProblem, AttentionProblem, attention_backward_pass, describe_backward
from mfa_native.codegen.attention.stage_sizes import ITEM_BYTES, STAGE_BYTES
from mfa_native.codegen.kernel.msl import float_literal
from mfa_native.codegen.kernel.products import threadgroup_bytes
from mfa_native.codegen.kernel.tables import BACKWARD_TABLES, backward_tile_row

PROBLEMS = [
    AttentionProblem(1, 4, 4, 64, 64, 64, 64),
    AttentionProblem(2, 8, 2, 100, 130, 72, 40, dtype="float16", layout="bshd", causal="lower_right",
                     mask="additive", mask_dtype="bfloat16", sinks=True, window=(5, -1)),
    AttentionProblem(1, 3, 1, 9, 17, 33, 7, dtype="bfloat16", causal="upper_left", mask="bool", scale=0.3),
    AttentionProblem(1, 2, 2, 1, 4096, 256, 256, window=(-1, 2)),
]


def small(**changes) -> AttentionBackwardProblem:
    base = dict(batch=1, q_heads=2, kv_heads=2, q_len=40, kv_len=56, head_dim=64, value_dim=64)
    return AttentionBackwardProblem(AttentionProblem(**{**base, **changes}))


def sources(problem: AttentionBackwardProblem, **kwargs) -> tuple[str, ...]:
    """The MSL of the pass's kernels: dQ, dK/dV and, with sinks, dsinks."""
    return tuple(kernel.source for kernel in attention_backward_pass(problem, **kwargs).kernels)


@pytest.mark.parametrize("forward", PROBLEMS)
def test_generated_msl_follows_the_rules(forward):
    for source in sources(AttentionBackwardProblem(forward))[:2]:
        code = code_of(source)
        assert UNSUFFIXED_FLOAT.findall(code) == []
        assert source.count("#include <metal_stdlib>") == 1 and "using namespace metal;" in source
        assert "__asm" not in code and "__metal" not in code and "atomic" not in code
        assert "return" not in kernel_of(code)  # no early exit: every lane reaches every collective
        assert "const uint tr = (lane / 16) * 4 + (lane / 2) % 4;" in source
        assert "const uint tc = ((lane / 4) & 2) * 2 + (lane % 2) * 2;" in source
        assert float_literal(np.float32(forward.softmax_scale * np.log2(np.e))) in source  # P = exp2(S * this - lse2)
        assert float_literal(np.float32(forward.softmax_scale)) in source                # dQ, dK = scale * ...


@pytest.mark.parametrize("forward", PROBLEMS)
def test_buffer_indices_come_from_the_plan_only(forward):
    backward = attention_backward_pass(AttentionBackwardProblem(forward))
    dq, dkdv, *dsinks = backward.kernels
    assert [k.entry for k in backward.kernels] == [codegen.DQ_KERNEL_NAME, codegen.DKDV_KERNEL_NAME] + \
        ([codegen.DSINKS_KERNEL_NAME] if forward.sinks else [])
    for kernel in backward.kernels:
        assert signature_buffers(kernel.source) == list(enumerate(kernel.buffers))
    for kernel in (dq, dkdv):
        assert kernel.buffers[:5] == ("q", "k", "v", "dout", "lse") and kernel.buffers[-1] == "sizes"
        assert ("mask" in kernel.buffers) == (forward.mask != "none")
    assert {"o", "dq", "delta"} <= set(dq.buffers)
    assert ("sinks" in dq.buffers) == ("sink_grad" in dq.buffers) == forward.sinks
    assert {"dk", "dv", "delta"} <= set(dkdv.buffers)
    # D = rowsum(dO o O): one float per (batch, head, row), written by dQ and read by dK/dV.
    rows = forward.batch * forward.q_heads * forward.q_len
    delta = backward.buffer("delta")
    assert (delta.role, delta.dtype, delta.shape, delta.writers, delta.readers) == \
        ("intermediate", "float32", (rows,), (0,), (1,))
    if forward.sinks:  # each row's share of dsinks: written by dQ, summed on the device by the third kernel
        share = backward.buffer("sink_grad")
        assert (share.role, share.shape, share.writers, share.readers) == ("intermediate", (rows,), (0,), (2,))
        assert backward.buffer("dsinks").role == "output" and backward.buffer("dsinks").shape == (forward.q_heads,)


def test_lengths_are_runtime_values_unless_baked():
    a, b = small(q_len=40, kv_len=56), small(q_len=100, kv_len=300, batch=3)
    assert sources(a) == sources(b)
    baked = sources(a, bake_lengths=True)
    assert all("const uint R = 40u;" in s and "const uint C = 56u;" in s for s in baked)
    assert baked != sources(b, bake_lengths=True)


def test_grids_cover_query_blocks_and_key_blocks():
    problem = small(q_heads=8, kv_heads=2, q_len=100, kv_len=130, batch=3)
    backward = attention_backward_pass(problem)
    descriptor = describe_backward(problem)
    dq, dkdv = backward.kernels
    assert dq.threadgroups == (-(-100 // descriptor.query_rows), 8, 3)
    assert dkdv.threadgroups == (-(-130 // descriptor.key_rows), 2, 3)  # one per kv head
    assert dq.threads_per_threadgroup == (4 * descriptor.query_rows, 1, 1)  # a simdgroup per 8 rows
    assert dkdv.threads_per_threadgroup == (4 * descriptor.key_rows, 1, 1)


def test_gqa_group_is_summed_in_one_kernel():
    _, dkdv = sources(small(q_heads=8, kv_heads=2))[:2]
    assert "for (uint g = 0; g < 4; ++g) {" in dkdv and "const uint h = h_kv * 4 + g;" in dkdv
    _, dkdv = sources(small())
    assert "const uint h = h_kv;" in dkdv and "for (uint g" not in dkdv


def test_flags_and_strides_become_literals():
    dq, dkdv = sources(small(causal="lower_right", window=(16, 3)))
    assert "key <= int(row) + diagonal" in dq and "key >= int(row) + diagonal - 16" in dq
    assert "int(key_row) <= query + diagonal" in dkdv and "int(key_row) >= query + diagonal - 16" in dkdv
    assert "query_begin = max(query_begin, int(key_first) - diagonal);" in dkdv            # causal
    assert "query_end = min(query_end, key_last - diagonal + 17);" in dkdv                 # window, left
    assert "query_begin = max(query_begin, int(key_first) - diagonal - 3);" in dkdv        # window, right
    assert "query_begin = max(query_begin, int(key_first));" in sources(small(causal="upper_left"))[1]
    plain = [code_of(s) for s in sources(small())]
    assert all("diagonal" not in s and "mask" not in s and "sink" not in s for s in plain)
    # o and dO with their own strides: 80 elements between rows instead of 64.
    problem = AttentionBackwardProblem(small().forward, o_strides=(2 * 40 * 80, 40 * 80, 80, 1))
    dq, _ = sources(problem)
    assert "o_head = o + (ulong(b) * Hq * R * 80 + ulong(h) * R * 80);" in dq and "ulong(row_read) * 80 + col" in dq
    assert "dout_head = dout + (ulong(b) * Hq * R * 64 + ulong(h) * R * 64);" in dq


def test_broadcast_mask_axes_are_read_with_stride_zero():
    # An (R, C) mask broadcast over batch and heads, read per key by dK/dV.
    _, dkdv = sources(small(batch=2, mask="bool", mask_strides=(0, 0, 56, 1)))
    assert "device const uchar* mask_key = mask + (ulong(key_read));" in dkdv
    assert "mask_key[ulong(min(query, int(R) - 1)) * C]" in dkdv
    # A key-padding mask (B, 1, 1, C): no query term.
    _, dkdv = sources(small(batch=2, mask="additive", mask_strides=(56, 0, 0, 1)))
    assert "mask_key = mask + (ulong(b) * C + ulong(key_read));" in dkdv and "mask_key[0]" in dkdv


def test_backward_tile_tables():
    for rows in BACKWARD_TABLES.values():
        assert [r.max_head_dim for r in rows] == sorted(r.max_head_dim for r in rows)
        assert rows[-1].max_head_dim == codegen.MAX_HEAD_DIM
        for row in rows:
            assert all(n % 8 == 0 for n in (row.query_rows, row.key_block, row.key_rows, row.query_block))
    for family, dtype in itertools.product(codegen.FAMILIES, ("float32", "float16", "bfloat16")):
        row = backward_tile_row(family, dtype, 100)
        d = describe_backward(small(head_dim=100, value_dim=64, q_len=4096, kv_len=4096, dtype=dtype), family=family)
        caches = ("cache_q", "cache_dout", "cache_k", "cache_v")
        # A staged block is as many of the row's rows as the stage holds (K and V, or Q and dO:
        # 100 + 64 features), beside the tensor-op products' memory (apple10).
        item = ITEM_BYTES[dtype]

        def staged(block: int, rows: int) -> int:
            rows *= row.tensor_ops
            return max(n for n in range(8, block + 1, 8)
                       if n * 164 * item + threadgroup_bytes(rows, n, item) <= STAGE_BYTES)

        assert (d.query_rows, d.key_block, d.key_rows, d.query_block) == (
            row.query_rows, staged(row.key_block, row.query_rows) if d.stage_kv else row.key_block,
            row.key_rows, staged(row.query_block, row.key_rows) if d.stage_q_dout else row.query_block)
        assert [getattr(d, c) for c in caches] == [getattr(row, c) for c in caches]
    short = describe_backward(small(q_len=3, kv_len=5))
    assert short.query_rows == short.key_rows == 8  # one simdgroup when the sequence is that short
    with pytest.raises(ValueError, match="577"):
        describe_backward(small(head_dim=577))


def test_emit_backward_prints_both_kernels_and_their_plans(capsys):
    from mfa_native.__main__ import main as cli_main

    assert cli_main(["emit", "attention", "--head-dim", "64", "--causal", "lower_right", "--backward"]) == 0
    out = capsys.readouterr().out
    assert "kernel void attention_backward_dq(" in out and "kernel void attention_backward_dkdv(" in out
    assert cli_main(["emit", "attention", "--head-dim", "64", "--backward", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "kernel attention_backward_dq:" in out and "[[buffer(7)]] delta: intermediate float32 (128,)" in out
