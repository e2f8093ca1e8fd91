"""The KV cache call's rotary embedding arguments (flash-attn's): their declarations, their
checks are rules (ops/kvcache_rules.py: shapes once per signature, positions every call, before
anything is written); and how they bind: the caller's q and new k under the rotation kernels' input names
(codegen/attention/rotary.py), the tables and the positions' starts beside them."""

from __future__ import annotations

import numpy as np

from ..codegen.attention.rotary import TABLES, Rotary
from . import arguments as check
from .declaration import Arg
from .kvcache_rules import RULES

ROTARY_COS = Arg("rotary_cos", "array", rule=RULES["rotary_cos"], default=None, doc="""
    (seqlen_ro, rotary_dim / 2) in q's dtype, optional, with k and v: the rotary embedding of q
    and of the appended k at their absolute positions, on the device in the same pass as the
    append (flash-attn's rules): k's new row i of batch b at position rotary_seqlens[b] (else
    cache_seqlens[b]) + i; q's row i there too with causal or a window, else every q row at
    rotary_seqlens[b] (cache_seqlens[b]). The first rotary_dim features of a row turn, the
    rest pass unchanged; v is never rotated.""")
ROTARY_SIN = Arg("rotary_sin", "array", rule=RULES["rotary_sin"], default=None, doc="(seqlen_ro, rotary_dim / 2), given with rotary_cos.")
ROTARY_SEQLENS = Arg("rotary_seqlens", "array", rule=RULES["rotary_seqlens"], default=None, doc="""
    int32 (B,), optional (flash-attn 3's): where batch b's rotary positions start, in place of
    cache_seqlens[b].""")
ROTARY_INTERLEAVED = Arg("rotary_interleaved", "option", default=True, schema="bool", doc="""
    True (flash-attn's default): features (0, 1), (2, 3) ... turn together (GPT-J); False:
    feature j with j + rotary_dim / 2 (GPT-NeoX).""")
ARGUMENTS = (ROTARY_COS, ROTARY_SIN, ROTARY_SEQLENS, ROTARY_INTERLEAVED)


def rotary_of(call, per_row: bool) -> Rotary | None:
    """The rotation a call asks (None without tables; their rules checked them)."""
    if call.rotary_cos is None:
        return None
    starts = "cache_seqlens" if call.rotary_seqlens is None else "rotary_seqlens"
    return Rotary(2 * call.rotary_cos.shape[1], bool(call.rotary_interleaved), per_row, starts)


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

