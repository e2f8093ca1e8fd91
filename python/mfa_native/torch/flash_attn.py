"""flash-attn's functions, by its names, computed by mfa_native (differentiable through the
declared ops' torch custom ops, library.py).

`flash_attn_func`, `flash_attn_kvpacked_func` and `flash_attn_qkvpacked_func` are
`mfa_native.attention` in flash-attn's (B, S, H, D) layout; `flash_attn_varlen_func` is
`mfa_native.attention_varlen` with flash-attn's arguments and results. What flash-attn has and
mfa_native does not (dropout, a soft cap, ALiBi, the attention probabilities of the dense
functions) raises NotImplementedError naming the argument; `deterministic` is accepted and always
holds (the backward has no atomics). `flash_attn_with_kvcache` is `mfa_native.attention_with_kvcache`.
The options the functions share are documented once (_OPTIONS).
"""

from __future__ import annotations

import inspect

import torch

from ..ops.declaration import document
from ..ops.kvcache import attention_with_kvcache
from ..ops.varlen import ATTENTION_VARLEN
from .cache_rows import paged_view
from .functional import attention
from .library import torch_function

attention_varlen = torch_function(ATTENTION_VARLEN, example="""
    import numpy as np
    import torch
    import mfa_native.torch
    from mfa_native.reference import attention_varlen_reference

    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 5, 16], dtype=torch.int32)   # two sequences: rows 0..4 and 5..15
    q, k, v = (torch.randn(16, 2, 32, requires_grad=True) for _ in range(3))   # (total, H, D)
    o = mfa_native.torch.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, causal=True)
    o.sum().backward()   # through mfa_native.attention_varlen_backward
    expected = attention_varlen_reference(*(x.detach().numpy() for x in (q, k, v)), cu_seqlens.numpy(),
                                          cu_seqlens.numpy(), causal=True)
    assert np.allclose(o.detach().numpy(), expected, atol=1e-4) and k.grad.shape == k.shape
    """)

# flash-attn's options, as its functions take them (each function's docstring lists its own).
_OPTIONS = {
    "dropout_p": "0.0 only: mfa_native has no attention dropout (another value raises NotImplementedError).",
    "softmax_scale": "the logit scale; None: 1 / sqrt(D).",
    "causal": """
        bottom-right aligned, as flash-attn 2.1+: query i of a sequence of Sq queries and Sk
        keys sees keys up to i + Sk - Sq.""",
    "window_size": """
        (left, right): query i sees keys i + Sk - Sq - left .. i + Sk - Sq + right; -1 leaves
        a side unbounded, (-1, -1) is no window. With causal, right is 0.""",
    "softcap": """
        above 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2, Grok), in the
        kernels, forward and backward; 0.0 (or below, as flash-attn) is no cap.""",
    "alibi_slopes": """
        (nheads,) or (batch_size, nheads) float32, optional: ALiBi, a bias of
        -slope * |i + Sk - Sq - j| on query i's score of key j, in the kernels (not differentiated).""",
    "deterministic": "accepted, and always holds: the backward uses no atomics.",
}
# What the functions built on attention and attention_varlen raise (their errors, then flash-attn's features).
_RAISES = """
    NotImplementedError: a feature mfa_native does not implement asked for (dropout_p, ...
        other than its default), naming it.
    TypeError: tensors of different dtypes, or not float32, float16 or bfloat16.
    ValueError: shapes that disagree (batch, heads, head dims; Hq not a multiple of Hkv; a
        head dim beyond 576), a window_size side below -1.
"""


def _documented(summary: str, *, intro: str = "", returns: str, raises: str = _RAISES, example: str,
                **arguments: str):
    """Gives a function its docstring (declaration.document): Args for every parameter, from
    `arguments` or else _OPTIONS."""
    def decorate(function):
        names = inspect.signature(function).parameters
        function.__doc__ = document(summary, [(n, arguments[n] if n in arguments else _OPTIONS[n]) for n in names],
                                    returns=returns, raises=raises, example=example, intro=intro)
        return function
    return decorate


