"""`mfa_native.sparse_topk`: DeepSeek's lightning indexer and top-k, declared once."""

from __future__ import annotations

import numpy as np

from .. import reference
from ..codegen import physical
from ..codegen.sparse import topk as codegen_topk
from ..runtime.devices import Device, tuning_facts
from ..runtime.templates import evaluate
from . import arguments as check
from .attention_rules import FLOATS, MAX_INDEX
from .declaration import Arg, Call, Op, Out
from .empty import empty_call, filled
from .rules import ArrayRule, Binding, Checks, Require
from .warm import Checked, PreparedCall, prepared_call, same_memory


def _output(name: str, dtype: str) -> ArrayRule:
    """indices or topk_scores, as a C++ caller gives it: `dtype`, (B, 1, R, topk) in the
    layout's order, written in place."""
    return ArrayRule(dtypes=(dtype,), shapes=(("B", "1", "R", "topk"),), layout=True, written=True,
                     reads="contiguous", dtype_error=f"{name} must be {dtype}, got {{{name}.dtype}}",
                     shape_error=f"{name} must have shape ({{{name}.axes}}) = {{{name}.expected}}, "
                                 f"got {{{name}.shape}}")


_LIMIT = codegen_topk.TOPK_LIMIT
# The sizes' limits, checked once k binds C: the running top-k's, then the 32-bit indices'.
LIMITS = (
    Require(f"topk <= {_LIMIT} || C <= {_LIMIT}",
            f"topk is {{topk}} with {{C}} keys: at most {_LIMIT} keys are kept per row (min(topk, C) must not "
            "exceed it; the running top-k lives in threadgroup memory)"),
    *(Require(f"{size} <= {MAX_INDEX}", f"{text} is {{{size}}}; it must be below 2**31")
      for text, size in (("B (batch)", "B"), ("Hi (indexer heads)", "Hi"), ("R (query length)", "R"),
                         ("C (key length)", "C"), ("topk", "topk"))))
Q_RULE = ArrayRule(dtypes=FLOATS, shapes=(("B", "Hi", "R", "Di"),), layout=True, binds=True,
                   dtype_error="q must be float32, float16 or bfloat16 (ml_dtypes), got {q.dtype}",
                   rank_error="q must have 4 dimensions, got shape {q.shape}")
K_RULE = ArrayRule(dtype_of="q", shapes=(("B", "1", "C", "Di"),), layout=True, requires=LIMITS,
                   dtype_error="k has dtype {k.dtype} but q has {q.dtype}; q and k must share one dtype",
                   rank_error="k must have 4 dimensions, got shape {k.shape}",
                   shape_error="k must have shape ({k.axes}) with q's B = {B} and Di = {Di}, got {k.shape}")
WEIGHTS_RULE = ArrayRule(dtypes=("float32",), shapes=(("B", "Hi", "R"),), layout=True, reads="strided_broadcast",
                         dtype_error="weights must be float32, got {weights.dtype}",
                         shape_error="weights must have shape {weights.expected}, got {weights.shape}")
RULES = {"q": Q_RULE, "k": K_RULE, "weights": WEIGHTS_RULE}
CHECKS = Checks()   # topk is given (the option), C bound by k, the limits k's


