"""`mfa_native.block_sparse_attention` and its backward: attention over the key blocks a
BlockMask lists (FlexAttention's semantics), with the dense kernels' rules inside partial
blocks. The kernels are attention's, walking block lists instead of one key range."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import codegen, reference
from ..runtime.devices import tuning_facts
from .arguments import causal_mode, is_empty
from .attention import (ALIBI_SLOPES, CAUSAL, GRADIENT_OF, K, LAYOUT, LSE, MASK, OUTPUT, Q, RAISES, RETURN_LSE, SCALE,
                        SINKS, SOFTCAP, V, WINDOW, Validated, validate)
from .attention_backward import DO, GRADIENTS, LSE_IN, O, validate_backward
from .block_mask import BITS, PAIRS, BlockMask
from .declaration import Arg, Call, Op
from .flex_bits import as_block_mask
from .score_mod import SCORE_MOD, SCORE_MOD_RAISES, SCORE_MOD_TENSORS, with_score_mod
from .empty import empty_backward, empty_forward
from .rules import Binding
from .warm import prepared_call

LISTS = tuple(name for pair in PAIRS for name in pair) + BITS


def _expand(block_mask) -> tuple[tuple, tuple]:
    """A BlockMask's arrays (the signature's and the pass's) and its structure; a torch
    (FlexAttention) BlockMask is converted first (`BlockMask.from_torch`, once per mask)."""
    block_mask = as_block_mask(block_mask)
    return tuple(block_mask.array(name) for name in LISTS), block_mask.structure


def _take_apart(block_mask) -> dict:
    """A block mask's arrays and structure by the names of its torch schema (torch/library.py)."""
    block_mask = as_block_mask(block_mask)
    return {**{name: block_mask.array(name) for name in LISTS}, "block_size": list(block_mask.block_size),
            "seq_lengths": None if block_mask.shape is None else list(block_mask.shape)}


def _rebuild(parts: dict) -> BlockMask:
    shape = parts["seq_lengths"]
    return BlockMask(**{name: parts[name] for name in LISTS}, block_size=tuple(parts["block_size"]),
                     shape=None if shape is None else tuple(shape))


BLOCK_MASK = Arg("block_mask", "lists", keyword=False, expand=_expand, names=LISTS,
                 parts=(("block_size", "int[]"), ("seq_lengths", "int[]?")), take_apart=_take_apart,
                 rebuild=_rebuild, doc="""
    a `BlockMask` for (R, C) = (q's length, k's length); its H axis is the query-head count,
    or 1. A torch.nn.attention.flex_attention.BlockMask is converted (`BlockMask.from_torch`,
    mask_mod included) once per mask object.""")


BLOCK_CAUSAL = replace(CAUSAL, default=None, doc=CAUSAL.doc + """
    None (the default): the block mask's own rule (from_mask's causal), else False.""")
BLOCK_WINDOW = replace(WINDOW, doc=WINDOW.doc + """
    None: the block mask's own (from_mask's window), else none.""")
BLOCK_RULE_MASK = replace(MASK, doc=MASK.doc + """
    None: the block mask's own (the mask from_mask classified, as it was given), else none.""")


def _with_rule(values: dict) -> dict:
    """The call with the block mask's rule (from_mask's causal, window and mask) filling the
    arguments not given; ValueError naming an argument given otherwise (the lists were built by
    that rule: full blocks would not follow another)."""
    rule = getattr(values["block_mask"], "rule", None)
    if rule is None:
        return values if values["causal"] is not None else {**values, "causal": False}
    values = dict(values)
    given = {"causal": values["causal"], "window": values["window"], "mask": values["mask"]}
    if given["causal"] is not None and causal_mode(given["causal"]) != rule.causal:
        raise ValueError(f"causal={given['causal']!r} contradicts the block mask's rule (from_mask with causal="
                         f"{rule.causal!r}): omit causal, or pass the mask's")
    if given["window"] is not None and tuple(given["window"]) != rule.window:
        raise ValueError(f"window={given['window']!r} contradicts the block mask's rule (from_mask with window="
                         f"{rule.window!r}): omit window, or pass the mask's")
    if given["mask"] is not None and given["mask"] is not rule.mask and not _same_values(given["mask"], rule.mask):
        raise ValueError("mask differs from the one the block mask was built from (from_mask's): omit mask, or "
                         "pass the same")
    values.update(causal=rule.causal, window=rule.window, mask=rule.mask)
    return values


def _same_values(a, b) -> bool:
    if a is None or b is None:
        return False
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=True))