def unsupported(**features) -> None:
    """NotImplementedError for the first of flash-attn's features asked for (a value other than
    its default of off)."""
    for name, value in features.items():
        if value is not None and (not isinstance(value, (int, float)) or value != 0.0):
            shown = value if isinstance(value, (int, float)) else f"a {type(value).__name__}"
            raise NotImplementedError(f"{name}={shown}: mfa_native does not implement it; leave it at its "
                                      "default (0, None or False)")


def softcap_of(softcap) -> float | None:
    """flash-attn's softcap as attention's: a cap above 0, else None (flash-attn caps only then)."""
    return float(softcap) if softcap is not None and softcap > 0 else None


def window_of(window_size) -> tuple[int, int] | None:
    """flash-attn's window_size (left, right), -1 = unbounded on that side, as attention's window:
    the same (left, right) band around each sequence's lower-right diagonal; (-1, -1) is none."""
    left, right = (int(side) for side in window_size)
    return None if (left, right) == (-1, -1) else (left, right)


@_documented(
    "flash_attn.flash_attn_func, computed by mfa_native: `mfa_native.torch.attention` in flash-attn's layout.",
    intro="""
    Differentiable (q, k and v get their gradients from `mfa_native.attention_backward`). A row that sees no key
    is 0, as flash-attn's.
    """,
    q="(B, Sq, Hq, D) torch tensor, float32, float16 or bfloat16 (CPU or MPS).",
    k="(B, Sk, Hkv, D), q's dtype; Hq a multiple of Hkv (MQA, GQA).",
    v="(B, Sk, Hkv, Dv).",
    return_attn_probs="False only: the attention probabilities are not computed (True raises NotImplementedError).",
    returns="out (B, Sq, Hq, Dv), q's dtype and device.",
    example="""
    import torch
    import torch.nn.functional as F
    from mfa_native.torch import flash_attn_func

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 32, requires_grad=True) for _ in range(3))   # (B, S, H, D)
    out = flash_attn_func(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.sum(), q)
    expected = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-5) and dq.shape == q.shape
    """)
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    unsupported(dropout_p=dropout_p, return_attn_probs=return_attn_probs)
    return attention(q, k, v, scale=softmax_scale, causal=bool(causal), window=window_of(window_size),
                     softcap=softcap_of(softcap), alibi_slopes=alibi_slopes, layout="bshd")


@_documented(
    "flash_attn.flash_attn_kvpacked_func: `flash_attn_func` with k and v packed in one tensor.",
    q="(B, Sq, Hq, D), as in `flash_attn_func`.",
    kv="""
        (B, Sk, 2, Hkv, D): k and v stacked on axis 2 (read in place, strided; the gradient
        reaches kv through the views).""",
    return_attn_probs="False only (True raises NotImplementedError).",
    returns="out (B, Sq, Hq, D), q's dtype and device.",
    example="""
    import torch
    from mfa_native.torch import flash_attn_func, flash_attn_kvpacked_func

    torch.manual_seed(0)
    q = torch.randn(1, 16, 2, 32)          # (B, Sq, Hq, D)
    kv = torch.randn(1, 16, 2, 2, 32)      # (B, Sk, 2, Hkv, D)
    out = flash_attn_kvpacked_func(q, kv, causal=True)
    assert torch.equal(out, flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=True))
    """)
def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


@_documented(
    "flash_attn.flash_attn_qkvpacked_func: `flash_attn_func` with q, k and v packed in one tensor.",
    qkv="""
        (B, S, 3, H, D): q, k and v stacked on axis 2 (self-attention, Hq = Hkv; read in
        place, strided).""",
    return_attn_probs="False only (True raises NotImplementedError).",
    returns="out (B, S, H, D), qkv's dtype and device.",
    example="""
    import torch
    from mfa_native.torch import flash_attn_func, flash_attn_qkvpacked_func

    torch.manual_seed(0)
    qkv = torch.randn(1, 16, 3, 2, 32, requires_grad=True)   # (B, S, 3, H, D)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    out.sum().backward()   # the gradient reaches qkv through its views
    assert torch.equal(out, flash_attn_func(*qkv.unbind(2), causal=True)) and qkv.grad.shape == qkv.shape
    """)
