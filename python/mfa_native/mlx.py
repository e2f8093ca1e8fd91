"""mfa_native for MLX: `scaled_dot_product_attention` with mx.fast's semantics, and `attention`,
`sparse_attention`, `block_sparse_attention`, differentiable (mx.grad, mx.vjp), and
`int8_attention` (no backward: a gradient asked through it raises); `attention_with_kvcache`,
whose append updates the caller's MLX caches in place with MLX's indexed assignment;
`quantized_scaled_dot_product_attention`, mlx-lm's function of that name over a quantized KV
cache, read in the kernel. (The plain `mfa_native` ops on MLX arrays behave the same.)
`ring_attention` and `sharded_decode`: context parallelism over mx.distributed.

They run eagerly: their arguments are evaluated (mx.eval, which waits for MLX's
stream) and read in place through the buffer protocol (MLX's memory is unified);
the kernels run on mfa_native's default device (Metal on a Mac, the cpu backend
elsewhere) and have finished when the call returns, writing into arrays MLX
allocated. Inside mx.compile or mx.vmap they raise a RuntimeError (MLX cannot
evaluate arrays while tracing): call them outside the transformation.

`patch()` routes `mx.fast.scaled_dot_product_attention`, mlx-lm's quantized attention and
mlx-lm's Gemma 2 attention (soft-capped) through these inside a block (or a decorated function).

Importing this module imports mlx; `import mfa_native` alone does not.
"""

from __future__ import annotations

import functools
import inspect
import sys
import textwrap
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from . import reference
from .context.mlx_ring import ring_attention, sharded_decode  # noqa: F401 - public here
from .ops.attention import ATTENTION
from .ops.block_sparse import BLOCK_SPARSE_ATTENTION
from .ops.declaration import Call, Op, item, quantized_values
from .ops.int8_attention import INT8_ATTENTION
from .ops.kvcache import ATTENTION_WITH_KVCACHE, checked_append
from .ops.sparse import SPARSE_ATTENTION
from .ops.varlen import ATTENTION_VARLEN
from .ops.given_kind import inside_adapter, items, writes_in_place
from .ops.quantize import quantize
from .errors import Unsupported
from .quantized import QuantizedTensor
from .runtime.frameworks import framework_of, register_adapter


__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "block_sparse_attention", "int8_attention",
           "patch", "quantized_scaled_dot_product_attention", "ring_attention", "scaled_dot_product_attention",
           "sharded_decode", "sparse_attention"]

