"""`bundle --metallib`: each kernel source of a bundle compiled to a Metal library, so an
app loads compiled code (newLibraryWithData) instead of compiling MSL at run time.

Only where the metal device exists (macOS with a Metal GPU and the Metal toolchain, `xcrun
metal`); elsewhere check_available() refuses, saying why. The payload's "metallibs" maps the
sha256 of a kernel's source to its library, base64 (the same key the C++ reader computes).
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def check_available() -> None:
    """RuntimeError unless this machine can compile Metal libraries for the metal device."""
    from ..runtime.devices import devices
    if sys.platform != "darwin" or not any(d.kind == "metal" for d in devices()):
        raise RuntimeError("--metallib compiles the kernels for the metal device, and this machine has none "
                           "(it needs macOS with a Metal GPU); write the bundle without --metallib: the C++ "
                           "side then compiles the MSL it holds")
    if shutil.which("xcrun") is None:
        raise RuntimeError("--metallib needs the Metal toolchain (xcrun metal, from Xcode)")


def source_key(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def compile_source(source: str, language_version: str = "3.1") -> bytes:
    """The .metallib of `source`, compiled as the C++ core compiles MSL at run time (its
    CompileOptions' default fast_math=false: `xcrun metal` defaults to fast math), so that
    the library a bundle stores is the one the core would have compiled (the core's caches
    hold it under the source's key)."""
    with tempfile.TemporaryDirectory() as folder:
        msl, air, lib = (Path(folder) / name for name in ("k.metal", "k.air", "k.metallib"))
        msl.write_text(source)
        subprocess.run(["xcrun", "-sdk", "macosx", "metal", f"-std=metal{language_version}", "-fno-fast-math", "-c",
                        str(msl), "-o", str(air)], check=True, capture_output=True)
        subprocess.run(["xcrun", "-sdk", "macosx", "metallib", str(air), "-o", str(lib)], check=True,
                       capture_output=True)
        return lib.read_bytes()


def compile_all(payload: dict) -> dict[str, str]:
    """sha256(source) -> base64 metallib, for every kernel source in the payload."""
    libraries = {}
    for record in payload["entries"]:
        for template in record["forward"] + record["backward"]:
            for kernel in template["kernels"]:
                key = source_key(kernel["source"])
                if key not in libraries:
                    libraries[key] = base64.b64encode(compile_source(kernel["source"])).decode()
    return libraries