def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


@_documented(
    "flash_attn.flash_attn_varlen_func, computed by mfa_native: `mfa_native.torch.attention_varlen` with "
    "flash-attn's arguments and results.",
    intro="""
    Packed sequences: sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1
    of q and attend only its own keys. Differentiable in q, k and v, except with block_table
    (paged K/V is forward only, as in flash-attn: a gradient asked raises NotImplementedError).
    """,
    q="(total_q, Hq, D) torch tensor, float32, float16 or bfloat16: every sequence's queries, packed.",
    k="""
        (total_k, Hkv, D), q's dtype; Hq a multiple of Hkv. With block_table the pages
        (num_blocks, page_size, Hkv, D), any page_size (flash-attn 2 asks a multiple of 256),
        read in place through their strides (an HND or K/V-stacked page layout as a strided view).""",
    v="(total_k, Hkv, Dv), or with block_table pages like k's.",
    cu_seqlens_q="int32 (B + 1,): the sequences' first query rows, then total_q (non-decreasing, from 0).",
    cu_seqlens_k="""
        int32 (B + 1,): the same for the keys; with block_table, sequence b has
        cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys, its logical positions 0 .. in its pages.""",
    max_seqlen_q="the longest sequence's query count, or more (a hint: the work is sized per sequence).",
    max_seqlen_k="the same for the keys.",
    return_attn_probs="""
        also return softmax_lse (Hq, total_q) float32 and None in place of S_dmask (it exists
        for dropout, which is not implemented).""",
    block_table="""
        int32 (B, max_blocks), optional (paged K/V, forward only): sequence b's key position p
        is row p % page_size of page block_table[b, p // page_size] of k and v; entries of
        pages no key of the sequence lies in are not read.""",
    returns="""
    out (total_q, Hq, Dv) in q's dtype; with return_attn_probs the tuple (out, softmax_lse,
    None).
    """,
    raises=_RAISES + """
    ValueError: cu_seqlens not int32 (B + 1,), not non-decreasing or not from 0 to the row
        totals; a max_seqlen below the longest sequence; block_table not int32 (B, max_blocks),
        a sequence's keys beyond max_blocks * page_size, or an entry outside k's pages for a
        page that is read.
    """,
    example="""
    import torch
    import torch.nn.functional as F
    from mfa_native.torch import flash_attn_varlen_func

    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 5, 16], dtype=torch.int32)   # two sequences: rows 0..4 and 5..15
    q, k, v = (torch.randn(16, 2, 32) for _ in range(3))        # (total, H, D)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, 11, 11, causal=True,
                                         return_attn_probs=True)
    print(out.shape, lse.shape)   # torch.Size([16, 2, 32]) torch.Size([2, 16])
    for a, b in ((0, 5), (5, 16)):   # each sequence alone, (H, S, D) for torch's SDPA
        alone = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                               v[a:b].transpose(0, 1), is_causal=True)
        assert torch.allclose(out[a:b], alone.transpose(0, 1), atol=1e-5)
    """)
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    unsupported(dropout_p=dropout_p)
    hints = {name: None if value is None else int(value)
             for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k))}
    result = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **hints, scale=softmax_scale,
                              causal=bool(causal), window=window_of(window_size), softcap=softcap_of(softcap),
                              alibi_slopes=alibi_slopes, return_lse=bool(return_attn_probs), block_table=block_table)
    return (*result, None) if return_attn_probs else result


