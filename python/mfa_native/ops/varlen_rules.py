"""attention_varlen's and its backward's array rules and size checks, as plain data (rules.py).

q, k and v are packed, (total_q, Hq, D) and (total_k, Hkv, D|Dv), binding the sizes (paged k
and v are bound as every page's rows: their pages' layout is varlen_keys.py's code); the
problem is one "bshd" batch of them (B = 1, R = total_q, C = total_k). The caller gives
sizes: `sequences` (cu_seqlens_q's entries less one, read before it is checked:
seqused_k's, block_table's and a per-sequence alibi_slopes table's rows), `paged` (1 with
block_table), `page_size` and `blocks` (k's pages: 0 without block_table), and the
max_seqlen hints (NO_HINT, -1, where not given: no check). cu_seqlens, seqused_k and block_table
(and the backward's o, lse and do) are the op's own arrays, checked after attention's, their
contents on every call, those spanning several arrays by the Lengths they read: each
sequence's rows (cu_seqlens' steps) and the keys it uses (seqused_k's, else cu_seqlens_k's
steps, else every listed page).
"""

from __future__ import annotations

from . import attention_rules
from .attention_rules import FLOATS, GQA, HEAD_DIMS, limits, written
from .rules import ArrayRule, Checks, Content, Lengths, Require, int32_table

NO_HINT = -1   # a max_seqlen hint not given (a given one is never negative): not checked

MAX_SEQUENCES = 2**24   # per call: their tables are built on the host every call
Q_SHAPE, K_SHAPE, V_SHAPE = ("total_q", "Hq", "D"), ("total_k", "Hkv", "D"), ("total_k", "Hkv", "Dv")
O_SHAPE, LSE_SHAPE = ("total_q", "Hq", "Dv"), ("Hq", "total_q")
PACKED_STRIDES = ("row", "head")   # a packed array's strides: its rows', its heads'


def _packed(name: str, shape: tuple[str, ...], rows: str) -> ArrayRule:
    """q, k or v: packed rows binding their sizes; k and v have q's dtype."""
    dtype = dict(dtypes=FLOATS, dtype_error=attention_rules.Q.dtype_error) if name == "q" else dict(
        dtype_of="q", dtype_error=f"{name} has dtype {{{name}.dtype}} but q has {{q.dtype}}; q, k and v must share "
                                  "one dtype")
    return ArrayRule(**dtype, shapes=(shape,), binds=True, stride_axes=PACKED_STRIDES,
                     rank_error=f"{name} must have 3 dimensions ({rows}, heads, head dim), got shape {{{name}.shape}}")


def _cu_seqlens(name: str, count: str, ends: Content, *requires: Require, hints: tuple[Content, ...] = ()) -> ArrayRule:
    """cu_seqlens_q or cu_seqlens_k: int32 (B + 1,), at most 2**24 + 1 entries (before they are
    read), from 0, ending as `ends` says, non-decreasing (then `hints`, the max_seqlen checks)."""
    form = f"{name} must have shape (B + 1,), one axis of at least one entry, got {{{name}.shape}}"
    return ArrayRule(
        dtypes=("int32",), dtype_raises="ValueError", shapes=((count,),), own=True, reads="contiguous",
        requires=(Require(f"{count} >= 1", form),
                  Require(f"{count} <= {MAX_SEQUENCES + 1}", f"{name} has {{{count}}} entries: at most 2**24 "
                                                             "sequences (2**24 + 1 entries) per call"), *requires),
        contents=(Content("first", f"{name} must start at 0, got {{{name}.value}}", bound="0"), ends,
                  Content("nondecreasing", f"{name} must be non-decreasing, but {name}[{{{name}.index}}] = "
                                           f"{{{name}.value}} < {name}[{{{name}.prior_index}}] = {{{name}.prior}}"),
                  *hints),
        dtype_error=f"{name} must be int32, got dtype {{{name}.dtype}}", rank_error=form, shape_error=form)


def _ends(name: str, total: str, axis: str, when: str | None = None) -> Content:
    """cu_seqlens' last entry: `total`, the rows of `axis` (where `when` holds)."""
    return Content("last", f"{name} must end at the total row count {{{total}}} ({axis}'s first axis), got "
                           f"{{{name}.value}}", bound=total, when=when)


def _like_output(name: str) -> ArrayRule:
    """The backward's o or do: the output's shape and q's dtype, any strides."""
    return ArrayRule(dtype_of="q", shapes=(O_SHAPE,), own=True, stride_axes=PACKED_STRIDES,
                     buffer="dout" if name == "do" else None,
                     dtype_error=f"{name} has dtype {{{name}.dtype}} but q has {{q.dtype}}; {name} must have q's "
                                 "dtype, like the output",
                     shape_error=f"{name} must have the output's shape (total_q, Hq, Dv) = {{{name}.expected}}, "
                                 f"got {{{name}.shape}}")


