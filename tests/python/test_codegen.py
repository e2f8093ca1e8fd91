"""Code generation without running anything: descriptors, literals, bindings, tables, emit."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

import mfa_native
from mfa_native import codegen
from mfa_native.runtime.templates import PassTemplate
from mfa_native.__main__ import main as cli_main
from mfa_native.codegen import (AttentionProblem, attention_kernel, attention_pass, attention_source, describe,
                                kv_split, sizes_of)
from mfa_native.codegen.kernel.msl import float_literal
from mfa_native.codegen.kernel.tables import TABLES, tile_row
from mfa_native.codegen.attention.stage_sizes import ITEM_BYTES, STAGE_BYTES
from mfa_native.codegen.kernel.products import threadgroup_bytes

# A floating literal without its suffix: digits with a point or an exponent, not followed by f/h.
UNSUFFIXED_FLOAT = re.compile(r"(?<![\w.])(\d+\.\d*|\.\d+|\d+(?:\.\d*)?[eE][-+]?\d+)(?![\w.])")

PROBLEMS = [
    AttentionProblem(1, 4, 4, 64, 64, 64, 64),
    AttentionProblem(2, 8, 2, 100, 130, 72, 40, dtype="float16", layout="bshd", causal="lower_right",
                     mask="additive", mask_dtype="bfloat16", sinks=True, return_lse=True, window=(5, -1)),
    AttentionProblem(1, 3, 1, 9, 17, 33, 7, dtype="bfloat16", causal="upper_left", mask="bool", scale=0.3),
    AttentionProblem(1, 2, 2, 1, 4096, 256, 256, window=(-1, 2)),
]


def code_of(source: str) -> str:
    """The source without its comments."""
    return "\n".join(line.split("//")[0] for line in source.splitlines())


def kernel_of(code: str) -> str:
    """The kernel function itself: from `kernel void` on (helper functions come before it)."""
    return code[code.index("kernel void"):]


def signature_buffers(source: str) -> list[tuple[int, str]]:
    return [(int(i), name) for name, i in re.findall(r"(\w+) \[\[buffer\((\d+)\)\]\]", source)]


def small(**changes) -> AttentionProblem:
    base = dict(batch=1, q_heads=2, kv_heads=2, q_len=40, kv_len=56, head_dim=64, value_dim=64)
    return AttentionProblem(**{**base, **changes})


@pytest.mark.parametrize("value, text", [(1.0, "1.0f"), (0.125, "0.125f"), (1e-8, "1e-08f"), (-3.0, "-3.0f")])
def test_float_literals_are_suffixed_and_exact(value, text):
    assert float_literal(value) == text
    assert np.float32(float_literal(np.pi)[:-1]) == np.float32(np.pi)
    with pytest.raises(ValueError):
        float_literal(float("inf"))


@pytest.mark.parametrize("problem", PROBLEMS)
def test_generated_msl_follows_the_rules(problem):
    source = attention_source(problem)
    code = code_of(source)  # comments may hold any text
    assert UNSUFFIXED_FLOAT.findall(code) == []
    assert source.count("#include <metal_stdlib>") == 1 and "using namespace metal;" in source
    assert "__asm" not in code and "__metal" not in code
    assert "return" not in kernel_of(code)  # no early exit: every lane reaches every collective
    # The documented lane layout of simdgroup_matrix<T, 8, 8>.
    assert "const uint tr = (lane / 16) * 4 + (lane / 2) % 4;" in source
    assert "const uint tc = ((lane / 4) & 2) * 2 + (lane % 2) * 2;" in source
    scale = np.float32(problem.softmax_scale * np.log2(np.e))
    assert float_literal(scale) in source


@pytest.mark.parametrize("problem", PROBLEMS)
def test_buffer_indices_come_from_the_plan_only(problem):
    kernel = attention_kernel(problem)
    assert signature_buffers(kernel.source) == [(i, o.name) for i, o in enumerate(kernel.plan.operands)]
    names = [o.name for o in kernel.plan.operands]
    assert names[:3] == ["q", "k", "v"] and "o" in names and names[-1] == "sizes"
    assert ("lse" in names) == problem.return_lse
    assert ("mask" in names) == (problem.mask != "none")
    assert ("sinks" in names) == problem.sinks
    for i, operand in enumerate(kernel.plan.operands):
        assert kernel.plan.index(operand.name) == i
        assert f"[[buffer({i})]] {operand.name}" in kernel.source  # header comment lists them too


def test_lengths_are_runtime_values_unless_baked():
    a, b = small(q_len=40, kv_len=56), small(q_len=100, kv_len=300, batch=3)
    assert attention_source(a) == attention_source(b)  # a new length reuses the kernel
    assert attention_kernel(a).plan.sizes.fields == ("B", "Hq", "Hkv", "R", "C")
    baked = attention_kernel(a, bake_lengths=True)
    assert "sizes" not in [o.name for o in baked.plan.operands]
    assert "const uint C = 56u;" in baked.source and "const uint R = 40u;" in baked.source
    assert baked.source != attention_kernel(b, bake_lengths=True).source


def test_dense_strides_stay_symbolic_and_other_strides_are_literals():
    # q is a view of a longer buffer: 200 rows per head instead of R = 40.
    strided = small(q_strides=(2 * 200 * 64, 200 * 64, 64, 1))
    source = attention_source(strided)
    assert "q_head = q + (ulong(b) * Hq * 12800 + ulong(h) * 12800);" in source
    dense = attention_source(small())
    assert "ulong(h) * R * 64" in dense and "ulong(h_kv) * C * 64" in dense
    bshd = attention_source(small(layout="bshd"))
    assert "ulong(row_read) * Hq * 64" in bshd and "ulong(key0) * Hkv * 64" in bshd


def test_broadcast_mask_axes_are_read_with_stride_zero():
    # A (R, C) mask broadcast over batch and heads: only the row and key terms remain.
    source = attention_source(small(batch=2, mask="bool", mask_strides=(0, 0, 56, 1)))
    assert "device const uchar* mask_row = mask + (ulong(row_read) * C);" in source
    # A key-padding mask (B, 1, 1, C): batch and key terms only; the key index is used as is.
    source = attention_source(small(batch=2, mask="additive", mask_strides=(56, 0, 0, 1)))
    assert "mask_row = mask + (ulong(b) * C);" in source
    # Broadcast along keys: every key of a row reads element 0.
    source = attention_source(small(mask="bool", mask_strides=(0, 0, 1, 0)))
    assert "mask_row[0]" in source


def test_flags_become_literals():
    source = attention_source(small(q_heads=8, kv_heads=2, causal="lower_right", window=(16, 3)))
    assert "const uint h_kv = h / 4;" in source
    assert "key <= int(row) + diagonal" in source
    assert "key >= int(row) + diagonal - 16" in source and "key <= int(row) + diagonal + 3" in source
    assert "key_end = min(key_end, row_last + 1);" in attention_source(small(causal="upper_left"))
    plain = code_of(attention_source(small()))
    assert "diagonal" not in plain and "mask" not in plain and "sinks" not in plain


def test_tile_tables_are_readable_rows_per_head_dimension():
    for rows in TABLES.values():
        assert [r.max_head_dim for r in rows] == sorted(r.max_head_dim for r in rows)
        assert rows[-1].max_head_dim == codegen.MAX_HEAD_DIM
        for row in rows:
            assert row.query_rows % 8 == 0 and row.key_block % 8 == 0
    assert tile_row("apple9", "float32", 8) == TABLES[("apple9", "float32")][0]
    assert tile_row("apple9", "bfloat16", 64) == tile_row("apple9", "float16", 64) == TABLES[("apple9", "16-bit")][0]
    assert tile_row("apple8", "float16", 100) == tile_row("apple7", "float16", 100)  # families share tables
    with pytest.raises(ValueError, match="unknown GPU family"):
        tile_row("apple1", "float32", 64)
    with pytest.raises(ValueError, match="dtype must be one of"):
        tile_row("apple9", "int8", 64)
    with pytest.raises(ValueError, match="577"):
        describe(small(head_dim=577))


def test_descriptor_tiles_follow_the_table_and_shrink_for_decode():
    for family, dtype in itertools.product(codegen.FAMILIES, ("float32", "float16", "bfloat16")):
        row = tile_row(family, dtype, 128)
        descriptor = describe(small(head_dim=128, value_dim=96, q_len=4096, dtype=dtype), family=family)
        assert (descriptor.query_rows, descriptor.cache_q, descriptor.stage_kv) == \
            (row.query_rows, row.cache_q, row.stage_kv)
        # Staged (apple7/8, apple10), the key block is as many of the row's keys as the stage holds,
        # beside the tensor-op products' memory (apple10).
        item, products_rows = ITEM_BYTES[dtype], row.query_rows if row.tensor_ops else 0
        fits = max(n for n in range(8, row.key_block + 1, 8)
                   if n * (128 + 96) * item + threadgroup_bytes(products_rows, n, item) <= STAGE_BYTES)
        assert descriptor.key_block == (fits if row.stage_kv else row.key_block)
    decode = attention_kernel(small(q_len=1, kv_len=5000))
    assert decode.plan.threads_per_threadgroup == 32  # one simdgroup: 8 query rows
    assert decode.plan.threadgroups(sizes_of(small(q_len=1, batch=3))) == (1, 2, 3)
    long = describe(small(q_len=4096))
    plan = attention_kernel(small(q_len=4096)).plan
    assert plan.threadgroups(sizes_of(small(q_len=100))) == (-(-100 // long.query_rows), 2, 1)
    assert "threadgroups (ceil(R / 16), Hq, B), 64 threads each" in attention_source(small(q_len=4096))


def test_decode_splits_the_keys_only_when_the_device_would_idle():
    decode = small(q_len=1, kv_len=5000, q_heads=2, kv_heads=2)   # MHA: a threadgroup per head (GQA packs)
    assert kv_split(decode, "apple9", parallel_threadgroups=2) is None      # 2 heads already fill it
    packed = small(q_len=1, kv_len=5000, q_heads=2, kv_heads=1)            # GQA: both heads in one threadgroup,
    assert kv_split(packed, "apple9", parallel_threadgroups=2) is not None  # so splitting fills the device
    assert kv_split(small(q_len=17, kv_len=5000), "apple9", 1000) is None   # not a decode shape
    assert kv_split(small(q_len=1, kv_len=300), "apple9", 1000) is None     # too few keys to split
    splits, keys = kv_split(decode, "apple9", parallel_threadgroups=16)
    assert splits == 8 and keys % describe(decode).key_block == 0 and splits * keys >= 5000 > (splits - 1) * keys
    one = attention_pass(decode, parallel_threadgroups=2)
    assert [k.entry for k in one.kernels] == [codegen.KERNEL_NAME]
    split = attention_pass(decode, parallel_threadgroups=16)
    assert [k.entry for k in split.kernels] == [codegen.PARTIAL_KERNEL_NAME, codegen.COMBINE_KERNEL_NAME]
    assert split.buffer("sizes").value == (1, 2, 2, 1, 5000, splits, keys)  # B, Hq, Hkv, R, C, S, Cs
    partial, combine = split.kernels
    assert partial.threadgroups == (1, 2, splits)
    assert combine.threadgroups == (2, 1, 2)  # 64 value columns in 32-column groups
    for name, width in (("o_partial", 64), ("ml_partial", 2)):  # written by the partial, read by the combine
        buffer = split.buffer(name)
        assert (buffer.role, buffer.dtype, buffer.writers, buffer.readers) == ("intermediate", "float32", (0,), (1,))
        assert buffer.shape == (splits * 2 * width,) and buffer.nbytes == 4 * splits * 2 * width
    for kernel in split.kernels:
        code = code_of(kernel.source)
        assert UNSUFFIXED_FLOAT.findall(code) == [] and "return" not in kernel_of(code)
        assert signature_buffers(kernel.source) == list(enumerate(kernel.buffers))


def test_emit_prints_the_codegen_source(capsys):
    args = ["emit", "attention", "--head-dim", "80", "--value-dim", "64", "--dtype", "bfloat16", "--q-heads", "8",
            "--kv-heads", "2", "--causal", "upper_left", "--mask", "additive", "--window", "32", "-1", "--sinks"]
    assert cli_main(args) == 0
    problem = AttentionProblem(1, 8, 2, 128, 128, 80, 64, dtype="bfloat16", causal="upper_left", mask="additive",
                               mask_dtype="float32", window=(32, -1), sinks=True, aligned=codegen.ALLOCATED)
    assert capsys.readouterr().out == attention_source(problem)   # the kernels of allocated (aligned) arrays
    assert cli_main(["emit", "attention", "--head-dim", "64", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "[[buffer(0)]] q: input float16 (1, 1, 128, 64)" in out
    assert "kernel attention_forward: threadgroups (8, 1, 1), 64 threads each" in out
    assert cli_main(["emit", "attention", "--head-dim", "64", "--json"]) == 0
    template = PassTemplate.from_json(capsys.readouterr().out)
    assert template == codegen.attention_template(AttentionProblem(1, 1, 1, 128, 128, 64, 64, dtype="float16",
                                                                   aligned=codegen.ALLOCATED))
    assert template.sizes == ("B", "Hq", "Hkv", "R", "C")
    assert cli_main(["emit", "attention", "--head-dim", "64", "--json", "--sizes", "R=300,B=2"]) == 0
    assert mfa_native.PassDescription.from_json(capsys.readouterr().out) == attention_pass(
        AttentionProblem(2, 1, 1, 300, 128, 64, 64, dtype="float16", aligned=codegen.ALLOCATED))
    assert cli_main(["emit", "attention", "--head-dim", "64", "--json", "--sizes", "R"]) == 2
    assert "NAME=N" in capsys.readouterr().err
    # A decode problem on a device that runs 64 threadgroups at once: the split-KV pair.
    assert cli_main(["emit", "attention", "--head-dim", "64", "--q-len", "1", "--kv-len", "4096",
                     "--parallel-threadgroups", "64"]) == 0
    out = capsys.readouterr().out
    assert "kernel void attention_partial(" in out and "kernel void attention_combine(" in out
    assert cli_main(["emit", "attention", "--head-dim", "600"]) == 2
    assert "1..576" in capsys.readouterr().err
