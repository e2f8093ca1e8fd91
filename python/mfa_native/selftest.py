"""`python -m mfa_native selftest`: every kernel family on a device, against the float64
references (and, on Metal, against the cpu backend running the same MSL), one table row per
family. It is how the first users of a Mac check this library on their own GPU: `--report
FILE` writes the table as Markdown to paste into an issue.

Each family runs small random problems for each dtype and head dimension of the run (`--quick`:
float16 at D 64, and the dense families at D 576 too); its row is ok, wrong (the worst relative
L2 error, or what differed) or a compile error (the log's first lines).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Callable

import numpy as np

import mfa_native

from . import reference
from .codegen.int8.problem import INT8_MAX_HEAD_DIM
from .codegen.kernel import tuned
from .int8_reference import int8_attention_emulation
from .runtime.arrays import DTYPES
from .runtime.devices import Device, resolve_device, tuned_as, tuning_facts

TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-2}
FULL = (("float32", "float16", "bfloat16"), (64, 128, 576))
QUICK = (("float16",), (64, 576))
DENSE = ("forward", "backward")   # the families --quick also runs at its largest head dim

Compared = list  # of (what, actual, expected, tolerance factor)


def _tensors(rng, dtype: str, *shapes):
    return [rng.standard_normal(s).astype(DTYPES[dtype]) for s in shapes]


def _forward(rng, device, dtype, d) -> Compared:
    q, k, v = _tensors(rng, dtype, (1, 4, 37, d), (1, 2, 45, d), (1, 2, 45, d))
    out = mfa_native.attention(q, k, v, causal=True, device=device)
    return [("out", out, reference.attention_reference(q, k, v, causal=True), 1)]


def _backward(rng, device, dtype, d) -> Compared:
    q, k, v, do = _tensors(rng, dtype, (1, 4, 21, d), (1, 2, 33, d), (1, 2, 33, d), (1, 4, 21, d))
    o, lse = mfa_native.attention(q, k, v, causal=True, return_lse=True, device=device)
    grads = mfa_native.attention_backward(q, k, v, o, lse, do, causal=True, device=device)
    expected = reference.attention_backward_reference(q, k, v, do, causal=True, out=o)
    return [(name, g, e, 10) for name, g, e in zip(("dq", "dk", "dv"), grads, expected)]


def _split_kv(rng, device, dtype, d) -> Compared:
    q, k, v = _tensors(rng, dtype, (1, 2, 1, d), (1, 2, 1100, d), (1, 2, 1100, d))
    with tuned_as(device, parallel_threadgroups=max(tuning_facts(device).parallel_threadgroups, 64)):
        out = mfa_native.attention(q, k, v, device=device)
    return [("out", out, reference.attention_reference(q, k, v), 1)]


def _packed(rng, device, dtype, d) -> Compared:
    q, k, v = _tensors(rng, dtype, (2, 8, 2, d), (2, 1, 70, d), (2, 1, 70, d))
    out = mfa_native.attention(q, k, v, causal=True, device=device)
    return [("out", out, reference.attention_reference(q, k, v, causal=True), 1)]


def _varlen(rng, device, dtype, d) -> Compared:
    cu_q, cu_k = np.array([0, 5, 5, 17], np.int32), np.array([0, 9, 13, 30], np.int32)
    q, k, v = _tensors(rng, dtype, (17, 4, d), (30, 2, d), (30, 2, d))
    out = mfa_native.attention_varlen(q, k, v, cu_q, cu_k, causal=True, device=device)
    return [("out", out, reference.attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True), 1)]


def _kvcache(rng, device, dtype, d) -> Compared:
    q, new_k, new_v = _tensors(rng, dtype, (2, 3, 4, d), (2, 3, 2, d), (2, 3, 2, d))
    pages_k, pages_v = _tensors(rng, dtype, (6, 16, 2, d), (6, 16, 2, d))
    table, lengths = np.array([[4, 1, 5], [0, 3, 2]], np.int32), np.array([20, 7], np.int32)
    expected = reference.attention_with_kvcache_reference(q, pages_k.copy(), pages_v.copy(), lengths, new_k, new_v,
                                                          table, causal=True)
    out = mfa_native.attention_with_kvcache(q, pages_k, pages_v, cache_seqlens=lengths, k=new_k, v=new_v,
                                            block_table=table, causal=True, device=device)
    written = pages_k[table[0, 20 // 16], 20 % 16 : 20 % 16 + 3]
    return [("out", out, expected, 1), ("appended k", written, new_k[0], 0)]


def _quantized(rng, device, dtype, d) -> Compared:
    q, k, v = _tensors(rng, dtype, (1, 4, 3, d), (1, 2, 90, d), (1, 2, 90, d))
    kq, vq = (mfa_native.quantize(x, "q8_0", device=device) for x in (k, v))
    out = mfa_native.attention(q, kq, vq, device=device)
    return [("out", out, reference.attention_reference(q, kq.dequantize(), vq.dequantize()), 1)]


def _int8(rng, device, dtype, d) -> Compared:
    q, k, v = _tensors(rng, dtype, (1, 2, 33, d), (1, 2, 40, d), (1, 2, 40, d))
    out = mfa_native.int8_attention(q, k, v, causal=True, device=device)
    return [("out", out, int8_attention_emulation(q, k, v, causal=True), 0.05)]


def _sparse(rng, device, dtype, d) -> Compared:
    q, k, v = _tensors(rng, dtype, (1, 4, 9, d), (1, 1, 80, d), (1, 1, 80, d))
    index_q, index_k = _tensors(rng, "float32", (1, 4, 9, 32), (1, 1, 80, 32))
    weights = rng.standard_normal((1, 4, 9)).astype(np.float32)
    indices = mfa_native.sparse_topk(index_q, index_k, weights, 16, device=device)
    expected_indices = reference.sparse_topk_reference(index_q, index_k, weights, 16)
    out = mfa_native.sparse_attention(q, k, v, indices, device=device)
    return [("indices", indices, expected_indices, 0),
            ("out", out, reference.sparse_attention_reference(q, k, v, expected_indices), 1)]


def _block_sparse(rng, device, dtype, d) -> Compared:
    q, k, v = _tensors(rng, dtype, (1, 2, 64, d), (1, 2, 64, d), (1, 2, 64, d))
    mask = mfa_native.BlockMask.from_mask(causal=True, R=64, C=64, block_size=16, device=device)
    out = mfa_native.block_sparse_attention(q, k, v, mask, device=device)
    return [("out", out, reference.attention_reference(q, k, v, causal=True), 1)]


def _merge(rng, device, dtype, d) -> Compared:
    q, k, v = _tensors(rng, dtype, (1, 2, 7, d), (1, 2, 50, d), (1, 2, 50, d))
    parts = [mfa_native.attention(q, k[:, :, s], v[:, :, s], return_lse=True, device=device)
             for s in (slice(0, 20), slice(20, 50))]
    merged = mfa_native.merge_attention([o.astype(np.float32) for o, _ in parts], [lse for _, lse in parts],
                                        device=device)[0]
    return [("out", merged, reference.attention_reference(q, k, v), 1)]


FAMILIES: dict[str, Callable] = {
    "forward": _forward, "backward": _backward, "decode split-KV": _split_kv, "decode packed GQA": _packed,
    "varlen": _varlen, "KV cache paged + append": _kvcache, "quantized K/V (q8_0)": _quantized, "int8": _int8,
    "sparse-indexed + indexer": _sparse, "block-sparse": _block_sparse, "merge": _merge,
}


@dataclass
class Row:
    family: str
    status: str = "ok"
    worst: float = 0.0
    detail: str = ""
    cases: int = 0


def _error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if actual.shape != expected.shape or not np.all(np.isfinite(actual)):
        return float("inf")
    if expected.dtype.kind in "iu" or actual.dtype.kind in "iu":
        return 0.0 if np.array_equal(actual, expected) else float("inf")
    norm = np.linalg.norm(expected)
    return float(np.linalg.norm(actual - expected) / norm) if norm else float(np.linalg.norm(actual))


def _case(row: Row, run: Callable, device: Device, cpu: Device | None, dtype: str, d: int, seed: int) -> None:
    where = f"{dtype} D{d}"
    try:
        compared = run(np.random.default_rng(seed), device, dtype, d)
        against_cpu = run(np.random.default_rng(seed), cpu, dtype, d) if cpu is not None else None
    except mfa_native.CompileError as error:
        row.status, row.detail = "compile error", f"{where}: " + " / ".join(str(error).splitlines()[:3])
        return
    except Exception as error:   # a diagnostic (DispatchError, ...) or a bug: named, never a crash
        row.status, row.detail = "error", f"{where}: {type(error).__name__}: {error}".splitlines()[0]
        return
    row.cases += 1
    for i, (what, actual, expected, factor) in enumerate(compared):
        bound = factor * TOLERANCE[dtype] if factor else 0.0
        errors = [_error(actual, expected)]
        if against_cpu is not None:
            errors.append(_error(actual, against_cpu[i][1]))
        error = max(errors)
        row.worst = max(row.worst, error if np.isfinite(error) else row.worst)
        if not error <= bound:
            if row.status == "ok":
                row.status = "wrong"
                row.detail = f"{where}: {what} relative L2 {error:.3g} (bound {bound:.3g})"


def run(device: Device | str | None = None, *, quick: bool = False, families=None,
        progress: Callable[[str], None] | None = None) -> tuple[dict[str, str], list[Row]]:
    """Every family (or those named) on `device`: the facts of the device and one Row per family;
    `progress(family)` is called as each family finishes."""
    device = resolve_device(device)
    cpu = resolve_device("cpu") if device.kind != "cpu" else None
    dtypes, dims = QUICK if quick else FULL
    rows = []
    for name in families or FAMILIES:
        row, function = Row(name), FAMILIES[name]
        for dtype in dtypes:
            for d in dims:
                if (quick and d == max(dims) and name not in DENSE) or (name == "int8" and d > INT8_MAX_HEAD_DIM):
                    continue
                _case(row, function, device, cpu, dtype, d, seed=len(rows) * 1000 + d)
        rows.append(row)
        if progress:
            progress(name)
    family = tuning_facts(device).family
    facts = {"device": f"{device.kind}: {device.name}", "family": tuned.parts(family)[0],
             "os": platform.platform(), "tuned table": tuned.source(family), "mfa_native": mfa_native.__version__}
    return facts, rows


def markdown(facts: dict[str, str], rows: list[Row]) -> str:
    lines = ["# mfa_native selftest", ""] + [f"- {k}: {v}" for k, v in facts.items()] + [
        "", "| family | status | cases | worst relative L2 | detail |", "|---|---|---|---|---|"]
    lines += [f"| {r.family} | {r.status} | {r.cases} | {r.worst:.2e} | {r.detail.replace('|', '/')} |" for r in rows]
    return "\n".join(lines) + "\n"


def table(rows: list[Row]) -> str:
    width = max(len(r.family) for r in rows)
    lines = [f"{'family':<{width}}  {'status':<13}  {'cases':>5}  {'worst rel L2':>12}  detail"]
    lines += [f"{r.family:<{width}}  {r.status:<13}  {r.cases:>5}  {r.worst:>12.2e}  {r.detail}" for r in rows]
    return "\n".join(lines)
