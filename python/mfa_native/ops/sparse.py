"""`mfa_native.sparse_attention`: each query row attends exactly the keys its token list names
(DeepSeek sparse attention; FlashMLA's `[s_q, h_kv, topk]` lists with a batch axis)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import codegen, reference
from ..codegen import TokenLists, physical
from ..runtime.devices import tuning_facts
from . import arguments as check
from . import attention_rules
from .attention import (ALIBI_SLOPES, FAMILY_RULES, GRADIENT_OF, K, LAYOUT, LSE, OUTPUT, Q, RAISES, RETURN_LSE, SCALE,
                        SINKS, SOFTCAP, Validated, validate)
from .attention_rules import MAX_INDEX
from .rules import ArrayRule, Binding, Content, Require
from .attention_backward import DO, GRADIENTS, LSE_IN, O, validate_backward
from .declaration import Arg, Call, Op
from .empty import empty_backward, empty_forward
from .score_mod import SCORE_MOD, SCORE_MOD_RAISES, SCORE_MOD_TENSORS, with_score_mod
from .warm import prepared_call, same_memory

INDICES_RULE = ArrayRule(
    dtypes=("int32",), shapes=(("B", "Hkv", "R", "topk"), ("B", "1", "R", "topk")), layout=True, expands=True,
    own=True, requires=(Require(f"topk <= {MAX_INDEX}", "indices has topk = {topk} entries per row; the kernels "
                                "index it with 32-bit integers, so it must be below 2**31"),),
    dtype_error="indices must be int32, got {indices.dtype}",
    rank_error="indices must have 4 dimensions ({indices.axes}), got shape {indices.shape}",
    shape_error="indices must have shape ({indices.axes}) = {indices.expected} (or a kv-head axis of 1), got "
                "{indices.shape}")
TOPK_LENGTH_RULE = ArrayRule(
    dtypes=("int32",), shapes=(("B", "R"),), own=True, reads="strided_broadcast", stride_axes=("batch", "row"),
    contents=(Content("nonnegative", "topk_length must not be negative, got {topk_length.min}"),),
    dtype_error="topk_length must be int32, got {topk_length.dtype}",
    shape_error="topk_length must have shape (B, R) = {topk_length.expected}, got {topk_length.shape}")
LIST_RULES = {**FAMILY_RULES, "indices": INDICES_RULE, "topk_length": TOPK_LENGTH_RULE}

INDICES = Arg("indices", "array", keyword=False, rule=INDICES_RULE, doc="""
    int32 (B, Hkv, R, topk) in "bhsd", (B, R, Hkv, topk) in "bshd": query row r of query
    head h attends keys indices[b, h // (Hq // Hkv), r, :]. An entry < 0 or >= C is skipped
    wherever it appears; a key listed twice counts twice (a gather, then dense attention).
    Any non-negative strides; a kv-head axis of size 1 or stride 0 shares one list among the
    kv heads (as sparse_topk returns it).""")
TOPK_LENGTH = Arg("topk_length", "array", default=None, rule=TOPK_LENGTH_RULE, doc="""
    int32 (B, R), optional: only the first topk_length[b, r] entries of each list are read
    (an entry above topk reads the whole list; negative is an error).""")
SPARSE_V = Arg("v", "array", leading=True, grad=True, keyword=False, rule=attention_rules.V, doc="""
    values, as in `attention`; v may be a view of k (MLA's shared latent: v = k[..., :Dv]).""")


def _prepare_forward(call: Call, device):
    shared = _shared_latent(call.k, call.v)
    checked = _with_lists(validate((call.q, call.k, call.v, None, call.sinks), scale=call.scale, causal=False,
                                   window=None, layout=call.layout, return_lse=call.return_lse, softcap=call.softcap,
                                   alibi_slopes=call.alibi_slopes),
                          call.indices, call.topk_length, shared)
    checked, tensors = with_score_mod(checked, call.score_mod, call.score_mod_tensors)
    p, names = checked.problem, call.op.array_names + tensors
    if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        return empty_forward(p, names, checked)
    description = codegen.attention_pass(p, family=tuning_facts(device).family)
    return prepared_call(description, device, checked, names, call.results)


def _prepare_backward(call: Call, device):
    backward = validate_backward((call.q, call.k, call.v, call.o, call.lse, call.do, None, call.sinks),
                                 scale=call.scale, causal=False, window=None, layout=call.layout,
                                 softcap=call.softcap, alibi_slopes=call.alibi_slopes)
    forward = _with_lists(Validated(backward.problem.forward, backward.bound, backward.converts,
                                    binding=backward.binding), call.indices, call.topk_length, False)
    forward, tensors = with_score_mod(forward, call.score_mod, call.score_mod_tensors)
    problem = replace(backward.problem, forward=forward.problem)
    p = problem.forward
    names = tuple("dout" if n == "do" else n for n in call.op.array_names) + tensors
    if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        return empty_backward(p, names, forward)
    description = codegen.attention_backward_pass(problem, family=tuning_facts(device).family)
    return prepared_call(description, device, forward, names, call.results)


SPARSE_RAISES = RAISES + SCORE_MOD_RAISES + """
    TypeError: indices or topk_length is not int32.
    ValueError: indices is not (B, Hkv or 1, R, topk) ("bshd": (B, R, Hkv or 1, topk)),
        topk_length not (B, R) or negative.
"""

SPARSE_ATTENTION = Op(
    "sparse_attention",
    "Attention of each query row over exactly the keys its list names.",
    arguments=(Q, K, SPARSE_V, INDICES, SCALE, SINKS, SOFTCAP, ALIBI_SLOPES, SCORE_MOD_TENSORS, SCORE_MOD, TOPK_LENGTH,
               LAYOUT, RETURN_LSE),
    outputs=(OUTPUT, LSE),
    prepare=_prepare_forward,
    checks=attention_rules.CHECKS,
    key=lambda values: (_shared_latent(values["k"], values["v"]),),
    reference=reference.sparse_attention_reference,
    backward="sparse_attention_backward",
    gradients=GRADIENT_OF,
    details="""
    q, k, scale, sinks, softcap, alibi_slopes, layout and return_lse are as in `attention`
    ("bhsd": (B, Hq, R, D), (B, Hkv, C, D), (B, Hkv, C, Dv); "bshd" swaps the sequence and
    head axes), one float dtype, GQA, strides in place. There is no causal, window or mask: a
    row attends exactly the keys its list names (a gather, then dense attention over them,
    softcap capping each listed key's scaled score; ALiBi's distance |r + C - R - j| counts
    from query row r to the listed key's index j in k).
    """,
    returns="""
    As `attention`: the output o of q's kind, dtype and layout, (B, Hq, R, Dv), and with
    return_lse=True the tuple (o, lse), lse (B, Hq, R) float32 (natural log). A row with no
    valid entry gives 0, and lse -inf (the sink's logit with sinks).
    """,
    raises=SPARSE_RAISES,
    example="""
    import numpy as np
    import mfa_native
    from mfa_native.reference import sparse_attention_reference

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 16, 32), dtype=np.float32) for _ in range(3))
    indices = rng.integers(0, 16, size=(1, 1, 16, 4), dtype=np.int32)   # 4 keys per query row,
    indices[:, :, 0, 3] = -1                                            # shared by the kv heads; -1: none
    o = mfa_native.sparse_attention(q, k, v, indices, device="cpu")
    print(o.shape)   # (1, 2, 16, 32)
    assert np.allclose(o, sparse_attention_reference(q, k, v, indices), atol=1e-4)
    """)
sparse_attention = SPARSE_ATTENTION.function

SPARSE_ATTENTION_BACKWARD = Op(
    "sparse_attention_backward",
    "Exact gradients of `sparse_attention`: (dq, dk, dv), or (dq, dk, dv, dsinks) with sinks.",
    arguments=(Q, K, SPARSE_V, INDICES, O, LSE_IN, DO, SCALE, SINKS, SOFTCAP, ALIBI_SLOPES, SCORE_MOD_TENSORS,
               SCORE_MOD, TOPK_LENGTH, LAYOUT),
    outputs=GRADIENTS,
    prepare=_prepare_backward,
    checks=attention_rules.CHECKS,
    reference=reference.sparse_attention_backward_reference,
    no_backward="sparse_attention_backward has no second derivative",
    details="""
    No atomics and deterministic (two runs give the same bits): dq comes straight from the
    lists; dk and dv from the transposed lists (per key, the (query, slot) entries that
    list it), built on the device in the same pass. The arguments are those passed to
    `sparse_attention`, and o and lse what it returned (return_lse=True).
    """,
    returns="""
    (dq, dk, dv) of q's kind and dtype, laid out like q, k and v; with sinks, (dq, dk, dv,
    dsinks), dsinks being (Hq,) float32. dk and dv sum over the query heads of each kv head
    and over every listing of a key. When v is a view of k (MLA's shared latent), dk and dv
    are returned separately: the caller sums them (`dk[..., :Dv] += dv`).
    """,
    raises=SPARSE_RAISES + """
    TypeError: o or do has not q's dtype, lse is not float32.
    ValueError: o or do is not the output's shape, lse not (B, Hq, R).
    """,
    example="""
    import numpy as np
    import mfa_native
    from mfa_native.reference import sparse_attention_backward_reference

    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 2, 16, 32), dtype=np.float32) for _ in range(4))
    indices = rng.integers(0, 16, size=(1, 1, 16, 4), dtype=np.int32)
    o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True, device="cpu")
    dq, dk, dv = mfa_native.sparse_attention_backward(q, k, v, indices, o, lse, do, device="cpu")
    for got, expected in zip((dq, dk, dv), sparse_attention_backward_reference(q, k, v, do, indices)):
        assert np.allclose(got, expected, atol=1e-3)
    """)
sparse_attention_backward = SPARSE_ATTENTION_BACKWARD.function


def _indices(indices, binding: Binding) -> np.ndarray:
    """indices as bound: checked by its rule, its kv-head axis broadcast where it has size 1."""
    indices = check.as_array(indices, "indices")
    binding.check("indices", indices.shape, str(indices.dtype))
    return check.bindable(np.broadcast_to(indices, binding.expected("indices")))


def _indices_read(indices, shape: tuple[int, ...]) -> np.ndarray:
    """A warm call's indices (its signature fixes their dtype and shape) read as `shape`."""
    return check.bindable(np.broadcast_to(check.as_array(indices, "indices"), shape))


def _lengths(topk_length, binding: Binding) -> np.ndarray:
    """topk_length as bound: checked by its rule, then `_lengths_read`."""
    lengths = check.as_array(topk_length, "topk_length")
    binding.check("topk_length", lengths.shape, str(lengths.dtype))
    return _lengths_read(lengths, binding)


def _lengths_read(lengths, binding: Binding) -> np.ndarray:
    """topk_length's contents checked (every call: a warm call's signature fixes its dtype and
    shape, not its values) and bound."""
    lengths = check.as_array(lengths, "topk_length")
    binding.check_contents("topk_length", lengths)
    return check.normalized(lengths) if check.usable_in_place(lengths) else np.ascontiguousarray(lengths)


def _shared_latent(k, v) -> bool:
    """Whether v is k's first Dv features (MLA's shared latent): the same memory, rows and heads."""
    return (type(k) is np.ndarray and type(v) is np.ndarray and k.dtype == v.dtype and k.ndim == v.ndim == 4
            and v.shape[:3] == k.shape[:3] and v.shape[3] <= k.shape[3] and v.strides[:3] == k.strides[:3]
            and k.__array_interface__["data"][0] == v.__array_interface__["data"][0])


def _with_lists(call: Validated, indices, topk_length, shared_kv: bool) -> Validated:
    """`call` with the token lists checked and their layout in the problem."""
    p = call.problem
    bound, converts = dict(call.bound), dict(call.converts)
    binding = call.binding.with_rules(LIST_RULES)
    bound["indices"] = _indices(indices, binding)
    shape = bound["indices"].shape
    converts["indices"] = None if same_memory(indices, bound["indices"]) else (lambda x: _indices_read(x, shape))
    length_strides = None
    if topk_length is not None:
        bound["topk_length"] = _lengths(topk_length, binding)
        converts["topk_length"] = lambda x: _lengths_read(x, binding)
        length_strides = tuple(s // 4 for s in bound["topk_length"].strides)
    index_strides = physical(check.element_strides(bound["indices"]), p.layout)
    tokens = TokenLists(bound["indices"].shape[-1], index_strides, length_strides, shared_kv)
    return Validated(replace(p, keys=tokens), bound, converts)
