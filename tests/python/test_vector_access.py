"""The vector_access column (tables.py): a lane's two adjacent elements of a row tile as one
half2 / bfloat2 / float2 access, only where its alignment is provable. Forced through
`tables.forced_rows` on and off and checked on the cpu backend against the float64 references
(forward and backward, float32 / float16 / bfloat16, odd and even head dims, bhsd and bshd,
views whose strides or first element forbid vector pairs); the generated MSL has vector
accesses exactly when the row and the layout allow them, and the cpu backend's traffic
counters see the same bytes either way. Outputs start poisoned (conftest)."""

from __future__ import annotations

import numpy as np
import pytest
from test_attention import make_inputs
from test_attention import check as check_forward
from test_attention_backward import check as check_backward
from test_tile_choices import backward_row, forced, forward_row

import mfa_native
from mfa_native import codegen
from mfa_native.codegen.kernel.report import report
from mfa_native.ops.attention import validate
from mfa_native.ops.warm import signature

ALL = frozenset(("q", "k", "v", "o", "dout", "dq", "dk", "dv"))
VECTOR = "2*)("   # the cast of a vector access: *(device const half2*)(q_head + ...)


def _sources(problem: codegen.AttentionProblem, vector_access: bool) -> list[str]:
    """The forward and backward kernels' MSL of `problem` with the column forced on or off (the
    forced family's name, which names its rows, left out of the header)."""
    with forced(forward=forward_row(vector_access=vector_access),
                backward=backward_row(vector_access=vector_access)) as family:
        passes = [codegen.attention_pass(problem, family=family),
                  codegen.attention_backward_pass(codegen.AttentionBackwardProblem(problem), family=family)]
    return [kernel.source.replace(family, "forced") for p in passes for kernel in p.kernels]


@pytest.mark.parametrize("dtype, pair", [("float32", "float2"), ("float16", "half2"), ("bfloat16", "bfloat2")])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_msl_has_vector_accesses_exactly_when_the_row_and_the_layout_allow(dtype, pair, layout):
    """On: every row load of Q, V, O, dO (and K, V as dK/dV rows) and every store of O, dQ, dK,
    dV is one `pair` access; the transposed loads stay scalar. Off, an odd head dim (odd
    strides, a pair past the last feature), or arrays not known to be aligned: none, and the
    MSL is the scalar kernels'."""
    aligned = codegen.AttentionProblem(1, 2, 2, 24, 40, 40, 24, dtype=dtype, layout=layout, aligned=ALL)
    forward, dq, dkdv = _sources(aligned, True)
    assert forward.count(f"(device const {pair}*)(") == 2        # Q cached, V in O += P V
    assert forward.count(f"(device {pair}*)(o_row + col)") == 1
    assert dq.count(f"(device const {pair}*)(") == 4             # Q, dO cached; O in D; K in dQ += dS K
    assert dkdv.count(f"(device const {pair}*)(") == 4 and dkdv.count(f"(device {pair}*)(") == 2
    scalar = _sources(aligned, False)
    assert not any(VECTOR in source for source in scalar)
    odd = codegen.AttentionProblem(1, 2, 2, 24, 40, 33, 17, dtype=dtype, layout=layout, aligned=ALL)
    assert not any(VECTOR in source for source in _sources(odd, True))
    unknown = codegen.AttentionProblem(1, 2, 2, 24, 40, 40, 24, dtype=dtype, layout=layout)
    assert _sources(unknown, True) == scalar   # nothing known aligned: the scalar kernels


def test_only_the_aligned_operands_vectorize():
    """A first element known aligned and even strides make an operand's pairs vectors; an odd
    row stride (a padded view of 41 columns) keeps that operand scalar and no other."""
    p = codegen.AttentionProblem(1, 2, 2, 16, 16, 40, 40, dtype="float16", aligned=frozenset(("q", "o")),
                                 k_strides=(2 * 16 * 41, 16 * 41, 41, 1))
    forward, dq, dkdv = _sources(p, True)
    assert "(device const half2*)(q_head" in forward and "(device half2*)(o_row" in forward
    assert "(device const half2*)(v_head" not in forward                    # v not known aligned
    assert "(device const half2*)(k_head" not in dq + dkdv                   # k: odd row stride
    assert "(device const half2*)(q_head" in dq and "(device half2*)(dq_row" not in dq  # dq not listed


def _offset_view(rng, shape, dtype, offset, pad=0):
    """A view of `shape` into a bigger buffer, starting `offset` elements in, rows padded by `pad`."""
    padded = (*shape[:-1], shape[-1] + pad + offset)
    return rng.standard_normal(padded).astype(dtype)[..., offset:offset + shape[-1]]


