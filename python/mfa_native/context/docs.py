"""The docstrings of the context-parallel functions, written once for their torch and MLX faces
(torch/ring.py, context/mlx_ring.py): the arguments, results and errors are the same; each face
names its arrays, its group, how its messages travel and its own example."""

from __future__ import annotations

from ..ops.declaration import document

def ring_attention(*, framework: str, array: str, group: str, transport: str, gradient: str, lse: str,
                   example: str) -> str:
    """`ring_attention`'s docstring for `framework` ("torch.distributed", "mx.distributed"):
    `array` names its arrays, `group` documents the group argument, `transport` how the K/V
    shards travel, `gradient` how to differentiate, `lse` what the returned lse takes."""
    return document(
        f"Attention over sequences sharded across the ranks of `group` ({framework}); returns this "
        "rank's output shard.",
        [("q", f"""this rank's queries, as `mfa_native.attention` takes them in `layout` ((B, Hq, R, D)
              for "bhsd"): {array}, float32, float16 or bfloat16. Every dimension but the sequence
              length, the dtype and the options must agree between ranks."""),
         ("k", 'this rank\'s keys, (B, Hkv, C, D) for "bhsd"; Hq a multiple of Hkv.'),
         ("v", "this rank's values, (B, Hkv, C, Dv)."),
         ("group", group),
         ("causal", """False, True (= "lower_right") or "upper_left", as `attention` means it on the
                   concatenated q and k/v (the global lengths set the lower-right alignment)."""),
         ("window", "(left, right) as in `attention`, by global position; None: no window."),
         ("sinks", """(Hq,) one more logit per head in the softmax denominator of this rank's queries;
                  its gradient is that through the rows this rank computed (sum it over the group, as
                  for any replicated parameter)."""),
         ("scale", "the logit scale; None: 1 / sqrt(D)."),
         ("layout", '"bhsd" or "bshd".'),
         ("return_lse", "also return this rank's lse.")],
        details=f"""
        Rank r holds a contiguous block of the global queries (q) and one of the global keys (k,
        v), each in rank order: its queries are global positions [sum of the q lengths of ranks <
        r, + its q length), its keys likewise with the k/v lengths. Lengths may differ between
        ranks (0 too), and a rank's q and k/v lengths may differ (self-attention: give each rank
        the same positions of q and k/v). Every rank must call it. The ranks first all-gather a
        descriptor (shard lengths and their own argument checks), so an argument one rank rejects
        raises on every rank.

        Each step computes attention of a rank's queries over one K/V shard while the shards move
        one rank on around the ring ({transport}); the partial results merge in float32 by their
        lse (`mfa_native.merge_attention`). Under causal the queries a rank computes are not its
        own shard but chunks r and 2N-1-r of the global queries cut in 2N (zig-zag: every rank's
        work within a chunk's rounding of the mean, whatever the shard lengths); they travel to it
        and their outputs back to their owners around the ring. Differentiable ({gradient}): the
        backward ring carries each K/V shard's float32 dk/dv along with it back to its owner.
        """,
        returns=f"""
        This rank's output shard (q's dtype and layout); with return_lse=True the tuple (output,
        lse), lse (B, Hq, R) float32, {lse}.
        """,
        raises="""
        ValueError: an argument one rank rejects as `attention` would, or dimensions, dtypes,
            layouts or options that differ between ranks: the same error on every rank.
        TypeError: an argument of the wrong type, likewise on every rank.
        """,
        example=example)


def sharded_decode(*, framework: str, array: str, cache: str, group: str, append: str, example: str) -> str:
    """`sharded_decode`'s docstring for `framework`: `array` names its arrays, `cache` what a
    cache may be, `group` documents the group argument, `append` how the last rank appends."""
    return document(
        f"Decode over a KV cache sharded by position across the ranks of `group` ({framework}): the "
        "whole sequences' `mfa_native.attention_with_kvcache`, returned on every rank.",
        [("q", f"(B, R, Hq, D) {array}, float32, float16 or bfloat16: the same on every rank."),
         ("k_cache", f"""this rank's cache, (B, Cmax, Hkv, D), or with block_table its pages
                     (num_blocks, page_size, Hkv, D); {cache}."""),
         ("v_cache", "like k_cache, Dv wide."),
         ("cache_seqlens", "int32 (B,), required: this rank's local length of each sequence."),
         ("k", f"""(B, Rn, Hkv, D), optional, the same on every rank: the new rows, which the last rank
               appends to its cache in place ({append}; the other ranks' caches are not written)."""),
         ("v", "(B, Rn, Hkv, Dv), given with k."),
         ("block_table", "int32 (B, max_blocks), this rank's pages of a paged cache."),
         ("group", group),
         ("scale", "the logit scale; None: 1 / sqrt(D)."),
         ("causal", "as `attention_with_kvcache` means it on the whole sequences."),
         ("window", "likewise."),
         ("sinks", "(Hq,), likewise."),
         ("return_lse", "also return the lse.")],
        details="""
        Rank r's k_cache / v_cache hold every sequence's positions after those of ranks 0..r-1.
        Every rank must call it. The ranks first all-gather their local lengths and the checks of
        their own arguments (the last rank's include the append: a full cache raises here), so a
        bad or mismatched call raises the same error on every rank before anything is written.
        Then each rank attends its part, and one all-gather of every rank's float32 (output, lse),
        `B * R * Hq * (Dv + 1) * 4` bytes per rank whatever the context length, is merged by lse
        (`mfa_native.merge_attention`) on every rank. Inference only.
        """,
        returns="""
        out (B, R, Hq, Dv) of q's dtype, the same on every rank; with return_lse=True the tuple
        (out, lse), lse (B, Hq, R) float32.
        """,
        raises="""
        ValueError: an argument a rank's `attention_with_kvcache` would reject (the last rank's
            append beyond its cache included) or arguments that differ between ranks: the same
            error on every rank, before anything is written.
        TypeError: an argument of the wrong type, likewise on every rank.
        """,
        example=example)
