"""The child process of sanitize="address" (asan.py): runs one dispatch of the
ASan-built kernel described by <dir>/spec.json on the cpu device and writes the
writable buffers back. ASan's report goes to stderr; another error (the core's diagnostic)
to <dir>/error.txt, exit status 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from .. import _core
from .kernel import Kernel


def main(directory: Path) -> int:
    spec = json.loads((directory / "spec.json").read_text())
    kernel = Kernel(spec["source"], spec["name"], constants=dict(spec["constants"]), device="cpu",
                    bounds_check=spec["bounds_check"], sanitize="address")
    host, inline, arrays = [], [], []
    for buffer in spec["buffers"]:
        index, path = buffer["index"], directory / f"buffer{buffer['index']}.bin"
        if buffer.get("inline"):
            inline.append((index, path.read_bytes()))
        else:
            array = np.fromfile(path, np.uint8)
            arrays.append((path, array, buffer["writable"]))
            host.append((index, array.ctypes.data, array.nbytes, buffer["writable"]))
    batch = _core.CommandBatch(kernel.device)
    batch.dispatch(kernel.pipeline, tuple(spec["threadgroups"]), tuple(spec["threads_per_threadgroup"]),
                   host, inline, [], spec["threadgroup_memory"])
    batch.commit()
    batch.wait()
    for path, array, writable in arrays:
        if writable:
            array.tofile(path)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(Path(sys.argv[1])))
    except Exception as error:  # a diagnostic of the core (DispatchError, a bounds check...): the parent raises it
        (Path(sys.argv[1]) / "error.txt").write_text(f"{type(error).__name__}: {error}")
        sys.exit(2)
