"""`mfa_native.attention_varlen` and its backward: attention over packed sequences, in
flash-attn's varlen layout and vocabulary, declared once.

A call is one "bshd" attention problem of total_q queries and total_k keys without its
batch axis, whose key facet is the packed sequences (codegen/attention/sequences.py): the
dense kernels, each simdgroup on 8 rows of one sequence, listed in host-built unit tables.
With block_table the keys are pages (codegen/attention/paged_sequences.py; forward only);
where each sequence's keys lie is varlen_keys.py's. cu_seqlens, seqused_k and block_table
are checked (and the tables built from them) on every call, before any kernel runs: their
contents are not part of a call's signature. The arrays' checks, those spanning several
arrays' contents included, are varlen_rules.py's data (which a bundle carries for the C++
core).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from .. import codegen, reference
from ..codegen import AttentionBackwardProblem, physical, unit_table
from ..runtime.devices import tuning_facts
from . import arguments as check
from . import varlen_rules as rules
from .attention import (ALIBI_SLOPES, CAUSAL, DETERMINISTIC, GRADIENT_OF, RETURN_LSE, SCALE, SINKS, SOFTCAP, WINDOW,
                        Validated, validate, with_determinism)
from .attention_backward import GRADIENTS
from .declaration import Arg, Call, Op, Out
from .empty import empty_call, filled
from .rules import ArrayRule, Binding
from .score_mod import SCORE_MOD, SCORE_MOD_TENSORS, with_score_mod
from .varlen_keys import SequenceKeys
from .warm import prepared_call, same_memory

VQ = Arg("q", "array", leading=True, grad=True, keyword=False, rule=rules.Q, doc="""
    (total_q, Hq, D): the queries of every sequence, packed along the rows. q, k, v: one kind
    of array (numpy, torch or MLX) and one dtype (float32, float16, bfloat16); Hq a multiple
    of Hkv (GQA); D and Dv 1..576; any non-negative strides with a contiguous last axis.""")
VK = Arg("k", "array", leading=True, grad=True, keyword=False, rule=rules.K, doc="""
    (total_k, Hkv, D): the keys, packed likewise; with block_table the pages (num_blocks,
    page_size, Hkv, D), any page_size (1 included), read in place through their strides: one
    after another, or whole rows apart with other data between them (FlashInfer's HND pages
    (num_pages, Hkv, page_size, D) as `x.transpose(0, 2, 1, 3)`, its stacked (num_pages, 2,
    page_size, Hkv, D) pages as `x[:, 0]` and `x[:, 1]`), k's and v's alike.""")
VV = Arg("v", "array", leading=True, grad=True, keyword=False, rule=rules.V, doc="""
    (total_k, Hkv, Dv): the values, packed likewise; with block_table pages like k's.""")
CU_Q = Arg("cu_seqlens_q", "array", keyword=False, rule=rules.CU_SEQLENS_Q, doc="""
    int32 (B + 1,): sequence b's queries are q's rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]);
    non-decreasing, from 0 to total_q (empty sequences allowed).""")
CU_K = Arg("cu_seqlens_k", "array", keyword=False, default=None, rule=rules.CU_SEQLENS_K, doc="""
    int32 (B + 1,): sequence b's keys and values are rows [cu_seqlens_k[b], cu_seqlens_k[b + 1])
    of k and v; non-decreasing, from 0 to total_k. Required without block_table. With it
    (flash-attn 2's paged varlen) sequence b has cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys
    (from 0, non-decreasing, ending anywhere), or None (flash-attn 3's page table): seqused_k's,
    else every listed page's, max_blocks * page_size.""")
BLOCK_TABLE = Arg("block_table", "array", default=None, rule=rules.BLOCK_TABLE, doc="""
    int32 (B, max_blocks), optional (paged K/V, forward only): sequence b's key position p
    lives in page block_table[b, p // page_size] of k and v, at row p % page_size. Entries of
    pages no used key lies in are not read (they may be anything, -1 included).""")
SEQUSED_K = Arg("seqused_k", "array", default=None, rule=rules.SEQUSED_K, doc="""
    int32 (B,), optional (flash-attn 3's name; forward only): sequence b uses seqused_k[b] keys,
    whatever cu_seqlens_k says: packed, k's rows [cu_seqlens_k[b], cu_seqlens_k[b] +
    seqused_k[b]) (within the sequence's rows); paged, positions 0 .. seqused_k[b] - 1 (within
    max_blocks * page_size). causal and window line the last query up with the last used key.""")
MAX_Q = Arg("max_seqlen_q", "option", default=None, schema="int?", doc="""
    a hint, as flash-attn takes it (the work is sized per sequence whatever it says): if
    given, it must be at least the longest sequence's query count.""")