def _prepare_forward(call: Call, device):
    block_mask = as_block_mask(call.block_mask)
    checked, lists = _with_lists(validate((call.q, call.k, call.v, call.mask, call.sinks), scale=call.scale,
                                          causal=call.causal, window=call.window, layout=call.layout,
                                          return_lse=call.return_lse, softcap=call.softcap,
                                          alibi_slopes=call.alibi_slopes), block_mask)
    checked, tensors = with_score_mod(checked, call.score_mod, call.score_mod_tensors)
    p, names = checked.problem, call.op.array_names + tensors
    if is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        return empty_forward(p, names, checked)
    description = codegen.attention_pass(p, family=tuning_facts(device).family)
    return prepared_call(description, device, checked, names, call.results, _list_check(lists, names))


def _prepare_backward(call: Call, device):
    backward = validate_backward((call.q, call.k, call.v, call.o, call.lse, call.do, call.mask, call.sinks),
                                 scale=call.scale, causal=call.causal, window=call.window, layout=call.layout,
                                 softcap=call.softcap, alibi_slopes=call.alibi_slopes)
    block_mask = as_block_mask(call.block_mask)
    forward, lists = _with_lists(Validated(backward.problem.forward, backward.bound, backward.converts), block_mask)
    forward, tensors = with_score_mod(forward, call.score_mod, call.score_mod_tensors)
    problem = replace(backward.problem, forward=forward.problem)
    p = problem.forward
    names = _bindings(call.op.array_names) + tensors
    if is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        return empty_backward(p, names, forward)
    description = codegen.attention_backward_pass(problem, family=tuning_facts(device).family)
    return prepared_call(description, device, forward, names, call.results, _list_check(lists, names),
                         _transpose_check if forward.problem.keys.transposed_given else None)


def _bindings(names: tuple[str, ...]) -> tuple[str, ...]:
    """The pass's names of the backward's arrays (do binds as dout)."""
    return tuple("dout" if n == "do" else n for n in names)


BLOCK_RAISES = RAISES + SCORE_MOD_RAISES + """
    TypeError: block_mask is neither a BlockMask nor a torch FlexAttention BlockMask.
    ValueError: the block mask does not fit the problem (its counts, indices or leading axes,
        or its shape, against B, Hq, R and C), or causal, window or mask contradict the rule of
        a `BlockMask.from_mask` mask (naming the argument).
"""

BLOCK_SPARSE_ATTENTION = Op(
    "block_sparse_attention",
    "Attention over the key blocks `block_mask` lists for each query block.",
    arguments=(Q, K, V, BLOCK_MASK, SCALE, BLOCK_CAUSAL, BLOCK_RULE_MASK, BLOCK_WINDOW, SINKS, SOFTCAP, ALIBI_SLOPES,
               SCORE_MOD_TENSORS, SCORE_MOD, LAYOUT, RETURN_LSE),
    outputs=(OUTPUT, LSE),
    prepare=_prepare_forward,
    resolve=_with_rule,
    reference=reference.block_sparse_attention_reference,
    backward="block_sparse_attention_backward",
    gradients=GRADIENT_OF,
    details="""
    Query (b, h, r) sees key c iff c lies in a block its query block lists, and either the
    block is in the full lists, or it is in the partial lists and causal, window and a
    boolean `mask` allow (r, c) exactly as in `attention`. The logit is attention's: scale *
    q . k, capped with softcap, less ALiBi's slope[h] * |r + C - R - c| with alibi_slopes,
    then an additive `mask` added wherever (r, c) is visited. A block listed twice (in one
    list, or in both) is visited twice (its keys count twice in the softmax), as in
    FlexAttention. The other arguments are `attention`'s (shapes, dtypes, GQA, D and Dv).
    The lists' contents are checked on every call.
    """,
    returns="""
    As `attention`: the output o, (B, Hq, R, Dv) ("bshd": (B, R, Hq, Dv)) of q's kind and
    dtype, and with return_lse=True the tuple (o, lse), lse (B, Hq, R) float32. Rows that
    see nothing give 0, and lse -inf (the sink's logit with sinks).
    """,
    raises=BLOCK_RAISES,
    example="""
    import numpy as np
    import mfa_native
    from mfa_native.reference import attention_reference

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 16, 32), dtype=np.float32) for _ in range(3))
    # Blocks of 8 queries and 8 keys. Query block 0 visits key block 0 (partial: causal applies
    # inside it); query block 1 visits key block 1 (partial) and key block 0 (full: all allowed).
    block_mask = mfa_native.BlockMask(
        kv_num_blocks=np.array([[[1, 1]]], dtype=np.int32),              # (B|1, H|1, ceil(R / 8))
        kv_indices=np.array([[[[0], [1]]]], dtype=np.int32),             # (B|1, H|1, ceil(R / 8), W)
        full_kv_num_blocks=np.array([[[0, 1]]], dtype=np.int32),
        full_kv_indices=np.array([[[[0], [0]]]], dtype=np.int32),        # row 0's entry: past its count
        block_size=8)
    o = mfa_native.block_sparse_attention(q, k, v, block_mask, causal=True, device="cpu")
    print(o.shape)   # (1, 2, 16, 32): here causal attention, computed block by block
    assert np.allclose(o, attention_reference(q, k, v, causal=True), atol=1e-4)
    """)
