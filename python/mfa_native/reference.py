"""Float64 numpy reference for attention, written independently of the kernels.

It implements exactly the semantics of `mfa_native.attention` (see that
function for the argument conventions) and is what tests, the demo and the
benchmarks compare the kernels against. It favours clarity over speed and
expects valid arguments (validation lives in `mfa_native.attention`).

Semantics in one place:

- logits[b, h, i, j] = scale * q[b, h, i] . k[b, h // (Hq // Hkv), j]  (+ mask if additive)
- key j is allowed for query i when every active rule allows it:
  causal "lower_right" (or True): j <= i + (C - R);  "upper_left": j <= i;
  window (left, right): -left <= j - (i + C - R) <= right, -1 = unbounded side;
  boolean mask: mask[b, h, i, j] is True;
  additive mask: not mask[b, h, i, j] <= MASKED_BELOW (so -inf removes the key, NaN stays).
- NaN propagates as in PyTorch's math attention: a NaN logit of an allowed key (from q, k
  or the additive mask) makes its row's output and lse NaN; a NaN in v[j, d] makes
  out[i, d] NaN for every row i that sees key j.
- sinks[h] is one more logit in the softmax denominator, with no value.
- out = sum_j p_ij v_j with p the softmax over the allowed keys (and the sink);
  lse = natural log of the softmax denominator (sink included).
- A row with nothing in its denominator (no allowed key, no sink): out = 0, lse = -inf.

Gradients (`attention_backward_reference`), from the softmax Jacobian, for a
loss whose gradient with respect to out is dout:
  dv_j = sum_i p_ij dout_i,   dp_ij = dout_i . v_j,   delta_i = sum_j p_ij dp_ij,
  ds_ij = p_ij (dp_ij - delta_i),   dq_i = scale sum_j ds_ij k_j,   dk_j = scale sum_i ds_ij q_i,
  dsinks[h] = -sum over batch and rows of p_sink delta_i  (the sink logit has no value),
with dk and dv summed over the query heads that share a kv head. The mask gets no gradient.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "attention_reference", "attention_backward_reference", "attention_probabilities", "allowed_keys",
    "attention_varlen_reference", "attention_varlen_backward_reference", "attention_with_kvcache_reference",
    "sparse_attention_reference", "sparse_attention_backward_reference", "sparse_topk_reference",
    "block_sparse_attention_reference", "block_sparse_attention_backward_reference",
]

# Additive mask values at or below this remove the key outright (as -inf does),
# so a row filled with np.finfo(...).min counts as fully masked.
MASKED_BELOW = -1e30

CAUSAL_MODES = {False: None, True: "lower_right", "lower_right": "lower_right", "upper_left": "upper_left"}


def allowed_keys(q_len: int, kv_len: int, causal=False, window=None) -> np.ndarray:
    """(R, C) bool: which keys the causal and window rules leave to each query."""
    i = np.arange(q_len)[:, None]
    j = np.arange(kv_len)[None, :]
    allowed = np.ones((q_len, kv_len), dtype=bool)
    mode = CAUSAL_MODES[causal]
    if mode == "lower_right":
        allowed &= j <= i + (kv_len - q_len)
    elif mode == "upper_left":
        allowed &= j <= i
    if window is not None:
        left, right = window
        offset = j - (i + kv_len - q_len)
        if left != -1:
            allowed &= offset >= -left
        if right != -1:
            allowed &= offset <= right
    return allowed


def _to_bhsd(x: np.ndarray, layout: str) -> np.ndarray:
    x = np.asarray(x).astype(np.float64)
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def masked_logits(logits: np.ndarray, causal, window, mask) -> np.ndarray:
    """Logits (B, Hq, R, C) with the masking rules applied: a removed key's logit is -inf
    (causal, window, a False boolean mask entry, an additive value <= -1e30), and an
    additive mask is added to the allowed ones (a NaN value stays, and makes the row NaN)."""
    R, C = logits.shape[-2:]
    allowed = np.broadcast_to(allowed_keys(R, C, causal, window), logits.shape)
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask), logits.shape)
        if mask.dtype == np.bool_:
            allowed = allowed & mask
        else:
            additive = mask.astype(np.float64)
            allowed = allowed & ~(additive <= MASKED_BELOW)
            logits = logits + np.where(allowed, additive, 0.0)
    return np.where(allowed, logits, -np.inf)


def scaled_scores(q, k, *, scale=None, layout="bhsd") -> np.ndarray:
    """scale * q . k (B, Hq, R, C) in float64, query head h reading kv head h // (Hq // Hkv)."""
    qh, kh = _to_bhsd(q, layout), _to_bhsd(k, layout)
    kh = np.repeat(kh, qh.shape[1] // max(kh.shape[1], 1), axis=1)
    scale = 1.0 / np.sqrt(qh.shape[-1]) if scale is None else scale
    return scale * np.einsum("bhid,bhjd->bhij", qh, kh)


def softcapped(scores: np.ndarray, softcap=None) -> tuple[np.ndarray, np.ndarray]:
    """flash-attn's logit cap of scaled scores, softcap * tanh(s / softcap) (None: s), and its
    derivative with respect to s."""
    if softcap is None:
        return scores, np.ones_like(scores)
    turned = np.tanh(scores / softcap)
    return softcap * turned, 1.0 - turned ** 2


def alibi_bias(alibi_slopes, shape) -> np.ndarray:
    """flash-attn's ALiBi bias of (B, Hq, R, C) scores: -slope[h] * |i + C - R - j|, the slopes
    (Hq,) or (B, Hq); 0 without slopes."""
    if alibi_slopes is None:
        return np.zeros(shape)
    batch, heads, rows, keys = shape
    slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype=np.float64).reshape(-1, heads), (batch, heads))
    distance = np.abs(np.arange(rows)[:, None] + keys - rows - np.arange(keys)[None, :])
    return -slopes[:, :, None, None] * distance


