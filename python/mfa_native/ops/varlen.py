"""`mfa_native.attention_varlen` and its backward: attention over packed sequences, in
flash-attn's varlen layout and vocabulary, declared once.

A call is one "bshd" attention problem of total_q queries and total_k keys without its
batch axis, whose key facet is the packed sequences (codegen/attention/sequences.py): the
dense kernels, each simdgroup on 8 rows of one sequence, listed in host-built unit tables.
cu_seqlens are checked (and the tables built from them) on every call, before any kernel
runs: their contents are not part of a call's signature.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from .. import codegen, reference
from ..codegen import AttentionBackwardProblem, SequenceRanges, physical, unit_table
from ..runtime.devices import tuning_facts
from . import arguments as check
from .attention import (CAUSAL, DETERMINISTIC, GRADIENT_OF, RETURN_LSE, SCALE, SINKS, WINDOW, Validated, validate,
                        with_determinism)
from .attention_backward import GRADIENTS
from .declaration import Arg, Call, Op, Out
from .empty import empty_call, filled
from .warm import prepared_call, same_memory

VQ = Arg("q", "array", leading=True, grad=True, keyword=False, doc="""
    (total_q, Hq, D): the queries of every sequence, packed along the rows. q, k, v: one kind
    of array (numpy, torch or MLX) and one dtype (float32, float16, bfloat16); Hq a multiple
    of Hkv (GQA); D and Dv 1..576; any non-negative strides with a contiguous last axis.""")
VK = Arg("k", "array", leading=True, grad=True, keyword=False, doc="(total_k, Hkv, D): the keys, packed likewise.")
VV = Arg("v", "array", leading=True, grad=True, keyword=False, doc="(total_k, Hkv, Dv): the values, packed likewise.")
CU_Q = Arg("cu_seqlens_q", "array", keyword=False, doc="""
    int32 (B + 1,): sequence b's queries are q's rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]);
    non-decreasing, from 0 to total_q (empty sequences allowed).""")
CU_K = Arg("cu_seqlens_k", "array", keyword=False, doc="""
    int32 (B + 1,): sequence b's keys and values are rows [cu_seqlens_k[b], cu_seqlens_k[b + 1])
    of k and v; non-decreasing, from 0 to total_k.""")
MAX_Q = Arg("max_seqlen_q", "option", default=None, schema="int?", doc="""
    a hint, as flash-attn takes it (the work is sized per sequence whatever it says): if
    given, it must be at least the longest sequence's query count.""")
MAX_K = Arg("max_seqlen_k", "option", default=None, schema="int?", doc="the same for the keys.")
CU = ("cu_seqlens_q", "cu_seqlens_k")
# Sequences per call: their bounds and unit tables are copied and checked on the host every call,
# so a count beyond any batch (a broadcast cu_seqlens of 2**31 entries) is refused, not copied.
MAX_SEQUENCES = 2**24

OUTPUT = Out("o", "(total_q, Hq, Dv), q's kind and dtype",
             fake=lambda a: ((*a["q"].shape[:-1], a["v"].shape[-1]), "q"))
LSE = Out("lse", "(Hq, total_q) float32, natural log of each row's softmax denominator (flash-attn's "
                 "varlen softmax_lse)", when="return_lse", fake=lambda a: ((a["q"].shape[1], a["q"].shape[0]), "float32"))


def _packed(x, name: str, rows: str) -> np.ndarray:
    x = check.as_array(x, name)
    if x.ndim != 3:
        raise ValueError(f"{name} must have 3 dimensions ({rows}, heads, head dim), got shape {x.shape}")
    return x


def _cu_form(cu, name: str) -> np.ndarray:
    """cu_seqlens as bound: int32, one axis of at least one entry, contiguous."""
    cu = check.as_array(cu, name)
    if cu.dtype != np.int32:
        raise ValueError(f"{name} must be int32, got dtype {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must have shape (B + 1,), one axis of at least one entry, got {cu.shape}")
    if cu.shape[0] > MAX_SEQUENCES + 1:   # before its contents are read or copied (a broadcast one is huge)
        raise ValueError(f"{name} has {cu.shape[0]} entries: at most 2**24 sequences (2**24 + 1 entries) per call")
    return np.ascontiguousarray(cu)


