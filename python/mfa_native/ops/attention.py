"""`mfa_native.attention`: the fused flash-attention forward pass, declared once."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import codegen, reference
from ..codegen import AttentionProblem, Float8Storage, QuantizedStorage, physical
from ..codegen.attention.scores import Alibi, Softcap
from ..quantized import QuantizedTensor
from ..runtime.arrays import FLOAT_DTYPES
from ..runtime.devices import Device, tuning_facts
from . import arguments as check
from . import attention_rules as rules
from .declaration import Arg, Call, Op, Out
from .rules import Binding
from .empty import empty_forward
from .float8_cache import float8_format, stored_bytes
from .score_mod import SCORE_MOD, SCORE_MOD_RAISES, SCORE_MOD_TENSORS, with_score_mod
from .warm import Checked, Convert, PreparedCall, prepared_call, same_memory

# The arguments the attention family shares, each documented once.
Q = Arg("q", "array", leading=True, grad=True, keyword=False, rule=rules.Q, doc="""
    queries. q, k, v: one kind of array: numpy (or CPU arrays that support DLPack),
    torch tensors (CPU or MPS) or MLX arrays, read in place (no copy); of one dtype:
    float32, float16 or bfloat16 (ml_dtypes.bfloat16 for numpy). With layout "bhsd", q is
    (B, Hq, R, D), k is (B, Hkv, C, D), v is (B, Hkv, C, Dv); "bshd" swaps the sequence and
    head axes. Hq must be a multiple of Hkv (query head h reads kv head h // (Hq // Hkv)).
    D and Dv are 1..576. Any non-negative strides with a contiguous last axis are used in
    place, without a copy.""")
K = Arg("k", "array", leading=True, grad=True, keyword=False, quantized=True, rule=rules.K, doc="""
    keys. k and/or v may be QuantizedTensors (a quantized K/V cache: MLX's affine format,
    GGUF's q8_0, q4_0, q4_1, q5_0 or q5_1, quantized along D; k and v may differ): the kernel reads the stored bytes once per kv
    head and dequantizes them on chip, rounded to q's dtype; the result is attention over
    k.dequantize(), v.dequantize().""")
V = Arg("v", "array", leading=True, grad=True, keyword=False, quantized=True, rule=rules.V,
        doc="values (see q and k).")
SCALE = Arg("scale", "option", default=None, schema="float?", doc="logit scale; default 1 / sqrt(D).")
CAUSAL = Arg("causal", "option", default=False, schema="str", to_schema=check.causal_mode, doc="""
    False, True (= "lower_right": the last query lines up with the last key, as in MLX and
    FlashAttention 2.1+) or "upper_left" (query i sees keys j <= i, PyTorch's is_causal).""")
MASK = Arg("mask", "array", default=None, rule=rules.MASK, doc="""
    boolean (True = attend) or additive float mask, broadcastable to (B, Hq, R, C) whatever
    the layout; broadcast axes are read with stride 0. Additive values of -inf (or <= -1e30)
    remove the key. A numpy array or q's kind.""")
WINDOW = Arg("window", "option", default=None, schema="int[]?", to_schema=check.window_list, doc="""
    (left, right): key j is allowed for query i iff -left <= j - (i + C - R) <= right; -1
    leaves a side unbounded.""")
SINKS = Arg("sinks", "array", default=None, grad=True, rule=rules.SINKS, doc="""
    (Hq,) one extra logit per head in the softmax denominator, with no value. FlashMLA's
    infinite values: -inf is no sink; +inf takes every weight (output 0, lse +inf). A numpy
    array or q's kind.""")
ALIBI_SLOPES = Arg("alibi_slopes", "array", default=None, rule=rules.ALIBI_SLOPES, doc="""
    (Hq,) or (B, Hq) floats (stored float32), optional: ALiBi (BLOOM, MPT; flash-attn's
    `alibi_slopes`): query i's score of key j gets -slope[h] * |i + C - R - j| (the diagonal
    `causal=True` uses), after softcap, before masks and sinks. Not differentiated.""")
SOFTCAP = Arg("softcap", "option", default=None, schema="float?", doc="""
    logit cap c > 0 (Gemma 2, Grok; flash-attn's `softcap`): each scaled score s becomes
    c * tanh(s / c) before masks and sinks; None: no cap.""")
LAYOUT = Arg("layout", "option", default="bhsd", schema="str", doc='"bhsd" or "bshd"; the output uses the same layout.')
RETURN_LSE = Arg("return_lse", "option", default=False, schema="bool", doc="""
    also return lse, (B, Hq, R) float32: the natural log of the softmax denominator (sink
    included).""")

DETERMINISTIC = Arg("deterministic", "option", default=False, schema="str", to_schema=check.deterministic_mode, doc="""
    False or True (or "run_to_run", the torch schema's spelling of both): every call is
    deterministic run to run (no atomics), as flash-attn's deterministic=True asks.
    "batch_invariant": besides, a query's output and lse bits do
    not depend on the batch, R, its place in a varlen batch or whether the call decodes,
    verifies or prefills: the keys are cut into splits of a fixed length, merged in order,
    with the same tiles in every path (docs/guides/serving.md; slower).""")


def with_determinism(problem: AttentionProblem, deterministic) -> AttentionProblem:
    """`problem` in the mode `deterministic` asks for (checked: ValueError naming it)."""
    return replace(problem, batch_invariant=check.deterministic_mode(deterministic) == "batch_invariant")


def rows_of(values: dict) -> tuple[int, int, int]:
    """(B, Hq, R) of a call's q, from its shape and layout."""
    shape = values["q"].shape
    return (shape[0], shape[1], shape[2]) if values["layout"] == "bhsd" else (shape[0], shape[2], shape[1])


# The rules of the family's array arguments, by name (Python checks those of attention's validate).
FAMILY_RULES = {arg.name: arg.rule for arg in (Q, K, V, MASK, SINKS, ALIBI_SLOPES)}

# Which output of the attention family's backward ops is the gradient of which argument.
GRADIENT_OF = {"q": "dq", "k": "dk", "v": "dv", "sinks": "dsinks"}

OUTPUT = Out("o", "the output, q's kind, dtype and layout, shape (.., Dv)",
             fake=lambda a: ((*a["q"].shape[:-1], a["v"].shape[-1]), "q"), rule=rules.OUT)
LSE = Out("lse", "(B, Hq, R) float32, natural log of the softmax denominator", when="return_lse",
          fake=lambda a: (rows_of(a), "float32"), rule=rules.LSE_OUT)


class Validated(Checked):
    """One call's arguments, checked: the problem they make, how they bind (Checked), and
    the binding of their sizes (rules.py) that checked them."""

    def __init__(self, problem: AttentionProblem, bound: dict[str, np.ndarray],
                 converts: dict[str, Convert | None], sources: dict[str, str] | None = None,
                 binding: Binding | None = None) -> None:
        super().__init__(bound, converts, sources)
        self.problem = problem
        self.binding = binding


def validate(arrays, *, scale, causal, window, layout, return_lse, softcap=None, alibi_slopes=None,
             quantized_refusal: str | None = "only attention reads quantized K/V",
             descales: dict[str, np.ndarray] | None = None, binding: Binding | None = None) -> Validated:
    """Every check of `attention`'s arguments (also those of the ops that share them);
    `arrays` = (q, k, v, mask, sinks) as passed. k and v may be QuantizedTensors unless
    `quantized_refusal` says why the op refuses them (a TypeError), and float8 arrays when
    the op gives their `descales` (float8_cache.bound_descales: bound (B, Hkv) arrays).
    `binding`: the sizes of q, k and v already bound by another op's rules (varlen's packed
    arrays), which then checks sinks and alibi_slopes too; None: attention's rules bind them."""
    q, k, v, mask, sinks = arrays
    layout = check.layout_of(layout)
    raw = {"q": q, "k": k, "v": v}
    q = check.as_array(q, "q")
    k, v = (x if isinstance(x, QuantizedTensor) else check.as_array(x, name) for name, x in (("k", k), ("v", v)))
    for x, name in ((k, "k"), (v, "v")):
        if isinstance(x, QuantizedTensor):
            if quantized_refusal is not None:
                raise TypeError(f"{name} is a QuantizedTensor: {quantized_refusal}")
            if x.ndim != 4:
                raise ValueError(f"{name} must have 4 dimensions, got shape {x.shape}")
    if binding is None:
        binding = Binding(FAMILY_RULES, rules.CHECKS, layout)
        binding.bind({"q": (q.shape, str(q.dtype)), "k": (k.shape, _stored_dtype(k, descales)),
                      "v": (v.shape, _stored_dtype(v, descales))})
    sizes = binding.sizes
    B, Hq, Hkv, R, C, D, Dv = (sizes[name] for name in ("B", "Hq", "Hkv", "R", "C", "D", "Dv"))
    dtype = FLOAT_DTYPES[q.dtype]
    scale = check.scale_value(scale)
    softcap = check.softcap_value(softcap)
    causal_mode = check.causal_mode(causal)
    window = check.window_sides(window, R, C)
    return_lse = check.flag(return_lse, "return_lse")

    bound = {"q": check.bindable(q)}
    converts: dict[str, Convert | None] = {"q": check.bindable}
    sources: dict[str, str] = {}
    storage = {}
    for name, x in (("k", k), ("v", v)):
        if isinstance(x, QuantizedTensor):
            storage[name] = _quantized_fields(x, name, layout, bound, converts, sources)
        elif float8_format(x) is not None and descales is not None:
            storage[name] = _float8_fields(x, name, layout, bound, descales)
        else:
            bound[name], converts[name] = check.bindable(x), check.bindable
    mask_kind, mask_dtype, mask_strides = "none", None, None
    if mask is not None:
        bound["mask"], mask_kind, mask_dtype = check.mask_array(mask, binding)
        mask_strides = check.element_strides(bound["mask"])
        converts["mask"] = lambda m: check.mask_array(m, binding)[0]
    alibi_per_batch = None
    for name, x in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if x is not None:
            bound[name], shape = check.float32_array(x, name, binding)
            converts[name] = lambda s, name=name: check.float32_array(s, name, binding)[0]
            if name == "alibi_slopes":
                alibi_per_batch = shape == 1   # its rule's second shape: (B, Hq)
    raw.update(mask=mask, sinks=sinks)
    for name in bound:
        if name in raw and name != "sinks" and same_memory(raw[name], bound[name]):
            converts[name] = None

    problem = AttentionProblem(
        batch=B, q_heads=Hq, kv_heads=Hkv, q_len=R, kv_len=C, head_dim=D, value_dim=Dv,
        dtype=dtype, layout=layout,
        q_strides=physical(check.element_strides(bound["q"]), layout),
        k_strides=None if "k" in storage else physical(check.element_strides(bound["k"]), layout),
        v_strides=None if "v" in storage else physical(check.element_strides(bound["v"]), layout),
        causal=causal_mode, window=window, mask=mask_kind, mask_dtype=mask_dtype, mask_strides=mask_strides,
        sinks=sinks is not None, scale=scale, return_lse=return_lse,
        scores=score_transforms(softcap, alibi_per_batch),
        k_storage=storage.get("k", codegen.PLAIN),
        v_storage=storage.get("v", codegen.PLAIN),
        aligned=check.aligned({name: bound[name] for name in ("q", "k", "v") if name not in storage}, ("o",)))
    return Validated(problem, bound, converts, sources, binding)


def _stored_dtype(x, descales: dict | None) -> str | None:
    """The dtype name of k or v its rule checks: None for a QuantizedTensor or a float8 array
    the op reads with descales (the storage checks its own)."""
    if isinstance(x, QuantizedTensor) or (float8_format(x) is not None and descales is not None):
        return None
    return str(x.dtype)


def score_transforms(softcap: float | None, alibi_per_batch: bool | None = None) -> tuple:
    """The problem's chain of score transforms (codegen/attention/scores.py) for the options
    given, in flash-attn's order: softcap, then ALiBi (per batch, or per head only)."""
    return (((Softcap(softcap),) if softcap is not None else ())
            + ((Alibi(alibi_per_batch),) if alibi_per_batch is not None else ()))


def _quantized_fields(x: QuantizedTensor, name: str, layout: str, bound: dict, converts: dict,
                      sources: dict) -> QuantizedStorage:
    """Binds the fields of a quantized k or v (as `name`, `name`_scales, `name`_biases, each
    from argument `name`) and returns how they are stored."""
    strides = {}
    for field, array in x.arrays().items():
        buffer = name if field == "data" else f"{name}_{field}"
        bound[buffer] = check.bindable(array)
        if same_memory(array, bound[buffer]):  # bound as given on warm calls
            converts[buffer] = lambda t, field=field: t.field(field)
        else:
            converts[buffer] = lambda t, field=field: check.bindable(t.field(field))
        sources[buffer] = name
        strides[field] = physical(check.element_strides(bound[buffer]), layout)
    scale_dtype = FLOAT_DTYPES[x.arrays()["scales"].dtype] if "scales" in strides else None
    return QuantizedStorage(x.quant_format, strides["data"], scale_dtype, strides.get("scales"), strides.get("biases"))


def _float8_fields(x: np.ndarray, name: str, layout: str, bound: dict, descales: dict) -> Float8Storage:
    """Binds a float8 k or v (its bytes as `name`) and its descales (`name`_descale, and for k
    q_descale when given) and returns how it is stored; the op sets their warm conversions."""
    bound[name] = check.bindable(stored_bytes(x))
    factors = [f"{name}_descale"] + (["q_descale"] if name == "k" and "q_descale" in descales else [])
    strides = []
    for buffer in factors:
        bound[buffer] = descales[buffer]
        strides.append(check.element_strides(descales[buffer]))
    return Float8Storage(float8_format(x), physical(check.element_strides(bound[name]), layout), *strides)


def _prepare(call: Call, device: Device) -> tuple[PreparedCall, list[np.ndarray]]:
    """The first call of a signature: every check, then the problem's pass, prepared; and
    this call's inputs."""
    checked = validate((call.q, call.k, call.v, call.mask, call.sinks), scale=call.scale, causal=call.causal,
                       window=call.window, layout=call.layout, return_lse=call.return_lse, softcap=call.softcap,
                       alibi_slopes=call.alibi_slopes, quantized_refusal=None)
    checked.problem = with_determinism(checked.problem, call.deterministic)
    checked, tensors = with_score_mod(checked, call.score_mod, call.score_mod_tensors)
    p, names = checked.problem, call.op.array_names + tensors
    if check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
        return empty_forward(p, names, checked)
    facts = tuning_facts(device)
    description = codegen.attention_pass(p, family=facts.family, parallel_threadgroups=facts.parallel_threadgroups)
    return prepared_call(description, device, checked, names, call.results)


# The errors of the attention family's shared arguments (validate), each naming the argument.
RAISES = """
    TypeError: q, k or v is not an array numpy can read (or the three are not one kind), they
        differ in dtype, or the dtype is not float32, float16 or bfloat16; scale or softcap is
        not a real number, return_lse not a bool, a window side not an int; a mask neither
        boolean nor float; sinks or alibi_slopes not float.
    ValueError: q, k, v are not 4-d or their shapes disagree (B, D, Hkv, C), Hq is not a
        multiple of Hkv, D or Dv is outside 1..576 or a size reaches `2**31`; scale is not
        finite or too large; softcap is not finite or not above 0; causal or layout is not one
        of the values above; window is not a (left, right) pair or a side is below -1; the
        mask does not broadcast to (B, Hq, R, C); sinks is not (Hq,); alibi_slopes is not
        (Hq,) or (B, Hq); deterministic is not False, True, "run_to_run" or "batch_invariant".
"""

ATTENTION = Op(
    "attention",
    "Softmax attention, fused: softmax(scale * q k^T + mask) v, computed blockwise on the device.",
    arguments=(Q, K, V, SCALE, CAUSAL, MASK, WINDOW, SINKS, SOFTCAP, ALIBI_SLOPES, SCORE_MOD_TENSORS, SCORE_MOD,
               LAYOUT, RETURN_LSE, DETERMINISTIC),
    outputs=(OUTPUT, LSE),
    prepare=_prepare,
    checks=rules.CHECKS,
    reference=reference.attention_reference,
    backward="attention_backward",
    gradients=GRADIENT_OF,
    details="""
    Query i of head h attends key j of kv head h // (Hq // Hkv) when every rule given allows
    it (causal, window, a boolean mask); the logits are scale * q . k (capped with softcap)
    plus an additive mask.
    The softmax runs in float32 whatever the dtype; the output is rounded once to q's dtype.
    `mfa_native.reference.attention_reference` computes the same in float64.
    """,
    returns="""
    The output o, an array of q's kind (allocated by its framework, on its device) with q's
    dtype and layout: (B, Hq, R, Dv), or (B, R, Hq, Dv) for "bshd". With return_lse=True the
    tuple (o, lse). A row with no allowed key (and no sink) gives output 0 and lse -inf.
    """,
    raises=RAISES + SCORE_MOD_RAISES,
    example="""
    import numpy as np
    import mfa_native
    from mfa_native.reference import attention_reference

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 16, 32), dtype=np.float32)   # (B, Hq, R, D)
    k = rng.standard_normal((1, 2, 16, 32), dtype=np.float32)   # (B, Hkv, C, D)
    v = rng.standard_normal((1, 2, 16, 32), dtype=np.float32)   # (B, Hkv, C, Dv)
    o, lse = mfa_native.attention(q, k, v, causal=True, return_lse=True, device="cpu")
    print(o.shape, o.dtype, lse.shape)   # (1, 2, 16, 32) float32 (1, 2, 16)
    expected, expected_lse = attention_reference(q, k, v, causal=True, return_lse=True)
    assert np.allclose(o, expected, atol=1e-4) and np.allclose(lse, expected_lse, atol=1e-4)
    """)
attention = ATTENTION.function
