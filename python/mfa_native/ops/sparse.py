"""`mfa_native.sparse_attention`: each query row attends exactly the keys its token list names
(DeepSeek sparse attention; FlashMLA's `[s_q, h_kv, topk]` lists with a batch axis)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import codegen
from ..codegen import physical
from ..codegen import TokenLists
from ..codegen.sparse import topk as sparse_topk_codegen
from ..runtime.devices import Device, resolve_device, tuning_facts
from ..runtime.runner import PreparedPass
from ..runtime.templates import evaluate
from . import arguments as check
from .attention import Validated, forward_results, validate
from .attention_backward import gradients, validate_backward
from .empty import empty_backward, empty_forward
from .given_kind import returns_given_kind
from .warm import SignatureCache, prepared_call, run, same_memory, signature

ARGUMENTS = ("q", "k", "v", "mask", "sinks", "indices", "topk_length")
BACKWARD_ARGUMENTS = ("q", "k", "v", "o", "lse", "dout", "mask", "sinks", "indices", "topk_length")
_calls = SignatureCache()
_backward_calls = SignatureCache()


@returns_given_kind(("q", "k", "v"), ("indices", "topk_length", "sinks"))
def sparse_attention(q, k, v, indices, *, scale=None, sinks=None, topk_length=None, layout="bhsd",
                     return_lse=False, device: Device | str | None = None):
    """Attention of each query row over exactly the keys its list names.

    Args:
        q, k, v: as in `attention` ("bhsd": (B, Hq, R, D), (B, Hkv, C, D), (B, Hkv, C, Dv);
            "bshd" swaps the sequence and head axes), one float dtype, GQA, strides in place.
            v may be a view of k (MLA's shared latent: v = k[..., :Dv]).
        indices: int32 (B, Hkv, R, topk) in "bhsd", (B, R, Hkv, topk) in "bshd": query row r
            of query head h attends keys indices[b, h // (Hq // Hkv), r, :]. An entry < 0 or
            >= C is skipped wherever it appears; a key listed twice counts twice (a gather,
            then dense attention). Any non-negative strides; a kv-head axis of size 1 or
            stride 0 shares one list among the kv heads (as sparse_topk returns it).
        topk_length: int32 (B, R), optional: only the first topk_length[b, r] entries of each
            list are read (an entry above topk reads the whole list; negative is an error).
        scale, sinks, layout, return_lse, device: as in `attention`.

    Returns:
        As `attention`: the output, and with return_lse the (B, Hq, R) float32 lse (natural
        log). A row with no valid entry gives 0, and lse -inf (the sink's logit with sinks).
    """
    device = resolve_device(device)
    arrays = (q, k, v, None, sinks, indices, topk_length)
    shared = _shared_latent(k, v)
    key = signature(arrays, (scale, layout, return_lse, shared), device)

    def prepare():
        checked = _with_lists(validate(arrays[:5], scale=scale, causal=False, window=None, layout=layout,
                                       return_lse=return_lse), indices, topk_length, shared)
        p = checked.problem
        if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
            return empty_forward(p, ARGUMENTS, checked)
        description = codegen.attention_pass(p, family=tuning_facts(device).family)
        return prepared_call(description, device, checked, ARGUMENTS, forward_results(return_lse))

    return run(_calls, key, arrays, prepare)


@returns_given_kind(("q", "k", "v"), ("o", "lse", "do", "indices", "topk_length", "sinks"))
def sparse_attention_backward(q, k, v, indices, o, lse, do, *, scale=None, sinks=None, topk_length=None,
                              layout="bhsd", device: Device | str | None = None):
    """Exact gradients of `sparse_attention`: (dq, dk, dv), or (dq, dk, dv, dsinks) with sinks.

    dk and dv sum over the query heads of each kv head and over every listing of a key. No
    atomics and deterministic (two runs give the same bits): dq comes straight from the
    lists; dk and dv from the transposed lists (per key, the (query, slot) entries that
    list it), built on the device in the same pass. When v is a view of k (MLA's shared
    latent), dk and dv are returned separately: the caller sums them (dk[..., :Dv] += dv).

    Args:
        q, k, v, indices, scale, sinks, topk_length, layout, device: as passed to
            `sparse_attention`.
        o, lse: what `sparse_attention(..., return_lse=True)` returned. do: the gradient of
            the loss with respect to o, shaped and typed like o.
    """
    device = resolve_device(device)
    arrays = (q, k, v, o, lse, do, None, sinks, indices, topk_length)
    key = signature(arrays, (scale, layout), device)

    def prepare():
        backward = validate_backward(arrays[:8], scale=scale, causal=False, window=None, layout=layout)
        forward = _with_lists(Validated(backward.problem.forward, backward.bound, backward.converts), indices,
                              topk_length, False)
        problem = replace(backward.problem, forward=forward.problem)
        p = problem.forward
        if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
            return empty_backward(p, BACKWARD_ARGUMENTS, forward)
        description = codegen.attention_backward_pass(problem, family=tuning_facts(device).family)
        return prepared_call(description, device, forward, BACKWARD_ARGUMENTS, gradients(p.sinks))

    return run(_backward_calls, key, arrays, prepare)


def _indices(indices, shape: tuple[int, int, int], layout: str) -> np.ndarray:
    """indices as bound: int32, its kv-head axis broadcast where it has size 1, slots contiguous."""
    batch, kv_heads, q_len = shape
    indices = check.as_array(indices, "indices")
    if indices.dtype != np.int32:
        raise TypeError(f"indices must be int32, got {indices.dtype}")
    expected = physical((batch, kv_heads, q_len), layout) if layout == "bhsd" else (batch, q_len, kv_heads)
    axes = "(B, Hkv, R, topk)" if layout == "bhsd" else "(B, R, Hkv, topk)"
    if indices.ndim != 4:
        raise ValueError(f"indices must have 4 dimensions {axes}, got shape {indices.shape}")
    head_axis = 1 if layout == "bhsd" else 2
    full = list(indices.shape)
    full[head_axis] = kv_heads if indices.shape[head_axis] == 1 else indices.shape[head_axis]
    if tuple(full[:3]) != expected:
        raise ValueError(f"indices must have shape {axes} = {(*expected, 'topk')}, got {indices.shape}")
    return check.bindable(np.broadcast_to(indices, tuple(full)))


def _lengths(topk_length, shape: tuple[int, int]) -> np.ndarray:
    """topk_length as bound: int32 (B, R), no negative entry."""
    lengths = check.as_array(topk_length, "topk_length")
    if lengths.dtype != np.int32:
        raise TypeError(f"topk_length must be int32, got {lengths.dtype}")
    if lengths.shape != shape:
        raise ValueError(f"topk_length must have shape (B, R) = {shape}, got {lengths.shape}")
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"topk_length must not be negative, got {lengths.min()}")
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
    shape = (p.batch, p.kv_heads, p.q_len)
    bound["indices"] = _indices(indices, shape, p.layout)
    converts["indices"] = None if same_memory(indices, bound["indices"]) else \
        (lambda x: _indices(x, shape, p.layout))
    length_strides = None
    if topk_length is not None:
        bound["topk_length"] = _lengths(topk_length, (p.batch, p.q_len))
        converts["topk_length"] = lambda x: _lengths(x, (p.batch, p.q_len))  # contents: checked every call
        length_strides = tuple(s // 4 for s in bound["topk_length"].strides)
    index_strides = physical(check.element_strides(bound["indices"]), p.layout)
    tokens = TokenLists(bound["indices"].shape[-1], index_strides, length_strides, shared_kv)
    return Validated(replace(p, keys=tokens), bound, converts)


@returns_given_kind(("q", "k"), ("weights",))
def sparse_topk(q, k, weights, topk: int, *, causal: bool = True, layout: str = "bhsd", return_scores: bool = False,
                device: Device | str | None = None):
    """DeepSeek's lightning indexer and top-k: the keys each query row should attend.

    score[b, r, c] = sum over indexer heads h of weights[b, h, r] * relu(q[b, h, r] . k[b, 0, c]),
    computed in float32; the topk candidates of each row by descending score (equal scores:
    the lower key first), padded with -1 where a row has fewer candidates.

    Args:
        q: (B, Hi, R, Di) indexer queries in "bhsd", (B, R, Hi, Di) in "bshd"; float32,
            float16 or bfloat16. k: (B, 1, C, Di) ("bshd": (B, C, 1, Di)), q's dtype: one
            indexer key per token. weights: (B, Hi, R) float32 ("bshd": (B, R, Hi)).
        topk: how many keys to keep per row (>= 0; more than C pads).
        causal: key c is a candidate for row r iff c <= r + C - R (lower right, as
            `attention`'s causal=True); False: every key is.
        return_scores: also return the matching float32 scores (-inf at padding).

    Returns:
        indices, int32 (B, 1, R, topk) ("bshd": (B, R, 1, topk)), to pass to
        `sparse_attention` (broadcast it over the kv heads: np.broadcast_to gives stride 0);
        with return_scores, (indices, scores).
    """
    device = resolve_device(device)
    layout = check.layout_of(layout)
    q, k = check.as_array(q, "q"), check.as_array(k, "k")
    weights = check.as_array(weights, "weights")
    dtype = check.dtype_of(q, "q")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}; q and k must share one dtype")
    if weights.dtype != np.float32:
        raise TypeError(f"weights must be float32, got {weights.dtype}")
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)):
        raise TypeError(f"topk must be an int, got {type(topk).__name__}")
    if topk < 0:
        raise ValueError(f"topk must not be negative, got {topk}")
    causal = check.flag(causal, "causal")
    return_scores = check.flag(return_scores, "return_scores")
    for x, name in ((q, "q"), (k, "k")):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {x.shape}")
    B, Hi, R, Di = physical(q.shape, layout)
    kb, one, C, kd = physical(k.shape, layout)
    if kb != B or one != 1 or kd != Di:
        want = "(B, 1, C, Di)" if layout == "bhsd" else "(B, C, 1, Di)"
        raise ValueError(f"k must have shape {want} with q's B = {B} and Di = {Di}, got {k.shape}")
    expected = (B, Hi, R) if layout == "bhsd" else (B, R, Hi)
    if weights.shape != expected:
        raise ValueError(f"weights must have shape {expected}, got {weights.shape}")
    for name, size in (("B (batch)", B), ("Hi (indexer heads)", Hi), ("R (query length)", R),
                       ("C (key length)", C), ("topk", topk)):
        if size > check.MAX_INDEX:
            raise ValueError(f"{name} is {size}; it must be below 2**31")
    out_shape = (B, 1, R, topk) if layout == "bhsd" else (B, R, 1, topk)
    if B * Hi * R * C * topk == 0 or Di == 0:
        indices = np.full(out_shape, -1, np.int32)
        scores = np.full(out_shape, -np.inf, np.float32)
        if Hi == 0 or Di == 0:  # every score is 0: the candidates in key order
            n = np.minimum(np.arange(R) + C - R + 1 if causal else np.full(R, C), C).clip(0)
            for r in range(R):
                kept = min(int(n[r]), topk)
                row = (slice(None), 0, r) if layout == "bhsd" else (slice(None), r, 0)
                indices[row + (slice(0, kept),)] = np.arange(kept, dtype=np.int32)
                scores[row + (slice(0, kept),)] = 0.0
        return (indices, scores) if return_scores else indices
    q, k = check.bindable(q), check.bindable(k)
    weights = check.normalized(weights) if check.usable_in_place(weights) else np.ascontiguousarray(weights)
    logical = {"q": physical(check.element_strides(q), layout), "k": physical(check.element_strides(k), layout),
               "weights": (*(s // 4 for s in (weights.strides if layout == "bhsd" else
                                              (weights.strides[0], weights.strides[2], weights.strides[1]))), 0)}
    descriptor = sparse_topk_codegen.describe_topk(dtype=dtype, shape=dict(B=B, Hi=Hi, R=R, C=C, K=topk, Di=Di),
                                                   strides=logical, layout=layout, causal=causal)
    description = evaluate(sparse_topk_codegen.topk_template(descriptor), dict(B=B, Hi=Hi, R=R, C=C, K=topk))
    prepared = PreparedPass(description, device)
    arrays = {"q": q, "k": k, "weights": weights}
    outputs = dict(zip(prepared.output_names, prepared.run([arrays[name] for name in prepared.input_names])))
    return (outputs["indices"], outputs["topk_scores"]) if return_scores else outputs["indices"]