block_sparse_attention = BLOCK_SPARSE_ATTENTION.function

BLOCK_SPARSE_ATTENTION_BACKWARD = Op(
    "block_sparse_attention_backward",
    "Gradients of `block_sparse_attention`, as `attention_backward` returns them.",
    arguments=(Q, K, V, O, LSE_IN, DO, BLOCK_MASK, SCALE, BLOCK_CAUSAL, BLOCK_RULE_MASK, BLOCK_WINDOW, SINKS, SOFTCAP,
               ALIBI_SLOPES, SCORE_MOD_TENSORS, SCORE_MOD, LAYOUT),
    outputs=GRADIENTS,
    prepare=_prepare_backward,
    resolve=_with_rule,
    reference=reference.block_sparse_attention_backward_reference,
    no_backward="block_sparse_attention_backward has no second derivative",
    details="""
    No atomics: the dK/dV kernel walks the transposed lists, built from the kv lists on the
    device in the same pass. The block mask's q lists, when it has them, are checked there
    against the built ones: for each key block, the counted part of q_indices must hold the
    query blocks whose kv_indices list that block, each as often as it is listed, in any
    order (FlexAttention's are ascending), and full_q_indices the same for the full lists.
    o and lse are what `block_sparse_attention(..., return_lse=True)` returned for the same
    block mask; the other arguments are those passed to it.
    """,
    returns="""
    (dq, dk, dv) of q's kind and dtype, laid out like q, k and v; with sinks, (dq, dk, dv,
    dsinks), dsinks being (Hq,) float32. With GQA, dk and dv sum the query heads of each kv
    head. The mask gets no gradient.
    """,
    raises=BLOCK_RAISES + """
    ValueError: the block mask's q lists are not the transpose of its kv lists (naming
        q_indices or full_q_indices); o, do or lse of the wrong shape.
    TypeError: o or do has not q's dtype, lse is not float32.
    """,
    example="""
    import numpy as np
    import mfa_native
    from mfa_native.reference import attention_backward_reference

    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 2, 16, 32), dtype=np.float32) for _ in range(4))
    block_mask = mfa_native.BlockMask(np.array([[[1, 2]]], dtype=np.int32),       # kv_num_blocks
                                      np.array([[[[0, 0], [0, 1]]]], dtype=np.int32),   # kv_indices
                                      block_size=8)
    o, lse = mfa_native.block_sparse_attention(q, k, v, block_mask, causal=True, return_lse=True, device="cpu")
    dq, dk, dv = mfa_native.block_sparse_attention_backward(q, k, v, o, lse, do, block_mask, causal=True,
                                                            device="cpu")
    for got, expected in zip((dq, dk, dv), attention_backward_reference(q, k, v, do, causal=True)):
        assert np.allclose(got, expected, atol=1e-3)   # these blocks with causal: causal attention
    """)
block_sparse_attention_backward = BLOCK_SPARSE_ATTENTION_BACKWARD.function


def _with_lists(call: Validated, block_mask: BlockMask) -> tuple[Validated, Binding]:
    """`call` (attention's checked arguments) with the block mask's lists checked for its
    problem, and the binding that checked them (a warm call's list check)."""
    p = call.problem
    checked = block_mask.checked(p.batch, p.q_heads, p.q_len, p.kv_len)
    converts = {**call.converts, **checked.converts}
    return Validated(replace(p, keys=checked.lists), {**call.bound, **checked.arrays}, converts), checked.binding


def _transpose_check(outputs: dict[str, np.ndarray]) -> None:
    """ValueError naming the given q lists that are not the transpose of the kv lists (the
    pass's q_lists_differ: per list pair and key block, bit 1 q lists, bit 2 full_q lists)."""
    differ = outputs[codegen.Q_LISTS_DIFFER]
    for bit, given, source in ((1, "q_indices", "kv_indices"), (2, "full_q_indices", "full_kv_indices")):
        wrong = np.argwhere(differ & bit)
        if wrong.size:
            b, h, block = wrong[0]
            raise ValueError(f"{given} is not the transpose of {source} for {len(wrong)} key block(s), the "
                             f"first key block {block} of list batch {b}, head {h}: the counted part of a key "
                             f"block's list must hold the query blocks whose {source} list it, each as often as "
                             f"listed, in any order")


def _list_check(binding: Binding, names: tuple[str, ...]):
    """The warm path's check of the lists' contents (the arguments named LISTS in `names`), by
    the binding of the cold call's lists (a warm call's have their shapes: its signature's)."""
    at = tuple(names.index(name) for name in LISTS)
    return lambda arguments: binding.check_contents_of({name: arguments[i] for name, i in zip(LISTS, at)})