def check_sequences(cu_q: np.ndarray, cu_k: np.ndarray, totals: tuple[int, int], hints: tuple) -> None:
    """The contents of cu_seqlens_q and cu_seqlens_k (every call): non-decreasing, from 0 to
    the totals, and the max_seqlen hints at least the longest sequence."""
    for cu, name, total, hint, hint_name in zip((cu_q, cu_k), CU, totals, hints, ("max_seqlen_q", "max_seqlen_k")):
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {cu[0]}")
        if cu[-1] != total:
            raise ValueError(f"{name} must end at the total row count {total} ({'q' if name[-1] == 'q' else 'k'}'s "
                             f"first axis), got {cu[-1]}")
        lengths = np.diff(cu)
        if lengths.size and lengths.min() < 0:
            at = int(np.argmin(lengths))
            raise ValueError(f"{name} must be non-decreasing, but {name}[{at + 1}] = {cu[at + 1]} < "
                             f"{name}[{at}] = {cu[at]}")
        longest = int(lengths.max()) if lengths.size else 0
        if hint is not None and hint < longest:
            raise ValueError(f"{hint_name} is {hint}, but sequence {int(np.argmax(lengths))} has {longest} rows")


def _hint(value, name: str):
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    return int(value)


def validate_varlen(q, k, v, cu_q, cu_k, sinks, *, scale, causal, window, return_lse, hints,
                    packing: bool = False) -> Validated:
    """Every check of attention_varlen's arguments but the contents of cu_seqlens (returned
    problem: one bshd batch without its batch axis, keys = SequenceRanges), the unit tables
    bound (built from cu_seqlens, sourced from them on warm calls). With `packing` (the
    forward) the per-sequence query bound, max_seqlen_q or else total_q, lets decode batches
    pack heads."""
    raw = {"q": q, "k": k, "v": v}
    arrays = {"q": _packed(q, "q", "total_q"), "k": _packed(k, "k", "total_k"), "v": _packed(v, "v", "total_k")}
    if arrays["v"].shape[:2] != arrays["k"].shape[:2]:
        raise ValueError(f"v must have k's rows and heads: k {arrays['k'].shape}, v {arrays['v'].shape}")
    bound = {name: check.bindable(x) for name, x in arrays.items()}
    forward = validate(tuple(bound[n][None] for n in ("q", "k", "v")) + (None, sinks), scale=scale, causal=causal,
                       window=window, layout="bshd", return_lse=return_lse)
    cus = {name: _cu_form(cu, name) for name, cu in zip(CU, (cu_q, cu_k))}
    if cus["cu_seqlens_q"].shape != cus["cu_seqlens_k"].shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one entry per sequence and one more, alike; got "
                         f"{cus['cu_seqlens_q'].shape} and {cus['cu_seqlens_k'].shape}")
    bound_q = (arrays["q"].shape[0] if hints[0] is None else hints[0]) if packing else None
    p = replace(forward.problem, keys=SequenceRanges(cus["cu_seqlens_q"].shape[0] - 1, bound_q))
    sizes = p.keys.sizes(p)
    converts = dict(forward.converts)
    for name in ("q", "k", "v"):
        converts[name] = None if same_memory(raw[name], bound[name]) else check.bindable
    for name, raw_cu in zip(CU, (cu_q, cu_k)):
        bound[name] = cus[name]
        converts[name] = None if same_memory(raw_cu, cus[name]) else np.ascontiguousarray
    check_sequences(cus["cu_seqlens_q"], cus["cu_seqlens_k"], (p.q_len, p.kv_len), hints)
    sources = {}
    for table, cu, count, unit in (("q_units", "cu_seqlens_q", "NQU", p.keys.query_unit(p)),
                                   ("k_units", "cu_seqlens_k", "NKU", 8)):
        bound[table] = unit_table(cus[cu], sizes[count], unit)
        converts[table] = lambda x, entries=sizes[count], unit=unit: unit_table(x, entries, unit)
        sources[table] = cu
    if "sinks" in forward.bound:
        bound["sinks"] = forward.bound["sinks"]
    return Validated(p, bound, converts, sources)


def _contents_check(arguments: Sequence[str], totals: tuple[int, int], hints: tuple):
    """A warm call's check of cu_seqlens' contents (PreparedCall.check), from its arguments."""
    at = tuple(arguments.index(name) for name in CU)

    def checked(values):
        check_sequences(values[at[0]], values[at[1]], totals, hints)
    return checked


def _empty(p, arguments, checked, outputs):
    """An empty call (no rows, heads or keys): `outputs(inputs)` from q (and the sinks)."""
    names = ["q", "sinks"] if p.sinks else ["q"]
    prepared, inputs = empty_call(names, arguments, checked, outputs)
    prepared.check = _contents_check(arguments, (p.q_len, p.kv_len), (None, None))
    return prepared, inputs