def test_the_ops_know_which_arrays_are_aligned(rng):
    """An array owning its memory is aligned; a view starting one element in is not, and its
    warm-path signature differs from an aligned view's with the same shape and strides."""
    shape = (1, 2, 8, 16)
    q = rng.standard_normal(shape).astype(np.float16)
    at_0, at_1 = _offset_view(rng, shape, np.float16, 0, pad=1), _offset_view(rng, shape, np.float16, 1)
    assert at_0.strides == at_1.strides
    problem = validate((at_1, q, at_0, None, None), scale=None, causal=False, window=None, layout="bhsd",
                       return_lse=False).problem
    assert problem.aligned == frozenset(("k", "v", "o"))
    device = mfa_native.default_device()
    assert signature([at_0], [], device) != signature([at_1], [], device)


@pytest.mark.parametrize("vector_access", [True, False])
@pytest.mark.parametrize("dtype, D, Dv, layout", [("float32", 40, 24, "bshd"), ("float16", 33, 17, "bhsd"),
                                                  ("bfloat16", 64, 8, "bhsd"), ("float16", 16, 48, "bshd")])
def test_forward_and_backward_match_the_reference(rng, vector_access, dtype, D, Dv, layout):
    q, k, v = make_inputs(rng, Hq=4, Hkv=2, R=13, C=21, D=D, Dv=Dv, dtype=dtype, layout=layout)
    with forced(forward=forward_row(vector_access=vector_access), backward=backward_row(vector_access=vector_access)):
        check_forward(q, k, v, layout=layout, causal=True)
        check_backward(rng, q, k, v, layout=layout, window=(6, 2))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_views_that_forbid_vector_pairs_fall_back_and_stay_right(rng, dtype):
    """Odd row strides (padded rows), and first elements one element in (even strides, so only
    the address forbids pairs): scalar accesses for those operands, right results."""
    shape = (1, 2, 11, 24)
    q = _offset_view(rng, shape, dtype, 0, pad=1)                                    # row stride 25
    k = _offset_view(rng, (1, 2, 19, 24), dtype, 1, pad=1)                          # starts at element 1
    v = _offset_view(rng, (1, 2, 19, 24), dtype, 1, pad=3)                          # both
    with forced(forward=forward_row(), backward=backward_row()):
        check_forward(q, k, v)
        check_backward(rng, q, k, v, causal=True)


def _traffic(rng, vector_access: bool, arrays, **kwargs) -> list[tuple[str, dict, dict]]:
    q, k, v = arrays
    with forced(forward=forward_row(vector_access=vector_access), backward=backward_row(vector_access=vector_access)):
        with mfa_native.profile() as prof:
            o, lse = mfa_native.attention(q, k, v, return_lse=True, **kwargs)
            mfa_native.attention_backward(q, k, v, o, lse, np.ones_like(o), **kwargs)
    return [(r.kernel, r.bytes_read, r.bytes_written) for r in prof.records]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_traffic_is_the_same_with_and_without_vector_access(rng, layout):
    """A vector pair moves the bytes its two scalar accesses did: the cpu backend's counters,
    per kernel and argument, are equal (and not empty)."""
    arrays = make_inputs(rng, Hq=2, Hkv=1, R=12, C=20, D=40, Dv=24, dtype="float16", layout=layout)
    on, off = _traffic(rng, True, arrays, layout=layout, causal=True), _traffic(rng, False, arrays, layout=layout,
                                                                            causal=True)
    assert on == off and len(on) == 3
    assert all(read["q"] > 0 and written for _, read, written in on)


def test_the_report_counts_one_access_per_vector_pair():
    """`emit --report`'s accesses: every vector access replaces two scalar ones (forward: Q, V
    loads and the O store; dQ: Q, dO, O, K and the dQ store; dK/dV: K, V, dO, Q and the dK, dV
    stores)."""
    problem = codegen.AttentionProblem(1, 2, 2, 64, 64, 64, 64, dtype="float16", aligned=codegen.ALLOCATED)
    on = [report("k", source) for source in _sources(problem, True)]
    off = [report("k", source) for source in _sources(problem, False)]
    assert [r.vector_accesses for r in on] == [3, 5, 6] and [r.vector_accesses for r in off] == [0, 0, 0]
    assert [b.device_accesses - a.device_accesses for a, b in zip(on, off)] == [3, 5, 6]
    assert all(a.tile_registers == b.tile_registers for a, b in zip(on, off))
