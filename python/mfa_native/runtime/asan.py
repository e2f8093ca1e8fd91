"""sanitize="address": a Kernel built with AddressSanitizer runs in a child process.

The parent never loads the ASan build (it needs the ASan runtime loaded first):
each call writes the kernel, its launch and its buffers to a temporary
directory, runs `python -m mfa_native.runtime.asan_child <dir>` with the
compiler's ASan runtime preloaded, and copies the writable buffers back.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import _core

CHILD_MARKER = "MFA_NATIVE_ASAN_CHILD"  # set in the child: it runs the kernel in process
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=0:halt_on_error=1:symbolize=1:detect_stack_use_after_return=0"


def in_child() -> bool:
    return os.environ.get(CHILD_MARKER) == "1"


def _library(compiler: str, name: str) -> str | None:
    found = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True,
                           check=False).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


@functools.lru_cache(maxsize=None)
def asan_runtime(compiler: str) -> str:
    """The ASan runtime library of `compiler` (g++ or clang++) and the C++ runtime, for LD_PRELOAD:
    ASan finds the real __cxa_throw at start-up only if libstdc++ is loaded by then (python does
    not link it), else the first exception the child throws (a DispatchError) aborts it."""
    for name in ("libasan.so", f"libclang_rt.asan-{platform.machine()}.so"):
        runtime = _library(compiler, name)
        if runtime:
            return " ".join(filter(None, [runtime, _library(compiler, "libstdc++.so.6")]))
    raise RuntimeError(f"sanitize='address' needs the AddressSanitizer runtime of {compiler}, "
                       f"which `{compiler} -print-file-name=libasan.so` does not find")


def _report(stderr: str) -> str:
    """ASan's report when there is one (its ==pid==ERROR line to its SUMMARY line), else all of stderr."""
    start = stderr.find("AddressSanitizer")
    if start < 0:
        return stderr
    end = stderr.find("\n", stderr.find("SUMMARY: AddressSanitizer", start))
    report = stderr[stderr.rfind("\n", 0, start) + 1:end if end >= 0 else len(stderr)]
    if "use-after-poison" in report:
        report += "\n(use-after-poison: past the end of a kernel-scope threadgroup variable, into its redzone)"
    return report


def run_in_child(device, source: str, name: str, constants: list, bounds_check: bool,
                 arrays: Sequence[tuple[int, np.ndarray]], inline: Sequence[tuple[int, bytes]],
                 grid: tuple[int, int, int], group: tuple[int, int, int], memory: list[int]) -> None:
    """Runs one dispatch of the ASan build in a child; raises DispatchError with its report."""
    compiler = device.properties["compiler"].split(" (")[0]
    env = {k: v for k, v in os.environ.items() if k != "MFA_NATIVE_SANITIZE"}
    env[CHILD_MARKER] = "1"
    env["LD_PRELOAD"] = " ".join(filter(None, [asan_runtime(compiler), env.get("LD_PRELOAD")]))
    env["ASAN_OPTIONS"] = ASAN_OPTIONS
    with tempfile.TemporaryDirectory(prefix="mfa_asan_") as tmp:
        directory = Path(tmp)
        buffers = []
        for index, array in arrays:
            array.tofile(directory / f"buffer{index}.bin")
            buffers.append({"index": index, "writable": bool(array.flags.writeable)})
        for index, data in inline:
            (directory / f"buffer{index}.bin").write_bytes(data)
            buffers.append({"index": index, "inline": True})
        spec = {"source": source, "name": name, "constants": constants, "bounds_check": bounds_check,
                "threadgroups": grid, "threads_per_threadgroup": group, "threadgroup_memory": memory,
                "buffers": buffers}
        (directory / "spec.json").write_text(json.dumps(spec))
        result = subprocess.run([sys.executable, "-m", "mfa_native.runtime.asan_child", tmp], env=env,
                                capture_output=True, text=True, check=False)
        diagnostic = directory / "error.txt"
        if result.returncode == 2 and diagnostic.exists():   # the core's own diagnostic, as in process
            raise _core.DispatchError(diagnostic.read_text().removeprefix("DispatchError: "))
        if result.returncode != 0:
            raise _core.DispatchError(f"kernel '{name}' under sanitize='address' (child process exit "
                                      f"{result.returncode}):\n{_report(result.stderr)}")
        for index, array in arrays:
            if array.flags.writeable:
                array.reshape(-1).view(np.uint8)[:] = np.fromfile(directory / f"buffer{index}.bin", np.uint8)