def attention_probabilities(q, k, *, scale=None, causal=False, mask=None, window=None,
                            sinks=None, layout="bhsd", softcap=None, alibi_slopes=None):
    """Softmax probabilities (B, Hq, R, C) and lse (B, Hq, R), both float64; the scaled scores
    are capped first with `softcap`, then get ALiBi's bias with `alibi_slopes` (flash-attn's
    order: before masks and sinks).

    Rows with an empty denominator get all-zero probabilities and lse = -inf.
    """
    scores = softcapped(scaled_scores(q, k, scale=scale, layout=layout), softcap)[0]
    scores = scores + alibi_bias(alibi_slopes, scores.shape)
    batch, q_heads, q_len = scores.shape[:3]
    logits = masked_logits(scores, causal, window, mask)

    if sinks is not None:
        sink = np.broadcast_to(np.asarray(sinks).astype(np.float64)[None, :, None], (batch, q_heads, q_len))
    else:
        sink = np.full((batch, q_heads, q_len), -np.inf)
    takes_all = np.isposinf(sink)                        # FlashMLA's +inf sink: every weight, O = 0
    sink = np.where(takes_all, -np.inf, sink)
    row_max = np.maximum(logits.max(axis=-1, initial=-np.inf), sink)   # no keys (C = 0): -inf
    empty = np.isneginf(row_max) | takes_all
    shift = np.where(empty, 0.0, row_max)
    with np.errstate(over="ignore"):
        weights = np.exp(logits - shift[..., None])      # exp(-inf) = 0 for removed keys
    denominator = weights.sum(axis=-1) + np.exp(sink - shift)
    with np.errstate(divide="ignore", invalid="ignore"):
        probabilities = np.where(empty[..., None], 0.0, weights / denominator[..., None])
        lse = np.where(takes_all, np.inf, np.where(empty, -np.inf, shift + np.log(denominator)))
    return probabilities, lse


