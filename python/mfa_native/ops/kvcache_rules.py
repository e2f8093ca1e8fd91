"""attention_with_kvcache's array rules and checks, as plain data (rules.py).

q and the caches bind the sizes: q (B, R, Hq, D), each cache (N, P, Hkv, D|Dv), N and P
being (B, Cmax) for a contiguous cache and (num_blocks, page_size) for pages (a
QuantizedTensor cache by its logical shape, its dtype unchecked). The call gives sizes of its
own: `paged` (1 with block_table), `Rn` (the rows k appends: its axis 1, 0 without
k), `per_row` (1 where causal or a window turn each q row at its own position, given once
the options are checked) and `k_float8`, `v_float8` (1 for a float8 cache). The other
arrays are checked against them: their forms first, then (every call, once the options are
checked) their contents, which read two Lengths: the keys each batch attends (its cached
length plus Rn, or every listed page without cache_seqlens) and the rotary positions each
batch turns (from its rotary start). Then attention's rules check q and the caches' rows as
the kernels read them (ops/kvcache.py). The caches' layout (pages whole rows apart, fields
alike) is how they bind, ops/pages.py's code.
"""

from __future__ import annotations

from .attention_rules import FLOATS
from .attention_rules import Q as ATTENTION_Q
from .rules import ArrayRule, Checks, Content, Lengths, Require, int32_table

APPEND_TOGETHER = "k and v are appended together: give both or neither"
ROTARY_TOGETHER = "rotary_cos and rotary_sin are given together"
CACHE_DTYPES = ("{q.dtype}", "float8_e4m3fn", "float8_e5m2")


def _cache(name: str, head_dim: str) -> ArrayRule:
    """k_cache or v_cache: q's dtype or float8, 4 dimensions binding their sizes."""
    return ArrayRule(
        dtypes=CACHE_DTYPES, shapes=(("N", "P", "Hkv", head_dim),), binds=True,
        dtype_error=f"{name} has dtype {{{name}.dtype}} but q has {{q.dtype}}; q and the caches must share one "
                    "dtype (float32, float16, bfloat16), or a cache be float8 or a QuantizedTensor",
        rank_error=f"{name} must have 4 dimensions {{cache_axes}}, got shape {{{name}.shape}}")


def _appended(name: str, head_dim: str, other: str) -> ArrayRule:
    """k or v: the rows appended, (B, Rn, Hkv, D|Dv) of q's dtype, given with the other."""
    message = (f"{name} must be (B, Rn, Hkv, {'D' if name == 'k' else 'Dv'}) = {{{name}.expected}} of q's dtype "
               f"{{q.dtype}}, got {{{name}.shape}} {{{name}.dtype}}")
    needs = ((other, APPEND_TOGETHER),) + (() if name == "v" else (
        ("cache_seqlens", "cache_seqlens is required with k and v: it says where the append writes (without it "
                          "every sequence is the cache's whole capacity, flash-attn's rule)"),))
    return ArrayRule(dtype_of="q", dtype_raises="ValueError", shapes=(("B", "Rn", "Hkv", head_dim),), needs=needs,
                     reads="contiguous", dtype_error=message, shape_error=message,
                     rank_error=f"{name} must have 4 dimensions (B, Rn, Hkv, D), got shape {{{name}.shape}}"
                     if name == "k" else "")


def _nonnegative(name: str) -> Content:
    return Content("nonnegative", f"{name} must not be negative, got {{{name}.min}}")


def _descale(name: str, cache: str) -> ArrayRule:
    """A descale: float32 (B, Hkv) or a single factor, for a float8 cache only."""
    folded = " (q_descale is folded into K's factor)" if name == "q_descale" else ""
    return ArrayRule(
        dtypes=("float32",), dtype_raises="ValueError", shapes=(("B", "Hkv"), ("1",), ()), reads="contiguous",
        requires=(Require(f"{cache[0]}_float8", f"{name} is for a float8 {cache} (float8_e4m3fn or float8_e5m2), and "
                                                f"{cache} is not float8{folded}"),),
        dtype_error=f"{name} must be float32, got {{{name}.dtype}}",
        shape_error=f"{name} must be (B, Hkv) = ({{B}}, {{Hkv}}) or a single factor ((1,) or 0-d), got shape "
                    f"{{{name}.shape}}")


ROTARY_FORM = "rotary_cos must be (seqlen_ro, rotary_dim / 2) with 0 < rotary_dim <= D = {D}, got {rotary_cos.shape}"
ROTARY_APPENDS = "rotary_cos needs k and v: the rotary embedding applies to the rows appended (flash-attn's rule)"

Q = ArrayRule(dtypes=FLOATS, shapes=(("B", "R", "Hq", "D"),), binds=True, dtype_error=ATTENTION_Q.dtype_error,
              rank_error="q must have 4 dimensions (B, R, Hq, D), got shape {q.shape}")
