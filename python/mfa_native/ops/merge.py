"""`mfa_native.merge_attention`: attention over a union of disjoint key sets, from its parts,
merged on the device (codegen/attention/merge.py)."""

from __future__ import annotations

import numpy as np

from ..codegen import physical
from ..codegen.attention import merge as codegen_merge
from ..runtime.devices import Device
from ..runtime.templates import evaluate
from . import arguments as check
from .attention_rules import FLOATS
from .declaration import Arg, Call, Op, Out
from .empty import empty_call, filled
from .rules import ArrayRule, Binding, Checks
from .warm import Checked, PreparedCall, prepared_call, same_memory

_UNLIKE = ("outputs must be 4-d arrays of one dtype and shape: outputs[0] is {outputs[0].dtype} {outputs[0].shape}, "
           "{outputs.element} is {outputs.dtype} {outputs.shape}")
# Each part: the first binds B, Hq, R and Dv (a float dtype, 4-d), every other is like it.
OUTPUTS_RULE = ArrayRule(dtypes=FLOATS, shapes=(("B", "Hq", "R", "Dv"),), layout=True, binds=True,
                         reads="contiguous", unlike_error=_UNLIKE, rank_error=_UNLIKE,
                         dtype_error="outputs[0] must be float32, float16 or bfloat16 (ml_dtypes), got "
                                     "{outputs[0].dtype}")
LSES_RULE = ArrayRule(dtypes=("float32",), shapes=(("B", "Hq", "R"),), reads="contiguous",
                      dtype_error="{lses.element} must be float32, as attention(..., return_lse=True) returns it, "
                                  "got {lses.dtype}",
                      shape_error="{lses.element} must have shape (B, Hq, R) = {lses.expected}, got {lses.shape}")
RULES = {"outputs": OUTPUTS_RULE, "lses": LSES_RULE}
CHECKS = Checks()


def _merged(name: str, shape: tuple[str, ...], what: str, dtype: str | None = None) -> ArrayRule:
    """The merged output or lse a C++ caller gives (Python returns new ones): `dtype` (None:
    the parts'), `shape`, contiguous; one message for a wrong dtype or shape."""
    called = "out" if name == "o" else name
    message = (f"{called} must be {what}, {dtype or '{outputs[0].dtype}'} {{{called}.expected}}, got "
               f"{{{called}.dtype}} {{{called}.shape}}")
    return ArrayRule(dtypes=(dtype,) if dtype else (), dtype_of=None if dtype else "outputs[0]", shapes=(shape,),
                     layout=len(shape) == 4, written=True, reads="contiguous",
                     called=None if called == name else called, dtype_error=message, shape_error=message)


def _merge_reference(outputs, lses, *, layout="bhsd"):
    """float64: output = sum_i exp(lses[i] - lse) outputs[i], lse = logsumexp over the parts."""
    logs = np.stack([np.asarray(x, np.float64) for x in lses])
    parts = np.stack([np.asarray(x, np.float64) for x in outputs])
    top = np.max(np.where(np.isneginf(logs), -np.inf, logs), axis=0)
    seen = top > -np.inf
    shares = np.exp(logs - np.where(seen, top, 0.0))
    total = shares.sum(axis=0)
    weights = shares / np.where(seen, total, 1.0)
    if layout == "bshd":
        weights = weights.transpose(0, 1, 3, 2)
    merged = np.einsum("pbhr,pbhrd->bhrd" if layout == "bhsd" else "pbrh,pbrhd->brhd", weights, parts)
    return merged, np.where(seen, top + np.log(np.where(seen, total, 1.0)), -np.inf)