def attention_reference(q, k, v, *, scale=None, causal=False, mask=None, window=None,
                        sinks=None, layout="bhsd", return_lse=False, softcap=None, alibi_slopes=None):
    """Attention output in float64, laid out like q (same `layout`); with
    return_lse=True also the (B, Hq, R) lse."""
    probabilities, lse = attention_probabilities(q, k, scale=scale, causal=causal, mask=mask, window=window,
                                                 sinks=sinks, layout=layout, softcap=softcap,
                                                 alibi_slopes=alibi_slopes)
    vh = _to_bhsd(v, layout)
    vh = np.repeat(vh, probabilities.shape[1] // vh.shape[1], axis=1)
    out = np.einsum("bhij,bhjd->bhid", probabilities, vh)
    if layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    return (out, lse) if return_lse else out


def attention_backward_reference(q, k, v, dout, *, scale=None, causal=False, mask=None, window=None,
                                 sinks=None, layout="bhsd", out=None, softcap=None, alibi_slopes=None):
    """Gradients of attention in float64: (dq, dk, dv) laid out like q, k and v, and with
    `sinks` also dsinks (Hq,). `dout` is the gradient of the loss with respect to the output.

    `out`, when given, is the forward output to take delta = rowsum(dout o out) from, as
    `attention_backward` does with its `o` (the same value as sum_j p_ij dp_ij when `out` is
    exact; a float16 or bfloat16 `out` moves delta by its rounding, and where dp_ij - delta_i
    cancels, so do the gradients). With `softcap`, dS carries the cap's derivative."""
    probabilities, lse = attention_probabilities(q, k, scale=scale, causal=causal, mask=mask, window=window,
                                                 sinks=sinks, layout=layout, softcap=softcap,
                                                 alibi_slopes=alibi_slopes)
    qh, kh, vh, douth = (_to_bhsd(x, layout) for x in (q, k, v, dout))
    batch, q_heads, q_len, head_dim = qh.shape
    kv_heads, kv_len = kh.shape[1], kh.shape[2]
    ratio = q_heads // kv_heads
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)

    dp = np.einsum("bhid,bhjd->bhij", douth, np.repeat(vh, ratio, axis=1))
    if out is None:
        delta = (probabilities * dp).sum(axis=-1)             # (B, Hq, R)
    else:
        delta = (douth * _to_bhsd(out, layout)).sum(axis=-1)
    ds = probabilities * (dp - delta[..., None]) * softcapped(scaled_scores(q, k, scale=scale, layout=layout),
                                                               softcap)[1]
    dq = scale * np.einsum("bhij,bhjd->bhid", ds, np.repeat(kh, ratio, axis=1))
    dk = scale * np.einsum("bhij,bhid->bhjd", ds, qh)
    dv = np.einsum("bhij,bhid->bhjd", probabilities, douth)

    def per_kv_head(x):  # sum the query heads of each kv head's group
        return x.reshape(batch, kv_heads, ratio, kv_len, x.shape[-1]).sum(axis=2)

    grads = [dq, per_kv_head(dk), per_kv_head(dv)]
    if layout == "bshd":
        grads = [g.transpose(0, 2, 1, 3) for g in grads]
    if sinks is None:
        return tuple(grads)
    sink = np.asarray(sinks).astype(np.float64)[None, :, None]
    with np.errstate(invalid="ignore"):
        p_sink = np.where(sink == lse, 1.0, np.exp(sink - lse))   # 1 where an infinite sink took every weight
    dsinks = -(p_sink * delta).sum(axis=(0, 2))
    return (*grads, dsinks)