def mlx_function(op: Op, example: str = ""):
    """`op` on MLX arrays as an mx.custom_function (see `mlx_call`), with the op's arguments
    less `device`; its docstring is the op's (Op.adapter_docstring) with what differs for MLX,
    and `example`."""
    signature = inspect.Signature([p for p in op.parameters() if p.name != "device"])

    def function(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return mlx_call(op, op.resolved({**bound.arguments, "device": None}))

    function.__name__ = function.__qualname__ = op.name
    function.__signature__ = signature
    function.__doc__ = op.adapter_docstring(
        summary=f"`mfa_native.{op.name}` on MLX arrays, {'differentiable' if op.backward else 'without a backward'}.",
        notes=_mlx_notes(op), raises=_mlx_raises(op), example=example)
    return function


def _mlx_notes(op: Op) -> str:
    if op.backward is None:
        autograd = (f"A gradient asked through it (mx.grad, mx.vjp) raises NotImplementedError ({op.no_backward}), "
                    "never a silent zero.")
    else:
        grads = [a.name for a in op.arguments if a.name in op.gradients]
        autograd = (f"Differentiable with mx.grad and mx.vjp: {', '.join(grads[:-1])} and {grads[-1]} get their "
                    f"gradients from `mfa_native.{op.backward}`"
                    + (", an additive (float) mask its own (computed with MLX ops, only when asked)"
                       if op.name in _KEY_RULES else "")
                    + "; outputs the backward takes no cotangent of (lse) come back through mx.stop_gradient.")
    return textwrap.fill(
        f"The same op as `mfa_native.{op.name}`, with its arguments (less device) and results, as an "
        f"mx.custom_function. {autograd} It runs eagerly: its arguments are evaluated (mx.eval) and read in "
        "place; the kernels run on mfa_native's default device (Metal on a Mac, the cpu backend elsewhere) and "
        "have finished when the call returns, writing into arrays MLX allocated. The argument descriptions "
        "below are the op's.", 92)


def _mlx_raises(op: Op) -> str:
    lines = ["RuntimeError: called inside mx.compile or mx.vmap (MLX cannot evaluate arrays while tracing)."]
    if op.backward is None:
        lines.append(f"NotImplementedError: a gradient asked through it ({op.no_backward}).")
    if any(a.quantized for a in op.arguments):
        lines.append("NotImplementedError: a gradient asked of a QuantizedTensor's fields (a constant of the call).")
    return "\n".join(item(line) for line in lines)


def mlx_call(op: Op, values: dict):
    """A call of `op` (every argument by name) as an mx.custom_function, so that MLX sees it.

    Its primals are the MLX arrays among the op's differentiable arguments; an additive
    (floating) mask of an op with a mask rule below is a primal too, its gradient computed
    lazily with MLX ops (so it costs nothing unless asked for). The fields of a QuantizedTensor
    argument (quantized k, v) and the other floating MLX arrays (alibi_slopes, score_mod_tensors'
    items) are primals too, each through `_constant`: a constant of the call, whose gradient
    asked raises NotImplementedError. The vjp runs the backward op, its arguments found by name
    as torch/library.py finds them: forward arguments (a QuantizedTensor dequantized to q's
    dtype), outputs, and `d` + an output's name for its cotangent. Outputs the backward takes
    no cotangent of (lse) come back through mx.stop_gradient. An op without a backward runs as
    `_without_gradient` says."""
    if op.backward is None:
        return _without_gradient(op, values)
    backward_op = op.backward_op
    backward_names = [] if backward_op is None else [p.name for p in backward_op.parameters()]
    selectors = {o.when: True for o in op.outputs if o.when in op.option_names}
    given = [a.name for a in op.arguments if a.kind == "array" and _is_primal(op, a, values[a.name])]
    quantized = quantized_values(op, values)
    constants = [(name, field) for name, x in quantized.items()
                 for field, array in x.fields().items() if isinstance(array, mx.array)]
    kinds = {a.name: a.kind for a in op.arguments}
    listed = [(a.name, i) for a in op.arguments if a.kind in ("array", "arrays") and a.name not in given
              for i, x in enumerate(items(values[a.name])) if _floating(x)]
    everything = Call(op, {**values, **selectors}).results   # what the forward computes
    everything = (everything,) if isinstance(everything, str) else everything

    def bound(primals) -> dict:
        """The call's arguments, the primals in place of the arrays they stand for."""
        replaced: dict[str, dict] = {}
        for (name, field), p in zip(constants, primals[len(given):]):
            replaced.setdefault(name, {})[field] = p
        lists = {name: list(items(values[name])) for name, _ in listed}
        for (name, i), p in zip(listed, primals[len(given) + len(constants):]):
            lists[name][i] = p
        lists = {name: x if kinds[name] == "arrays" else x[0] for name, x in lists.items()}
        return {**values, **dict(zip(given, primals)), **lists,
                **{name: quantized[name].with_fields(**fields) for name, fields in replaced.items()}}

    @mx.custom_function
    def forward(*primals):
        with inside_adapter():
            result = op.function(**{**bound(primals), **selectors})
        return tuple(result) if isinstance(result, tuple) else (result,)

    @forward.vjp
    def vjp(primals, cotangents, outputs):
        if backward_op is None:
            raise NotImplementedError(op.no_backward)
        known = {**bound(primals), **dict(zip(everything, outputs)),
                 **{f"d{name}": c for name, c in zip(everything, cotangents)}}
        dtype = known[op.leading[0]].dtype
        known.update({name: x.dequantize().astype(dtype) for name, x in quantized_values(op, known).items()})
        grads = backward_op.function(**{n: known[n] for n in backward_names})
        by_name = dict(zip((o.name for o in backward_op.outputs), grads if isinstance(grads, tuple) else (grads,)))
        by_name["dmask"] = _mask_gradient(op, known) if "mask" in given else None
        # The constants' cotangents never reach the caller: each constant's own vjp raises first.
        return (*(by_name[op.gradients.get(n, "dmask")].astype(p.dtype) for n, p in zip(given, primals)),
                *(mx.zeros_like(p) for p in primals[len(given):]))

    constant_primals = [_constant(quantized[name].fields()[field],
                                  f"{op.name}: {name}.{field} is a field of a QuantizedTensor, a constant with no "
                                  "gradient; differentiate with respect to its dequantize() instead")
                        for name, field in constants]
    constant_primals += [_constant(items(values[name])[i], f"{op.name} gives {name} no gradient (a constant "
                                   "of the call)") for name, i in listed]
    outputs = dict(zip(everything, forward(*[values[n] for n in given], *constant_primals)))
    outputs = {name: mx.stop_gradient(o) if backward_op is not None and f"d{name}" not in backward_names else o
               for name, o in outputs.items()}
    asked = Call(op, values).results
    return outputs[asked] if isinstance(asked, str) else tuple(outputs[name] for name in asked)


def _constant(x: mx.array, message: str) -> mx.array:
    """x as a constant of a call: MLX would give it a zero gradient (as it does any array a custom
    function does not take); asking its gradient through this raises NotImplementedError(message)."""
    @mx.custom_function
    def identity(x):
        return x

    @identity.vjp
    def vjp(primals, cotangent, output):
        raise NotImplementedError(message)

    return identity(x)


def _without_gradient(op: Op, values: dict):
    """A call of an op without a backward: run as is, its floating outputs then tied to the call's
    floating MLX inputs (array lists and QuantizedTensor fields included) by a custom function
    whose vjp raises, so that a gradient asked through the op is an error, never a zero."""
    with inside_adapter():
        result = op.function(**values)
    inputs = [t for a in op.arguments if a.kind in ("array", "arrays") for x in items(values[a.name])
              for t in (x.fields().values() if isinstance(x, QuantizedTensor) else [x]) if _floating(t)]
    parts = result.fields() if isinstance(result, QuantizedTensor) else \
        dict(enumerate(result if isinstance(result, tuple) else (result,)))
    tied = [name for name, x in parts.items() if _floating(x)]
    if not inputs or not tied:
        return result

    @mx.custom_function
    def through(*arrays):
        return tuple(arrays[len(inputs):])

    @through.vjp
    def vjp(primals, cotangents, outputs):
        raise NotImplementedError(op.no_backward)

    parts = {**parts, **dict(zip(tied, through(*inputs, *(parts[name] for name in tied))))}
    if isinstance(result, QuantizedTensor):
        return result.with_fields(**parts)
    return tuple(parts.values()) if isinstance(result, tuple) else parts[0]


def _floating(x) -> bool:
    return isinstance(x, mx.array) and mx.issubdtype(x.dtype, mx.floating)


def _is_primal(op: Op, argument, value) -> bool:
    """Whether an argument's value is one of the custom function's primals (see mlx_call)."""
    if not isinstance(value, mx.array):
        return False
    if argument.grad:
        return True
    return argument.name == "mask" and _floating(value) and op.name in _KEY_RULES


# The rules other than the mask that remove keys, as an additive (B|1, Hq|1, R, C) numpy
# array of 0 and -inf (block visits: log of the visit count), per op with a mask gradient.
_KEY_RULES = {
    "attention": lambda known, B, H, R, C: np.log(reference.allowed_keys(R, C, known["causal"], known["window"])),
    "block_sparse_attention": lambda known, B, H, R, C: reference.block_sparse_bias(
        known["block_mask"], np.zeros((B, H, R, 1)), np.zeros((B, 1, C, 1)), causal=known["causal"],
        window=known["window"]),
}


def _mask_gradient(op: Op, known: dict) -> mx.array:
    """d loss / d mask of softmax(scale q k^T + mask): dS = P * (dP - rowsum(dO * O)), with
    P = exp(S - lse) (the sink's share is in lse), summed over the axes the mask broadcasts;
    MLX ops, evaluated only if the mask's gradient is used."""
    q, k, v, o, do = (known[n] for n in ("q", "k", "v", "o", "do"))
    if known["layout"] == "bshd":
        q, k, v, o, do = (x.transpose(0, 2, 1, 3) for x in (q, k, v, o, do))
    groups = q.shape[1] // k.shape[1]
    k, v = (mx.repeat(x.astype(mx.float32), groups, axis=1) for x in (k, v))
    q, o, do = (x.astype(mx.float32) for x in (q, o, do))
    R, C = q.shape[2], k.shape[2]
    scale = known["scale"] if known["scale"] is not None else q.shape[3] ** -0.5
    mask = known["mask"].astype(mx.float32)
    with np.errstate(divide="ignore"):
        rules = mx.array(_KEY_RULES[op.name](known, q.shape[0], q.shape[1], R, C).astype(np.float32))
    lse = known["lse"][..., None]
    p = mx.where(mx.isinf(lse), 0.0, mx.exp(scale * (q @ k.swapaxes(2, 3)) + mask + rules - lse))
    ds = p * (do @ v.swapaxes(2, 3) - (do * o).sum(-1, keepdims=True))
    extra = ds.ndim - known["mask"].ndim
    ds = ds.sum(axis=tuple(range(extra))) if extra else ds
    axes = tuple(i for i, n in enumerate(known["mask"].shape) if n == 1 and ds.shape[i] != 1)
    return ds.sum(axis=axes, keepdims=True) if axes else ds


attention = mlx_function(ATTENTION, example="""
    import mlx.core as mx
    import mfa_native.mlx

    mx.random.seed(0)
    q, k, v = (mx.random.normal((1, 2, 16, 32)) for _ in range(3))   # (B, H, R or C, D)

    def ours(q):
        return mfa_native.mlx.attention(q, k, v, causal=True)

    def theirs(q):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=32 ** -0.5, mask="causal")

    assert mx.allclose(ours(q), theirs(q), atol=1e-5).item()
    dq = mx.grad(lambda q: ours(q).sum())(q)   # through mfa_native.attention_backward
    assert mx.allclose(dq, mx.grad(lambda q: theirs(q).sum())(q), atol=1e-4).item()
    """)
sparse_attention = mlx_function(SPARSE_ATTENTION, example="""
    import mlx.core as mx
    import numpy as np
    import mfa_native.mlx
    from mfa_native.reference import sparse_attention_reference

    mx.random.seed(0)
    q, k, v = (mx.random.normal((1, 2, 16, 32)) for _ in range(3))
    indices = mx.random.randint(0, 16, (1, 1, 16, 4)).astype(mx.int32)   # 4 keys per query row
    o = mfa_native.mlx.sparse_attention(q, k, v, indices)
    expected = sparse_attention_reference(*(np.array(x) for x in (q, k, v, indices)))
    assert np.allclose(np.array(o), expected, atol=1e-4)
    dq = mx.grad(lambda q: mfa_native.mlx.sparse_attention(q, k, v, indices).sum())(q)
    print(dq.shape)   # (1, 2, 16, 32)
    """)
block_sparse_attention = mlx_function(BLOCK_SPARSE_ATTENTION, example="""
    import mlx.core as mx
    import numpy as np
    import mfa_native
    import mfa_native.mlx

    mx.random.seed(0)
    q, k, v = (mx.random.normal((1, 2, 16, 32)) for _ in range(3))
    # Blocks of 8: query block 0 visits key block 0, query block 1 key blocks 0 and 1.
    block_mask = mfa_native.BlockMask(np.array([[[1, 2]]], dtype=np.int32),
                                      np.array([[[[0, 0], [0, 1]]]], dtype=np.int32), block_size=8)
    o = mfa_native.mlx.block_sparse_attention(q, k, v, block_mask, causal=True)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=32 ** -0.5, mask="causal")
    assert mx.allclose(o, expected, atol=1e-5).item()   # these blocks with causal: causal attention
    """)
int8_attention = mlx_function(INT8_ATTENTION, example="""
    import mlx.core as mx
    import mfa_native.mlx

    mx.random.seed(0)
    q, k, v = (mx.random.normal((1, 2, 16, 32)) for _ in range(3))
    o = mfa_native.mlx.int8_attention(q, k, v, causal=True)
    exact = mx.fast.scaled_dot_product_attention(q, k, v, scale=32 ** -0.5, mask="causal")
    print((mx.linalg.norm(o - exact) / mx.linalg.norm(exact)).item())   # about 0.01: int8 products
    try:
        mx.grad(lambda q: mfa_native.mlx.int8_attention(q, k, v).sum())(q)
    except NotImplementedError as error:
        print(error)   # int8_attention has no backward: ...
    """)
attention_varlen = mlx_function(ATTENTION_VARLEN, example="""
    import mlx.core as mx
    import numpy as np
    import mfa_native.mlx
    from mfa_native.reference import attention_varlen_reference

    mx.random.seed(0)
    cu_seqlens = mx.array([0, 5, 16], dtype=mx.int32)   # two sequences: rows 0..4 and 5..15
    q, k, v = (mx.random.normal((16, 2, 32)) for _ in range(3))   # (total, H, D)
    o = mfa_native.mlx.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, causal=True)
    expected = attention_varlen_reference(*(np.array(x) for x in (q, k, v, cu_seqlens, cu_seqlens)), causal=True)
    assert np.allclose(np.array(o), expected, atol=1e-4)
    dq = mx.grad(lambda q: mfa_native.mlx.attention_varlen(q, k, v, cu_seqlens, cu_seqlens).sum())(q)
    """)


def _host(x, name: str):
    """A numpy view of an MLX array (a QuantizedTensor, numpy or None as given), for the checks."""
    framework = framework_of(x)
    return x if framework is None or isinstance(x, QuantizedTensor) else framework.as_numpy(x, name)


def _write_rows(cache, at: tuple[mx.array, mx.array], new: mx.array) -> None:
    """cache[at] = new with MLX's indexed assignment, which updates the caller's array object; a
    QuantizedTensor cache gets `quantize(new)`'s fields (the integers the device append writes)."""
    if not isinstance(cache, QuantizedTensor):
        cache[at] = new
        return
    rows = quantize(new, cache.format, cache.bits, cache.group_size).fields()
    for name, field in cache.fields().items():
        field[at] = rows[name]
    cache.reread()


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens=None, k=None, v=None, block_table=None,
                           rotary_cos=None, rotary_sin=None, rotary_seqlens=None, rotary_interleaved=True, scale=None,
                           causal=False, window=None, sinks=None, softcap=None, alibi_slopes=None, q_descale=None,
                           k_descale=None, v_descale=None, return_lse=False, deterministic=False, score_mod_tensors=(),
                           score_mod=None):
    """`mfa_native.attention_with_kvcache` on MLX arrays, appending with MLX's own in-place update.

    MLX arrays are read-only to the pass, so the append is MLX's indexed assignment: after
    every check, k and v are written into the caller's k_cache and v_cache objects
    (`cache[index] = rows`; a QuantizedTensor cache's fields get `quantize(k)`'s integers and
    scales, as the device append writes them), then the call attends cache_seqlens + Rn keys
    without an append. cache_seqlens is not modified. No rotary tables (the rotation runs in the
    pass's append, which MLX caches do not take): MLX models turn q and k themselves
    (`mx.fast.rope`) before the call. Inference only: a gradient asked through it raises
    NotImplementedError. Runs eagerly (not inside mx.compile or mx.vmap).

    Args:
        q: (B, R, Hq, D) MLX array, float32, float16 or bfloat16.
        k_cache: (B, Cmax, Hkv, D), or with block_table the pages (num_blocks, page_size,
            Hkv, D), q's dtype; or a QuantizedTensor of MLX arrays. Updated in place by the
            append.
        v_cache: like k_cache, Dv wide.
        cache_seqlens: int32 (B,): each sequence's cache length before this call. None: the
            whole cache (Cmax, or max_blocks * page_size); required with k and v.
        k: (B, Rn, Hkv, D), optional: written into k_cache at positions cache_seqlens[b] ..
            cache_seqlens[b] + Rn - 1, then attended.
        v: (B, Rn, Hkv, Dv), given with k.
        block_table: int32 (B, max_blocks), optional: a paged cache's pages per sequence.
        rotary_cos: must be None here (NotImplementedError otherwise).
        rotary_sin: must be None here.
        rotary_seqlens: must be None here.
        rotary_interleaved: unused without rotary tables.
        scale: the logit scale; None: 1 / sqrt(D).
        causal: True aligns the last query with the last attended key.
        window: (left, right) as in `mfa_native.attention`.
        sinks: (Hq,) one more logit per head in the softmax denominator.
        softcap: a logit cap c > 0: each scaled score s becomes c * tanh(s / c); None: none.
        alibi_slopes: (Hq,) or (B, Hq) ALiBi slopes, as in `mfa_native.attention_with_kvcache`.
        q_descale: float8 caches' descales, as in `mfa_native.attention_with_kvcache`: MLX
            has no float8 arrays, so one given is a ValueError naming it.
        k_descale: likewise.
        v_descale: likewise.
        return_lse: also return the lse.
        deterministic: False, True or "batch_invariant", as in `mfa_native.attention_with_kvcache`.
        score_mod_tensors: the arrays score_mod reads, as in `mfa_native.attention_with_kvcache`.
        score_mod: a traced score_mod's text, as in `mfa_native.attention_with_kvcache`, or an MLX
            function `(score, b, h, q_idx, kv_idx) -> score`, traced into it.

    Returns:
        The output (B, R, Hq, Dv), q's dtype; with return_lse=True the tuple (output, lse),
            lse (B, Hq, R) float32.

    Raises:
        ValueError: what `mfa_native.attention_with_kvcache` refuses (shapes, cache_seqlens
            missing with k and v or beyond the capacity, block_table entries), before
            anything is written.
        TypeError: dtypes that differ; arguments of the wrong type.
        NotImplementedError: a gradient asked through it; rotary_cos, rotary_sin or
            rotary_seqlens given (turn q and k with `mx.fast.rope` first).
        RuntimeError: called inside mx.compile or mx.vmap.

    Example:
        ```python
        import mlx.core as mx
        import mfa_native.mlx

        mx.random.seed(0)
        k_cache = mx.concatenate([mx.random.normal((1, 15, 2, 32)), mx.zeros((1, 17, 2, 32))], axis=1)
        v_cache = mx.concatenate([mx.random.normal((1, 15, 2, 32)), mx.zeros((1, 17, 2, 32))], axis=1)
        q, k, v = (mx.random.normal((1, 1, 2, 32)) for _ in range(3))   # one new token: (B, 1, H, D)
        out = mfa_native.mlx.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                                    cache_seqlens=mx.array([15], dtype=mx.int32))
        assert mx.array_equal(k_cache[:, 15], k[:, 0]).item()   # k_cache itself was updated
        expected = mx.fast.scaled_dot_product_attention(*(x.transpose(0, 2, 1, 3) for x in
                                                          (q, k_cache[:, :16], v_cache[:, :16])), scale=32 ** -0.5)
        assert mx.allclose(out, expected.transpose(0, 2, 1, 3), atol=1e-5).item()
        ```
    """
    for name, table in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("rotary_seqlens", rotary_seqlens)):
        if table is not None:
            raise NotImplementedError(f"{name}: the rotary embedding of MLX KV caches is not implemented (the "
                                      "append to MLX arrays runs in MLX); turn q and k with mx.fast.rope first")
    for name, descale in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if descale is not None:   # before any write
            raise ValueError(f"{name} is for a float8 cache, and MLX has no float8 arrays")
    values = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k=None, v=None,
                  block_table=block_table, rotary_cos=None, rotary_sin=None, rotary_seqlens=None,
                  rotary_interleaved=rotary_interleaved, scale=scale, causal=causal, window=window, sinks=sinks,
                  softcap=softcap, alibi_slopes=alibi_slopes, q_descale=q_descale, k_descale=k_descale,
                  v_descale=v_descale, return_lse=return_lse, deterministic=deterministic,
                  score_mod_tensors=score_mod_tensors, score_mod=score_mod, device=None)
    values = ATTENTION_WITH_KVCACHE.resolved(values)   # a score_mod function traced before the append writes
    if k is not None or v is not None:
        views = {name: _host(x, name) for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                                       ("cache_seqlens", cache_seqlens), ("k", k), ("v", v),
                                                       ("block_table", block_table))}
        at = tuple(mx.array(i.astype(np.int32)) for i in checked_append(*views.values()))
        for cache, new in ((k_cache, k), (v_cache, v)):
            _write_rows(cache, at, new)
        values["cache_seqlens"] = cache_seqlens + k.shape[1]
    return mlx_call(ATTENTION_WITH_KVCACHE, values)


