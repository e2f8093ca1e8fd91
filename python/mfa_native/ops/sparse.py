"""`mfa_native.sparse_attention`: each query row attends exactly the keys its token list names
(DeepSeek sparse attention; FlashMLA's `[s_q, h_kv, topk]` lists with a batch axis)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import codegen
from ..codegen import physical
from ..codegen.problem import TokenLists
from ..runtime.devices import Device, resolve_device, tuning_facts
from ..runtime.runner import PreparedPass
from . import arguments as check
from .attention import Validated, validate
from .attention_backward import validate_backward
from .empty import empty_backward, empty_forward
from .given_kind import returns_given_kind
from .warm import PreparedCall, SignatureCache, pick, same_memory, signature

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
    key = signature(arrays, (scale, layout, return_lse), device)
    call = _calls.get(key)
    if call is not None:
        return call(arrays)
    checked = _with_lists(validate(arrays[:5], scale=scale, causal=False, window=None, layout=layout,
                                   return_lse=return_lse), indices, topk_length)
    p = checked.problem
    if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        empty, names = empty_forward(p, ARGUMENTS, checked.converts)
        return empty.run([checked.bound[name] for name in names])
    prepared = PreparedPass(codegen.attention_pass(p, family=tuning_facts(device).family), device)
    o = prepared.output_names.index("o")
    lse = prepared.output_names.index("lse") if return_lse else None
    finish = (lambda outputs: (outputs[o], outputs[lse])) if return_lse else (lambda outputs: outputs[o])
    call = PreparedCall(prepared, pick(prepared.input_names, ARGUMENTS, checked.converts), finish)
    _calls.put(key, call)
    return call.run([checked.bound[name] for name in prepared.input_names])


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
    call = _backward_calls.get(key)
    if call is not None:
        return call(arrays)
    backward = validate_backward(arrays[:8], scale=scale, causal=False, window=None, layout=layout)
    forward = _with_lists(Validated(backward.problem.forward, backward.bound, backward.converts), indices,
                          topk_length)
    problem = replace(backward.problem, forward=forward.problem)
    p = problem.forward
    if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        empty, names = empty_backward(p, BACKWARD_ARGUMENTS, forward.converts)
        return empty.run([forward.bound[name] for name in names])
    prepared = PreparedPass(codegen.attention_backward_pass(problem, family=tuning_facts(device).family), device)
    wanted = ("dq", "dk", "dv", "dsinks") if p.sinks else ("dq", "dk", "dv")
    order = tuple(prepared.output_names.index(name) for name in wanted)
    call = PreparedCall(prepared, pick(prepared.input_names, BACKWARD_ARGUMENTS, forward.converts),
                        lambda outputs: tuple(outputs[i] for i in order))
    _backward_calls.put(key, call)
    return call.run([forward.bound[name] for name in prepared.input_names])


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


def _with_lists(call: Validated, indices, topk_length) -> Validated:
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
    tokens = TokenLists(bound["indices"].shape[-1], index_strides, length_strides)
    return Validated(replace(p, tokens=tokens), bound, converts)