def block_visits(block_mask, batch: int, q_heads: int, q_len: int, kv_len: int, *, causal=False, window=None,
                 mask=None) -> np.ndarray:
    """(B, Hq, R, C) float64: how many times query (b, h, r) visits key c under a block mask
    (anything with FlexAttention's list attributes and block_size = (Qb, Kb)): once per
    listing of c's block in r's query block's full list, and once per listing in its partial
    list where causal, window and a boolean mask allow the pair, and the partial block's mask
    bit (kv_bit_blocks, kv_bits, where the mask has them) is set."""
    q_block, k_block = block_mask.block_size
    bits = partial_block_bits(block_mask)
    rules = np.broadcast_to(allowed_keys(q_len, kv_len, causal, window), (batch, q_heads, q_len, kv_len))
    if mask is not None and np.asarray(mask).dtype == np.bool_:
        rules = rules & np.broadcast_to(np.asarray(mask), rules.shape)
    visits = np.zeros((batch, q_heads, q_len, kv_len))
    for prefix, allowed in (("", rules), ("full_", np.ones_like(rules))):
        counts, listed = getattr(block_mask, f"{prefix}kv_num_blocks"), getattr(block_mask, f"{prefix}kv_indices")
        if counts is None:
            continue
        counts, listed = np.asarray(counts), np.asarray(listed)
        for b in range(batch):
            for h in range(q_heads):
                lb, lh = b % counts.shape[0], h % counts.shape[1]   # size-1 axes broadcast
                for i in range(counts.shape[2]):
                    rows = slice(i * q_block, min(q_len, (i + 1) * q_block))
                    for n, j in enumerate(listed[lb, lh, i, :counts[lb, lh, i]]):
                        cols = slice(j * k_block, min(kv_len, (j + 1) * k_block))
                        pairs = allowed[b, h, rows, cols]
                        if prefix == "" and bits is not None:
                            block = bits(block_mask.kv_bit_blocks[lb, lh, i] + n)
                            pairs = pairs & block[:pairs.shape[0], :pairs.shape[1]]
                        visits[b, h, rows, cols] += pairs
    return visits


def partial_block_bits(block_mask):
    """p -> the (Qb, Kb) bool mask bits of partial block p, or None for a mask without bits."""
    words = getattr(block_mask, "kv_bits", None)
    if words is None:
        return None
    q_block, k_block = block_mask.block_size
    flat = np.unpackbits(np.asarray(words, dtype="<i4").view(np.uint8), bitorder="little").astype(bool)
    return lambda p: flat[p * q_block * k_block:(p + 1) * q_block * k_block].reshape(q_block, k_block)


def block_sparse_bias(block_mask, q, k, *, causal=False, mask=None, window=None, layout="bhsd") -> np.ndarray:
    """The additive mask that makes dense attention equal block-sparse attention: log of the
    visit counts (-inf where a pair is never visited) plus an additive `mask` where visited.
    (Visiting a key m times multiplies its softmax weight by m.)"""
    qh, kh = _to_bhsd(q, layout), _to_bhsd(k, layout)
    batch, q_heads, q_len, _ = qh.shape
    visits = block_visits(block_mask, batch, q_heads, q_len, kh.shape[2], causal=causal, window=window, mask=mask)
    with np.errstate(divide="ignore"):
        bias = np.log(visits)
    if mask is not None and np.asarray(mask).dtype != np.bool_:
        bias = bias + np.where(visits > 0, np.broadcast_to(np.asarray(mask, dtype=np.float64), bias.shape), 0.0)
    return bias


def block_sparse_attention_reference(q, k, v, block_mask, *, scale=None, causal=False, mask=None, window=None,
                                     sinks=None, layout="bhsd", return_lse=False, softcap=None, alibi_slopes=None):
    """Block-sparse attention in float64 (see `block_sparse_bias`; the bias adds to the capped
    scores with ALiBi's)."""
    bias = block_sparse_bias(block_mask, q, k, causal=causal, mask=mask, window=window, layout=layout)
    return attention_reference(q, k, v, scale=scale, mask=bias, sinks=sinks, layout=layout, return_lse=return_lse,
                               softcap=softcap, alibi_slopes=alibi_slopes)


def block_sparse_attention_backward_reference(q, k, v, dout, block_mask, *, scale=None, causal=False, mask=None,
                                              window=None, sinks=None, layout="bhsd", out=None, softcap=None,
                                              alibi_slopes=None):
    """Gradients of block-sparse attention in float64, as `attention_backward_reference` gives them."""
    bias = block_sparse_bias(block_mask, q, k, causal=causal, mask=mask, window=window, layout=layout)
    return attention_backward_reference(q, k, v, dout, scale=scale, mask=bias, sinks=sinks, layout=layout, out=out,
                                        softcap=softcap, alibi_slopes=alibi_slopes)


