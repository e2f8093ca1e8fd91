"""attention_varlen's and its backward's array rules and size checks, as plain data (rules.py).

q, k and v are packed, (total_q, Hq, D) and (total_k, Hkv, D|Dv), binding the sizes (paged k
and v are bound as every page's rows: their pages' layout is varlen_keys.py's code); the
problem is one "bshd" batch of them (B = 1, R = total_q, C = total_k). The caller gives two
sizes: `sequences` (cu_seqlens_q's entries less one, read before it is checked: seqused_k's,
block_table's and a per-sequence alibi_slopes table's rows) and `paged` (1 with block_table).
cu_seqlens, seqused_k and block_table (and the backward's o, lse and do) are the op's own
arrays, checked after attention's, their contents on every call. What spans several arrays'
contents (seqused_k within each sequence's rows, the pages each sequence reads, the max_seqlen
hints) is varlen_keys.py's code.
"""

from __future__ import annotations

from . import attention_rules
from .attention_rules import FLOATS, GQA, HEAD_DIMS, limits, written
from .rules import ArrayRule, Checks, Content, Require

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


def _cu_seqlens(name: str, count: str, ends: Content, *requires: Require) -> ArrayRule:
    """cu_seqlens_q or cu_seqlens_k: int32 (B + 1,), at most 2**24 + 1 entries (before they are
    read), from 0, ending as `ends` says, non-decreasing."""
    form = f"{name} must have shape (B + 1,), one axis of at least one entry, got {{{name}.shape}}"
    return ArrayRule(
        dtypes=("int32",), dtype_raises="ValueError", shapes=((count,),), own=True, reads="contiguous",
        requires=(Require(f"{count} >= 1", form),
                  Require(f"{count} <= {MAX_SEQUENCES + 1}", f"{name} has {{{count}}} entries: at most 2**24 "
                                                             "sequences (2**24 + 1 entries) per call"), *requires),
        contents=(Content("first", f"{name} must start at 0, got {{{name}.value}}", bound="0"), ends,
                  Content("nondecreasing", f"{name} must be non-decreasing, but {name}[{{{name}.index}}] = "
                                           f"{{{name}.value}} < {name}[{{{name}.prior_index}}] = {{{name}.prior}}")),
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


def _int32_form(name: str, shape: tuple[str, ...], form: str) -> dict:
    """An int32 table's dtype and shape, refused with one message (a ValueError) naming both."""
    message = f"{name} must be int32 {form}, got {{{name}.dtype}} {{{name}.shape}}"
    return dict(dtypes=("int32",), dtype_raises="ValueError", shapes=(shape,), own=True, reads="contiguous",
                dtype_error=message, shape_error=message)


Q, K, V = _packed("q", Q_SHAPE, "total_q"), _packed("k", K_SHAPE, "total_k"), _packed("v", V_SHAPE, "total_k")
CU_SEQLENS_Q = _cu_seqlens("cu_seqlens_q", "Ncu", _ends("cu_seqlens_q", "total_q", "q"))
CU_SEQLENS_K = _cu_seqlens(
    "cu_seqlens_k", "Ncu_k", _ends("cu_seqlens_k", "total_k", "k", when="paged == 0"),   # paged: ends anywhere
    Require("Ncu_k == Ncu", "cu_seqlens_q and cu_seqlens_k must have one entry per sequence and one more, alike; "
                            "got {cu_seqlens_q.shape} and {cu_seqlens_k.shape}"))
SEQUSED_K = ArrayRule(
    **_int32_form("seqused_k", ("sequences",), "(B,) = {seqused_k.expected}"),
    contents=(Content("nonnegative", "seqused_k must not be negative, got seqused_k[{seqused_k.index}] = "
                                     "{seqused_k.min}"),))
BLOCK_TABLE = ArrayRule(**_int32_form("block_table", ("sequences", "Wt"), "(B, max_blocks) with B = {sequences}"))
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
    derived=(("B", "1"), ("R", "total_q"), ("C", "total_k"), ("slope_rows", "sequences")))
# Python's checks by name (the C++ binder reads the declarations, Op.declaration_data).
RULES = {"q": Q, "k": K, "v": V, "cu_seqlens_q": CU_SEQLENS_Q, "cu_seqlens_k": CU_SEQLENS_K, "seqused_k": SEQUSED_K,
         "block_table": BLOCK_TABLE, "sinks": attention_rules.SINKS, "alibi_slopes": attention_rules.ALIBI_SLOPES,
         "o": O, "do": DO, "lse": LSE_IN}
