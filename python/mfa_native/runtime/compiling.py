"""Compiling a pass's kernels: the new ones in parallel, each slow first compile logged.

A pass of several kernels (a backward's dQ and dK/dV, a split-KV decode's partials and
combine) compiles them side by side on a small pool bounded by the cores; the core's caches
release the GIL while they compile and make a kernel asked for twice compile once. A first
compile that takes longer than SLOW_SECONDS is one line on the "mfa_native" logger (INFO):
which kernel, how long, and that `precompile` pays it ahead of time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from .devices import Device
from .passes import KernelLaunch
from .templates import KernelTemplate

SLOW_SECONDS = 1.0
LOG = logging.getLogger("mfa_native")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def workers() -> int:
    """Kernels compiled at once: one per core this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="mfa_native-compile")
        return _pool


def pipeline(device: Device, kernel: KernelLaunch | KernelTemplate):
    """The compiled pipeline of one kernel, a pass's or a template's (from the core's caches when
    it was built before)."""
    start = time.perf_counter()
    compiled = device.pipeline(device.library(kernel.source), kernel.entry, [])
    seconds = time.perf_counter() - start
    if seconds > SLOW_SECONDS:
        LOG.info("compiled kernel %r for %s in %.1f s (python -m mfa_native precompile compiles ahead of time)",
                 _title(kernel), device.name, seconds)
    return compiled


def pipelines(device: Device, kernels: Sequence[KernelLaunch]) -> list:
    """The pipelines of `kernels`, in order; several are compiled in parallel."""
    if len(kernels) < 2 or workers() < 2:
        return [pipeline(device, kernel) for kernel in kernels]
    futures = [_shared_pool().submit(pipeline, device, kernel) for kernel in kernels]
    return [future.result() for future in futures]


def _title(kernel: KernelLaunch | KernelTemplate) -> str:
    """The kernel's entry and its header's first facts line ("float16, D = 64, ..."), if any."""
    lines = kernel.source.splitlines()
    facts = lines[1].lstrip("/ ").strip() if len(lines) > 1 and lines[1].startswith("//") else ""
    return f"{kernel.entry} ({facts})" if facts else kernel.entry
