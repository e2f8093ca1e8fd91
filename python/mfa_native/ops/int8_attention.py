"""`mfa_native.int8_attention`: attention whose two products are exact int8 integer arithmetic."""

from __future__ import annotations

import numpy as np

from .. import codegen
from ..codegen import Int8Problem
from ..codegen.int8.problem import PV_MODES, QK_SCALES
from ..int8_reference import int8_attention_emulation, int8_quantized_reference
from ..runtime.devices import Device, tuning_facts
from . import arguments as check
from . import attention_rules
from .attention import (ALIBI_SLOPES, CAUSAL, LAYOUT, LSE, MASK, OUTPUT, Q, RAISES, RETURN_LSE, SCALE, SINKS, SOFTCAP,
                        WINDOW, Validated, validate)
from .declaration import Arg, Call, Op, Out
from .empty import empty_forward
from .warm import PreparedCall, prepared_call

# Why a QuantizedTensor k or v is refused (a TypeError naming it).
QUANTIZED_REFUSAL = "int8_attention quantizes float k and v itself; pass k.dequantize() (or use attention)"

FLOAT_K = Arg("k", "array", leading=True, keyword=False, rule=attention_rules.K,
              doc="keys, a float array as in `attention` (not quantized).")
FLOAT_V = Arg("v", "array", leading=True, keyword=False, rule=attention_rules.V,
              doc="values, a float array as in `attention`.")
QK_SCALE = Arg("qk_scale", "option", default="token", schema="str", doc="""
    how Q and K are quantized: symmetric int8 (round to nearest, halfway to even; clamped to
    +-127) with float32 scales absmax / 127, "token": one scale per row (per token and head),
    "tile": one per 16 query rows and per 64 key rows, aligned from row 0 of each (batch,
    head); K is quantized per kv head.""")
SMOOTH_K = Arg("smooth_k", "option", default=True, schema="bool", doc="""
    quantize K minus its mean over the attended keys (per batch, kv head and channel; see
    "Statistics" below). The results are those of the unshifted logits: each row's shift
    scale * q . mean(k) (float q) is added back before the softmax (before softcap and
    ALiBi: the cap takes the unshifted score), so lse and the sinks are those of the
    unshifted logits.""")
PV = Arg("pv", "option", default="int8", schema="str", doc="""
    "int8": V minus its per-channel mean over the attended keys is int8 with one scale per
    channel (the mean comes back with the real keys' probability mass, not the sink's); P is
    quantized to integers 0..127 (round(127 * p / block max)) per aligned block of 64 keys
    (keys 0-63, 64-127, ...), against the row's maximum over the allowed keys of the block
    (additive mask included), and the denominator is summed from the quantized P. "float": V
    in the input dtype, P float32 and not quantized, the float denominator.""")


def int8_options(qk_scale, smooth_k, pv) -> dict:
    """The checked quantization choices, as Int8Problem takes them."""
    if not isinstance(qk_scale, str) or qk_scale not in QK_SCALES:
        raise ValueError(f"qk_scale must be 'token' or 'tile', got {qk_scale!r}")
    smooth_k = check.flag(smooth_k, "smooth_k")
    if not isinstance(pv, str) or pv not in PV_MODES:
        raise ValueError(f"pv must be 'int8' or 'float', got {pv!r}")
    return dict(qk_scale=qk_scale, smooth_k=smooth_k, pv=pv)


def _checked(call: Call, *, scale=None, causal=False, mask=None, window=None, sinks=None, softcap=None,
             alibi_slopes=None, return_lse=False) -> tuple[Validated, dict]:
    options = int8_options(call.qk_scale, call.smooth_k, call.pv)
    checked = validate((call.q, call.k, call.v, mask, sinks), scale=scale, causal=causal, window=window,
                       layout=call.layout, return_lse=return_lse, softcap=softcap, alibi_slopes=alibi_slopes,
                       quantized_refusal=QUANTIZED_REFUSAL)
    return checked, options


def _prepare(call: Call, device: Device) -> tuple[PreparedCall, list[np.ndarray]]:
    """The first call of a signature: every check, then the problem's pass, prepared; and
    this call's inputs."""
    checked, options = _checked(call, scale=call.scale, causal=call.causal, mask=call.mask, window=call.window,
                                sinks=call.sinks, softcap=call.softcap, alibi_slopes=call.alibi_slopes,
                                return_lse=call.return_lse)
    p = checked.problem
    if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        return empty_forward(p, call.op.array_names, checked)
    description = codegen.int8_attention_pass(Int8Problem(p, **options), family=tuning_facts(device).family)
    return prepared_call(description, device, checked, call.op.array_names, call.results)


