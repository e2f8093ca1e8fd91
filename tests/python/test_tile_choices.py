"""The tile tables' generator choices, each forced through `tables.forced_rows` and checked on
the cpu backend against the float64 references: 16-bit operand tiles (tiles16), P and dS
rounded to 16 bits for the accumulated products (p16), and the per-operand caching choices (forward cache_q and o_block; backward cache_q, cache_dout,
cache_k, cache_v and the paged accumulators), every pair of caching choices of a kernel, for
float32, float16 and bfloat16, odd head dims and head dims past 256, with the dense features
(causal, masks, window, sinks, GQA, layouts, packed decode, split-KV). The generated MSL is
checked for the tile types the row asks for. Outputs start poisoned (conftest)."""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import numpy as np
import pytest
from test_attention import make_inputs
from test_attention import check as check_forward
from test_attention_backward import check as check_backward
from test_head_dims import feature_arguments

import mfa_native
from mfa_native import codegen
from mfa_native.codegen.kernel import table_columns, tables
from mfa_native.codegen.kernel.tables import BackwardTileRow, TileRow, forced_rows
from mfa_native.runtime.devices import tuned_as


def forward_row(*, cache_q=True, o_block=0, tiles16=True, query_rows=16, key_block=32, stage_apart=True,
                p16=False, stage_kv=False, vector_access=True) -> TileRow:
    return TileRow(max_head_dim=576, query_rows=query_rows, key_block=key_block, cache_q=cache_q,
                   stage_apart=stage_apart, o_block=o_block, tiles16=tiles16, p16=p16, stage_kv=stage_kv,
                   vector_access=vector_access)


def backward_row(*, cache_q=True, cache_dout=True, cache_k=True, cache_v=True, dq_block=0, dk_block=0, dv_block=0,
                 tiles16=True, rows=16, block=32, p16=False, stage_kv=False, stage_q_dout=False,
                 vector_access=True) -> BackwardTileRow:
    return BackwardTileRow(max_head_dim=576, query_rows=rows, key_block=block, key_rows=rows, query_block=block,
                           cache_q=cache_q, cache_dout=cache_dout, cache_k=cache_k, cache_v=cache_v,
                           dq_block=dq_block, dk_block=dk_block, dv_block=dv_block, tiles16=tiles16, p16=p16,
                           stage_kv=stage_kv, stage_q_dout=stage_q_dout, vector_access=vector_access)


@contextmanager
def forced(forward: TileRow | None = None, backward: BackwardTileRow | None = None, **facts):
    """The default device runs with these rows (and tuning facts) inside the block."""
    with forced_rows(tables.CPU_FAMILY, forward=forward, backward=backward) as family:
        with tuned_as(mfa_native.default_device(), family=family, **facts):
            yield family


FORWARD_ROWS = [forward_row(cache_q=c, o_block=o) for c, o in itertools.product((True, False), (0, 32))]
FORWARD_ROWS.append(forward_row(tiles16=False, cache_q=False, vector_access=False))
DTYPE_NAMES = ("float32", "float16", "bfloat16")
# (D, Dv, Hq, Hkv, R, C, layout, keyword arguments): odd, mixed and past-256 head dims, each
# with a dense feature; cycled over the (row, dtype) cases so every row meets several.
FORWARD_SHAPES = [
    (33, 17, 2, 2, 11, 23, "bhsd", dict(causal=True)),
    (8, 8, 4, 2, 9, 40, "bshd", dict(window=(5, 3))),
    (300, 264, 2, 1, 7, 19, "bhsd", dict(sinks=True)),
    (64, 40, 2, 2, 13, 21, "bhsd", dict(mask="bool")),
    (20, 20, 2, 2, 6, 30, "bshd", dict(mask="additive", causal="upper_left")),
]
FORWARD_CASES = [(row, dtype, FORWARD_SHAPES[i % len(FORWARD_SHAPES)])
                 for i, (row, dtype) in enumerate(itertools.product(FORWARD_ROWS, DTYPE_NAMES))]


def _row_id(row) -> str:
    return "-".join(f"{f}{int(getattr(row, f))}" for f in row.__dataclass_fields__ if f != "max_head_dim")


@pytest.mark.parametrize("case", FORWARD_CASES, ids=[f"{_row_id(r)}-{t}-D{s[0]}" for r, t, s in FORWARD_CASES])
def test_forward_rows(rng, case):
    row, dtype, (D, Dv, Hq, Hkv, R, C, layout, kwargs) = case
    q, k, v = make_inputs(rng, Hq=Hq, Hkv=Hkv, R=R, C=C, D=D, Dv=Dv, dtype=dtype, layout=layout)
    with forced(forward=row):
        check_forward(q, k, v, layout=layout, **feature_arguments(rng, Hq, R, C, kwargs))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("cache_q", (True, False))