MAX_K = Arg("max_seqlen_k", "option", default=None, schema="int?", doc="the same for the keys.")
OUTPUT = Out("o", "(total_q, Hq, Dv), q's kind and dtype",
             fake=lambda a: ((*a["q"].shape[:-1], a["v"].shape[-1]), "q"), rule=rules.OUT)
LSE = Out("lse", "(Hq, total_q) float32, natural log of each row's softmax denominator (flash-attn's "
                 "varlen softmax_lse)", when="return_lse", fake=lambda a: ((a["q"].shape[1], a["q"].shape[0]), "float32"),
          rule=rules.LSE_OUT)
# The backward's outputs: attention's, shaped as the packed arrays are.
VARLEN_GRADIENTS = tuple(replace(out, rule=rule) for out, rule in zip(GRADIENTS, (rules.DQ, rules.DK, rules.DV))) \
    + GRADIENTS[3:]


OWN = ("cu_seqlens_q", "cu_seqlens_k", "block_table", "seqused_k")   # the forward's own arrays, in order
OWN_BACKWARD = ("o", "lse", "do") + OWN
HINTS = ("max_seqlen_q", "max_seqlen_k")


def _sequences(cu_q) -> int:
    """The sequences cu_seqlens_q gives (its first axis less one), read before its rule checks it."""
    shape = check.as_array(cu_q, "cu_seqlens_q").shape
    return max(shape[0] - 1, 0) if shape else 0