def sparse_attention_reference(q, k, v, indices, *, scale=None, sinks=None, topk_length=None, layout="bhsd",
                               return_lse=False, softcap=None, alibi_slopes=None):
    """Sparse-indexed attention in float64: query (b, h, r) attends the keys
    indices[b, h // (Hq // Hkv), r, :topk_length[b, r]] (layout "bshd": indices (B, R, Hkv,
    topk)), entries < 0 or >= C skipped, a key listed twice counted twice; as a gather
    followed by dense attention over the gathered list (its scaled scores capped with
    `softcap`, then less ALiBi's slope[h] * |r + C - R - j| for listed key j with
    `alibi_slopes`). A size-1 kv-head axis broadcasts."""
    qh, kh, vh = (_to_bhsd(x, layout) for x in (q, k, v))
    listed = np.asarray(indices)
    listed = listed if layout == "bhsd" else listed.transpose(0, 2, 1, 3)
    batch, q_heads, q_len, head_dim = qh.shape
    kv_heads, kv_len, value_dim = kh.shape[1], kh.shape[2], vh.shape[3]
    ratio = q_heads // kv_heads
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    out = np.zeros((batch, q_heads, q_len, value_dim))
    lse = np.full((batch, q_heads, q_len), -np.inf)
    for b in range(batch):
        for h in range(q_heads):
            for r in range(q_len):
                row = listed[b, (h // ratio) % listed.shape[1], r]
                if topk_length is not None:
                    row = row[:max(0, int(np.asarray(topk_length)[b, r]))]
                keys = row[(row >= 0) & (row < kv_len)]
                logits = softcapped(scale * kh[b, h // ratio, keys] @ qh[b, h, r], softcap)[0]
                if alibi_slopes is not None:
                    logits = logits - _of_batch(alibi_slopes, b)[h] * np.abs(r + kv_len - q_len - keys)
                sink = -np.inf if sinks is None else float(np.asarray(sinks)[h])
                if sink == np.inf:   # FlashMLA's +inf sink takes every weight: output 0
                    lse[b, h, r] = np.inf
                    continue
                terms = [logits] + ([np.array([sink])] if sink != -np.inf else [])   # -inf: no sink
                every = np.concatenate(terms)
                if every.size == 0:
                    continue
                top = every.max()
                weights = np.exp(every - top)
                denominator = weights.sum()
                out[b, h, r] = weights[:len(keys)] @ vh[b, h // ratio, keys] / denominator
                lse[b, h, r] = top + np.log(denominator)
    if layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    return (out, lse) if return_lse else out


def sparse_bias(q, k, indices, *, topk_length=None, layout="bhsd") -> np.ndarray:
    """The additive mask that makes dense attention equal sparse-indexed attention: log of how
    many times each query row lists each key (-inf where never)."""
    qh, kh = _to_bhsd(q, layout), _to_bhsd(k, layout)
    batch, q_heads, q_len, _ = qh.shape
    kv_heads, kv_len = kh.shape[1], kh.shape[2]
    listed = np.asarray(indices)
    listed = listed if layout == "bhsd" else listed.transpose(0, 2, 1, 3)
    visits = np.zeros((batch, q_heads, q_len, kv_len))
    for b in range(batch):
        for h in range(q_heads):
            for r in range(q_len):
                row = listed[b, (h // (q_heads // kv_heads)) % listed.shape[1], r]
                if topk_length is not None:
                    row = row[:max(0, int(np.asarray(topk_length)[b, r]))]
                np.add.at(visits[b, h, r], row[(row >= 0) & (row < kv_len)], 1.0)
    with np.errstate(divide="ignore"):
        return np.log(visits)


def sparse_attention_backward_reference(q, k, v, dout, indices, *, scale=None, sinks=None, topk_length=None,
                                        layout="bhsd", out=None, softcap=None, alibi_slopes=None):
    """Gradients of sparse-indexed attention in float64, as `attention_backward_reference` gives
    them (dk and dv summed over every listing of a key and the query heads of its kv head)."""
    bias = sparse_bias(q, k, indices, topk_length=topk_length, layout=layout)
    return attention_backward_reference(q, k, v, dout, scale=scale, mask=bias, sinks=sinks, layout=layout, out=out,
                                        softcap=softcap, alibi_slopes=alibi_slopes)


def sparse_topk_reference(q, k, weights, topk: int, *, causal=True, layout="bhsd", return_scores=False):
    """The lightning indexer and top-k in float64 scores (numpy lexsort): per row the topk
    candidates by descending score, equal scores by the lower key, NaN above every number
    (the lower key first among NaNs, as torch.topk), padded with -1 (-inf)."""
    qh, kh = _to_bhsd(q, layout), _to_bhsd(k, layout)
    w = np.asarray(weights, dtype=np.float64)
    w = w if layout == "bhsd" else w.transpose(0, 2, 1)
    batch, heads, q_len, _ = qh.shape
    kv_len = kh.shape[2]
    scores = np.einsum("bhr,bhrc->brc", w, np.maximum(np.einsum("bhrd,bcd->bhrc", qh, kh[:, 0]), 0.0))
    indices = np.full((batch, q_len, topk), -1, np.int32)
    kept = np.full((batch, q_len, topk), -np.inf, np.float32)
    for b in range(batch):
        for r in range(q_len):
            n = min(kv_len, max(0, r + kv_len - q_len + 1)) if causal else kv_len
            row = scores[b, r, :n]
            nan = np.isnan(row)
            order = np.lexsort((np.arange(n), -np.where(nan, 0.0, row), ~nan))[:topk]
            indices[b, r, :len(order)] = order
            kept[b, r, :len(order)] = scores[b, r, order]
    shape = (batch, 1, q_len, topk) if layout == "bhsd" else (batch, q_len, 1, topk)
    indices, kept = indices.reshape(shape), kept.reshape(shape)
    return (indices, kept) if return_scores else indices


def _of_batch(alibi_slopes, b: int):
    """Batch b's ALiBi slopes (Hq,) of a (Hq,) or (B, Hq) table, or None."""
    if alibi_slopes is None:
        return None
    slopes = np.asarray(alibi_slopes)
    return slopes if slopes.ndim == 1 else slopes[b]


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """(query rows, key rows) slices of each packed sequence."""
    cu_q, cu_k = (np.asarray(cu).astype(np.int64) for cu in (cu_seqlens_q, cu_seqlens_k))
    return [(slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])) for s in range(len(cu_q) - 1)]


def sequence_keys(x, cu_seqlens_k, s: int, seqused_k=None, block_table=None) -> np.ndarray:
    """Sequence s's keys (or values) of `x` as flash-attn reads them, (length, Hkv, D): packed,
    rows cu_seqlens_k[s] .. of x (seqused_k[s] of them, else up to cu_seqlens_k[s + 1]); paged
    (x the pages (num_blocks, page_size, Hkv, D)), logical position p at row p % page_size of page
    block_table[s, p // page_size], for the first seqused_k[s] positions, else
    cu_seqlens_k[s + 1] - cu_seqlens_k[s], else every listed page's."""
    x = np.asarray(x)
    if seqused_k is not None:
        length = int(np.asarray(seqused_k)[s])
    elif cu_seqlens_k is not None:
        length = int(np.asarray(cu_seqlens_k)[s + 1]) - int(np.asarray(cu_seqlens_k)[s])
    else:
        length = np.asarray(block_table).shape[1] * x.shape[1]
    if block_table is None:
        start = int(np.asarray(cu_seqlens_k)[s])
        return x[start:start + length]
    page_size, positions = x.shape[1], np.arange(length)
    return x[np.asarray(block_table)[s, positions // page_size], positions % page_size]


def attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, scale=None, causal=False, window=None,
                               sinks=None, return_lse=False, block_table=None, seqused_k=None, softcap=None,
                               alibi_slopes=None):
    """Attention over packed sequences in float64: `attention_reference` on each sequence's
    query rows and keys (`sequence_keys`: packed, or paged with block_table) as a batch of one
    ("bshd"), concatenated: out (total_q, Hq, Dv), lse (Hq, total_q)."""
    q = np.asarray(q).astype(np.float64)
    out = np.zeros((q.shape[0], q.shape[1], np.asarray(v).shape[-1]))
    lse = np.zeros((q.shape[1], q.shape[0]))
    cu_q = np.asarray(cu_seqlens_q).astype(np.int64)
    for s in range(len(cu_q) - 1):
        rows = slice(cu_q[s], cu_q[s + 1])
        keys, values = (sequence_keys(x, cu_seqlens_k, s, seqused_k, block_table).astype(np.float64)
                        for x in (k, v))
        o, l = attention_reference(q[None, rows], keys[None], values[None], scale=scale, causal=causal,
                                   window=window, sinks=sinks, layout="bshd", return_lse=True, softcap=softcap,
                                   alibi_slopes=_of_batch(alibi_slopes, s))
        out[rows], lse[:, rows] = o[0], l[0]
    return (out, lse) if return_lse else out


def attention_varlen_backward_reference(q, k, v, dout, cu_seqlens_q, cu_seqlens_k, *, scale=None, causal=False,
                                        window=None, sinks=None, out=None, softcap=None, alibi_slopes=None):
    """Gradients of attention over packed sequences in float64: (dq, dk, dv) shaped like q,
    k, v, and with `sinks` also dsinks (Hq,) summed over the sequences (`out` as in
    attention_backward_reference)."""
    q, k, v, dout = (np.asarray(x).astype(np.float64) for x in (q, k, v, dout))
    grads = [np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)]
    dsinks = np.zeros(q.shape[1])
    for s, (rows, keys) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        part = attention_backward_reference(q[None, rows], k[None, keys], v[None, keys], dout[None, rows],
                                            scale=scale, causal=causal, window=window, sinks=sinks, layout="bshd",
                                            out=None if out is None else np.asarray(out)[None, rows], softcap=softcap,
                                            alibi_slopes=_of_batch(alibi_slopes, s))
        for grad, at, g in zip(grads, (rows, keys, keys), part[:3]):
            grad[at] = g[0]
        if sinks is not None:
            dsinks += part[3]
    return (*grads, dsinks) if sinks is not None else tuple(grads)


def logical_cache(cache, cache_seqlens, new=None, block_table=None) -> list[np.ndarray]:
    """Each batch's attended cache rows (its first cache_seqlens[b] rows, then `new`[b]) in
    float64, (L_b, Hkv, D), read from the contiguous (B, Cmax, ...) cache or, with
    `block_table`, its (num_blocks, page_size, ...) pages; the inputs are not modified."""
    cache = np.asarray(cache).astype(np.float64)
    rows = []
    for b, length in enumerate(np.asarray(cache_seqlens).astype(np.int64)):
        if block_table is None:
            old = cache[b, :length]
        else:
            page = cache.shape[1]
            positions = np.arange(length)
            old = cache[np.asarray(block_table)[b, positions // page], positions % page]
        rows.append(old if new is None else np.concatenate([old, np.asarray(new)[b].astype(np.float64)]))
    return rows


def rotary_reference(x, cos, sin, positions, interleaved: bool = True) -> np.ndarray:
    """x (B, S, H, D) in float64 with the first 2 * cos.shape[1] features of row (b, s) turned
    by row positions[b, s] of the tables (flash-attn's rotary embedding): pairs (2j, 2j + 1)
    when interleaved, else (j, j + rotary_dim / 2); (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)."""
    x = np.asarray(x).astype(np.float64)
    half = np.asarray(cos).shape[1]
    c, s = (np.asarray(t).astype(np.float64)[np.asarray(positions)][:, :, None, :] for t in (cos, sin))
    first, second = ((slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved
                     else (slice(0, half), slice(half, 2 * half)))
    x1, x2 = x[..., first].copy(), x[..., second].copy()
    x[..., first], x[..., second] = x1 * c - x2 * s, x1 * s + x2 * c
    return x


def float8_quantize_reference(x, descale, dtype) -> np.ndarray:
    """The float8 codes (uint8) of x / descale as an append stores them: the quotient in float32
    (x and descale, broadcast against it, converted to float32 first), rounded to the nearest
    `dtype` value (ml_dtypes.float8_e4m3fn or float8_e5m2), ties to even; e4m3fn saturates at
    +-448 (+-inf included) and e5m2 overflows to +-inf, as torch's `.to()`; NaN is 0x7f with
    its sign (ml_dtypes' astype differs only there: NaN for e4m3fn beyond 448, 0x7e for e5m2's NaN)."""
    quotient = np.asarray(x).astype(np.float32) / np.asarray(descale, dtype=np.float32)
    if np.dtype(dtype).name == "float8_e4m3fn":
        quotient = np.clip(quotient, np.float32(-448), np.float32(448))   # NaN stays NaN
    codes = quotient.astype(dtype).view(np.uint8)
    return np.where(np.isnan(quotient), np.uint8(0x7F) | (np.signbit(quotient).astype(np.uint8) << 7), codes)


def _per_kv_head(descale, batch: int, kv_heads: int) -> np.ndarray:
    """A descale (None: 1; a single factor; (B, Hkv)) as (B, Hkv) float64."""
    if descale is None:
        return np.ones((batch, kv_heads))
    factor = np.asarray(descale, dtype=np.float64)
    return np.broadcast_to(factor.reshape(1, 1) if factor.size == 1 else factor, (batch, kv_heads))


def attention_with_kvcache_reference(q, k_cache, v_cache, cache_seqlens, k=None, v=None, block_table=None,
                                     rotary_cos=None, rotary_sin=None, rotary_seqlens=None, rotary_interleaved=True,
                                     *, scale=None, causal=False, window=None, sinks=None, q_descale=None,
                                     k_descale=None, v_descale=None, return_lse=False, softcap=None, alibi_slopes=None):
    """flash_attn_with_kvcache in float64: batch b's q (R, Hq, D) ("bshd") attends its
    attended cache rows (logical_cache); out (B, R, Hq, Dv), lse (B, Hq, R). With rotary
    tables, q and k are turned first (rotary_reference) at positions rotary_seqlens[b] (else
    cache_seqlens[b]) + i, q's rows all at the start unless causal or a window. A float8 cache
    holds cache * descale (its new rows as an append stores them, float8_quantize_reference);
    q_descale multiplies each query head by its kv head's factor."""
    if rotary_cos is not None:
        start = np.asarray(cache_seqlens if rotary_seqlens is None else rotary_seqlens).astype(np.int64)[:, None]
        rows = np.arange(np.shape(q)[1]) if causal or window is not None else np.zeros(np.shape(q)[1], np.int64)
        q = rotary_reference(q, rotary_cos, rotary_sin, start + rows, rotary_interleaved)
        k = rotary_reference(k, rotary_cos, rotary_sin, start + np.arange(np.shape(k)[1]), rotary_interleaved)
    q = np.asarray(q).astype(np.float64)
    batch, kv_heads = q.shape[0], np.shape(k_cache)[2]
    group = q.shape[2] // kv_heads if kv_heads else 1
    q = q * np.repeat(_per_kv_head(q_descale, batch, kv_heads), group, axis=1)[:, None, :, None]
    rows = []
    for cache, new, descale in ((k_cache, k, k_descale), (v_cache, v, v_descale)):
        factor = _per_kv_head(descale, batch, kv_heads)
        dtype = getattr(cache, "dtype", None)
        if new is not None and isinstance(dtype, np.dtype) and dtype.name.startswith("float8"):
            new = float8_quantize_reference(new, factor[:, None, :, None], dtype).view(dtype)
        rows.append([x * factor[b][None, :, None] for b, x in
                     enumerate(logical_cache(cache, cache_seqlens, new, block_table))])
    keys, values = rows
    parts = [attention_reference(q[b:b + 1], kb[None], vb[None], scale=scale, causal=causal,
                                 window=window, sinks=sinks, layout="bshd", return_lse=True, softcap=softcap,
                                 alibi_slopes=_of_batch(alibi_slopes, b))
             for b, (kb, vb) in enumerate(zip(keys, values))]
    out = np.concatenate([o for o, _ in parts])
    lse = np.concatenate([l for _, l in parts])
    return (out, lse) if return_lse else out