def test_forward_rows_packed_decode_and_split_kv(rng, dtype, cache_q):
    """Packed-heads decode (staged K/V) and the split-KV partial kernel with 16-bit tiles (and,
    with Q re-read, P and the staged V as 16-bit tiles: p16)."""
    row = forward_row(cache_q=cache_q, o_block=0 if cache_q else 64, query_rows=8, p16=not cache_q)
    q, k, v = make_inputs(rng, Hq=4, Hkv=1, R=1, C=45, D=72, Dv=40, dtype=dtype)
    with forced(forward=row):
        check_forward(q, k, v)
    q, k, v = make_inputs(rng, Hq=2, Hkv=2, R=1, C=700, D=264, Dv=24, dtype=dtype)
    with forced(forward=row, parallel_threadgroups=64), mfa_native.profile() as prof:
        check_forward(q, k, v, sinks=rng.standard_normal(2).astype(np.float32))
    assert [r.kernel for r in prof.records] == [codegen.PARTIAL_KERNEL_NAME, codegen.COMBINE_KERNEL_NAME]


# Every pair of each kernel's caching choices ((cache_q, cache_dout) in dQ, (cache_k, cache_v)
# in dK/dV), with and without paged accumulators, and one row of float tiles.
BACKWARD_ROWS = [backward_row(cache_q=a, cache_dout=b, cache_k=b, cache_v=a) for a, b in itertools.product((True, False), repeat=2)]
# (Paged, one simdgroup per threadgroup: two simdgroups' dK and dV pages at D 264 / Dv 300
# would take 35.5 KiB, over the 32 KiB of threadgroup memory.)
BACKWARD_ROWS += [backward_row(cache_q=False, cache_v=False, dq_block=32, dk_block=32, dv_block=32, rows=8),
                  backward_row(cache_dout=False, cache_k=False, dv_block=32, tiles16=False, vector_access=False)]
BACKWARD_SHAPES = [
    (33, 17, 2, 1, 11, 23, "bhsd", dict(causal=True)),
    (8, 8, 2, 2, 9, 17, "bshd", dict(window=(4, 2), sinks=True)),
    (264, 300, 1, 1, 7, 9, "bhsd", dict(mask="bool")),
    (40, 24, 4, 2, 10, 13, "bhsd", dict(mask="additive")),
]
BACKWARD_CASES = [(row, dtype, BACKWARD_SHAPES[i % len(BACKWARD_SHAPES)])
                  for i, (row, dtype) in enumerate(itertools.product(BACKWARD_ROWS, DTYPE_NAMES))]


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=[f"{_row_id(r)}-{t}-D{s[0]}" for r, t, s in BACKWARD_CASES])
def test_backward_rows(rng, case):
    row, dtype, (D, Dv, Hq, Hkv, R, C, layout, kwargs) = case
    q, k, v = make_inputs(rng, Hq=Hq, Hkv=Hkv, R=R, C=C, D=D, Dv=Dv, dtype=dtype, layout=layout)
    with forced(backward=row):
        check_backward(rng, q, k, v, layout=layout, **feature_arguments(rng, Hq, R, C, kwargs))


# p16: P (and dS) rounded to the input's 16-bit type, with V (and dO, K, Q) as 16-bit right
# operands; with register and paged accumulators, MFA's 80-wide blocks, and without tiles16.
P16_FORWARD_ROWS = [forward_row(p16=True), forward_row(cache_q=False, o_block=16, key_block=80, p16=True),
                    forward_row(tiles16=False, p16=True)]
P16_BACKWARD_ROWS = [backward_row(p16=True),
                     backward_row(cache_q=False, cache_v=False, dq_block=16, dk_block=16, dv_block=16, rows=8,
                                  block=80, p16=True),
                     backward_row(cache_dout=False, cache_k=False, tiles16=False, p16=True)]
P16_SHAPES = [
    (33, 17, 4, 2, 11, 23, "bhsd", dict(causal=True)),
    (300, 264, 2, 1, 7, 19, "bshd", dict(sinks=True)),
    (40, 24, 4, 2, 10, 45, "bhsd", dict(mask="additive", causal="upper_left")),
]
P16_FORWARD_CASES = [(row, dtype, P16_SHAPES[i % len(P16_SHAPES)])
                     for i, (row, dtype) in enumerate(itertools.product(P16_FORWARD_ROWS, ("float16", "bfloat16")))]
P16_BACKWARD_CASES = [(row, dtype, P16_SHAPES[i % len(P16_SHAPES)])
                      for i, (row, dtype) in enumerate(itertools.product(P16_BACKWARD_ROWS, ("float16", "bfloat16")))]