def _mask_options(mask: str | mx.array | None) -> dict:
    """mx.fast's mask as `attention`'s options: "causal" is lower right."""
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be 'causal', an array or None, got {mask!r}")
        return {"causal": "lower_right"}
    return {"mask": mask}


def scaled_dot_product_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                                 mask: str | mx.array | None = None, sinks: mx.array | None = None) -> mx.array:
    """mx.fast.scaled_dot_product_attention, computed by mfa_native, differentiable.

    One difference from MLX: a row with no allowed key (every key masked out, no sink) gives
    0 here, where MLX gives the mean of v over the masked keys. Additive values <= -1e30
    remove a key here, so a row masked only with such finite values also gives 0
    (`patch` falls back to MLX for such masks).

    Args:
        q: (B, Hq, L, D) MLX array, float32, float16 or bfloat16.
        k: (B, Hkv, S, D), q's dtype; Hq a multiple of Hkv.
        v: (B, Hkv, S, Dv).
        scale: the logit scale (required, as MLX's).
        mask: "causal" (lower right: the last query sees every key), a boolean array (True =
            attend) or an additive array, broadcastable to (B, Hq, L, S); or None.
        sinks: (Hq,) one more logit per head in the softmax denominator, or None.

    Returns:
        The output (B, Hq, L, Dv), q's dtype.

    Raises:
        ValueError: a mask string other than "causal"; what `mfa_native.attention` refuses
            (shapes, head dims beyond 576).
        TypeError: dtypes that differ or that mfa_native has no kernels for.
        RuntimeError: called inside mx.compile or mx.vmap.

    Example:
        ```python
        import mlx.core as mx
        from mfa_native.mlx import scaled_dot_product_attention

        mx.random.seed(0)
        q = mx.random.normal((1, 4, 16, 32))   # 4 query heads over
        k, v = mx.random.normal((1, 2, 16, 32)), mx.random.normal((1, 2, 16, 32))   # 2 kv heads
        out = scaled_dot_product_attention(q, k, v, scale=32 ** -0.5, mask="causal")
        expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=32 ** -0.5, mask="causal")
        assert mx.allclose(out, expected, atol=1e-5).item()
        ```
    """
    return attention(q, k, v, scale=scale, sinks=sinks, **_mask_options(mask))


