"""Compiling kernels ahead of time: `mfa_native.precompile(work)` and `python -m mfa_native
precompile FILE`, so an application or a CI job pays the compile once, before its first call.

`work` is one of:

- a bundle spec (``{"families": [...]}``, the format of `python -m mfa_native bundle`): the
  kernels of every template of that bundle, what a C++ program running it compiles;
- a list of calls (or ``{"calls": [...]}``): each a dict ``{"op": "attention", "q": ..., ...}``
  with the op's arguments by name. An array argument is a numpy array, a list of numbers, or
  ``{"shape": [...], "dtype": "float16"}`` (zeros of that shape; add ``"format": "q8_0"`` for a
  QuantizedTensor of them). Kernels depend on shapes, strides, dtypes and options, not on
  contents, so the same calls later with real arrays of those shapes compile nothing.

On the cpu backend the kernels land in the disk cache (MFA_NATIVE_CACHE_DIR), so later
processes load them; any device also keeps them for the rest of this process.
"""

from __future__ import annotations

import inspect
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .ops.declaration import OPS, Op
from .progress import bar
from .runtime import compiling
from .runtime.arrays import DTYPES
from .runtime.devices import Device, resolve_device
from .runtime.templates import KernelTemplate

__all__ = ["Precompiled", "precompile"]


@dataclass(frozen=True)
class Precompiled:
    """What `precompile` did: `items` calls prepared or template kernels compiled, `compiled`
    of the kernels actually compiled (the cpu backend's count; 0 where all were cached or the
    device does not count them), in `seconds`.

    Example:
        ```python
        import mfa_native

        q = {"shape": [1, 2, 16, 32], "dtype": "float32"}   # zeros of that shape
        done = mfa_native.precompile([{"op": "attention", "q": q, "k": q, "v": q}], device="cpu", quiet=True)
        print(done)   # Precompiled(items=1, compiled=..., seconds=...)
        assert done.items == 1 and done.compiled >= 0 and done.seconds >= 0
        ```
    """

    items: int
    compiled: int
    seconds: float


def precompile(work: dict | list, *, device: Device | str | None = None, quiet: bool = False) -> Precompiled:
    """Compiles the kernels of `work` ahead of time, several at once, so that the calls it lists
    (or a bundle's templates) compile nothing later.

    A call's kernels depend on its arrays' shapes, strides and dtypes and on its options, not
    on the arrays' contents: a later call of the same form with real arrays is warm in this
    process, and on the cpu backend later processes load the kernels from the disk cache
    (MFA_NATIVE_CACHE_DIR).

    Args:
        work: a list of calls (or {"calls": [...]}), each a dict {"op": "attention", "q": ...,
            ...} with the op's arguments by name; an array argument is a numpy array, a list of
            numbers, or {"shape": [...], "dtype": "float16"} (zeros of that shape; add
            "format": "q8_0" for a QuantizedTensor of them). Or a bundle spec
            {"families": [...]} (the format of `python -m mfa_native bundle`): the kernels of
            every template of that bundle.
        device: a Device, "cpu", "metal" or None for the default device.
        quiet: no progress bar (there is one on a terminal otherwise).

    Returns:
        A Precompiled: the items prepared, the kernels compiled, the seconds taken.

    Raises:
        ValueError: work is neither form, a call is not a dict naming a known op, an argument
            form is wrong (before anything compiles); a spec key that is wrong.
        TypeError: a call its op refuses with a TypeError (the op's error, prefixed with the
            call's index); ValueError likewise.

    Example:
        ```python
        import numpy as np
        import mfa_native

        q = {"shape": [1, 2, 16, 32], "dtype": "float32"}
        mfa_native.precompile([{"op": "attention", "q": q, "k": q, "v": q, "causal": True}], device="cpu",
                              quiet=True)
        x = np.random.default_rng(0).standard_normal((1, 2, 16, 32), dtype=np.float32)
        with mfa_native.profile() as p:   # this call's kernel was compiled above: it just runs
            mfa_native.attention(x, x, x, causal=True, device="cpu")
        print(p.records[0].kernel)
        ```
    """
    device = resolve_device(device)
    if isinstance(work, dict) and "families" in work:
        jobs = _template_jobs(work, device)
        unit = "kernel"
    else:
        calls = work.get("calls") if isinstance(work, dict) else work
        if not isinstance(calls, list):
            raise ValueError('precompile takes a bundle spec {"families": [...]}, a list of calls, or {"calls": [...]}')
        jobs = [_call_job(call, i, device) for i, call in enumerate(calls)]
        unit = "call"
    before, start = _compiled(device), time.perf_counter()
    with bar(len(jobs), "precompile", unit=unit, quiet=quiet) as progress, \
            ThreadPoolExecutor(max_workers=compiling.workers(), thread_name_prefix="mfa_native-precompile") as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()
            progress.update()
    return Precompiled(len(jobs), _compiled(device) - before, time.perf_counter() - start)