@_documented(
    "flash_attn.flash_attn_with_kvcache, computed by mfa_native: `mfa_native.attention_with_kvcache` with "
    "flash-attn's arguments.",
    intro="""
    Attention of new queries over a KV cache, contiguous or paged, plain or QuantizedTensor,
    appending k and v to it in place first. Inference only (no gradient).
    """,
    q="(B, R, Hq, D) torch tensor, float32, float16 or bfloat16 (CPU or MPS).",
    k_cache="""
        (B, Cmax, Hkv, D), or with block_table the pages (num_blocks, page_size, Hkv, D),
        any page_size, pages read in place through their strides (an HND or K/V-stacked page
        layout as a strided view); q's dtype, torch.float8_e4m3fn or torch.float8_e5m2 (a CPU
        tensor, read through its bytes without a copy; see k_descale), or a QuantizedTensor.
        Written in place by the append (an MPS cache must be contiguous).""",
    v_cache="like k_cache, Dv wide.",
    k="(B, Rn, Hkv, D), optional: appended to k_cache in place at positions cache_seqlens[b] ..",
    v="(B, Rn, Hkv, Dv): the same for v_cache (given with k).",
    rotary_cos="""
        (seqlen_ro, rotary_dim / 2) in q's dtype, optional, with k and v: the rotary embedding of
        q and the new k at their absolute positions (cache_seqlens[b] + i; every q row at
        cache_seqlens[b] when neither causal nor a window), as flash-attn; v is never rotated.
        Applied on the device, in the same pass as the append.""",
    rotary_sin="(seqlen_ro, rotary_dim / 2), like rotary_cos.",
    cache_seqlens="""
        an int or int32 (B,): each sequence's cache length before this call (not modified).
        None: every sequence is the whole cache (Cmax, or max_blocks * page_size), as
        flash-attn; required with k and v.""",
    cache_batch_idx="""
        int32 (B,), optional, contiguous caches only: batch element b uses cache row
        cache_batch_idx[b] of k_cache (B_cache, Cmax, Hkv, D); None: row b.""",
    cache_leftpad="""
        int32 (B,), optional, contiguous caches only: sequence b starts at position
        cache_leftpad[b] of its cache row (its keys are leftpad .. cache_seqlens - 1, then the
        new rows; causal and the window count from its first key); None: 0.""",
    block_table="int32 (B, max_blocks), optional: a paged cache's pages per sequence.",
    causal="aligns the last query with the last attended key (cache_seqlens[b] + Rn).",
    window_size="(left, right) around that diagonal, -1 unbounded; (-1, -1) is no window.",
    rotary_interleaved="""
        True: features (0, 1), (2, 3) ... rotate together (GPT-J); False: feature j with
        j + rotary_dim / 2 (GPT-NeoX).""",
    num_splits="a hint, ignored: mfa_native sizes the split of the keys itself.",
    return_softmax_lse="also return softmax_lse (B, Hq, R) float32.",
    q_descale="""
        float32 (B, Hkv) or one factor ((1,)), flash-attn 3's: multiplies q (query head h by its
        kv head's factor); needs a float8 k_cache.""",
    k_descale="""
        float32 (B, Hkv) or one factor, flash-attn 3's, for a float8 k_cache: the keys are
        k_cache * k_descale; an appended k is stored as (k / k_descale).to(k_cache.dtype).""",
    v_descale="the same for a float8 v_cache.",
    returns="out (B, R, Hq, Dv) in q's dtype; with return_softmax_lse the tuple (out, softmax_lse).",
    raises="""
    TypeError: q and the caches of different dtypes; any argument
        `mfa_native.attention_with_kvcache` refuses with a TypeError.
    ValueError: cache_seqlens missing with k and v, or cache_seqlens + Rn beyond the
        capacity; rotary tables of the wrong shape or dtype, too short for the positions, or
        given without k and v; a block_table entry outside k_cache for a position read; cache_batch_idx or
        cache_leftpad with block_table, not int32 (B,), a cache_batch_idx outside the cache's
        rows (or repeated, with an append), a cache_leftpad outside 0..cache_seqlens[b]; any
        other argument `mfa_native.attention_with_kvcache` refuses.
    """,
    example="""
    import torch
    import torch.nn.functional as F
    from mfa_native.torch import flash_attn_with_kvcache

    torch.manual_seed(0)
    k_cache, v_cache = torch.zeros(1, 32, 2, 32), torch.zeros(1, 32, 2, 32)   # (B, Cmax, Hkv, D)
    k_cache[:, :15], v_cache[:, :15] = torch.randn(2, 1, 15, 2, 32)          # 15 positions cached
    q, k, v = (torch.randn(1, 1, 2, 32) for _ in range(3))                   # one new token
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=15, causal=True)
    assert torch.equal(k_cache[:, 15], k[:, 0])   # appended in place, at position 15
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:, :16].transpose(1, 2),
                                              v_cache[:, :16].transpose(1, 2))
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-5)
    """)
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            q_descale=None, k_descale=None, v_descale=None):
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32)
    rotary_seqlens = None
    if cache_batch_idx is not None or cache_leftpad is not None:
        # The rotation counts positions in the cache row, the pad included (flash-attn's rule).
        rotary_seqlens = cache_seqlens if rotary_cos is not None else None
        k_cache, v_cache, block_table, cache_seqlens = paged_view(
            q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
            0 if k is None else k.shape[1])
    return attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k=k, v=v, block_table=block_table,
                                  rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_seqlens=rotary_seqlens,
                                  rotary_interleaved=bool(rotary_interleaved), scale=softmax_scale,
                                  causal=bool(causal), window=window_of(window_size), softcap=softcap_of(softcap),
                                  alibi_slopes=alibi_slopes, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                  return_lse=bool(return_softmax_lse))