def quantized_scaled_dot_product_attention(queries: mx.array, q_keys: Sequence[mx.array],
                                           q_values: Sequence[mx.array], scale: float,
                                           mask: str | mx.array | None = None, group_size: int = 64,
                                           bits: int = 8, *, sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's `quantized_scaled_dot_product_attention`, with K and V read quantized inside
    the kernel (mlx-lm dequantizes them and builds the whole score matrix).

    Differentiable in queries (and sinks, an additive mask): the quantized cache is a
    constant, whose gradient (mx.grad with respect to its arrays) raises NotImplementedError.

    Args:
        queries: (B, Hq, L, D) MLX array, float32, float16 or bfloat16.
        q_keys: what mlx-lm's QuantizedKVCache holds for the keys: (wq, scales, biases) as
            `mx.quantize(keys, group_size, bits)` returns them, (B, Hkv, S, ...) along D.
        q_values: the same for the values.
        scale: the logit scale (required).
        mask: as in `scaled_dot_product_attention`: "causal", a boolean or additive array, or
            None.
        group_size: the cache's group size: 32, 64 or 128.
        bits: the cache's bits per value: 2, 3, 4, 5, 6 or 8.
        sinks: (Hq,) one more logit per head in the softmax denominator, or None.

    Returns:
        The output (B, Hq, L, Dv), queries' dtype.

    Raises:
        ValueError: bits that do not fit q_keys' words for queries' D; what
            `mfa_native.attention` refuses for these arguments (group_size, shapes).
        TypeError: fields of the wrong dtypes.
        NotImplementedError: a gradient asked of the cache's arrays.
        RuntimeError: called inside mx.compile or mx.vmap.

    Example:
        ```python
        import mlx.core as mx
        from mfa_native.mlx import quantized_scaled_dot_product_attention

        mx.random.seed(0)
        queries, keys, values = (mx.random.normal((1, 2, 16, 32)) for _ in range(3))
        q_keys = mx.quantize(keys, group_size=32, bits=8)       # (wq, scales, biases), as mlx-lm caches them
        q_values = mx.quantize(values, group_size=32, bits=8)
        out = quantized_scaled_dot_product_attention(queries, q_keys, q_values, scale=32 ** -0.5, mask="causal",
                                                     group_size=32, bits=8)
        keys, values = (mx.dequantize(*x, group_size=32, bits=8) for x in (q_keys, q_values))
        expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=32 ** -0.5, mask="causal")
        assert mx.allclose(out, expected, atol=1e-4).item()
        ```
    """
    words = q_keys[0].shape[-1]   # uint32 words per row: D * bits / 32
    if words * 32 != queries.shape[-1] * bits:
        stored = words * 32 / queries.shape[-1]
        raise ValueError(f"bits={bits} does not fit q_keys: {words} words per row hold queries' D = "
                         f"{queries.shape[-1]} values at {stored:g} bits (pass the cache's bits)")
    k, v = (QuantizedTensor.from_mlx(*fields, group_size=group_size, bits=bits) for fields in (q_keys, q_values))
    return attention(queries, k, v, scale=scale, sinks=sinks, **_mask_options(mask))


REMOVED = -1e30  # an additive mask value at or below this removes the key in mfa_native's kernels


def _refuse_rows_without_keys(mask) -> None:
    """Unsupported for a mask array (of any rank MLX broadcasts: 0-d and 1-d too) that leaves
    some row no key: MLX gives such a row the mean of v (mlx-lm's quantized function too: it
    masks with finfo.min), mfa_native 0."""
    if not isinstance(mask, mx.array):
        return
    rows = mask.reshape(1) if mask.ndim == 0 else mask   # a 0-d mask is one value for every pair
    if rows.dtype == mx.bool_:
        some_row_empty = mx.logical_not(mx.all(mx.any(rows, axis=-1)))
    else:
        some_row_empty = mx.any(mx.max(rows, axis=-1) <= REMOVED)
    if some_row_empty.item():
        raise Unsupported("a mask row allows no key: MLX gives it the mean of v, mfa_native 0")


def _refusing(compute: Callable) -> Callable:
    """`compute`, its argument errors (ValueError, TypeError, NotImplementedError: a shape, dtype
    or mask mfa_native does not take) raised as Unsupported, so that patch() falls back on them
    and on nothing else (an internal error stays one)."""
    @functools.wraps(compute)
    def refusing(*args, **kwargs):
        try:
            return compute(*args, **kwargs)
        except Unsupported:
            raise
        except (ValueError, TypeError, NotImplementedError) as error:
            raise Unsupported(str(error)) from error

    return refusing


@_refusing
def _fast_sdpa(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None, sinks=None,
               **options) -> mx.array:
    """mx.fast.scaled_dot_product_attention's signature onto `scaled_dot_product_attention`;
    Unsupported where the result would not be MLX's (`options`: its stream or force_fused; a
    mask row with no key) or mfa_native refuses the arguments."""
    if options:
        raise Unsupported(f"mfa_native takes no {', '.join(options)}")
    _refuse_rows_without_keys(mask)
    return scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


@_refusing
def _mlx_lm_quantized_sdpa(queries: mx.array, q_keys, q_values, scale: float, mask, group_size: int = 64,
                           bits: int = 8) -> mx.array:
    """mlx-lm's quantized_scaled_dot_product_attention's signature onto ours; Unsupported for a
    mask row with no key, or what mfa_native refuses."""
    _refuse_rows_without_keys(mask)
    return quantized_scaled_dot_product_attention(queries, q_keys, q_values, scale=scale, mask=mask,
                                                  group_size=group_size, bits=bits)


def _gemma2_attention(self, x: mx.array, mask: mx.array | None = None, cache=None) -> mx.array:
    """mlx-lm's Gemma 2 `Attention.__call__` (models/gemma2.py writes its attention with plain MLX
    ops around the logit cap: tanh(scores / cap) * cap, the mask, a softmax), its attention
    computed by `attention(..., softcap=)`; the projections, rotary embedding and cache update
    are mlx-lm's own calls, in its order. Unsupported (the original runs) for a mask row with
    no key, checked before the cache is written; any later error is raised, never retried (the
    cache holds this step's keys by then)."""
    _refuse_rows_without_keys(mask)
    B, L, _ = x.shape
    queries, keys, values = (projection(x).reshape(B, L, heads, -1).transpose(0, 2, 1, 3) for projection, heads in
                             ((self.q_proj, self.n_heads), (self.k_proj, self.n_kv_heads),
                              (self.v_proj, self.n_kv_heads)))
    offset = 0 if cache is None else cache.offset
    queries, keys = self.rope(queries, offset=offset), self.rope(keys, offset=offset)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    out = attention(queries, keys, values, scale=self.scale, softcap=self.attn_logit_softcapping,
                    **_mask_options(mask))
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _routed(ours: Callable, original: Callable) -> Callable:
    """`original`, computed by `ours` (which takes its arguments), or by `original` itself when
    ours raises Unsupported (shapes, dtypes, masks mfa_native does not take or would not give
    MLX's result for)."""
    @functools.wraps(original)
    def routed(*args, **kwargs):
        try:
            return ours(*args, **kwargs)
        except Unsupported:
            return original(*args, **kwargs)

    return routed


def _patch_targets() -> list[tuple[object, str, Callable]]:
    """(namespace, attribute, ours) of every function `patch` routes: mx.fast's SDPA, and, when
    mlx_lm is imported, mlx-lm's quantized SDPA in `mlx_lm.models.base` and in every loaded
    mlx_lm module that imported it by name, and its Gemma 2 attention's `__call__` (the class's,
    so models built before or inside the block both use it)."""
    targets: list[tuple[object, str, Callable]] = [(mx.fast, "scaled_dot_product_attention", _fast_sdpa)]
    if "mlx_lm" in sys.modules:
        from mlx_lm.models import base, gemma2

        targets.append((gemma2.Attention, "__call__", _gemma2_attention))

        name = "quantized_scaled_dot_product_attention"
        original = getattr(base, name)
        targets += [(module, name, _mlx_lm_quantized_sdpa) for module_name, module in list(sys.modules.items())
                    if module_name.startswith("mlx_lm") and getattr(module, name, None) is original]
    return targets


@contextmanager
def patch() -> Iterator[None]:
    """Inside the block (or a function decorated with `@patch()`), mx.fast.scaled_dot_product_attention
    and mlx-lm's quantized_scaled_dot_product_attention (the quantized KV cache's attention,
    `kv_bits` in mlx-lm's generate) run through mfa_native, and through their originals for
    what mfa_native refuses or would compute differently (a mask row with no key, MLX's
    stream or force_fused arguments, shapes or dtypes it does not take: `Unsupported`).
    So does mlx-lm's Gemma 2 attention, which mlx-lm writes with plain MLX ops around its
    logit cap (not through mx.fast): `mlx_lm.models.gemma2.Attention.__call__` runs its
    attention as `attention(..., softcap=attn_logit_softcapping)` (the original for a mask
    row with no key). Restored on exit, also on an exception; blocks may nest.

    It replaces module and class attributes, so code that looks them up when calling (mlx-lm's
    models: `mx.fast.scaled_dot_product_attention(...)`, `base.scaled_dot_product_attention`
    calling `quantized_scaled_dot_product_attention`, a Gemma 2 layer calling its attention)
    uses it; import mlx_lm before entering the block for its functions to be routed. Not under mx.compile (see the module
    docstring). Not thread-safe: the attributes are process-wide.

    Returns:
        A context manager (its value is None), also usable as a decorator.

    Raises:
        ValueError: inside the block, for arguments neither mfa_native nor the original
            takes: the original's own error (likewise its TypeError or other errors; a
            call mfa_native refuses runs through the original).

    Example:
        ```python
        import mlx.core as mx
        import mfa_native.mlx

        mx.random.seed(0)
        q, k, v = (mx.random.normal((1, 2, 16, 32)) for _ in range(3))
        expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=32 ** -0.5, mask="causal")
        with mfa_native.mlx.patch():   # code calling mx.fast.scaled_dot_product_attention runs mfa_native
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=32 ** -0.5, mask="causal")
        assert mx.allclose(out, expected, atol=1e-5).item()
        ```
    """
    targets = _patch_targets()
    originals = [(namespace, name, getattr(namespace, name)) for namespace, name, _ in targets]
    for (namespace, name, ours), (_, _, original) in zip(targets, originals):
        setattr(namespace, name, _routed(ours, original))
    try:
        yield
    finally:
        for namespace, name, original in reversed(originals):
            setattr(namespace, name, original)


def _differentiating(op: Op, values: dict):
    """A call on MLX arrays (runtime.frameworks.adapter): through the op's custom function, or for
    a call that writes a cache in place, this module's function of the op, which updates MLX's
    arrays with MLX itself (never behind its back)."""
    if writes_in_place(op, values):
        return globals()[op.name](**{k: v for k, v in values.items() if k != "device"})
    return mlx_call(op, values)


register_adapter("mlx", _differentiating)
