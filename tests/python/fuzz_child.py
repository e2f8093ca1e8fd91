"""The fuzzer's child: malformed calls of `PreparedPass.run` and of the public ops, built by
a seeded generator, each of which must raise ValueError or TypeError or return a result
with no NaN (nor +inf: every input is finite). test_fuzz.py runs it in a subprocess, so a
crash is an exit code and a hang a timeout, not a dead pytest.

    python fuzz_child.py SEED RUN_CASES OP_CASES

then PATCH_CASES calls of mx.fast.scaled_dot_product_attention under mfa_native.mlx.patch() with
every mask form MLX takes, each of which must equal MLX's own result (or raise as MLX does).

prints one line per case that failed, then a summary: `clean errors E results R bad N`;
exits 1 if any case raised another exception or returned NaN.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Callable

import numpy as np

import mfa_native
from mfa_native import BlockMask, codegen
from mfa_native.runtime import pool_arrays, runner
from mfa_native.runtime.arrays import DTYPES
from mfa_native.runtime.runner import PreparedPass

CLEAN = (ValueError, TypeError, NotImplementedError)   # NotImplementedError: a documented refusal (a drop-in's)
WRONG_DTYPES = [np.float16, np.float64, DTYPES["bfloat16"], np.int32, np.int64, np.uint8, np.bool_, ">f4"]
NOT_ARRAYS = [None, 3.0, "q", [[1.0, 2.0]], b"\0" * 64, {"a": 1}]
HUGE = 2**31  # every size the kernels index from here on is refused
PATCH_CASES = 40


def poison(shape, dtype, device) -> np.ndarray:
    """Outputs (the runner's pool arrays) start as NaN (integers: their largest value), so an
    element no kernel wrote shows."""
    dtype = np.dtype(dtype)
    floating = dtype.kind == "f" or dtype == DTYPES["bfloat16"]
    out = pool_arrays.empty(shape, dtype, device)
    out[...] = np.nan if floating else (True if dtype == np.bool_ else np.iinfo(dtype).max)
    return out


def leaves(result) -> list[np.ndarray]:
    """The arrays of an op's result (an array, a tuple of them, a QuantizedTensor or a BlockMask)."""
    if isinstance(result, (tuple, list)):
        return [a for r in result for a in leaves(r)]
    if isinstance(result, np.ndarray):
        return [result]
    if isinstance(result, BlockMask):
        return list(result.arrays.values())
    return [a for a in vars(result).values() if isinstance(a, np.ndarray)]


def finite_enough(result) -> bool:
    """No NaN and no +inf in any float array of the result (-inf is an lse or score of no key)."""
    for a in leaves(result):
        if a.dtype.kind == "f" or a.dtype == DTYPES["bfloat16"]:
            values = a.astype(np.float32)
            if np.isnan(values).any() or np.isposinf(values).any():
                return False
    return True


class Tally:
    """Counts the outcomes; prints each bad one with what was called."""

    def __init__(self) -> None:
        self.errors = self.results = self.bad = 0

    def case(self, what: str, call: Callable[[], Any]) -> None:
        try:
            result = call()
        except CLEAN:
            self.errors += 1
            return
        except Exception:  # noqa: BLE001 - any other exception type is what the fuzzer looks for
            self.bad += 1
            print(f"BAD {what}: {traceback.format_exc(limit=3)}", flush=True)
            return
        if finite_enough(result):
            self.results += 1
        else:
            self.bad += 1
            print(f"BAD {what}: a result with NaN or +inf", flush=True)


# -- PreparedPass.run -----------------------------------------------------------------------------

RUN_PROBLEMS = [codegen.AttentionProblem(1, 4, 2, 1, 64, 16, 16),
                codegen.AttentionProblem(1, 2, 1, 5, 9, 16, 16, causal="lower_right", sinks=True)]


def valid_inputs(rng, prepared: PreparedPass) -> list[np.ndarray]:
    """Fresh standard-normal inputs, C-contiguous (what the passes above were built for)."""
    return [rng.standard_normal(b.shape).astype(DTYPES[b.dtype]) for b in prepared.description.inputs]


def wrong_run_inputs(rng, inputs: list[np.ndarray]) -> tuple[str, Any]:
    """One mutation of a valid input list: (what it is, the inputs)."""
    i = int(rng.integers(len(inputs)))
    x = inputs[i]
    axis = int(rng.integers(x.ndim))
    kind = str(rng.choice(["extent", "dtype", "view", "count", "not an array", "rank", "order", "fewer keys"]))
    if kind == "extent":
        n = x.shape[axis]
        extent = int(rng.choice([m for m in (0, 1, n // 2, n - 1, n + 1, 2 * n) if m != n]))
        shape = list(x.shape)
        shape[axis] = extent
        wrong = rng.standard_normal(shape).astype(x.dtype)
    elif kind == "fewer keys":  # the README's segfault: k and v of fewer keys than the pass was built for
        keys = int(rng.integers(1, 8))
        return kind, [y[:, :, :keys] if y.ndim == 4 and j else y for j, y in enumerate(inputs)]
    elif kind == "dtype":
        wrong = x.astype(WRONG_DTYPES[int(rng.integers(len(WRONG_DTYPES)))])
    elif kind == "view":
        wrong = np.repeat(x, 2, axis=axis)[(slice(None),) * axis + (slice(None, None, 2),)]
        if x.shape[axis] == 1:
            wrong = x[..., ::-1]
    elif kind == "count":
        return kind, inputs[:-1] if rng.integers(2) else [*inputs, x]
    elif kind == "not an array":
        wrong = NOT_ARRAYS[int(rng.integers(len(NOT_ARRAYS)))]
    elif kind == "rank":
        wrong = x[None] if rng.integers(2) else x[0]
    else:
        wrong = np.asfortranarray(x)
    return kind, [wrong if j == i else y for j, y in enumerate(inputs)]


def fuzz_run(rng, tally: Tally, cases: int) -> None:
    device = mfa_native.default_device()
    passes = [PreparedPass(codegen.attention_pass(p), device) for p in RUN_PROBLEMS]
    for prepared in passes:
        tally.case("run on valid inputs", lambda p=prepared: p.run(valid_inputs(rng, p)))
    for _ in range(cases):
        prepared = passes[int(rng.integers(len(passes)))]
        kind, inputs = wrong_run_inputs(rng, valid_inputs(rng, prepared))
        tally.case(f"PreparedPass.run, {kind}: {describe(inputs)}", lambda: prepared.run(inputs))


def describe(value) -> str:
    """Shapes and dtypes, for a bad case's report."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{value.shape}@{value.strides}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={describe(v)}" for k, v in value.items()) + "}"
    return repr(value)[:60]


# -- the public ops --------------------------------------------------------------------------------

B, HQ, HKV, R, C, D = 1, 2, 1, 5, 9, 16
BAD_SCALARS = {"scale": ["x", np.nan, np.inf, True, -1.0, 0.0, 1e300],
               "causal": [2, "yes", None, "upper_left", True],
               "window": [(-2, 1), (1,), (1.5, 2), (2**40, 0), "ab", (0, 0), (-1, -1)],
               "layout": ["bsdh", 3, "bshd"],
               "return_lse": [1, "no", True],
               "device": ["gpu", 0, "cpu"],
               "topk": [-1, 2**40, HUGE, 1.5, 0, 10**6, True],
               "sinks": ["none", "shape", "int"],
               "mask": ["shape", "dtype", "bool", "broadcast"],
               "cache_seqlens": ["long", "negative", "beyond", "float", "none"],
               "block_table": ["range", "shape", "int64"]}
BAD_SCALARS["softmax_scale"] = BAD_SCALARS["scale"]
BAD_SCALARS["window_size"] = BAD_SCALARS["window"]


def floats(rng, *shape, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def base_call(rng, op: str) -> tuple[Callable, list, dict]:
    """A valid call of `op` on small fresh inputs: (function, positional arguments, options)."""
    q, k, v = floats(rng, B, HQ, R, D), floats(rng, B, HKV, C, D), floats(rng, B, HKV, C, D)
    if op == "attention":
        return mfa_native.attention, [q, k, v], {"causal": True}
    if op == "attention_backward":
        o, lse = mfa_native.attention(q, k, v, return_lse=True)
        return mfa_native.attention_backward, [q, k, v, o, lse, floats(rng, *o.shape)], {}
    if op == "sparse_attention":
        indices = rng.integers(0, C, (B, HKV, R, 4)).astype(np.int32)
        return mfa_native.sparse_attention, [q, k, v, indices], {}
    if op == "block_sparse_attention":
        mask = BlockMask(np.ones((1, 1, 1), np.int32), np.zeros((1, 1, 1, 1), np.int32), block_size=16)
        return mfa_native.block_sparse_attention, [q, k, v, mask], {}
    if op == "int8_attention":
        return mfa_native.int8_attention, [q, k, v], {}
    if op == "sparse_topk":
        return mfa_native.sparse_topk, [q, k[:, :1], floats(rng, B, HQ, R), 3], {}
    if op in ("attention_varlen", "flash_attn_varlen_func"):
        cu_q, cu_k = np.array([0, 2, R], np.int32), np.array([0, 4, C], np.int32)
        tokens = [floats(rng, R, HQ, D), floats(rng, C, HKV, D), floats(rng, C, HKV, D), cu_q, cu_k]
        if op == "attention_varlen":
            return mfa_native.attention_varlen, tokens, {"causal": True}
        return _torch(flash_attn.flash_attn_varlen_func), tokens + [R, C], {"causal": True}
    if op in ("attention_with_kvcache", "flash_attn_with_kvcache"):
        return _kvcache_call(rng, op)
    o1, l1 = mfa_native.attention(q, k, v, return_lse=True)
    o2, l2 = mfa_native.attention(q, k[:, :, :4], v[:, :, :4], return_lse=True)
    return mfa_native.merge_attention, [[o1, o2], [l1, l2]], {}


def _kvcache_call(rng, op: str) -> tuple[Callable, list, dict]:
    """A KV-cache call: contiguous, paged, quantized (q8_0, D 32) or with an append, at random;
    numpy for attention_with_kvcache, torch tensors (converted in the call) for the drop-in."""
    form = str(rng.choice(["contiguous", "paged", "quantized", "append"]))
    d = 32 if form == "quantized" else D
    q = floats(rng, B, R, HQ, d)
    if form == "paged":
        caches = [floats(rng, 3, 8, HKV, d), floats(rng, 3, 8, HKV, d)]
        extra = {"block_table": np.array([[2, 0]], np.int32)}
    else:
        caches = [floats(rng, B, 16, HKV, d), floats(rng, B, 16, HKV, d)]
        extra = {}
    if form == "quantized" and op == "attention_with_kvcache":
        caches = [mfa_native.quantize(c, "q8_0") for c in caches]
    if form == "append":
        extra.update(k=floats(rng, B, 2, HKV, d), v=floats(rng, B, 2, HKV, d))
    seqlens = np.array([5], np.int32)
    if op == "attention_with_kvcache":
        return mfa_native.attention_with_kvcache, [q, *caches], {"cache_seqlens": seqlens, "causal": True, **extra}
    return _torch(flash_attn.flash_attn_with_kvcache), [q, *caches], \
        {"cache_seqlens": seqlens, "causal": True, **extra}


def _torch(drop_in: Callable) -> Callable:
    """`drop_in` (a torch function) called with its numpy arguments as torch tensors."""
    def call(*args, **options):
        def tensor(x):   # the same view where torch has one (huge stride-0 arrays stay views)
            if not isinstance(x, np.ndarray):
                return x
            bits = x.dtype == DTYPES["bfloat16"]
            x = x.view(np.int16) if bits else x
            try:
                t = torch.from_numpy(x)
            except (TypeError, ValueError):   # negative strides, a dtype torch has not: a copy (small ones)
                t = torch.from_numpy(x.copy()) if x.dtype != ">f4" else torch.from_numpy(x.astype(np.float32))
            return t.view(torch.bfloat16) if bits else t
        return drop_in(*(tensor(a) for a in args), **{k: tensor(v) for k, v in options.items()})
    return call


try:
    import torch

    from mfa_native.torch import flash_attn
    TORCH_OPS = ["flash_attn_varlen_func", "flash_attn_with_kvcache"]
except ImportError:   # the drop-ins are fuzzed where torch is installed
    TORCH_OPS = []

OPS = ["attention", "attention_backward", "sparse_attention", "block_sparse_attention", "int8_attention",
       "sparse_topk", "merge_attention", "attention_varlen", "attention_with_kvcache", *TORCH_OPS]


def array_slots(args: list) -> list[tuple[int, ...]]:
    """Where the arrays of a call's positional arguments are: (i,) or, inside a list, (i, j)."""
    slots = []
    for i, a in enumerate(args):
        if isinstance(a, np.ndarray):
            slots.append((i,))
        elif isinstance(a, list):
            slots += [(i, j) for j in range(len(a))]
    return slots


def mutated_array(rng, x: np.ndarray) -> Any:
    """x made wrong: another rank, extent, dtype or layout, huge, empty, or not an array."""
    axis = int(rng.integers(x.ndim)) if x.ndim else 0
    kind = int(rng.integers(9))
    if kind == 0:
        return x[None] if rng.integers(2) or not x.ndim else x[(slice(None),) * axis + (0,)]
    if kind == 1:
        shape = list(x.shape)
        shape[axis] = int(rng.choice([1, 2, 3, 7, 17, 300])) if x.ndim else 1
        return rng.standard_normal(shape).astype(x.dtype) if x.dtype.kind == "f" else \
            rng.integers(-3, 20, shape).astype(x.dtype)
    if kind == 2:
        return x.astype(WRONG_DTYPES[int(rng.integers(len(WRONG_DTYPES)))])
    if kind == 3:  # a strided last axis
        return np.repeat(x, 2, axis=-1)[..., ::2] if x.ndim else x
    if kind == 4:
        return x[..., ::-1] if x.ndim else x
    if kind == 5:  # a size the kernels cannot index, over one element
        shape = list(x.shape)
        shape[axis] = HUGE * int(rng.choice([1, 2]))
        return np.lib.stride_tricks.as_strided(x.reshape(-1)[:1], tuple(shape), (0,) * len(shape))
    if kind == 6:
        return x[(slice(None),) * axis + (slice(0, 0),)]
    if kind == 7:
        return np.asfortranarray(x)
    return NOT_ARRAYS[int(rng.integers(len(NOT_ARRAYS)))]


def bad_option(rng, name: str, args: list) -> Any:
    """A wrong (or unusual) value of option `name`."""
    value = BAD_SCALARS[name][int(rng.integers(len(BAD_SCALARS[name])))]
    if name == "sinks":
        return {"none": np.full(HQ, -np.inf, np.float32), "shape": np.zeros(HQ + 1, np.float32),  # -inf: no sink
                "int": np.zeros(HQ, np.int32)}[value]
    if name == "mask":
        return {"shape": np.zeros((R + 1, C), np.float32), "dtype": np.zeros((R, C), np.int32),
                "bool": rng.integers(0, 2, (R, C)).astype(bool), "broadcast": np.zeros((1, HQ, 1, C))}[value]
    if name == "cache_seqlens":
        return {"long": np.array([5, 5], np.int32), "negative": np.array([-3], np.int32),
                "beyond": np.array([15], np.int32), "float": np.array([5.0], np.float32), "none": None}[value]
    if name == "block_table":
        return {"range": np.array([[3, -1]], np.int32), "shape": np.zeros((2, 2), np.int32),
                "int64": np.array([[2, 0]], np.int64)}[value]
    return value


OPTIONS = {"attention": ["scale", "causal", "window", "layout", "return_lse", "device", "sinks", "mask"],
           "attention_backward": ["scale", "causal", "window", "layout", "device", "sinks", "mask"],
           "sparse_attention": ["scale", "layout", "return_lse", "device", "sinks"],
           "block_sparse_attention": ["scale", "causal", "window", "layout", "return_lse", "sinks", "mask"],
           "int8_attention": ["scale", "causal", "window", "layout", "return_lse", "sinks", "mask"],
           "sparse_topk": ["causal", "layout", "device"],
           "merge_attention": ["layout", "device"],
           "attention_varlen": ["scale", "causal", "window", "return_lse", "device", "sinks"],
           "attention_with_kvcache": ["scale", "causal", "window", "return_lse", "device", "sinks", "cache_seqlens",
                                      "block_table"],
           "flash_attn_varlen_func": ["softmax_scale", "causal", "window_size"],
           "flash_attn_with_kvcache": ["softmax_scale", "causal", "window_size", "cache_seqlens", "block_table"]}


def special(rng, op: str, args: list) -> list:
    """An op's own wrong arguments: out-of-range or wrongly typed indices, bad block lists, lists
    of the wrong length, a wrong topk."""
    args = list(args)
    if op == "sparse_attention":
        choice = int(rng.integers(3))
        shape = args[3].shape
        if choice == 0:
            args[3] = rng.choice([C, C + 5, -7, HUGE - 1, -HUGE], shape).astype(np.int32)
        elif choice == 1:
            args[3] = args[3].astype([np.int64, np.float32, np.uint32, np.int16][int(rng.integers(4))])
        else:
            args[3] = np.zeros((B, HKV, R + 1, 4), np.int32)
    elif op == "block_sparse_attention":
        counts = rng.choice([-1, 0, 1, 2, 5], (1, 1, 1)).astype(np.int32)
        indices = rng.choice([-1, 0, 1, 3, HUGE - 1], (1, 1, 1, 2)).astype(np.int32)
        block = int(rng.choice([16, 8, 12, -8, 0, 2**20]))
        args[3] = lambda: BlockMask(counts, indices, block_size=block)   # built inside the case
    elif op == "sparse_topk":
        args[3] = int(rng.choice([-1, 0, HUGE, 2**40, C + 3]))
    elif op == "merge_attention":
        choice = int(rng.integers(3))
        if choice == 0:
            args[1] = args[1][:1]
        elif choice == 1:
            args = [[], []]
        else:
            args = [tuple(args[0]), args[1][0]]
    return args


def materialized(args: list) -> list:
    """Arguments built lazily (a BlockMask whose construction may raise) built now."""
    return [a() if callable(a) else a for a in args]


def op_case(rng) -> tuple[str, Callable[[], Any]]:
    """One malformed call of a random op: (what it is, the call)."""
    op = OPS[int(rng.integers(len(OPS)))]
    fn, args, options = base_call(rng, op)
    kind = int(rng.integers(10))
    if kind < 6:
        slot = array_slots(args)[int(rng.integers(len(array_slots(args))))]
        if len(slot) == 1:
            args[slot[0]] = mutated_array(rng, args[slot[0]])
        else:
            args[slot[0]] = [mutated_array(rng, a) if j == slot[1] else a for j, a in enumerate(args[slot[0]])]
    elif kind < 9:
        name = OPTIONS[op][int(rng.integers(len(OPTIONS[op])))]
        options = {**options, name: bad_option(rng, name, args)}
    else:
        args = special(rng, op, args)
    return f"{op}({describe(args)}, {describe(options)})", lambda: fn(*materialized(args), **options)


def fuzz_ops(rng, tally: Tally, cases: int) -> None:
    for _ in range(cases):
        what, call = op_case(rng)
        tally.case(what, call)


# -- mlx.patch(): every mask form MLX takes, against MLX's own result ------------------------------

SDPA = (2, 4, 2, 5, 9, 16)   # B, Hq, Hkv, L, S, D


def patch_mask(rng) -> tuple[str, Any]:
    """A mask of any rank MLX broadcasts to (B, Hq, L, S) (0 to 4 axes, each full or 1; bool or
    additive), "causal", None, or a shape that does not broadcast."""
    B, H, _, L, S, _ = SDPA
    form = int(rng.integers(8))
    if form == 0:
        return "none", None
    if form == 1:
        return "causal", "causal"
    full = (B, H, L, S)
    rank = int(rng.integers(0, 5))
    shape = tuple(n if rng.integers(2) else 1 for n in full[4 - rank:])
    if form == 7 and rank:
        shape = shape[:-1] + (S + 1,)   # does not broadcast: MLX raises, and so must the patched call
    boolean = bool(rng.integers(2))
    values = rng.random(shape) > 0.2 if boolean else rng.standard_normal(shape).astype(np.float32)
    return f"{'bool' if boolean else 'additive'} {shape}", np.asarray(values)


def fuzz_patch(rng, tally: Tally, cases: int) -> None:
    try:
        import mlx.core as mx

        import mfa_native.mlx as mm
    except ImportError:   # MLX's drop-in is fuzzed where mlx is installed
        return
    B, H, Hkv, L, S, D = SDPA
    for _ in range(cases):
        what, mask = patch_mask(rng)
        q, k, v = (mx.array(floats(rng, B, h, n, D)) for h, n in ((H, L), (Hkv, S), (Hkv, S)))
        mask = mx.array(mask) if isinstance(mask, np.ndarray) else mask

        def call(q=q, k=k, v=v, mask=mask):
            try:
                theirs = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask))
            except ValueError:
                theirs = None
            with mm.patch():
                try:
                    ours = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask))
                except ValueError:
                    if theirs is None:
                        raise   # MLX refuses it too: a clean error
                    raise AssertionError("the patched call refused what MLX computes") from None
            if theirs is None:
                raise AssertionError("MLX refuses this mask; the patched call computed it")
            if np.linalg.norm(ours - theirs) > 1e-5 * np.linalg.norm(theirs):
                raise AssertionError("the patched call differs from MLX's")
            return ours

        tally.case(f"mlx.patch() scaled_dot_product_attention, mask {what}", call)


def main() -> int:
    seed, run_cases, op_cases = (int(a) for a in sys.argv[1:4])
    runner._allocate = poison
    rng = np.random.default_rng(seed)
    tally = Tally()
    fuzz_run(rng, tally, run_cases)
    fuzz_ops(rng, tally, op_cases)
    fuzz_patch(rng, tally, PATCH_CASES)
    print(f"clean errors {tally.errors} results {tally.results} bad {tally.bad}", flush=True)
    return 1 if tally.bad else 0


if __name__ == "__main__":
    sys.exit(main())
