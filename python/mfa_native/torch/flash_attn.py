"""flash-attn's functions, by its names, computed by mfa_native (differentiable through the
declared ops' torch custom ops, library.py).

`flash_attn_func`, `flash_attn_kvpacked_func` and `flash_attn_qkvpacked_func` are
`mfa_native.attention` in flash-attn's (B, S, H, D) layout; `flash_attn_varlen_func` is
`mfa_native.attention_varlen` with flash-attn's arguments and results. What flash-attn has and
mfa_native does not (dropout, a soft cap, ALiBi, the attention probabilities of the dense
functions) raises NotImplementedError naming the argument; `deterministic` is accepted and always
holds (the backward has no atomics). `flash_attn_with_kvcache` is `mfa_native.attention_with_kvcache`.
"""

from __future__ import annotations

from ..ops.varlen import ATTENTION_VARLEN
from .functional import attention
from .library import torch_function

attention_varlen = torch_function(ATTENTION_VARLEN)


def unsupported(**features) -> None:
    """NotImplementedError for the first of flash-attn's features asked for (a value other than
    its default of off)."""
    for name, value in features.items():
        if value is not None and (not isinstance(value, (int, float)) or value != 0.0):
            shown = value if isinstance(value, (int, float)) else f"a {type(value).__name__}"
            raise NotImplementedError(f"{name}={shown}: mfa_native does not implement it; leave it at its "
                                      "default (0, None or False)")


def window_of(window_size) -> tuple[int, int] | None:
    """flash-attn's window_size (left, right), -1 = unbounded on that side, as attention's window:
    the same (left, right) band around each sequence's lower-right diagonal; (-1, -1) is none."""
    left, right = (int(side) for side in window_size)
    return None if (left, right) == (-1, -1) else (left, right)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_func: q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), Hq a
    multiple of Hkv (MQA/GQA); float32, float16 or bfloat16. softmax_scale defaults to
    1/sqrt(D); causal is bottom-right aligned (query i sees keys up to i + Sk - Sq);
    window_size = (left, right): query i sees keys [i + Sk - Sq - left, i + Sk - Sq + right],
    -1 unbounded (with causal, right is 0). Returns out (B, Sq, Hq, Dv), differentiable
    (dq, dk, dv). dropout_p, softcap, alibi_slopes and return_attn_probs other than their
    defaults raise NotImplementedError naming them; deterministic is accepted (always holds).
    A row that sees no key is 0, as flash-attn's."""
    unsupported(dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes, return_attn_probs=return_attn_probs)
    return attention(q, k, v, scale=softmax_scale, causal=bool(causal), window=window_of(window_size), layout="bshd")


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_kvpacked_func: `flash_attn_func` with kv (B, Sk, 2, Hkv, D) holding k
    and v (read in place, strided; the gradient reaches kv through the views)."""
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_qkvpacked_func: `flash_attn_func` with qkv (B, S, 3, H, D) holding q,
    k and v (self-attention, Hq = Hkv; read in place, strided)."""
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_varlen_func: q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k,
    Hkv, Dv); cu_seqlens_q, cu_seqlens_k int32 (B + 1,). causal is bottom-right aligned (the
    last query of a sequence sees its last key); window_size = (left, right): query i sees
    keys [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right], -1 unbounded
    (with causal, right is 0). Returns out (total_q, Hq, Dv); with return_attn_probs
    (out, softmax_lse, None): softmax_lse (Hq, total_q) float32, and no S_dmask (it exists
    for dropout, which is not implemented)."""
    unsupported(dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes)
    hints = {name: None if value is None else int(value)
             for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k))}
    result = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **hints, scale=softmax_scale,
                              causal=bool(causal), window=window_of(window_size), return_lse=bool(return_attn_probs))
    return (*result, None) if return_attn_probs else result


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash_attn.flash_attn_with_kvcache: q (B, R, Hq, D); k_cache, v_cache (B, Cmax, Hkv, D)
    or, with block_table (B, max_blocks) int32, pages (num_blocks, page_size, Hkv, D); k, v
    (B, Rn, Hkv, D) appended in place at cache_seqlens (an int or int32 (B,), not modified;
    None: every sequence is the whole cache, Cmax or max_blocks * page_size, as flash-attn);
    causal aligns the last query with the last attended key. Returns out, or (out,
    softmax_lse) with return_softmax_lse. Rotary embedding, cache_batch_idx, cache_leftpad,
    softcap and ALiBi raise NotImplementedError; num_splits is a hint and ignored."""
    import torch

    unsupported(rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                cache_leftpad=cache_leftpad, softcap=softcap, alibi_slopes=alibi_slopes)
    from ..ops.kvcache import attention_with_kvcache

    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32)
    return attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k=k, v=v, block_table=block_table,
                                  scale=softmax_scale, causal=bool(causal), window=window_of(window_size),
                                  return_lse=bool(return_softmax_lse))


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_varlen_kvpacked_func: `flash_attn_varlen_func` with kv (total_k, 2,
    Hkv, D) holding k and v (read in place, strided)."""
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn.flash_attn_varlen_qkvpacked_func: `flash_attn_varlen_func` with qkv (total, 3, H,
    D) holding q, k and v of the same sequences (cu_seqlens for both)."""
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
