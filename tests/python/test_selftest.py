"""`python -m mfa_native selftest`: every family passes on the cpu backend here, a family whose
kernel gives a wrong answer (or fails to compile) is named and the exit status says so, and
the Markdown report holds the device's facts and one row per family."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import mfa_native
from mfa_native import selftest
from mfa_native.__main__ import main


def test_quick_passes_on_the_cpu_backend_and_writes_the_report(tmp_path):
    report = tmp_path / "selftest.md"
    done = subprocess.run([sys.executable, "-m", "mfa_native", "selftest", "--quick", "--report", str(report)],
                          env=dict(os.environ, MFA_NATIVE_DEVICE="cpu"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith(f"selftest: all {len(selftest.FAMILIES)} families ok")
    text = report.read_text()
    for fact in ("device: cpu", "family: apple9", "os: ", "tuned table: "):
        assert f"- {fact}" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0][2:] for row in rows] == list(selftest.FAMILIES)
    assert all(" | ok | " in row for row in rows)


def test_a_wrong_family_is_named_and_fails_the_run(monkeypatch, capsys):
    merge = mfa_native.merge_attention

    def off_by_a_tenth(outputs, lses, **kwargs):
        out, lse = merge(outputs, lses, **kwargs)
        return out * np.float32(1.1), lse

    monkeypatch.setattr(mfa_native, "merge_attention", off_by_a_tenth)
    assert main(["selftest", "--quick", "--device", "cpu", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "selftest: 1 of 11 families failed: merge" in captured.err
    merge_row = [line for line in captured.out.splitlines() if line.startswith("merge ")][0]
    assert "wrong" in merge_row and "out relative L2" in merge_row


def test_a_compile_error_is_its_own_status_with_the_log(monkeypatch):
    def broken(*args, **kwargs):
        raise mfa_native.CompileError("kernel 'int8_attention_forward' failed to compile\nline 3: error: nope\nmore")

    monkeypatch.setattr(mfa_native, "int8_attention", broken)
    _, rows = selftest.run("cpu", quick=True, families=["int8", "forward"])
    assert [(r.family, r.status) for r in rows] == [("int8", "compile error"), ("forward", "ok")]
    assert rows[0].detail == "float16 D64: kernel 'int8_attention_forward' failed to compile / line 3: error: nope / more"