@_documented(
    "flash_attn.flash_attn_varlen_kvpacked_func: `flash_attn_varlen_func` with k and v packed in one tensor.",
    q="(total_q, Hq, D), as in `flash_attn_varlen_func`.",
    kv="(total_k, 2, Hkv, D): k and v stacked on axis 1 (read in place, strided).",
    cu_seqlens_q="int32 (B + 1,), as in `flash_attn_varlen_func`.",
    cu_seqlens_k="int32 (B + 1,), likewise for the keys.",
    max_seqlen_q="a hint, as in `flash_attn_varlen_func`.",
    max_seqlen_k="likewise.",
    return_attn_probs="also return softmax_lse (Hq, total_q) float32 and None.",
    returns="out (total_q, Hq, D); with return_attn_probs the tuple (out, softmax_lse, None).",
    raises=_RAISES + """
    ValueError: cu_seqlens or max_seqlen as `flash_attn_varlen_func` refuses them.
    """,
    example="""
    import torch
    from mfa_native.torch import flash_attn_varlen_func, flash_attn_varlen_kvpacked_func

    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 5, 16], dtype=torch.int32)
    q, kv = torch.randn(16, 2, 32), torch.randn(16, 2, 2, 32)   # (total, H, D), (total, 2, H, D)
    out = flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens, 11, 11, causal=True)
    expected = flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens, cu_seqlens, 11, 11, causal=True)
    assert torch.equal(out, expected)
    """)
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


@_documented(
    "flash_attn.flash_attn_varlen_qkvpacked_func: `flash_attn_varlen_func` with q, k and v packed in one tensor.",
    qkv="(total, 3, H, D): q, k and v of the same sequences stacked on axis 1 (read in place, strided).",
    cu_seqlens="int32 (B + 1,): the sequences' first rows, then total, for queries and keys alike.",
    max_seqlen="a hint: the longest sequence's length, or more.",
    return_attn_probs="also return softmax_lse (H, total) float32 and None.",
    returns="out (total, H, D); with return_attn_probs the tuple (out, softmax_lse, None).",
    raises=_RAISES + """
    ValueError: cu_seqlens or max_seqlen as `flash_attn_varlen_func` refuses them.
    """,
    example="""
    import torch
    from mfa_native.torch import flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func

    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 5, 16], dtype=torch.int32)
    qkv = torch.randn(16, 3, 2, 32, requires_grad=True)   # (total, 3, H, D)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, 11, causal=True)
    out.sum().backward()
    expected = flash_attn_varlen_func(*qkv.unbind(1), cu_seqlens, cu_seqlens, 11, 11, causal=True)
    assert torch.equal(out, expected) and qkv.grad.shape == qkv.shape
    """)
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