@pytest.mark.parametrize("case", P16_FORWARD_CASES, ids=[f"{_row_id(r)}-{t}-D{s[0]}" for r, t, s in P16_FORWARD_CASES])
def test_p16_forward_rows(rng, case):
    row, dtype, (D, Dv, Hq, Hkv, R, C, layout, kwargs) = case
    q, k, v = make_inputs(rng, Hq=Hq, Hkv=Hkv, R=R, C=C, D=D, Dv=Dv, dtype=dtype, layout=layout)
    with forced(forward=row):
        check_forward(q, k, v, layout=layout, **feature_arguments(rng, Hq, R, C, kwargs))


@pytest.mark.parametrize("case", P16_BACKWARD_CASES,
                         ids=[f"{_row_id(r)}-{t}-D{s[0]}" for r, t, s in P16_BACKWARD_CASES])
def test_p16_backward_rows(rng, case):
    row, dtype, (D, Dv, Hq, Hkv, R, C, layout, kwargs) = case
    q, k, v = make_inputs(rng, Hq=Hq, Hkv=Hkv, R=R, C=C, D=D, Dv=Dv, dtype=dtype, layout=layout)
    with forced(backward=row):
        check_backward(rng, q, k, v, layout=layout, **feature_arguments(rng, Hq, R, C, kwargs))


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_p16_rounds_what_float_weights_keep(rng, dtype):
    """p16 changes the arithmetic (its results differ from float weights' in some bits) and
    not the float32 kernels (identical results)."""
    q, k, v = make_inputs(rng, Hq=2, R=24, C=70, D=40, dtype=dtype)
    do = rng.standard_normal(q.shape).astype(q.dtype)
    results = {}
    for p16 in (False, True):
        with forced(forward=forward_row(p16=p16), backward=backward_row(p16=p16)):
            o, lse = mfa_native.attention(q, k, v, return_lse=True)
            results[p16] = [o.copy()] + [g.copy() for g in mfa_native.attention_backward(q, k, v, o, lse, do)]
    for plain, rounded in zip(results[False], results[True]):
        assert not np.array_equal(plain, rounded)
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    outs = []
    for p16 in (False, True):
        with forced(forward=forward_row(p16=p16)):
            outs.append(mfa_native.attention(q32, k32, v32))
    assert np.array_equal(outs[0], outs[1])


# ---------------------------------------------------------------------------
# The generated MSL.


def _forward_source(dtype: str, family: str, D: int = 64) -> str:
    p = codegen.AttentionProblem(1, 2, 2, 64, 64, D, D, dtype=dtype)
    (kernel,) = codegen.attention_pass(p, family=family).kernels
    return kernel.source


def _backward_sources(dtype: str, family: str, D: int = 64) -> list[str]:
    p = codegen.AttentionBackwardProblem(codegen.AttentionProblem(1, 2, 2, 64, 64, D, D, dtype=dtype))
    return [kernel.source for kernel in codegen.attention_backward_pass(p, family=family).kernels]


@pytest.mark.parametrize("dtype, family, tile", [("float16", "apple9", "half"), ("float16", "apple7", "half"),
                                                 ("bfloat16", "apple9", "bfloat"), ("bfloat16", "apple8", "float")])
@pytest.mark.parametrize("D", [64, 300])
def test_msl_declares_16bit_operand_tiles(dtype, family, tile, D):
    """The built-in 16-bit rows (tiles16 and p16 on): Q and K (forward), Q, dO, K, V (backward)
    are tiles of the input's 16-bit type, and so are V in O += P V, K in dQ += dS K, dO in
    dV += P^T dO and Q in dK += dS^T Q, whose P and dS are rounded to it; bfloat widens to
    float on apple7/8; S, P, dP and the accumulators stay float."""
    source = _forward_source(dtype, family, D)
    q_tile = "q_tile[" if D <= 96 else "q_i;"
    assert f"simdgroup_{tile}8x8 {q_tile}" in source and f"simdgroup_{tile}8x8 k_tile;" in source
    assert f"simdgroup_{tile}8x8 v_tile;" in source and "simdgroup_float8x8 p_tile[" in source
    assert ("simdgroup_float8x8 o_tile[" in source) or ("threadgroup float o_tile_page[" in source)
    dq, dkdv = _backward_sources(dtype, family, D)
    assert f"simdgroup_{tile}8x8 v_tile;" in dq and "simdgroup_float8x8 dq_tile[" in dq
    assert f"simdgroup_{tile}8x8 q_tile;" in dkdv and f"simdgroup_{tile}8x8 dout_tile;" in dkdv
    rounded = {"forward": (source, ["p_tile"]), "dq": (dq, ["dp_tile"]), "dkdv": (dkdv, ["p_tile", "dp_tile"])}
    for kernel, (text, weights) in rounded.items():
        for name in weights:
            assert (f"{name}_{tile}.thread_elements()[1] = {tile}({name}[j].thread_elements()[1]);" in text) \
                == (tile != "float"), (kernel, name)
    if tile != "float":
        assert "simdgroup_float8x8 q_tile[" not in source and "simdgroup_float8x8 k_tile;" not in source
        assert "simdgroup_float8x8 v_tile;" not in source and "simdgroup_float8x8 dout_tile;" not in dkdv
        assert not any(f"simdgroup_{tile}8x8 {name}_tile" in dq + dkdv for name in ("dq", "dk", "dv"))