def _hint(value, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must not be negative, got {value}")
    return int(value)


def validate_varlen(call: Call, *, return_lse: bool, hints: tuple, own: tuple[str, ...] = OWN,
                    packing: bool = False) -> tuple[Validated, SequenceKeys]:
    """Every check of attention_varlen's arguments in `call` (contents included: warm calls
    run them through `_contents_check`), and the call's keys: the pages' layout (code), then
    the rules (varlen_rules.py): q, k and v, attention's, then the op's `own` arrays (the
    backward's include o, lse and do), then what spans their contents. The problem is one bshd
    batch without its batch axis, its keys packed sequences or paged ones; the unit tables are
    built from cu_seqlens (sourced from them on warm calls). With `packing` (the forward) the
    per-sequence query bound, max_seqlen_q or else total_q, lets decode batches pack heads."""
    sequences = _sequences(call.cu_seqlens_q)
    keys = SequenceKeys(call.k, call.v, call.cu_seqlens_k, call.seqused_k, call.block_table, sequences)
    raw = {"q": call.q, "k": keys.rows(call.k, "k"), "v": keys.rows(call.v, "v")}
    bound = {name: check.bindable(check.as_array(x, name)) for name, x in raw.items()}
    given = {"sequences": sequences, "paged": int(keys.paged), "page_size": keys.page if keys.paged else 0,
             "blocks": keys.blocks if keys.paged else 0,
             **{name: rules.NO_HINT if hint is None else hint for name, hint in zip(HINTS, hints)}}
    binding = Binding(rules.RULES, rules.CHECKS, "bshd", given)
    binding.bind({name: (x.shape, str(x.dtype)) for name, x in bound.items()})
    forward = validate(tuple(bound[n][None] for n in ("q", "k", "v")) + (None, call.sinks), scale=call.scale,
                       causal=call.causal, window=call.window, layout="bshd", return_lse=return_lse,
                       softcap=call.softcap, alibi_slopes=call.alibi_slopes, binding=binding)
    arrays = check.given_arrays(call.values, own)
    binding.check_arrays(arrays)
    keys.width = binding.sizes.get("Wt", 0)
    lengths = binding.lengths("keys", arrays).astype(np.int32) if keys.paged else None   # the keys each sequence reads
    bound_q = (bound["q"].shape[0] if hints[0] is None else hints[0]) if packing else None
    p = replace(forward.problem, keys=keys.visit(bound_q))
    sizes = p.keys.sizes(p)
    checked = Validated(p, bound, dict(forward.converts), binding=binding)
    for name in ("q", "k", "v"):
        checked.converts[name] = None if same_memory(raw[name], bound[name]) else check.bindable
    cu_q = np.ascontiguousarray(arrays["cu_seqlens_q"])
    checked.bound["cu_seqlens_q"] = cu_q
    checked.converts["cu_seqlens_q"] = None if same_memory(call.cu_seqlens_q, cu_q) else np.ascontiguousarray
    keys.bind(checked, call.values, lengths)
    sides = (("q_units", "cu_seqlens_q", "NQU", p.keys.query_unit(p)),) + (() if keys.paged else (
        ("k_units", "cu_seqlens_k", "NKU", 8),))
    for table, cu, count, unit in sides:
        checked.bound[table] = unit_table(checked.bound[cu], sizes[count], unit)
        checked.converts[table] = lambda x, entries=sizes[count], unit=unit: unit_table(x, entries, unit)
        checked.sources[table] = cu
    for name in ("sinks", "alibi_slopes"):   # validate's own arrays, as it bound them
        if name in forward.bound:
            checked.bound[name] = forward.bound[name]
    return checked, keys


def _contents_check(arguments: Sequence[str], binding: Binding):
    """A warm call's check of the sequences' contents (PreparedCall.check), from its arguments:
    the own arrays' by their rules."""
    at = {name: arguments.index(name) for name in OWN}

    def checked(values):
        binding.check_contents_of(check.given_arrays({name: values[i] for name, i in at.items()}, OWN))
    return checked


def _empty(p, arguments, checked, outputs, contents):
    """An empty call (no rows, heads or keys): `outputs(inputs)` from q (and the sinks);
    `contents` checks the sequences' contents on warm calls."""
    names = ["q", "sinks"] if p.sinks else ["q"]
    prepared, inputs = empty_call(names, arguments, checked, outputs)
    prepared.check = contents
    return prepared, inputs


def _prepare_forward(call: Call, device):
    hints = (_hint(call.max_seqlen_q, "max_seqlen_q"), _hint(call.max_seqlen_k, "max_seqlen_k"))
    checked, keys = validate_varlen(call, return_lse=call.return_lse, hints=hints, packing=True)
    binding = checked.binding
    checked.problem = with_determinism(checked.problem, call.deterministic)
    checked, tensors = with_score_mod(checked, call.score_mod, call.score_mod_tensors)
    p, names = checked.problem, call.op.array_names + tensors
    contents = _contents_check(names, binding)
    if check.is_empty(1, p.q_heads, p.q_len, p.kv_len):
        def outputs(inputs):
            lse = filled((p.q_heads, p.q_len), np.float32, -np.inf)
            if p.sinks:
                lse[...] = inputs[1][:, None]
            return [filled((p.q_len, p.q_heads, p.value_dim), inputs[0].dtype, 0), lse]
        prepared, inputs = _empty(p, names, checked, outputs, contents)
        prepared.finish = tuple if p.return_lse else (lambda out: out[0])
        return prepared, inputs
    facts = tuning_facts(device)
    description = codegen.attention_pass(p, family=facts.family, parallel_threadgroups=facts.parallel_threadgroups)
    return prepared_call(description, device, checked, names, call.results, check=contents)


def _as_given(rule: ArrayRule, name: str):
    """The backward's convert of o, lse or do (checked by its rule on the cold call; a warm call's
    signature fixes its dtype and shape): bound as its rule reads it."""
    read = np.ascontiguousarray if rule.reads == "contiguous" else check.bindable
    return lambda x: read(check.as_array(x, name))


def _forward_only(call: Call) -> None:
    """NotImplementedError for the forward-only arguments (a gradient of such a call is asked)."""
    for name, what in (("block_table", "paged K/V"), ("seqused_k", "keys limited by seqused_k")):
        if call.values[name] is not None:
            raise NotImplementedError(f"attention_varlen_backward: {name} given, but {what} is forward-only (as "
                                      "flash-attn's paged varlen): no gradient of such a call is computed")


def _prepare_backward(call: Call, device):
    _forward_only(call)
    hints = (_hint(call.max_seqlen_q, "max_seqlen_q"), _hint(call.max_seqlen_k, "max_seqlen_k"))
    forward, keys = validate_varlen(call, return_lse=False, hints=hints, own=OWN_BACKWARD)
    binding = forward.binding
    forward, tensors = with_score_mod(forward, call.score_mod, call.score_mod_tensors)
    p = forward.problem
    bound, converts = dict(forward.bound), dict(forward.converts)
    for name, raw in (("o", call.o), ("dout", call.do), ("lse", call.lse)):
        convert = _as_given(binding.rules["do" if name == "dout" else name], "do" if name == "dout" else name)
        bound[name] = convert(raw)
        converts[name] = None if same_memory(raw, bound[name]) else convert
    checked = Validated(p, bound, converts, forward.sources)
    names = tuple("dout" if n == "do" else n for n in call.op.array_names) + tensors
    if check.is_empty(1, p.q_heads, p.q_len, p.kv_len):
        def outputs(inputs):
            grads = [filled(s, inputs[0].dtype, 0) for s in ((p.q_len, p.q_heads, p.head_dim),
                                                              (p.kv_len, p.kv_heads, p.head_dim),
                                                              (p.kv_len, p.kv_heads, p.value_dim))]
            return grads + ([filled((p.q_heads,), np.float32, 0)] if p.sinks else [])
        return _empty(p, names, checked, outputs, _contents_check(names, binding))
    strides = {name: physical((0, *check.element_strides(bound[name])), "bshd") for name in ("o", "dout")}
    problem = AttentionBackwardProblem(p, o_strides=strides["o"], dout_strides=strides["dout"])
    description = codegen.attention_backward_pass(problem, family=tuning_facts(device).family)
    return prepared_call(description, device, checked, names, call.results,
                         check=_contents_check(names, binding))


VO = Arg("o", "array", keyword=False, rule=rules.O,
         doc="what attention_varlen returned: the (total_q, Hq, Dv) output.")
VLSE = Arg("lse", "array", keyword=False, rule=rules.LSE_IN, doc="the (Hq, total_q) float32 lse it returned.")
VDO = Arg("do", "array", keyword=False, rule=rules.DO,
          doc="the gradient of the loss with respect to o, shaped and typed like o.")

ATTENTION_VARLEN = Op(
    "attention_varlen",
    "Attention over packed sequences (flash-attn's varlen): each sequence's queries attend its own keys.",
    arguments=(VQ, VK, VV, CU_Q, CU_K, MAX_Q, MAX_K, SCALE, CAUSAL, WINDOW, SINKS, SOFTCAP, ALIBI_SLOPES, RETURN_LSE,
               BLOCK_TABLE, SEQUSED_K, SCORE_MOD_TENSORS, SCORE_MOD, DETERMINISTIC),
    outputs=(OUTPUT, LSE),
    prepare=_prepare_forward,
    checks=rules.CHECKS,
    reference=reference.attention_varlen_reference,
    backward="attention_varlen_backward",
    gradients=GRADIENT_OF,
    details="""
    Sequence b is exactly `attention` on its slices (layout "bshd" with a batch of one):
    causal (True: its last query lines up with its last key), window and sinks per sequence,
    GQA. The work is issued per sequence (8-row units of each), not padded to the longest.
    With block_table, k and v are pages and each sequence's keys are read through its own
    pages (chunked prefill on a paged cache: a sequence's new queries are its last ones, so
    causal lines them up with its last keys); with seqused_k, each sequence uses its first
    seqused_k keys. block_table and seqused_k are forward only, as in flash-attn: a gradient
    asked of such a call raises NotImplementedError. cu_seqlens, seqused_k and block_table are
    checked on every call, before any kernel runs (their contents are not part of the
    signature a warm call reuses). A score_mod sees b as the sequence's index and q_idx,
    kv_idx as positions inside the sequence (from its first query, its first key).
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
    ValueError: q, k, v not 3-d (with block_table, k and v not 4-d pages) or their shapes
        disagree; cu_seqlens not int32 (B + 1,), of different lengths, not non-decreasing or
        not from 0 to the row totals (cu_seqlens_k: from 0 with block_table), cu_seqlens_k
        missing without block_table; seqused_k not int32 (B,), negative or beyond a
        sequence's rows; block_table not int32 (B, max_blocks), a sequence's keys beyond
        max_blocks * page_size, or an entry outside k's pages for a page that is read; pages
        not whole rows apart, overlapping, or laid out unlike k's in v; a max_seqlen hint
        below the longest sequence; any other argument `attention` refuses (score_mod and
        score_mod_tensors included).
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
    arguments=(VQ, VK, VV, VO, VLSE, VDO, CU_Q, CU_K, MAX_Q, MAX_K, SCALE, CAUSAL, WINDOW, SINKS, SOFTCAP,
               ALIBI_SLOPES, BLOCK_TABLE, SEQUSED_K, SCORE_MOD_TENSORS, SCORE_MOD),
    outputs=VARLEN_GRADIENTS,
    prepare=_prepare_backward,
    checks=rules.CHECKS,
    reference=reference.attention_varlen_backward_reference,
    no_backward="attention_varlen_backward has no second derivative",
    details="""
    The arguments are those passed to `attention_varlen`, and o and lse what it returned
    (return_lse=True). block_table and seqused_k are forward only (NotImplementedError: the
    gradient of a paged call, as flash-attn's, is not computed).
    """,
    returns="""
    (dq, dk, dv) shaped like q, k and v (contiguous) in their dtype and kind; with sinks also
    dsinks, (Hq,) float32 summed over every sequence. No atomics: deterministic.
    """,
    raises="""
    NotImplementedError: block_table or seqused_k given (forward only).
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