def _prepare_forward(call: Call, device):
    hints = (_hint(call.max_seqlen_q, "max_seqlen_q"), _hint(call.max_seqlen_k, "max_seqlen_k"))
    checked = validate_varlen(call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.sinks,
                              scale=call.scale, causal=call.causal, window=call.window,
                              return_lse=call.return_lse, hints=hints, packing=True)
    checked.problem = with_determinism(checked.problem, call.deterministic)
    p, names = checked.problem, call.op.array_names
    if check.is_empty(1, p.q_heads, p.q_len, p.kv_len):
        def outputs(inputs):
            lse = filled((p.q_heads, p.q_len), np.float32, -np.inf)
            if p.sinks:
                lse[...] = inputs[1][:, None]
            return [filled((p.q_len, p.q_heads, p.value_dim), inputs[0].dtype, 0), lse]
        prepared, inputs = _empty(p, names, checked, outputs)
        prepared.finish = tuple if p.return_lse else (lambda out: out[0])
        return prepared, inputs
    facts = tuning_facts(device)
    description = codegen.attention_pass(p, family=facts.family, parallel_threadgroups=facts.parallel_threadgroups)
    return prepared_call(description, device, checked, names, call.results,
                         check=_contents_check(names, (p.q_len, p.kv_len), hints))


def _like_output(x, name: str, dtype, shape: tuple[int, ...]) -> np.ndarray:
    x = check.as_array(x, name)
    if x.dtype != dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but q has {dtype}; {name} must have q's dtype, like the output")
    if x.shape != shape:
        raise ValueError(f"{name} must have the output's shape (total_q, Hq, Dv) = {shape}, got {x.shape}")
    return check.bindable(x)


def _lse(x, shape: tuple[int, int]) -> np.ndarray:
    x = check.as_array(x, "lse")
    if x.dtype != np.float32:
        raise TypeError(f"lse must be float32, as attention_varlen(..., return_lse=True) returns it, got {x.dtype}")
    if x.shape != shape:
        raise ValueError(f"lse must have shape (Hq, total_q) = {shape}, got {x.shape}")
    return np.ascontiguousarray(x)


def _prepare_backward(call: Call, device):
    hints = (_hint(call.max_seqlen_q, "max_seqlen_q"), _hint(call.max_seqlen_k, "max_seqlen_k"))
    forward = validate_varlen(call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.sinks,
                              scale=call.scale, causal=call.causal, window=call.window, return_lse=False, hints=hints)
    p = forward.problem
    bound, converts = dict(forward.bound), dict(forward.converts)
    dtype, shape = bound["q"].dtype, (p.q_len, p.q_heads, p.value_dim)
    converts["o"] = lambda x: _like_output(x, "o", dtype, shape)
    converts["dout"] = lambda x: _like_output(x, "do", dtype, shape)
    converts["lse"] = lambda x: _lse(x, (p.q_heads, p.q_len))
    for name, raw in (("o", call.o), ("dout", call.do), ("lse", call.lse)):
        bound[name] = converts[name](raw)
        if same_memory(raw, bound[name]):
            converts[name] = None
    checked = Validated(p, bound, converts, forward.sources)
    names = tuple("dout" if n == "do" else n for n in call.op.array_names)
    if check.is_empty(1, p.q_heads, p.q_len, p.kv_len):
        def outputs(inputs):
            grads = [filled(s, inputs[0].dtype, 0) for s in ((p.q_len, p.q_heads, p.head_dim),
                                                              (p.kv_len, p.kv_heads, p.head_dim),
                                                              (p.kv_len, p.kv_heads, p.value_dim))]
            return grads + ([filled((p.q_heads,), np.float32, 0)] if p.sinks else [])
        return _empty(p, names, checked, outputs)
    strides = {name: physical((0, *check.element_strides(bound[name])), "bshd") for name in ("o", "dout")}
    problem = AttentionBackwardProblem(p, o_strides=strides["o"], dout_strides=strides["dout"])
    description = codegen.attention_backward_pass(problem, family=tuning_facts(device).family)
    return prepared_call(description, device, checked, names, call.results,
                         check=_contents_check(names, (p.q_len, p.kv_len), hints))


VO = Arg("o", "array", keyword=False, doc="what attention_varlen returned: the (total_q, Hq, Dv) output.")
VLSE = Arg("lse", "array", keyword=False, doc="the (Hq, total_q) float32 lse it returned.")
VDO = Arg("do", "array", keyword=False, doc="the gradient of the loss with respect to o, shaped and typed like o.")

