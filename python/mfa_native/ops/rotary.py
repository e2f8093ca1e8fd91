"""The KV cache call's rotary embedding arguments (flash-attn's): their declarations, their
checks (shapes once per signature, positions every call, before anything is written) and how
they bind: the caller's q and new k under the rotation kernels' input names
(codegen/attention/rotary.py), the tables and the positions' starts beside them."""

from __future__ import annotations

import numpy as np

from ..codegen.attention.rotary import TABLES, Rotary
from . import arguments as check
from .declaration import Arg

ROTARY_COS = Arg("rotary_cos", "array", default=None, doc="""
    (seqlen_ro, rotary_dim / 2) in q's dtype, optional, with k and v: the rotary embedding of q
    and of the appended k at their absolute positions, on the device in the same pass as the
    append (flash-attn's rules): k's new row i of batch b at position rotary_seqlens[b] (else
    cache_seqlens[b]) + i; q's row i there too with causal or a window, else every q row at
    rotary_seqlens[b] (cache_seqlens[b]). The first rotary_dim features of a row turn, the
    rest pass unchanged; v is never rotated.""")
ROTARY_SIN = Arg("rotary_sin", "array", default=None, doc="(seqlen_ro, rotary_dim / 2), given with rotary_cos.")
ROTARY_SEQLENS = Arg("rotary_seqlens", "array", default=None, doc="""
    int32 (B,), optional (flash-attn 3's): where batch b's rotary positions start, in place of
    cache_seqlens[b].""")
ROTARY_INTERLEAVED = Arg("rotary_interleaved", "option", default=True, schema="bool", doc="""
    True (flash-attn's default): features (0, 1), (2, 3) ... turn together (GPT-J); False:
    feature j with j + rotary_dim / 2 (GPT-NeoX).""")
ARGUMENTS = (ROTARY_COS, ROTARY_SIN, ROTARY_SEQLENS, ROTARY_INTERLEAVED)


def rotary_of(call, q, appended: int, per_row: bool) -> Rotary | None:
    """The rotation a call asks (None without tables), its tables' shapes and dtypes checked."""
    cos, sin = call.rotary_cos, call.rotary_sin
    if cos is None and sin is None:
        if call.rotary_seqlens is not None:
            raise ValueError("rotary_seqlens is given without rotary_cos and rotary_sin")
        return None
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin are given together")
    if not appended:
        raise ValueError("rotary_cos needs k and v: the rotary embedding applies to the rows appended "
                         "(flash-attn's rule)")
    cos, sin = check.as_array(cos, "rotary_cos"), check.as_array(sin, "rotary_sin")
    D = q.shape[-1]
    if cos.ndim != 2 or cos.shape != sin.shape or not 0 < 2 * cos.shape[1] <= D:
        raise ValueError(f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2) with 0 < rotary_dim "
                         f"<= D = {D}, got {cos.shape} and {sin.shape}")
    if cos.dtype != q.dtype or sin.dtype != q.dtype:
        raise ValueError(f"rotary_cos and rotary_sin must have q's dtype {q.dtype}, got {cos.dtype} and {sin.dtype}")
    starts = "cache_seqlens" if call.rotary_seqlens is None else "rotary_seqlens"
    return Rotary(2 * cos.shape[1], bool(call.rotary_interleaved), per_row, starts)


def check_positions(rotary: Rotary | None, values: dict, lengths: np.ndarray, rows: int, appended: int) -> None:
    """Every call: the positions the rotation reads lie in the tables (ValueError naming them)."""
    if rotary is None:
        return
    starts = lengths
    if rotary.starts == "rotary_seqlens":
        starts = check.as_array(values["rotary_seqlens"], "rotary_seqlens")
        if starts.dtype != np.int32 or starts.shape != lengths.shape:
            raise ValueError(f"rotary_seqlens must be int32 (B,) = {lengths.shape}, got {starts.dtype} {starts.shape}")
        if starts.size and starts.min() < 0:
            raise ValueError(f"rotary_seqlens must not be negative, got {starts.min()}")
    if not starts.size:
        return
    last = int(starts.max()) + max(appended, rows if rotary.per_row else 1) - 1
    positions = check.as_array(values["rotary_cos"], "rotary_cos").shape[0]
    if last >= positions:
        raise ValueError(f"rotary_cos has {positions} positions (seqlen_ro), too few for position {last} "
                         f"({rotary.starts} + the new rows)")


def bind(checked, rotary: Rotary | None, call) -> None:
    """Moves q and the new k to the rotation kernels' inputs (`{buffer}_unrotated`, bound
    contiguous, as the kernels index them) and binds the tables and the starts."""
    if rotary is None:
        return
    for buffer, given in rotary.rebinds().items():
        checked.bound[given] = np.ascontiguousarray(checked.bound.pop(buffer))
        checked.converts.pop(buffer, None)
        checked.converts[given] = np.ascontiguousarray
        checked.sources[given] = checked.sources.pop(buffer, buffer)
    for name in (*TABLES, *(("rotary_seqlens",) if rotary.starts == "rotary_seqlens" else ())):
        checked.bound[name] = np.ascontiguousarray(check.as_array(getattr(call, name), name))
        checked.converts[name] = np.ascontiguousarray