@pytest.mark.parametrize("family", ["apple7", "apple9"])
@pytest.mark.parametrize("D", [24, 64, 300])
def test_float32_msl_has_only_float_tiles(family, D):
    """float32 inputs keep float tiles whatever the row says (the kernels of main)."""
    for source in [_forward_source("float32", family, D), *_backward_sources("float32", family, D)]:
        assert "simdgroup_half8x8" not in source and "simdgroup_bfloat8x8" not in source
        assert "simdgroup_float8x8" in source


def test_forced_rows_reach_the_msl():
    """A forced row's choices are what the kernels do; float tiles when tiles16 is off."""
    p = codegen.AttentionBackwardProblem(codegen.AttentionProblem(1, 2, 2, 64, 64, 64, 64, dtype="float16"))
    row = backward_row(cache_q=True, cache_dout=False, cache_k=False, cache_v=True, tiles16=False)
    with forced_rows("apple9", backward=row) as family:
        dq, dkdv = (k.source for k in codegen.attention_backward_pass(p, family=family).kernels)
    assert "Q in registers, dO re-read per block" in dq and "simdgroup_float8x8 q_tile[8];" in dq
    assert "dout_tile[" not in dq and "simdgroup_float8x8 dout_i;" in dq
    assert "K re-read per block, V in registers" in dkdv and "simdgroup_float8x8 v_tile[8];" in dkdv
    assert "simdgroup_half8x8" not in dq + dkdv
    with pytest.raises(ValueError, match="unknown GPU family"):
        codegen.attention_backward_pass(p, family=family)   # gone after the block


def test_forced_rows_check_their_columns():
    with pytest.raises(ValueError, match="forward column key_block must be one of"):
        with forced_rows("apple9", forward=forward_row(key_block=24)):
            pass
    with pytest.raises(ValueError, match="backward column dq_block must be one of"):
        with forced_rows("apple9", backward=backward_row(dq_block=40)):
            pass
    with pytest.raises(ValueError, match="unknown GPU family 'apple1'"):
        with forced_rows("apple1"):
            pass


def test_column_domains_cover_the_tables():
    """Every column of every shipped row is in its declared domain; every field has one."""
    for rows, columns in ((tables.TABLES, table_columns.FORWARD_COLUMNS),
                          (tables.BACKWARD_TABLES, table_columns.BACKWARD_COLUMNS)):
        for table in rows.values():
            for row in table:
                names = [f for f in row.__dataclass_fields__ if f != "max_head_dim"]
                assert sorted(names) == sorted(columns)
                for name in names:
                    assert getattr(row, name) in columns[name], (row, name)
    kernel_columns = set(itertools.chain(*table_columns.BACKWARD_KERNEL_COLUMNS.values()))
    assert kernel_columns == set(table_columns.BACKWARD_COLUMNS)


def test_forced_rows_reach_the_ops(rng):
    """Inside `forced`, the ops run the forced rows (8 rows per threadgroup: 5 threadgroups for
    40 rows where the table's 16 make 3), and the warm path does not reuse them outside."""
    q, k, v = make_inputs(rng, Hq=1, R=40, C=40, D=32, dtype="float16")
    with forced(forward=forward_row(query_rows=8), backward=backward_row(rows=8)), mfa_native.profile() as prof:
        check_backward(rng, q, k, v)
    assert [(r.kernel, r.threadgroups) for r in prof.records] == [
        (codegen.KERNEL_NAME, 5), (codegen.DQ_KERNEL_NAME, 5), (codegen.DKDV_KERNEL_NAME, 5)]
    with mfa_native.profile() as prof:
        check_backward(rng, q, k, v)
    assert [r.threadgroups for r in prof.records] == [3, 3, 3]


def test_forced_rows_of_the_same_rows_give_the_same_kernel_source():
    """The forced family's name is a function of its rows, so a candidate's kernels are the same
    source on every run (the kernel cache serves repeated `tune` runs), and other rows differ."""
    problem = codegen.AttentionProblem(1, 2, 2, 64, 64, 64, 64)
    sources = []
    for row in (forward_row(cache_q=True), forward_row(cache_q=True), forward_row(cache_q=False)):
        with forced_rows("apple9", forward=row) as family:
            sources.append(codegen.attention_pass(problem, family=family).kernels[0].source)
    assert sources[0] == sources[1] and sources[0] != sources[2]
