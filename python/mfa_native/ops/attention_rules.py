"""The attention family's array rules and size checks, as plain data (rules.py).

Python's checks of attention and attention_backward (and of the ops sharing attention's
`validate`) run on these rules; a bundle carries them, and the C++ binder runs the same.
"""

from __future__ import annotations

from ..codegen import MAX_HEAD_DIM
from .rules import ArrayRule, Checks, Require

FLOATS = ("float32", "float16", "bfloat16")
MAX_INDEX = 2**31 - 1   # sizes the kernels hold in (signed) 32-bit integers
Q_SHAPE, K_SHAPE, V_SHAPE = ("B", "Hq", "R", "D"), ("B", "Hkv", "C", "D"), ("B", "Hkv", "C", "Dv")
O_SHAPE, ROWS = ("B", "Hq", "R", "Dv"), ("B", "Hq", "R")


def _key_value(name: str, shape: tuple[str, ...]) -> ArrayRule:
    """k or v: q's dtype, 4 dimensions binding their sizes."""
    return ArrayRule(dtype_of="q", shapes=(shape,), layout=True, binds=True,
                     dtype_error=f"{name} has dtype {{{name}.dtype}} but q has {{q.dtype}}; q, k and v must share "
                                 "one dtype",
                     rank_error=f"{name} must have 4 dimensions ({{q.axes}}), got shape {{{name}.shape}}")


def _like_output(name: str) -> ArrayRule:
    """o or do of the backward: attention's output shape and q's dtype, any strides."""
    return ArrayRule(dtype_of="q", shapes=(O_SHAPE,), layout=True, buffer="dout" if name == "do" else None,
                     dtype_error=f"{name} has dtype {{{name}.dtype}} but q has {{q.dtype}}; {name} must have q's "
                                 "dtype, like attention's output",
                     shape_error=f"{name} must have attention's output shape ({{{name}.axes}}) = "
                                 f"{{{name}.expected}}, got {{{name}.shape}}")


def written(name: str, shape: tuple[str, ...], *, dtype: str | None = None, layout: bool = True,
            called: str | None = None, needs: tuple[tuple[str, str], ...] = ()) -> ArrayRule:
    """An output the C++ API writes in place: `dtype` (None: q's), `shape`, contiguous."""
    called = called or name
    return ArrayRule(dtypes=(dtype,) if dtype else (), dtype_of=None if dtype else "q", shapes=(shape,),
                     layout=layout, written=True, called=None if called == name else called, needs=needs,
                     reads="contiguous",
                     dtype_error=f"{called} has dtype {{{called}.dtype}} but must be {dtype or '{q.dtype}'}",
                     shape_error=f"{called} must have shape ({{{called}.axes}}) = {{{called}.expected}}, "
                                 f"got {{{called}.shape}}")


Q = ArrayRule(dtypes=FLOATS, shapes=(Q_SHAPE,), layout=True, binds=True,
              dtype_error="q must be float32, float16 or bfloat16 (ml_dtypes), got {q.dtype}",
              rank_error="q must have 4 dimensions ({q.axes}), got shape {q.shape}")
K, V = _key_value("k", K_SHAPE), _key_value("v", V_SHAPE)
MASK = ArrayRule(dtypes=("bool",) + FLOATS, shapes=(("B", "Hq", "R", "C"),), broadcast=True,
                 reads="strided_broadcast",
                 dtype_error="mask must be boolean (True = attend) or float (additive), got dtype {mask.dtype}",
                 shape_error="mask of shape {mask.shape} does not broadcast to (B, Hq, R, C) = {mask.expected}")
# What the kernels read; Python converts other float dtypes first (arguments.py).
SINKS = ArrayRule(dtypes=("float32",), shapes=(("Hq",),), reads="contiguous",
                  dtype_error="sinks must be float32, got dtype {sinks.dtype}",
                  shape_error="sinks must have shape (Hq,) = {sinks.expected}, got {sinks.shape}")
ALIBI_SLOPES = ArrayRule(dtypes=("float32",), shapes=(("Hq",), ("slope_rows", "Hq")), reads="contiguous",
                         dtype_error="alibi_slopes must be float32, got dtype {alibi_slopes.dtype}",
                         shape_error="alibi_slopes must have shape (Hq,) = ({Hq},) or (B, Hq) = ({slope_rows}, "
                                     "{Hq}), got {alibi_slopes.shape}")
O, DO = _like_output("o"), _like_output("do")
LSE_IN = ArrayRule(dtypes=("float32",), shapes=(ROWS,), reads="contiguous",
                   dtype_error="lse must be float32, as attention(..., return_lse=True) returns it, got {lse.dtype}",
                   shape_error="lse must have shape (B, Hq, R) = {lse.expected}, got {lse.shape}")
OUT = written("o", O_SHAPE, called="out")
LSE_OUT = written("lse", ROWS, dtype="float32", layout=False)
DQ, DK, DV = written("dq", Q_SHAPE), written("dk", K_SHAPE), written("dv", V_SHAPE)
DSINKS = written("dsinks", ("Hq",), dtype="float32", layout=False,
                 needs=(("sinks", "dsinks is given but options.sinks is not: there is no sink gradient"),))

GQA = Require("Hkv == 0 && Hq == 0 || Hkv != 0 && Hq % Hkv == 0",
              "q's head count ({Hq}) must be a multiple of k/v's ({Hkv}) (GQA/MQA)")
HEAD_DIMS = tuple(Require(f"1 <= {size} && {size} <= {MAX_HEAD_DIM}",
                          f"{text} is {{{size}}}; the kernels support 1..{MAX_HEAD_DIM}")
                  for text, size in (("D (q/k head dimension)", "D"), ("Dv (v head dimension)", "Dv")))


def limits(sizes: tuple[tuple[str, str], ...]) -> tuple[Require, ...]:
    """Each (text, size name) below 2**31: the kernels index it with 32-bit integers."""
    return tuple(Require(f"{size} <= {MAX_INDEX}",
                         f"{text} is {{{size}}}; the kernels index it with 32-bit integers, so it must be below 2**31")
                 for text, size in sizes)


CHECKS = Checks(
    requires=(
        Require("k_B == q_B && v_B == q_B",
                "q, k and v must share the batch size: q {q.shape}, k {k.shape}, v {v.shape}"),
        Require("k_D == q_D", "k's head dimension ({k_D}) must match q's ({q_D}): q {q.shape}, k {k.shape}"),
        Require("v_Hkv == k_Hkv && v_C == k_C", "v must have k's heads and length ({layout}): k {k.shape}, "
                                               "v {v.shape}"),
        GQA, *HEAD_DIMS,
        *limits((("B (batch)", "B"), ("Hq (query heads)", "Hq"), ("Hkv (key/value heads)", "Hkv"),
                 ("R (query length)", "R"), ("C (key length)", "C")))),
    derived=(("slope_rows", "B"),))   # a per-batch alibi_slopes table's rows