def _compiled(device: Device) -> int:
    return int(device.properties.get("kernels_compiled", 0))


def _template_jobs(spec: dict, device: Device) -> list:
    """One job per kernel of the spec's bundle templates (each distinct kernel once)."""
    from .bundle import entries_of
    from .bundle.writer import backward_templates, forward_templates
    kernels = {}
    for facts in entries_of(spec):
        templates = forward_templates(facts) + (backward_templates(facts) if facts.backward else [])
        for template in templates:
            for kernel in template["kernels"]:
                kernels[(kernel["source"], kernel["entry"])] = KernelTemplate(**kernel)
    return [lambda kernel=kernel: compiling.pipeline(device, kernel) for kernel in kernels.values()]


def _call_job(call: Any, index: int, device: Device):
    """The job preparing one call, its arguments checked and bound now."""
    where = f"calls[{index}]"
    if not isinstance(call, dict) or call.get("op") not in OPS:
        raise ValueError(f"{where} must be a dict whose 'op' is one of {sorted(OPS)}, got {call!r}")
    op = OPS[call["op"]]
    arguments = {name: _value(op, name, value, device) for name, value in call.items() if name != "op"}
    try:
        bound = inspect.signature(op.function).bind(**arguments)
    except TypeError as error:
        raise ValueError(f"{where} ({op.name}): {error}") from None
    bound.apply_defaults()
    values = dict(bound.arguments, device=device)

    def job() -> None:
        try:
            op.precompile(values)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{where} ({op.name}): {error}") from error
    return job


def _value(op: Op, name: str, value: Any, device: Device) -> Any:
    """An argument as the op takes it: the array forms of the module docstring made arrays."""
    kinds = {a.name: a.kind for a in op.arguments}
    if kinds.get(name) == "arrays" and isinstance(value, (list, tuple)):
        return [_array(item, name, device) for item in value]
    return _array(value, name, device) if kinds.get(name) == "array" else value


def _array(value: Any, name: str, device: Device) -> Any:
    if isinstance(value, dict):
        if "shape" not in value:
            raise ValueError(f"{name}: an array is given as {{'shape': [...], 'dtype': ...}}, got {value!r}")
        dtype = value.get("dtype", "float32")
        if dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
        array = np.zeros(tuple(value["shape"]), dtype=DTYPES[dtype])
        if "format" not in value:
            return array
        from .ops.quantize import quantize
        return quantize(array, value["format"], device=device)
    if isinstance(value, list):
        return np.asarray(value, dtype=np.int32 if all(isinstance(v, int) for v in _flat(value)) else np.float32)
    return value


def _flat(values: Iterable) -> Iterable:
    for v in values:
        yield from _flat(v) if isinstance(v, list) else (v,)


def read_work(text: str) -> dict | list:
    """A precompile file's JSON (a bundle spec, a list of calls, or {"calls": [...]})."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON: {error}") from None
