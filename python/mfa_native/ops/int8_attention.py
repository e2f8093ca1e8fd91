"""`mfa_native.int8_attention`: attention whose two products are exact int8 integer arithmetic."""

from __future__ import annotations

import numpy as np

from .. import codegen
from ..codegen import Int8Problem
from ..codegen.int8.problem import PV_MODES, QK_SCALES
from ..runtime.devices import Device, resolve_device, tuning_facts
from ..runtime.runner import PreparedPass
from . import arguments as check
from .attention import ARGUMENTS, forward_results, validate
from .empty import empty_forward
from .given_kind import returns_given_kind
from .warm import PreparedCall, SignatureCache, prepared_call, run, signature

_calls = SignatureCache()

# Why a QuantizedTensor k or v is refused (a TypeError naming it).
QUANTIZED_REFUSAL = "int8_attention quantizes float k and v itself; pass k.dequantize() (or use attention)"


@returns_given_kind(("q", "k", "v"), ("mask", "sinks"))
def int8_attention(q, k, v, *, scale=None, causal=False, mask=None, window=None, sinks=None, layout="bhsd",
                   return_lse=False, qk_scale: str = "token", smooth_k: bool = True, pv: str = "int8",
                   device: Device | str | None = None):
    """Softmax attention with q, k (and v) quantized to int8 on the device and both products
    computed in exact integer arithmetic: for GPUs with int8 matrix units.

    Takes float inputs and returns float outputs exactly like `attention` (same arguments,
    shapes, layouts, masks, window, sinks, GQA, dtypes float32 / float16 / bfloat16, arrays
    of q's kind; k and v are float arrays, not QuantizedTensors); the quantization is
    internal, in one pass of kernels (quantizers, then attention) whose int8 values, scales
    and means stay in device memory.

    Args:
        q, k, v, scale, causal, mask, window, sinks, layout, return_lse, device: as in
            `attention`. D (and Dv) are 1..256.
        qk_scale: how Q and K are quantized: symmetric int8 (round to nearest, halfway to
            even; clamped to +-127) with float32 scales absmax / 127, "token": one scale
            per row (per token and head), "tile": one per 16 query rows and per 64 key
            rows, aligned from row 0 of each (batch, head); K is quantized per kv head.
        smooth_k: quantize K minus its mean over all C keys (per batch, kv head and
            channel). The results are those of the unshifted logits: each row's shift
            scale * q . mean(k) (float q) is added back before the softmax, so lse and the
            sinks are those of the unshifted logits.
        pv: "int8": V minus its per-channel mean over the keys is int8 with one scale per
            channel (the mean comes back with the real keys' probability mass, not the
            sink's); P is quantized to integers 0..127 (round(127 * p / block max)) per
            aligned block of 64 keys (keys 0-63, 64-127, ...), against the row's maximum
            over the allowed keys of the block (additive mask included), and the
            denominator is summed from the quantized P. "float": V in the input dtype, P
            float32 and not quantized, the float denominator.

    Returns:
        As `attention`: the output (q's kind, dtype and layout, (.., Dv)), with return_lse
        the tuple (output, lse); lse is the natural log of the denominator the output is
        normalized by (of the quantized P with pv="int8"), sink included. A row with no
        allowed key (and no sink) gives output 0 and lse -inf.

    Exactness: int8 values are exact in half, and every product sum is an integer below
    2**24 in magnitude (D * 127**2 for Q K^T, 64 * 127**2 for P V per block), so float32
    accumulation on simdgroup matrices is exact (codegen refuses D beyond 1040).

    NaN: a NaN reaches everything its scale (and, with smooth_k or pv="int8", its mean)
    covers: with qk_scale="token" its row; with "tile" its tile's rows; with smooth_k
    every row of its (batch, kv head); with pv="int8" its output channel for every row.

    No backward: train with `attention_backward` on the float inputs, the output and the
    lse this op returns (return_lse=True).

    Raises:
        TypeError, ValueError naming the argument that is wrong.
    """
    device = resolve_device(device)
    arrays = (q, k, v, mask, sinks)
    key = signature(arrays, (scale, causal, window, layout, return_lse, qk_scale, smooth_k, pv), device)
    return run(_calls, key, arrays, lambda: _prepare(arrays, scale=scale, causal=causal, window=window, layout=layout,
                                                     return_lse=return_lse, qk_scale=qk_scale, smooth_k=smooth_k,
                                                     pv=pv, device=device))


def int8_options(qk_scale, smooth_k, pv) -> dict:
    """The checked quantization choices, as Int8Problem takes them."""
    if not isinstance(qk_scale, str) or qk_scale not in QK_SCALES:
        raise ValueError(f"qk_scale must be 'token' or 'tile', got {qk_scale!r}")
    smooth_k = check.flag(smooth_k, "smooth_k")
    if not isinstance(pv, str) or pv not in PV_MODES:
        raise ValueError(f"pv must be 'int8' or 'float', got {pv!r}")
    return dict(qk_scale=qk_scale, smooth_k=smooth_k, pv=pv)


def _prepare(arrays, *, scale, causal, window, layout, return_lse, qk_scale, smooth_k, pv,
             device: Device) -> tuple[PreparedCall, list[np.ndarray]]:
    """The first call of a signature: every check, then the problem's pass, prepared; and
    this call's inputs."""
    options = int8_options(qk_scale, smooth_k, pv)
    call = validate(arrays, scale=scale, causal=causal, window=window, layout=layout, return_lse=return_lse,
                    quantized_refusal=QUANTIZED_REFUSAL)
    p = call.problem
    if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        return empty_forward(p, ARGUMENTS, call)
    description = codegen.int8_attention_pass(Int8Problem(p, **options), family=tuning_facts(device).family)
    return prepared_call(description, device, call, ARGUMENTS, forward_results(return_lse))


def int8_quantized(q, k, v, *, layout="bhsd", qk_scale="token", smooth_k=True, pv="int8",
                   device: Device | str | None = None) -> dict[str, np.ndarray]:
    """What int8_attention's quantizer kernels store for numpy q, k, v, by buffer name
    (codegen/int8_operands.py: q_int8, q_scale, k_int8, k_scale, with smooth_k k_mean and
    q_shift, with pv="int8" v_int8, v_scale, v_mean), C-contiguous in logical (batch, head,
    sequence, feature) order. For checking the quantizers; no warm path."""
    device = resolve_device(device)
    options = int8_options(qk_scale, smooth_k, pv)
    call = validate((q, k, v, None, None), scale=None, causal=False, window=None, layout=layout, return_lse=False,
                    quantized_refusal=QUANTIZED_REFUSAL)
    p = call.problem
    if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        raise ValueError("int8_quantized needs non-empty q, k and v")
    prepared = PreparedPass(codegen.int8_quantizer_pass(Int8Problem(p, **options),
                                                        family=tuning_facts(device).family), device)
    outputs = prepared.run([call.bound[name] for name in prepared.input_names])
    return dict(zip(prepared.output_names, outputs))
