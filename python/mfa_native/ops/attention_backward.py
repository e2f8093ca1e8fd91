"""`mfa_native.attention_backward`: the gradients of `attention`, from kernels without atomics."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import codegen, reference
from ..codegen import AttentionBackwardProblem, physical
from ..runtime.devices import Device, tuning_facts
from . import arguments as check
from . import attention_rules as rules
from .attention import (ALIBI_SLOPES, CAUSAL, FAMILY_RULES, K, LAYOUT, MASK, Q, RAISES, SCALE, SINKS, SOFTCAP, V,
                        WINDOW, Validated, validate)
from .declaration import Arg, Call, Op, Out
from .empty import empty_backward
from .score_mod import SCORE_MOD, SCORE_MOD_RAISES, SCORE_MOD_TENSORS, with_score_mod
from .warm import PreparedCall, prepared_call, same_memory

O = Arg("o", "array", keyword=False, rule=rules.O, doc="""
    what `attention(..., return_lse=True)` returned: the output (q's dtype and layout, shape
    (.., Dv)); any non-negative strides with a contiguous last axis.""")
LSE_IN = Arg("lse", "array", keyword=False, rule=rules.LSE_IN, doc="the lse it returned, (B, Hq, R) float32.")
DO = Arg("do", "array", keyword=False, rule=rules.DO, doc="""
    the gradient of the loss with respect to o, shaped and typed like o (any non-negative
    strides with a contiguous last axis).""")
GRADIENTS = (Out("dq", "gradient of q, laid out like q", fake=lambda a: (a["q"].shape, "q"), rule=rules.DQ),
             Out("dk", "gradient of k, laid out like k", fake=lambda a: (a["k"].shape, "k"), rule=rules.DK),
             Out("dv", "gradient of v, laid out like v", fake=lambda a: (a["v"].shape, "v"), rule=rules.DV),
             Out("dsinks", "(Hq,) float32", when="sinks", fake=lambda a: (a["sinks"].shape, "float32"),
                 rule=rules.DSINKS))
# The rules of the backward's array arguments, by name: the forward's and o, do, lse.
BACKWARD_RULES = {**FAMILY_RULES, **{arg.name: arg.rule for arg in (O, DO, LSE_IN)}}
# The pass's names of the array arguments, in declaration order (do binds as dout).
BINDINGS = ("q", "k", "v", "o", "lse", "dout", "mask", "sinks", "alibi_slopes")


def validate_backward(arrays, *, scale, causal, window, layout, softcap=None, alibi_slopes=None) -> Validated:
    """Every check of `attention_backward`'s arguments; `arrays` = (q, k, v, o, lse, do, mask,
    sinks) as passed. The problem is an AttentionBackwardProblem."""
    q, k, v, o, lse, do, mask, sinks = arrays
    forward = validate((q, k, v, mask, sinks), scale=scale, causal=causal, window=window, layout=layout,
                       return_lse=False, softcap=softcap, alibi_slopes=alibi_slopes, quantized_refusal="a quantized cache has no gradient; attention_backward "
                       "differentiates attention over float k and v")
    p = forward.problem
    binding = forward.binding.with_rules(BACKWARD_RULES)
    bound, converts = dict(forward.bound), dict(forward.converts)
    for name, raw in (("o", o), ("do", do), ("lse", lse)):
        buffer = BACKWARD_RULES[name].buffer or name
        converts[buffer] = lambda x, name=name: check.ruled(x, name, binding)
        bound[buffer] = converts[buffer](raw)
        if same_memory(raw, bound[buffer]):
            converts[buffer] = None
    # o is an input here (the forward's output); the gradients are allocated.
    aligned = check.aligned({name: bound[name] for name in ("q", "k", "v", "o", "dout")}, ("dq", "dk", "dv"))
    problem = AttentionBackwardProblem(replace(p, aligned=aligned), o_strides=physical(check.element_strides(bound["o"]), layout),
                                       dout_strides=physical(check.element_strides(bound["dout"]), layout))
    return Validated(problem, bound, converts, binding=binding)


def _prepare(call: Call, device: Device) -> tuple[PreparedCall, list[np.ndarray]]:
    """The first call of a signature: every check, then the backward pass, prepared; and
    this call's inputs."""
    checked = validate_backward((call.q, call.k, call.v, call.o, call.lse, call.do, call.mask, call.sinks),
                                scale=call.scale, causal=call.causal, window=call.window, layout=call.layout,
                                softcap=call.softcap, alibi_slopes=call.alibi_slopes)
    forward, tensors = with_score_mod(Validated(checked.problem.forward, checked.bound, checked.converts),
                                      call.score_mod, call.score_mod_tensors)
    checked = Validated(replace(checked.problem, forward=forward.problem), forward.bound, forward.converts)
    p, names = checked.problem.forward, BINDINGS + tensors
    if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        return empty_backward(p, names, checked)
    description = codegen.attention_backward_pass(checked.problem, family=tuning_facts(device).family)
    return prepared_call(description, device, checked, names, call.results)


ATTENTION_BACKWARD = Op(
    "attention_backward",
    "Gradients of `attention` with respect to q, k, v (and sinks), given the gradient of its output.",
    arguments=(Q, K, V, O, LSE_IN, DO, SCALE, CAUSAL, MASK, WINDOW, SINKS, SOFTCAP, ALIBI_SLOPES, SCORE_MOD_TENSORS,
               SCORE_MOD, LAYOUT),
    outputs=GRADIENTS,
    prepare=_prepare,
    checks=rules.CHECKS,
    reference=reference.attention_backward_reference,
    no_backward="attention_backward has no second derivative",
    details="""
    q, k, v, scale, causal, mask, window, sinks, softcap, alibi_slopes, score_mod,
    score_mod_tensors and layout are exactly as passed to
    `attention` (same semantics, shapes, dtypes and strides); q, k and v are one kind
    (numpy, torch or MLX), the other arrays numpy or that kind. The kernels use no atomics:
    two runs give the same bits. Accumulation runs in float32.
    """,
    returns="""
    (dq, dk, dv) of q's kind and dtype, laid out like q, k and v (contiguous); with sinks,
    (dq, dk, dv, dsinks), dsinks being (Hq,) float32. With GQA, dk and dv sum the query heads
    that share each kv head. The mask gets no gradient. Rows with no allowed key contribute
    nothing.
    """,
    raises=RAISES + SCORE_MOD_RAISES + """
    TypeError: k or v is a QuantizedTensor (a quantized cache has no gradient); o or do has
        not q's dtype, lse is not float32.
    ValueError: o or do is not attention's output shape, lse not (B, Hq, R).
    """,
    example="""
    import numpy as np
    import mfa_native
    from mfa_native.reference import attention_backward_reference

    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 2, 16, 32), dtype=np.float32) for _ in range(4))
    o, lse = mfa_native.attention(q, k, v, causal=True, return_lse=True, device="cpu")
    dq, dk, dv = mfa_native.attention_backward(q, k, v, o, lse, do, causal=True, device="cpu")
    print(dq.shape, dk.shape, dv.shape)   # (1, 2, 16, 32) three times
    for got, expected in zip((dq, dk, dv), attention_backward_reference(q, k, v, do, causal=True)):
        assert np.allclose(got, expected, atol=1e-3)
    """)
attention_backward = ATTENTION_BACKWARD.function