def _arrays(call: Call) -> tuple[Checked, dict[str, int], str]:
    """Every check of the arguments: the options, then the arrays by their rules (q binds B,
    Hi, R and Di, k binds C); the arrays to bind, the sizes B, Hi, R, C, K, Di, the dtype."""
    layout = check.layout_of(call.layout)
    q, k = check.as_array(call.q, "q"), check.as_array(call.k, "k")
    weights = check.as_array(call.weights, "weights")
    topk = call.topk
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)):
        raise TypeError(f"topk must be an int, got {type(topk).__name__}")
    if topk < 0:
        raise ValueError(f"topk must not be negative, got {topk}")
    if call.precision not in codegen_topk.PRECISIONS:
        raise ValueError(f"precision must be 'float' or 'int8', got {call.precision!r}")
    check.flag(call.causal, "causal")
    check.flag(call.return_scores, "return_scores")
    binding = Binding(RULES, CHECKS, layout, {"topk": int(topk)})
    binding.bind({"q": (q.shape, str(q.dtype))})
    binding.check("k", k.shape, str(k.dtype))
    binding.check("weights", weights.shape, str(weights.dtype))
    sizes = {name: binding.sizes[name] for name in ("B", "Hi", "R", "C", "Di")} | {"K": int(topk)}
    dtype = check.dtype_of(q, "q")

    def weights_bound(w):
        return check.normalized(w) if check.usable_in_place(w) else np.ascontiguousarray(w)

    bound = {"q": check.bindable(q), "k": check.bindable(k), "weights": weights_bound(weights)}
    # A warm call binds an argument as given where validation bound its own memory (the signature
    # fixes its strides, so that holds for every call of it): no view to make per call.
    makes = {"q": check.bindable, "k": check.bindable, "weights": weights_bound}
    given = {"q": call.q, "k": call.k, "weights": call.weights}
    converts = {name: None if same_memory(given[name], bound[name]) else makes[name] for name in bound}
    return Checked(bound, converts), sizes, dtype


def _candidates(sizes: dict[str, int], causal: bool, layout: str) -> list[np.ndarray]:
    """With no scores to rank (no indexer head or feature, every score 0) the candidates in key
    order, padded; with no key, query or slot, nothing but padding."""
    B, Hi, R, C, K, Di = (sizes[n] for n in ("B", "Hi", "R", "C", "K", "Di"))
    shape = (B, 1, R, K) if layout == "bhsd" else (B, R, 1, K)
    indices, scores = filled(shape, np.int32, -1), filled(shape, np.float32, -np.inf)
    if Hi == 0 or Di == 0:
        n = np.minimum(np.arange(R) + C - R + 1 if causal else np.full(R, C), C).clip(0)
        for r in range(R):
            kept = min(int(n[r]), K)
            row = (slice(None), 0, r) if layout == "bhsd" else (slice(None), r, 0)
            indices[row + (slice(0, kept),)] = np.arange(kept, dtype=np.int32)
            scores[row + (slice(0, kept),)] = 0.0
    return [indices, scores]


def _prepare(call: Call, device: Device) -> tuple[PreparedCall, list[np.ndarray]]:
    checked, sizes, dtype = _arrays(call)
    layout, causal = call.layout, bool(call.causal)
    finish = tuple if call.return_scores else (lambda outputs: outputs[0])
    if sizes["B"] * sizes["Hi"] * sizes["R"] * sizes["C"] * sizes["K"] == 0 or sizes["Di"] == 0:
        return empty_call([], call.op.array_names, checked, lambda inputs: _candidates(sizes, causal, layout),
                          finish)
    bound = checked.bound
    strides = {name: physical(check.element_strides(bound[name]), layout) for name in ("q", "k")}
    w = check.element_strides(bound["weights"])
    strides["weights"] = (*(w if layout == "bhsd" else (w[0], w[2], w[1])), 0)
    descriptor = codegen_topk.describe_topk(dtype=dtype, shape=sizes, strides=strides, layout=layout, causal=causal,
                                            precision=call.precision)
    given = {**sizes, "P": tuning_facts(device).parallel_threadgroups}
    description = evaluate(codegen_topk.topk_template(descriptor), {n: given[n] for n in codegen_topk.GIVEN_SIZES})
    return prepared_call(description, device, checked, call.op.array_names, call.results)