def _hint(name: str, lengths: str, what: str) -> Content:
    """A max_seqlen hint: at least each sequence's count (`lengths`)."""
    return Content("fits", f"{name} is {{{name}}}, but sequence {{cu_seqlens_q.index}} has {{cu_seqlens_q.value}} "
                           f"{what}", bound=name, when=f"{name} >= 0", lengths=lengths)


Q, K, V = _packed("q", Q_SHAPE, "total_q"), _packed("k", K_SHAPE, "total_k"), _packed("v", V_SHAPE, "total_k")

CU_SEQLENS_Q = _cu_seqlens("cu_seqlens_q", "Ncu", _ends("cu_seqlens_q", "total_q", "q"),
                           hints=(_hint("max_seqlen_q", "query_rows", "rows"), _hint("max_seqlen_k", "keys", "keys")))
CU_SEQLENS_K = _cu_seqlens(
    "cu_seqlens_k", "Ncu_k", _ends("cu_seqlens_k", "total_k", "k", when="paged == 0"),   # paged: ends anywhere
    Require("Ncu_k == Ncu", "cu_seqlens_q and cu_seqlens_k must have one entry per sequence and one more, alike; "
                            "got {cu_seqlens_q.shape} and {cu_seqlens_k.shape}"))
SEQUSED_K = int32_table(
    "seqused_k", ("sequences",), "(B,) = {seqused_k.expected}", own=True,
    contents=(Content("nonnegative", "seqused_k must not be negative, got seqused_k[{seqused_k.index}] = "
                                     "{seqused_k.min}"),
              Content("within", "seqused_k[{seqused_k.index}] = {seqused_k.value} is beyond sequence "
                                "{seqused_k.index}'s keys, {seqused_k.limit} (cu_seqlens_k's step)",
                      when="paged == 0", lengths="key_rows")))
BLOCK_TABLE = int32_table(
    "block_table", ("sequences", "Wt"), "(B, max_blocks) with B = {sequences}", own=True,
    contents=(Content("fits", "{block_table.source} gives sequence {block_table.index} {block_table.value} keys, "
                              "beyond what its pages hold: max_blocks * page_size = {Wt} * {page_size}",
                      bound="Wt * page_size", lengths="keys"),
              Content("pages", "block_table[{block_table.row}, {block_table.column}] = {block_table.value} is not a "
                               "page of k (0..{block_table.last}), and sequence {block_table.row} reads that page",
                      bound="blocks", lengths="keys", page="page_size")))
OUT = written("o", O_SHAPE, layout=False, called="out")
LSE_OUT = written("lse", LSE_SHAPE, dtype="float32", layout=False)
O, DO = _like_output("o"), _like_output("do")
LSE_IN = ArrayRule(dtypes=("float32",), shapes=(LSE_SHAPE,), own=True, reads="contiguous",
                   dtype_error="lse must be float32, as attention_varlen(..., return_lse=True) returns it, got "
                               "{lse.dtype}",
                   shape_error="lse must have shape (Hq, total_q) = {lse.expected}, got {lse.shape}")
DQ, DK, DV = (written(name, shape, layout=False) for name, shape in (("dq", Q_SHAPE), ("dk", K_SHAPE), ("dv", V_SHAPE)))

CHECKS = Checks(
    requires=(
        Require("v_Hkv == k_Hkv && v_total_k == k_total_k", "v must have k's rows and heads: k {k.shape}, v {v.shape}"),
        Require("k_D == q_D", "k's head dimension ({k_D}) must match q's ({q_D}): q {q.shape}, k {k.shape}"),
        GQA, *HEAD_DIMS,
        *limits((("Hq (query heads)", "Hq"), ("Hkv (key/value heads)", "Hkv"), ("total_q (query rows)", "total_q"),
                 ("total_k (key rows)", "total_k")))),
    derived=(("B", "1"), ("R", "total_q"), ("C", "total_k"), ("slope_rows", "sequences")),
    lengths={"query_rows": Lengths((("cu_seqlens_q", True),)),
             "key_rows": Lengths((("cu_seqlens_k", True),)),
             "keys": Lengths((("seqused_k", False), ("cu_seqlens_k", True)), fill="Wt * page_size",
                             rows="sequences")})
# Python's checks by name, in the declarations' order (the C++ binder reads them, Op.declaration_data).
RULES = {"q": Q, "k": K, "v": V, "o": O, "lse": LSE_IN, "do": DO, "cu_seqlens_q": CU_SEQLENS_Q,
         "cu_seqlens_k": CU_SEQLENS_K, "sinks": attention_rules.SINKS, "alibi_slopes": attention_rules.ALIBI_SLOPES,
         "block_table": BLOCK_TABLE, "seqused_k": SEQUSED_K}
