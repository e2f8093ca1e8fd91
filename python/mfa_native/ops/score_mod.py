"""The `score_mod` arguments of the attention family: a traced FlexAttention score_mod (its
expression's text, codegen/attention/score_expression.py) and the tensors it reads, checked
and made the last case of the problem's score chain (after softcap and ALiBi)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..codegen.attention.score_mod import ScoreMod, tensor_buffer
from . import arguments as check
from .declaration import Arg
from .warm import Checked

SCORE_MOD = Arg("score_mod", "option", default=None, schema="str?", doc="""
    a traced FlexAttention score_mod: its expression's text, as `mfa_native.torch.score_mod.trace`
    gives it (with the tensors it reads; `mfa_native.torch.flex_attention` traces a callable
    itself). Each scaled score s of query q_idx, key kv_idx, head h, batch b becomes
    score_mod(s, b, h, q_idx, kv_idx) after softcap and ALiBi, before masks and sinks (q_idx,
    kv_idx: positions in the sequence; b: the batch or packed sequence), computed in float32;
    the backward uses its derivative, derived from the expression. None: none.""")
SCORE_MOD_TENSORS = Arg("score_mod_tensors", "arrays", default=(), doc="""
    the tensors score_mod reads, in the order its text numbers them (read as float32, or
    int32 for integer and boolean ones, at most 2**31 elements each; integers within int32). A
    read outside a tensor's axis (after torch's counting of negative indices from the end)
    makes that score NaN. Not differentiated.""")
SCORE_MOD_RAISES = """
    TypeError: score_mod is not a str; a score_mod_tensors entry is not a float, integer or
        boolean array.
    ValueError: score_mod is not an expression's text, or the tensors it reads are not those
        given (their count, their axes); a score_mod_tensors entry is empty, too large, or
        holds integers outside int32's range.
"""


def stored(tensor, index: int) -> np.ndarray:
    """Captured tensor `index` as the kernels read it: contiguous float32, or int32."""
    array = check.as_array(tensor, f"score_mod_tensors[{index}]")
    if array.dtype.kind == "f" or array.dtype.name == "bfloat16":
        return np.ascontiguousarray(array, dtype=np.float32)
    if array.dtype.kind not in "biu":
        raise TypeError(f"score_mod_tensors[{index}] must be a float, integer or boolean array, got {array.dtype}")
    if array.size and array.dtype.kind != "b" and (array.min() < -2**31 or array.max() >= 2**31):
        raise ValueError(f"score_mod_tensors[{index}] holds integers outside int32's range")
    return np.ascontiguousarray(array, dtype=np.int32)


def with_score_mod(checked: Checked, text: str | None, tensors) -> tuple[Checked, tuple[str, ...]]:
    """`checked` (ops/attention.py's Validated) with the score_mod (None: none) last in its
    problem's score chain and its tensors bound; and the names of those pass inputs, in
    argument order."""
    tensors = tuple(tensors or ())
    if text is None:
        if tensors:
            raise ValueError("score_mod_tensors given without a score_mod")
        return checked, ()
    if not isinstance(text, str):
        raise TypeError(f"score_mod must be a traced expression's text (str), got {type(text).__name__}: "
                        "mfa_native.torch.flex_attention traces a callable")
    arrays = [stored(t, i) for i, t in enumerate(tensors)]
    for i, array in enumerate(arrays):
        if array.size == 0 or array.size >= 2**31:
            raise ValueError(f"score_mod_tensors[{i}] has {array.size} elements (1 to 2**31 - 1 are read)")
    transform = ScoreMod(text, tuple(("float" if a.dtype == np.float32 else "int", a.shape) for a in arrays))
    names = tuple(tensor_buffer(i) for i in range(len(arrays)))
    converts = {name: (lambda t, i=i: stored(t, i)) for i, name in enumerate(names)}
    problem = replace(checked.problem, scores=checked.problem.scores + (transform,))
    return (type(checked)(problem, {**checked.bound, **dict(zip(names, arrays))}, {**checked.converts, **converts},
                      checked.sources), names)
