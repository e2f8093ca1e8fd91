"""`mfa_native.merge_attention`: attention over a union of disjoint key sets, from its parts,
merged on the device (codegen/attention/merge.py)."""

from __future__ import annotations

import numpy as np

from ..codegen import physical
from ..codegen.attention import merge as codegen_merge
from ..runtime.devices import Device
from ..runtime.templates import evaluate
from . import arguments as check
from .declaration import Arg, Call, Op, Out
from .empty import empty_call, filled
from .warm import Checked, PreparedCall, prepared_call, same_memory


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
    dtype = check.dtype_of(first, "outputs[0]")
    for i, part in enumerate(parts):
        if part.dtype != first.dtype or part.shape != first.shape or part.ndim != 4:
            raise ValueError(f"outputs must be 4-d arrays of one dtype and shape: outputs[0] is {first.dtype} "
                             f"{first.shape}, outputs[{i}] is {part.dtype} {part.shape}")
    B, Hq, R, Dv = physical(first.shape, layout)
    bound, converts, names = {}, {}, []
    for i, (raw, convert) in enumerate([(o, np.ascontiguousarray) for o in parts]
                                       + [(lse, lambda x, shape=(B, Hq, R): check.lse_array(x, shape)) for lse in lses]):
        name = codegen_merge.part(i) if i < len(parts) else codegen_merge.part_lse(i - len(parts))
        bound[name] = convert(raw)
        converts[name] = None if same_memory(raw, bound[name]) else convert
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
        Arg("outputs", "arrays", leading=True, keyword=False, doc="""
            what `attention` returned for each part: arrays of one kind (numpy, torch or MLX),
            dtype and shape, (B, Hq, R, Dv) for layout "bhsd", (B, R, Hq, Dv) for "bshd"."""),
        Arg("lses", "arrays", keyword=False,
            doc="the parts' lse, (B, Hq, R) float32 (`attention(..., return_lse=True)`)."),
        Arg("layout", "option", default="bhsd", doc='"bhsd" or "bshd", as passed to `attention`.'),
    ),
    outputs=(Out("o", "the merged output, in the parts' dtype, layout and kind"),
             Out("lse", "(B, Hq, R) float32")),
    prepare=_prepare,
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