INT8_ATTENTION = Op(
    "int8_attention",
    "Softmax attention with q, k (and v) quantized to int8 on the device and both products\n"
    "computed in exact integer arithmetic: for GPUs with int8 matrix units.",
    arguments=(Q, FLOAT_K, FLOAT_V, SCALE, CAUSAL, MASK, WINDOW, SINKS, SOFTCAP, ALIBI_SLOPES, LAYOUT, RETURN_LSE,
               QK_SCALE, SMOOTH_K, PV),
    outputs=(OUTPUT, LSE),
    prepare=_prepare,
    checks=attention_rules.CHECKS,   # attention's arrays: validate checks them, the C++ binder too
    reference=int8_attention_emulation,
    no_backward="int8_attention has no backward: train with attention_backward on the float inputs, the output "
                "and the lse int8_attention returns (return_lse=True)",
    details="""
    Takes float inputs and returns float outputs exactly like `attention` (same arguments,
    shapes, layouts, masks, window, sinks, softcap, alibi_slopes, GQA, dtypes float32 /
    float16 / bfloat16, arrays of q's kind; k and v are float arrays, not QuantizedTensors);
    the quantization is internal, in one pass of kernels (quantizers, then attention) whose
    int8 values, scales and means stay in device memory. D (and Dv) are 1..256.

    Exactness: int8 values are exact in half, and every product sum is an integer below
    `2**24` in magnitude (`D * 127**2` for Q K^T, `64 * 127**2` for P V per block), so float32
    accumulation on simdgroup matrices is exact (codegen refuses D beyond 1040).

    Statistics: K's mean (smooth_k), V's mean and the scales of K's and V's rows and
    channels are taken over the attended keys only: those at least one query row of the
    (batch, kv head) may attend, under causal (either alignment), the window and the mask
    (a key is attended when some row of some query head of the kv head, as the mask
    broadcasts, has True, or an additive value that is not -inf). A key no query attends
    (a padded cache slot every row masks) is stored as integers 0: its values, even 1e4 or
    NaN, move no statistic and reach no output. A (batch, kv head) with no attended key
    gives what a fully masked row gives: output 0, lse -inf (or the sink).

    NaN: a NaN in q or in an attended key reaches everything its scale (and, with smooth_k
    or pv="int8", its mean) covers: with qk_scale="token" its row; with "tile" its tile's
    rows; with smooth_k every row of its (batch, kv head); with pv="int8" its output channel
    for every row.

    No backward: train with `attention_backward` on the float inputs, the output and the
    lse this op returns (return_lse=True).
    """,
    returns="""
    As `attention`: the output o (q's kind, dtype and layout, (B, Hq, R, Dv) or for "bshd"
    (B, R, Hq, Dv)), with return_lse=True the tuple (o, lse); lse is the natural log of the
    denominator the output is normalized by (of the quantized P with pv="int8"), sink
    included. A row with no allowed key (and no sink) gives output 0 and lse -inf.
    """,
    raises=RAISES + """
    TypeError: k or v is a QuantizedTensor (pass k.dequantize(), or use `attention`);
        smooth_k is not a bool.
    ValueError: qk_scale is not "token" or "tile", pv not "int8" or "float"; D or Dv
        beyond 256.
    """,
    example="""
    import numpy as np
    import mfa_native
    from mfa_native.reference import attention_reference

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 16, 32), dtype=np.float32) for _ in range(3))
    o = mfa_native.int8_attention(q, k, v, causal=True, device="cpu")
    exact = attention_reference(q, k, v, causal=True)
    error = np.linalg.norm(o - exact) / np.linalg.norm(exact)
    print(f"int8 against float64: relative error {error:.4f}")   # about 0.01
    assert o.dtype == np.float32 and error < 0.05
    """)
int8_attention = INT8_ATTENTION.function


def _prepare_quantizers(call: Call, device: Device) -> tuple[PreparedCall, list[np.ndarray]]:
    checked, options = _checked(call, causal=call.causal, mask=call.mask, window=call.window)
    p = checked.problem
    if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        raise ValueError("int8_quantized needs non-empty q, k and v")
    description = codegen.int8_quantizer_pass(Int8Problem(p, **options), family=tuning_facts(device).family)
    names = tuple(b.name for b in description.outputs)
    prepared, inputs = prepared_call(description, device, checked, call.op.array_names, names)
    by_name = PreparedCall(prepared.pass_, prepared.picks, lambda outputs: dict(zip(names, prepared.finish(outputs))))
    return by_name, inputs


INT8_QUANTIZED = Op(
    "int8_quantized",
    "What int8_attention's quantizer kernels store for q, k, v, by buffer name.",
    arguments=(Q, FLOAT_K, FLOAT_V, CAUSAL, MASK, WINDOW, LAYOUT, QK_SCALE, SMOOTH_K, PV),
    outputs=tuple(Out(name, "") for name in ("q_int8", "q_scale", "k_int8", "k_scale")),
    prepare=_prepare_quantizers,
    reference=int8_quantized_reference,
    no_backward="int8_quantized (int8 attention's quantizers) rounds to integers: it has no gradient",
    details="""
    codegen/int8/operands.py names them: q_int8, q_scale, k_int8, k_scale, with smooth_k
    k_mean and q_shift, with pv="int8" v_int8, v_scale, v_mean, with a masking rule (causal,
    mask, window) k_attended; C-contiguous in logical (batch, head, sequence, feature) order.
    For checking the quantizers.
    """)
int8_quantized = INT8_QUANTIZED.function
