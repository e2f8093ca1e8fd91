"""precompile: a spec's or a list of calls' kernels compiled ahead of time, so the same calls
after it compile nothing (the cpu backend's compile counter says so, in a child process with a
fresh kernel cache); its errors; the progress bar only on a terminal; the slow-compile log line."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mfa_native
from mfa_native import progress
from mfa_native.runtime import compiling

SPEC = {"families": [{"op": "attention", "dtype": ["float32"], "head_dim": [16], "causal": ["none"],
                      "mask": ["none"], "window": [False], "sinks": [False], "layout": ["bhsd"], "family": ["apple9"]}]}
CALLS = [
    {"op": "attention", "q": {"shape": [1, 2, 24, 16], "dtype": "float16"},
     "k": {"shape": [1, 2, 40, 16], "dtype": "float16"}, "v": {"shape": [1, 2, 40, 16], "dtype": "float16"},
     "causal": True, "return_lse": True},
    {"op": "attention_backward", "q": {"shape": [1, 2, 24, 16]}, "k": {"shape": [1, 2, 40, 16]},
     "v": {"shape": [1, 2, 40, 16]}, "o": {"shape": [1, 2, 24, 16]}, "lse": {"shape": [1, 2, 24]},
     "do": {"shape": [1, 2, 24, 16]}},
    {"op": "attention", "q": {"shape": [1, 4, 1, 32]}, "k": {"shape": [1, 2, 64, 32], "format": "q8_0"},
     "v": {"shape": [1, 2, 64, 32], "format": "q8_0"}},
]


def _child(script: str, tmp_path) -> dict:
    """Runs `script` in a fresh interpreter on the cpu backend with an empty kernel cache; its
    last line of output is JSON."""
    env = dict(os.environ, MFA_NATIVE_CACHE_DIR=str(tmp_path / "cache"), MFA_NATIVE_DEVICE="cpu")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_calls_after_precompiling_them_compile_nothing(tmp_path):
    result = _child(f"""
        import json
        import numpy as np
        import mfa_native
        from mfa_native.reference import attention_reference
        device = mfa_native.default_device()
        compiled = lambda: int(device.properties["kernels_compiled"])
        done = mfa_native.precompile({CALLS!r}, quiet=True)
        after_precompile = compiled()
        rng = np.random.default_rng(7)
        def x(*shape, dtype=np.float32):
            return rng.standard_normal(shape).astype(dtype)
        q, k, v = x(1, 2, 24, 16, dtype=np.float16), x(1, 2, 40, 16, dtype=np.float16), x(1, 2, 40, 16, dtype=np.float16)
        out, lse = mfa_native.attention(q, k, v, causal=True, return_lse=True)
        error = float(np.linalg.norm(out.astype(np.float64) - attention_reference(q, k, v, causal="lower_right"))
                      / np.linalg.norm(attention_reference(q, k, v, causal="lower_right")))
        q32, k32, v32 = x(1, 2, 24, 16), x(1, 2, 40, 16), x(1, 2, 40, 16)
        o, l = mfa_native.attention(q32, k32, v32, return_lse=True)   # its own kernel: not in the calls
        before_backward = compiled()
        mfa_native.attention_backward(q32, k32, v32, o, l, x(1, 2, 24, 16))
        kq, vq = (mfa_native.quantize(x(1, 2, 64, 32), "q8_0") for _ in range(2))
        mfa_native.attention(x(1, 4, 1, 32), kq, vq)
        print(json.dumps({{"items": done.items, "precompiled": done.compiled, "after_precompile": after_precompile,
                          "new": compiled() - before_backward, "error": error}}))
    """, tmp_path)
    assert result["items"] == len(CALLS)
    assert result["precompiled"] >= 4 and result["after_precompile"] >= result["precompiled"]
    assert result["new"] == 0, result
    assert result["error"] < 2e-3


def test_a_bundle_run_after_precompiling_its_spec_compiles_nothing(tmp_path):
    result = _child(f"""
        import json
        import numpy as np
        import mfa_native
        from mfa_native import _core
        from mfa_native.bundle.file import pack
        from mfa_native.bundle import build_payload, entries_of
        from mfa_native.reference import attention_reference
        device = mfa_native.default_device()
        compiled = lambda: int(device.properties["kernels_compiled"])
        done = mfa_native.precompile({SPEC!r}, quiet=True)
        before = compiled()
        bundle = _core._Bundle.from_bytes(pack(build_payload(entries_of({SPEC!r}))))
        view = lambda a: (a.ctypes.data, a.dtype.name, list(a.shape), [s // a.itemsize for s in a.strides])
        rng = np.random.default_rng(3)
        errors = []
        for r, c in ((1, 33), (20, 20), (70, 9)):
            q, k, v = (rng.standard_normal((1, 2, n, 16)).astype(np.float32) for n in (r, c, c))
            out = np.full((1, 2, r, 16), np.nan, np.float32)
            _core._bundle_attention("cpu", bundle, view(q), view(k), view(v), view(out))
            ref = attention_reference(q, k, v)
            errors.append(float(np.linalg.norm(out - ref) / np.linalg.norm(ref)))
        print(json.dumps({{"items": done.items, "precompiled": done.compiled, "new": compiled() - before,
                          "error": max(errors)}}))
    """, tmp_path)
    assert result["precompiled"] == result["items"] > 0
    assert result["new"] == 0, result
    assert result["error"] < 1e-5


@pytest.mark.parametrize("work, message", [
    ([{"op": "no_such_op"}], r"calls\[0\] must be a dict whose 'op' is one of"),
    ([{"op": "attention", "q": {"shape": [1, 1, 8, 16]}}], r"calls\[0\] \(attention\): missing a required argument"),
    ([{"op": "attention", "q": {"shape": [1, 1, 8, 16], "dtype": "float64"}, "k": [[1.0]], "v": [[1.0]]}],
     "dtype 'float64' is not one of"),
    ({"families": [{"op": "attention"}]}, "'head_dim' is required"),
    ("attention", "a list of calls"),
])
def test_bad_work_raises_a_value_error_naming_what(work, message):
    with pytest.raises(ValueError, match=message):
        mfa_native.precompile(work, quiet=True)


def test_a_call_the_op_refuses_names_the_call():
    call = {"op": "attention", "q": {"shape": [1, 1, 8, 16]}, "k": {"shape": [1, 1, 8, 32]},
            "v": {"shape": [1, 1, 8, 16]}}
    with pytest.raises(ValueError, match=r"calls\[1\] \(attention\): .*k"):
        mfa_native.precompile([CALLS[0], call], quiet=True)


def test_the_cli_prints_a_summary_and_no_bar_when_not_a_terminal(tmp_path):
    work = tmp_path / "calls.json"
    work.write_text(json.dumps(CALLS[:1]))
    env = dict(os.environ, MFA_NATIVE_DEVICE="cpu")
    done = subprocess.run([sys.executable, "-m", "mfa_native", "precompile", str(work)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("precompile: 1 items, ") and done.stderr == ""
    quiet = subprocess.run([sys.executable, "-m", "mfa_native", "precompile", "--quiet", str(work)], env=env,
                           capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and quiet.stdout == quiet.stderr == ""
    bad = subprocess.run([sys.executable, "-m", "mfa_native", "precompile", "-"], input="{not json", env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "precompile: not JSON" in bad.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_shows_on_a_terminal_unless_quiet(monkeypatch):
    for quiet, shown in ((False, True), (True, False)):
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        with progress.bar(3, "precompile", unit="call", quiet=quiet) as bar:
            bar.update(3)
        assert ("precompile" in terminal.getvalue()) == shown
    not_a_terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", not_a_terminal)
    with progress.bar(3, "precompile", unit="call") as bar:
        bar.update(3)
    assert not_a_terminal.getvalue() == ""


def test_a_slow_first_compile_is_one_log_line_never_a_print(monkeypatch, caplog, capsys, rng):
    monkeypatch.setattr(compiling, "SLOW_SECONDS", -1.0)   # every compile counts as slow
    q = rng.standard_normal((1, 1, 8, 24)).astype(np.float32)
    with caplog.at_level(logging.INFO, logger="mfa_native"):
        mfa_native.attention(q, q, q, scale=0.3125)
    lines = [r.getMessage() for r in caplog.records if r.name == "mfa_native"]
    assert len(lines) == 1 and lines[0].startswith("compiled kernel 'attention_forward (float32, D = 24")
    assert capsys.readouterr() == ("", "")
