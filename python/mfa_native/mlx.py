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

`patch()` routes `mx.fast.scaled_dot_product_attention` and mlx-lm's quantized attention
through these inside a block (or a decorated function).

Importing this module imports mlx; `import mfa_native` alone does not.
"""

from __future__ import annotations

import functools
import inspect
import sys
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from . import reference
from .context.mlx_ring import ring_attention, sharded_decode  # noqa: F401 - public here
from .ops.attention import ATTENTION
from .ops.block_sparse import BLOCK_SPARSE_ATTENTION
from .ops.declaration import Call, Op, quantized_values
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

def mlx_function(op: Op):
    """`op` on MLX arrays as an mx.custom_function (see `mlx_call`), with the op's arguments
    less `device`."""
    signature = inspect.Signature([p for p in op.parameters() if p.name != "device"])

    def function(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return mlx_call(op, op.resolved({**bound.arguments, "device": None}))

    function.__name__ = function.__qualname__ = op.name
    function.__signature__ = signature
    function.__doc__ = (f"`mfa_native.{op.name}` on MLX arrays, differentiable (mx.grad, mx.vjp) through its "
                        "declared backward; outputs the backward takes no cotangent of come back through "
                        f"mx.stop_gradient. Arguments and results are `mfa_native.{op.name}`'s, without `device`.")
    return function


def mlx_call(op: Op, values: dict):
    """A call of `op` (every argument by name) as an mx.custom_function, so that MLX sees it.

    Its primals are the MLX arrays among the op's differentiable arguments; an additive (floating) mask of an op with
    a mask rule below is a primal too, its gradient computed lazily with MLX ops (so it costs
    nothing unless asked for). The fields of a QuantizedTensor argument (quantized k, v) are
    primals too, each through `_constant`: the tensor is a constant of the call, and a
    gradient asked of it raises NotImplementedError. The vjp runs the backward op, its
    arguments found by name as torch/library.py finds them: forward arguments (a
    QuantizedTensor dequantized to q's dtype), outputs, and `d` + an output's name for its
    cotangent. Outputs the backward takes no cotangent of (lse) come back through
    mx.stop_gradient. An op without a backward runs as `_without_gradient` says."""
    if op.backward is None:
        return _without_gradient(op, values)
    backward_op = op.backward_op
    backward_names = [] if backward_op is None else [p.name for p in backward_op.parameters()]
    selectors = {o.when: True for o in op.outputs if o.when in op.option_names}
    given = [a.name for a in op.arguments if a.kind == "array" and _is_primal(op, a, values[a.name])]
    quantized = quantized_values(op, values)
    constants = [(name, field) for name, x in quantized.items()
                 for field, array in x.fields().items() if isinstance(array, mx.array)]
    everything = Call(op, {**values, **selectors}).results   # what the forward computes
    everything = (everything,) if isinstance(everything, str) else everything

    def bound(primals) -> dict:
        """The call's arguments, the primals in place of the arrays they stand for."""
        replaced: dict[str, dict] = {}
        for (name, field), p in zip(constants, primals[len(given):]):
            replaced.setdefault(name, {})[field] = p
        return {**values, **dict(zip(given, primals)),
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


attention = mlx_function(ATTENTION)
sparse_attention = mlx_function(SPARSE_ATTENTION)
block_sparse_attention = mlx_function(BLOCK_SPARSE_ATTENTION)
int8_attention = mlx_function(INT8_ATTENTION)
attention_varlen = mlx_function(ATTENTION_VARLEN)


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


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens=None, k=None, v=None, block_table=None, scale=None,
                           causal=False, window=None, sinks=None, return_lse=False):
    """`mfa_native.attention_with_kvcache` on MLX arrays (inference only: a gradient asked through
    it raises). MLX arrays are read-only to the pass, so the append is MLX's own in-place
    update: after every check, k and v are written into the caller's k_cache and v_cache
    objects (`cache[index] = rows`; a QuantizedTensor cache's fields get `quantize(k)`'s
    integers and scales, as the device append writes them), then the call attends
    cache_seqlens + Rn keys without an append. cache_seqlens is not modified."""
    values = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k=None, v=None,
                  block_table=block_table, scale=scale, causal=causal, window=window, sinks=sinks,
                  return_lse=return_lse, device=None)
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

    q (B, Hq, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), Hq a multiple of Hkv;
    mask "causal" (lower right: the last query sees every key), a boolean array
    (True = attend) or an additive array, broadcastable to (B, Hq, L, S); sinks (Hq,).

    One difference from MLX: a row with no allowed key (every key masked out, no
    sink) gives 0 here, where MLX gives the mean of v over the masked keys.
    Additive values <= -1e30 remove a key here, so a row masked only with such
    finite values also gives 0.
    """
    return attention(q, k, v, scale=scale, sinks=sinks, **_mask_options(mask))


def quantized_scaled_dot_product_attention(queries: mx.array, q_keys: Sequence[mx.array],
                                           q_values: Sequence[mx.array], *, scale: float,
                                           mask: str | mx.array | None = None, group_size: int = 64,
                                           bits: int = 8, sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's `quantized_scaled_dot_product_attention`, with K and V read quantized inside
    the kernel (mlx-lm dequantizes them and builds the whole score matrix).

    q_keys and q_values are what mlx-lm's QuantizedKVCache holds: (wq, scales, biases) as
    `mx.quantize(x, group_size, bits)` returns them, (B, Hkv, S, ...) along the head
    dimension; queries (B, Hq, L, D). mask, scale and sinks as in
    `scaled_dot_product_attention`. Differentiable in queries (and sinks, an additive
    mask): the quantized cache is a constant, whose gradient (mx.grad with respect to its
    arrays) raises NotImplementedError.
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
    mlx_lm module that imported it by name."""
    targets: list[tuple[object, str, Callable]] = [(mx.fast, "scaled_dot_product_attention", _fast_sdpa)]
    if "mlx_lm" in sys.modules:
        from mlx_lm.models import base

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
    stream or force_fused arguments, shapes or dtypes it does not take); errors are then the
    originals'. Restored on exit, also on an exception; blocks may nest.

    It replaces module attributes, so code that looks them up when calling (mlx-lm's models:
    `mx.fast.scaled_dot_product_attention(...)`, and `base.scaled_dot_product_attention`
    calling `quantized_scaled_dot_product_attention`) uses it; import mlx_lm before entering
    the block for its function to be routed. Not under mx.compile (see the module
    docstring). Not thread-safe: the attributes are process-wide.
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