K_CACHE, V_CACHE = _cache("k_cache", "D"), _cache("v_cache", "Dv")
CACHE_SEQLENS = int32_table(
    "cache_seqlens", ("B",), "(B,) = ({B},)",
    contents=(_nonnegative("cache_seqlens"),
              Content("fits", "batch {cache_seqlens.index} attends cache_seqlens + Rn = {cache_seqlens.value} keys, "
                              "beyond the cache's capacity Cmax = {P}", bound="P", when="paged == 0",
                      lengths="attended"),
              Content("fits", "batch {cache_seqlens.index} attends cache_seqlens + Rn = {cache_seqlens.value} keys, "
                              "beyond the cache's capacity max_blocks * page_size = {Wt} * {P}", bound="Wt * P",
                      when="paged", lengths="attended")))
K, V = _appended("k", "k_cache_D", "v"), _appended("v", "Dv", "k")
BLOCK_TABLE = int32_table(
    "block_table", ("B", "Wt"), "(B, max_blocks) with B = {B}",
    contents=(Content("pages", "block_table[{block_table.row}, {block_table.column}] = {block_table.value} is not a "
                               "page of k_cache (0..{block_table.last}), and batch {block_table.row} reads that page",
                      bound="N", lengths="attended", page="P"),))
ROTARY_COS = ArrayRule(
    dtype_of="q", dtype_raises="ValueError", shapes=(("Lro", "half"),), reads="contiguous",
    needs=(("rotary_sin", ROTARY_TOGETHER),
           ("k", ROTARY_APPENDS)),
    requires=(Require("half >= 1 && 2 * half <= D", ROTARY_FORM),
              Require("Rn >= 1", "rotary_cos needs rows to turn: k and v append none (Rn = 0)")),
    contents=(Content("fits", "rotary_cos has {Lro} positions (seqlen_ro), too few: batch {rotary_cos.index} needs "
                              "{rotary_cos.value} ({rotary_cos.source} + the rows turned)", bound="Lro",
                      lengths="rotary_ends"),),
    dtype_error="rotary_cos must have q's dtype {q.dtype}, got {rotary_cos.dtype}", rank_error=ROTARY_FORM,
    shape_error=ROTARY_FORM)
ROTARY_SIN = ArrayRule(
    dtype_of="q", dtype_raises="ValueError", shapes=(("Lro", "half"),), reads="contiguous",
    needs=(("rotary_cos", ROTARY_TOGETHER),),
    dtype_error="rotary_sin must have q's dtype {q.dtype}, got {rotary_sin.dtype}",
    shape_error="rotary_sin must have rotary_cos's shape {rotary_cos.shape}, got {rotary_sin.shape}")
ROTARY_SEQLENS = int32_table("rotary_seqlens", ("B",), "(B,) = ({B},)",
                        needs=(("rotary_cos", "rotary_seqlens is given without rotary_cos and rotary_sin"),),
                        contents=(_nonnegative("rotary_seqlens"),))
Q_DESCALE, K_DESCALE, V_DESCALE = (_descale(name, cache) for name, cache in (
    ("q_descale", "k_cache"), ("k_descale", "k_cache"), ("v_descale", "v_cache")))

CHECKS = Checks(
    requires=(
        Require("v_cache_N == k_cache_N && v_cache_P == k_cache_P && v_cache_Hkv == k_cache_Hkv",
                "v_cache must have k_cache's leading axes: k_cache {k_cache.shape}, v_cache {v_cache.shape}"),
        Require("paged || N == B", "k_cache must be (B, Cmax, Hkv, D) with q's B = {B}, got {k_cache.shape}"),
        Require("!paged || P >= 1", "k_cache's page_size (axis 1 of (num_blocks, page_size, Hkv, D)) must be at "
                                    "least 1, got shape {k_cache.shape}")),
    lengths={"attended": Lengths((("cache_seqlens", False),), offset="Rn", fill="Wt * P", rows="B"),
             "rotary_ends": Lengths((("rotary_seqlens", False), ("cache_seqlens", False)),
                                    offset="max(Rn, per_row * R + 1 - per_row)")})
# Python's checks by name, in the declaration's order (the C++ binder reads it, Op.declaration_data).
RULES = {"q": Q, "k_cache": K_CACHE, "v_cache": V_CACHE, "cache_seqlens": CACHE_SEQLENS, "k": K, "v": V,
         "block_table": BLOCK_TABLE, "rotary_cos": ROTARY_COS, "rotary_sin": ROTARY_SIN,
         "rotary_seqlens": ROTARY_SEQLENS, "q_descale": Q_DESCALE, "k_descale": K_DESCALE, "v_descale": V_DESCALE}