SPARSE_TOPK = Op(
    "sparse_topk",
    "DeepSeek's lightning indexer and top-k: the keys each query row should attend.",
    arguments=(
        Arg("q", "array", leading=True, keyword=False, rule=Q_RULE, doc="""
            (B, Hi, R, Di) indexer queries in "bhsd", (B, R, Hi, Di) in "bshd"; float32,
            float16 or bfloat16."""),
        Arg("k", "array", leading=True, keyword=False, rule=K_RULE, doc="""
            (B, 1, C, Di) ("bshd": (B, C, 1, Di)), q's dtype: one indexer key per token."""),
        Arg("weights", "array", keyword=False, rule=WEIGHTS_RULE, doc='(B, Hi, R) float32 ("bshd": (B, R, Hi)).'),
        Arg("topk", "option", keyword=False, doc="how many keys to keep per row (>= 0; more than C pads)."),
        Arg("causal", "option", default=True, doc="""
            key c is a candidate for row r iff c <= r + C - R (lower right, as `attention`'s
            causal=True); False: every key is."""),
        Arg("layout", "option", default="bhsd", doc='"bhsd" or "bshd".'),
        Arg("return_scores", "option", default=False,
            doc="also return the matching float32 scores (-inf at padding)."),
        Arg("precision", "option", default="float", doc="""
            "float" (exact float32 scores) or "int8": q and k quantized per token (int8
            attention's symmetric quantizer, absmax / 127) and multiplied exactly as
            integers; faster on int8 hardware, a slightly different selection (its
            recall against the float one: `python -m mfa_native bench sparse`)."""),
    ),
    outputs=(Out("indices", "int32 (B, 1, R, topk)", rule=_output("indices", "int32")),
             Out("topk_scores", "float32", when="return_scores", rule=_output("topk_scores", "float32"))),
    prepare=_prepare,
    checks=CHECKS,
    reference=reference.sparse_topk_reference,
    no_backward="sparse_topk selects keys: its integer result has no gradient",
    details="""
    score[b, r, c] = sum over indexer heads h of weights[b, h, r] * relu(q[b, h, r] . k[b, 0, c]),
    computed in float32 (precision="int8": from the per-token int8 q and k); the topk
    candidates of each row by descending score (equal scores: the lower key first), padded
    with -1 where a row has fewer candidates. A NaN score ranks above every number, the
    lower key first among NaNs (torch.topk's rule); NaN in q, k or weights gives NaN scores
    (relu keeps NaN).
    """,
    returns="""
    indices, int32 (B, 1, R, topk) ("bshd": (B, R, 1, topk)), to pass to `sparse_attention`
    (its kv-head axis of 1 is shared by every kv head); with return_scores=True the tuple
    (indices, scores), scores float32 of the same shape (-inf at padding).
    """,
    raises="""
    TypeError: topk not an int; causal or return_scores not a bool; q and k of different
        dtypes, or not float32, float16 or bfloat16; weights not float32.
    ValueError: q or k not 4-d; k not (B, 1, C, Di) with q's B and Di; weights not
        (B, Hi, R); topk negative, or min(topk, C) beyond the kernels' limit; precision not
        "float" or "int8"; layout not "bhsd" or "bshd"; a size reaching `2**31`.
    """,
    example="""
    import numpy as np
    import mfa_native
    from mfa_native.reference import sparse_topk_reference

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 16, 32), dtype=np.float32)    # (B, Hi, R, Di): 2 indexer heads
    k = rng.standard_normal((1, 1, 16, 32), dtype=np.float32)    # (B, 1, C, Di)
    weights = rng.random((1, 2, 16), dtype=np.float32)           # (B, Hi, R)
    indices = mfa_native.sparse_topk(q, k, weights, 4, device="cpu")   # causal: row r picks among keys 0..r
    print(indices[0, 0, :3])   # rows 0..2 have fewer than 4 candidates: padded with -1
    assert indices.shape == (1, 1, 16, 4) and np.array_equal(indices, sparse_topk_reference(q, k, weights, 4))
    """)
sparse_topk = SPARSE_TOPK.function