ATTENTION_VARLEN = Op(
    "attention_varlen",
    "Attention over packed sequences (flash-attn's varlen): each sequence's queries attend its own keys.",
    arguments=(VQ, VK, VV, CU_Q, CU_K, MAX_Q, MAX_K, SCALE, CAUSAL, WINDOW, SINKS, RETURN_LSE, DETERMINISTIC),
    outputs=(OUTPUT, LSE),
    prepare=_prepare_forward,
    reference=reference.attention_varlen_reference,
    backward="attention_varlen_backward",
    gradients=GRADIENT_OF,
    details="""
    Sequence b is exactly `attention` on its slices (layout "bshd" with a batch of one):
    causal (True: its last query lines up with its last key), window and sinks per sequence,
    GQA. The work is issued per sequence (8-row units of each), not padded to the longest.
    cu_seqlens are checked on every call, before any kernel runs (their contents are not part
    of the signature a warm call reuses).
    """,
    returns="""
    The output o (total_q, Hq, Dv), of q's kind and dtype; with return_lse=True the tuple
    (o, lse), lse being (Hq, total_q) float32 as flash-attn's varlen functions return it. A
    row with no allowed key (and no sink) gives 0 and lse -inf.
    """,
    raises="""
    TypeError: q, k, v of different kinds or dtypes, or not float32, float16 or bfloat16; a
        max_seqlen hint that is not an int; scale, window or return_lse of the wrong type (as
        in `attention`).
    ValueError: q, k, v not 3-d or their shapes disagree; cu_seqlens not int32 (B + 1,), of
        different lengths, not non-decreasing or not from 0 to the row totals; a max_seqlen
        hint below the longest sequence; any other argument `attention` refuses.
    """,
    example="""
    import numpy as np
    import mfa_native
    from mfa_native.reference import attention_varlen_reference

    rng = np.random.default_rng(0)
    cu_seqlens = np.array([0, 5, 16], dtype=np.int32)   # two sequences: rows 0..4 and 5..15
    q, k, v = (rng.standard_normal((16, 2, 32), dtype=np.float32) for _ in range(3))   # (total, H, D)
    o = mfa_native.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, causal=True, device="cpu")
    print(o.shape)   # (16, 2, 32)
    expected = attention_varlen_reference(q, k, v, cu_seqlens, cu_seqlens, causal=True)
    assert np.allclose(o, expected, atol=1e-4)
    """)
attention_varlen = ATTENTION_VARLEN.function

ATTENTION_VARLEN_BACKWARD = Op(
    "attention_varlen_backward",
    "Gradients of `attention_varlen` with respect to q, k, v (and sinks), given the gradient of its output.",
    arguments=(VQ, VK, VV, VO, VLSE, VDO, CU_Q, CU_K, MAX_Q, MAX_K, SCALE, CAUSAL, WINDOW, SINKS),
    outputs=GRADIENTS,
    prepare=_prepare_backward,
    reference=reference.attention_varlen_backward_reference,
    no_backward="attention_varlen_backward has no second derivative",
    details="""
    The arguments are those passed to `attention_varlen`, and o and lse what it returned
    (return_lse=True).
    """,
    returns="""
    (dq, dk, dv) shaped like q, k and v (contiguous) in their dtype and kind; with sinks also
    dsinks, (Hq,) float32 summed over every sequence. No atomics: deterministic.
    """,
    raises="""
    TypeError: o or do has not q's dtype, lse is not float32; any argument
        `attention_varlen` refuses with a TypeError.
    ValueError: o or do is not (total_q, Hq, Dv), lse not (Hq, total_q); any argument
        `attention_varlen` refuses with a ValueError (cu_seqlens included).
    """,
    example="""
    import numpy as np
    import mfa_native
    from mfa_native.reference import attention_varlen_backward_reference

    rng = np.random.default_rng(0)
    cu_seqlens = np.array([0, 5, 16], dtype=np.int32)
    q, k, v, do = (rng.standard_normal((16, 2, 32), dtype=np.float32) for _ in range(4))
    o, lse = mfa_native.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, causal=True, return_lse=True,
                                         device="cpu")
    dq, dk, dv = mfa_native.attention_varlen_backward(q, k, v, o, lse, do, cu_seqlens, cu_seqlens,
                                                      causal=True, device="cpu")
    expected = attention_varlen_backward_reference(q, k, v, do, cu_seqlens, cu_seqlens, causal=True)
    for got, want in zip((dq, dk, dv), expected):
        assert np.allclose(got, want, atol=1e-3)
    """)
attention_varlen_backward = ATTENTION_VARLEN_BACKWARD.function
