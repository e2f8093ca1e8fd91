"""The `score_mod` arguments of the attention family: a traced FlexAttention score_mod (its
expression's text, codegen/attention/score_expression.py) and the tensors it reads, checked
and made the last case of the problem's score chain (after softcap and ALiBi). A score_mod
given as a function is traced first (`traced_score_mod`), by the tracer of q's framework."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..codegen.attention.score_mod import ScoreMod, tensor_buffer
from ..runtime.frameworks import framework_of, trace_score_mod
from .given_kind import items
from . import arguments as check
from .declaration import Arg
from .warm import Checked

def traced_score_mod(values: dict) -> dict:
    """`values` with a score_mod function traced into its text and the arrays it captured, by
    the tracer of q's array kind (torch tensors: torch's; MLX arrays: MLX's)."""
    score_mod = values["score_mod"]
    if not callable(score_mod):
        return values
    framework = framework_of(values["q"])
    if framework is None:
        raise TypeError("score_mod is a function, which is traced by the framework of q's arrays (torch "
                        "tensors or MLX arrays); with numpy arrays pass its text and tensors "
                        "(mfa_native.torch.score_mod.trace)")
    if items(values["score_mod_tensors"]):
        raise ValueError("score_mod_tensors is given with a score_mod function: tracing the function finds the "
                         "arrays it reads")
    text, arrays = trace_score_mod(framework, score_mod)
    return {**values, "score_mod": text, "score_mod_tensors": tuple(arrays)}


SCORE_MOD = Arg("score_mod", "option", default=None, schema="str?", resolve=traced_score_mod, doc="""
    a FlexAttention score_mod: a function `(score, b, h, q_idx, kv_idx) -> score` written with
    torch (for torch tensors) or MLX (for MLX arrays), traced into the kernels with the arrays
    it captured, once while what it sees stays the same; or its traced expression's text, as
    `mfa_native.torch.score_mod.trace` gives it, with score_mod_tensors. Each scaled score s
    of query q_idx, key kv_idx, head h, batch b becomes score_mod(s, b, h, q_idx, kv_idx)
    after softcap and ALiBi, before masks and sinks (q_idx, kv_idx: positions in the
    sequence; b: the batch or packed sequence), computed in float32; the backward uses its
    derivative, derived from the expression. None: none.""")
SCORE_MOD_TENSORS = Arg("score_mod_tensors", "arrays", default=(), doc="""
    the tensors score_mod reads, in the order its text numbers them (read as float32, or
    int32 for integer and boolean ones, at most 2**31 elements each; integers within int32). A
    read outside a tensor's axis (after torch's counting of negative indices from the end)
    makes that score NaN. Not differentiated.""")
SCORE_MOD_RAISES = """
    TypeError: score_mod is neither a str nor a function; a function with numpy arrays (no
        framework to trace it); a score_mod_tensors entry is not a float, integer or boolean
        array.
    ValueError: score_mod is not an expression's text, or the tensors it reads are not those
        given (their count, their axes); a function uses what cannot be compiled, or comes with
        score_mod_tensors; a score_mod_tensors entry is empty, too large, or holds integers
        outside int32's range.
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
        raise TypeError(f"score_mod must be a function or its traced expression's text (str), got "
                        f"{type(text).__name__}")
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