def _prepare(call: Call, device: Device) -> tuple[PreparedCall, list[np.ndarray]]:
    layout = check.layout_of(call.layout)
    outputs, lses = call.outputs, call.lses
    if not isinstance(outputs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError("outputs and lses must be lists (or tuples) of arrays")
    if not outputs or len(outputs) != len(lses):
        raise ValueError(f"outputs and lses must be non-empty and of one length, got {len(outputs)} and {len(lses)}")
    parts = [check.as_array(o, f"outputs[{i}]") for i, o in enumerate(outputs)]
    first = parts[0]
    binding = Binding(RULES, CHECKS, layout)
    binding.bind({"outputs[0]": (first.shape, str(first.dtype))})
    for i, part in enumerate(parts[1:], 1):
        binding.check(f"outputs[{i}]", part.shape, str(part.dtype))
    dtype = check.dtype_of(first, "outputs[0]")
    B, Hq, R, Dv = physical(first.shape, layout)
    rows = [check.as_array(lse, f"lses[{i}]") for i, lse in enumerate(lses)]
    for i, lse in enumerate(rows):
        binding.check(f"lses[{i}]", lse.shape, str(lse.dtype))
    bound, converts, names = {}, {}, []
    for i, raw in enumerate(parts + rows):   # the signature fixes each one's dtype and shape
        name = codegen_merge.part(i) if i < len(parts) else codegen_merge.part_lse(i - len(parts))
        bound[name] = np.ascontiguousarray(raw)
        converts[name] = None if same_memory(raw, bound[name]) else np.ascontiguousarray
        names.append(name)
    checked = Checked(bound, converts)
    if B * Hq * R * Dv == 0:
        return empty_call([], tuple(names), checked,
                          lambda inputs: [filled(first.shape, first.dtype, 0), filled((B, Hq, R), np.float32, -np.inf)])
    descriptor = codegen_merge.describe_merge(dtype=dtype, value_dim=Dv, parts=len(parts), layout=layout)
    description = evaluate(codegen_merge.merge_template(descriptor), dict(B=B, Hq=Hq, R=R))
    return prepared_call(description, device, checked, tuple(names), ("o", "lse"))


MERGE_ATTENTION = Op(
    "merge_attention",
    "The exact combination of attentions of the same queries over disjoint sets of keys.",
    arguments=(
        Arg("outputs", "arrays", leading=True, keyword=False, rule=OUTPUTS_RULE, doc="""
            what `attention` returned for each part: arrays of one kind (numpy, torch or MLX),
            dtype and shape, (B, Hq, R, Dv) for layout "bhsd", (B, R, Hq, Dv) for "bshd"."""),
        Arg("lses", "arrays", keyword=False, rule=LSES_RULE,
            doc="the parts' lse, (B, Hq, R) float32 (`attention(..., return_lse=True)`)."),
        Arg("layout", "option", default="bhsd", doc='"bhsd" or "bshd", as passed to `attention`.'),
    ),
    outputs=(Out("o", "the merged output, in the parts' dtype, layout and kind",
                 rule=_merged("o", ("B", "Hq", "R", "Dv"), "the merged output (the parts' dtype and shape)")),
             Out("lse", "(B, Hq, R) float32", rule=_merged("lse", ("B", "Hq", "R"), "the merged lse (B, Hq, R)",
                                                          "float32"))),
    prepare=_prepare,
    checks=CHECKS,
    reference=_merge_reference,
    no_backward="merge_attention has no backward yet: differentiate the parts' attention instead",
    details="""
    With lse = logsumexp over parts of lses[i], the result is
    output = sum_i exp(lses[i] - lse) * outputs[i], computed in float32 on the device (one
    pass, one kernel); a part whose lse is -inf (a row that saw no key there) contributes
    nothing, a row with lse -inf in every part gets output 0 and lse -inf, as `attention`
    gives, and a NaN in any part's lse makes its row's output and lse NaN (as
    torch.logsumexp). This is how split-KV decode, ring attention and sharded decode combine
    their parts.
    """,
    returns="""
    The tuple (o, lse): o in the parts' dtype, layout, shape and kind; lse (B, Hq, R) float32.
    """,
    raises="""
    TypeError: outputs or lses is not a list or tuple; a part is not an array numpy can read
        or not float32, float16 or bfloat16; an lse is not float32.
    ValueError: no parts, or outputs and lses of different lengths; parts of different
        shapes or dtypes, or not 4-d; an lse that is not (B, Hq, R); layout not "bhsd" or
        "bshd".
    """,
    example="""
    import numpy as np
    import mfa_native
    from mfa_native.reference import attention_reference

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 16, 32), dtype=np.float32)
    k1, v1, k2, v2 = (rng.standard_normal((1, 2, 16, 32), dtype=np.float32) for _ in range(4))
    o1, lse1 = mfa_native.attention(q, k1, v1, return_lse=True, device="cpu")   # the first 16 keys
    o2, lse2 = mfa_native.attention(q, k2, v2, return_lse=True, device="cpu")   # the other 16
    o, lse = mfa_native.merge_attention([o1, o2], [lse1, lse2], device="cpu")
    k, v = np.concatenate([k1, k2], axis=2), np.concatenate([v1, v2], axis=2)   # all 32 keys
    expected, expected_lse = attention_reference(q, k, v, return_lse=True)
    assert np.allclose(o, expected, atol=1e-4) and np.allclose(lse, expected_lse, atol=1e-4)
    """)
merge_attention = MERGE_ATTENTION.function
