"""Long commands show a progress bar with an ETA on a terminal and nothing else when standard
error is not one, or with --quiet: emit --report, bundle, tune --check (precompile's and
selftest's bars are the same `progress.bar`)."""

from __future__ import annotations

import json
import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

BAR = "%|"   # a drawn tqdm bar's percentage and left edge


def _stderr(arguments: list[str], terminal: bool, cwd) -> str:
    """What `python -m mfa_native ARGUMENTS` writes to standard error, a terminal or a pipe."""
    command = [sys.executable, "-m", "mfa_native", *arguments]
    if not terminal:
        return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd, check=True).stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # a pty starts 0 columns wide
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=follower, cwd=cwd)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:   # the terminal closed with the process
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert process.wait(timeout=600) == 0
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def _spec(tmp_path) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"families": [{"op": "attention", "head_dim": [32, 64], "dtype": ["float16"],
                                              "causal": ["lower_right"], "mask": ["none"]}]}))
    return str(path)


COMMANDS = {
    "emit --report": lambda tmp: ["emit", "attention", "--head-dim", "32", "--report"],
    "bundle": lambda tmp: ["bundle", "-o", str(tmp / "b.mfab"), "--spec", _spec(tmp)],
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_bar_on_a_terminal_and_none_on_a_pipe_or_with_quiet(name, tmp_path):
    arguments = COMMANDS[name](tmp_path)
    shown = _stderr(arguments, terminal=True, cwd=tmp_path)
    assert BAR in shown and "<" in shown, shown[-2000:]   # the bar, and its elapsed<remaining time
    assert BAR not in _stderr(arguments, terminal=False, cwd=tmp_path)
    assert BAR not in _stderr([*arguments, "--quiet"], terminal=True, cwd=tmp_path)
