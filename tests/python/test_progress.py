"""Long commands show a progress bar with an ETA on a terminal and nothing else when standard
error is not one, or with --quiet: emit --report, bundle, tune --check, every bench (precompile's
and selftest's bars are the same `progress.bar`); a bench prints each row of its table as soon as
it is measured."""

from __future__ import annotations

import json
import fcntl
import importlib
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from mfa_native.cli import bench

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
                                              "causal": ["lower_right"], "mask": ["none"], "window": [False]}]}))
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


BENCH = ["bench", "core", "--size", "40", "--repeats", "1"]   # its last two rows compile in new processes


def _bench(arguments: list[str], terminal: bool, cwd) -> tuple[list[str], float, str]:
    """`python -m mfa_native ARGUMENTS` with standard output on a pipe, read line by line as it
    comes, and standard error on a terminal or a pipe: (the output's lines, the seconds from its
    first row (its third line) to its end, standard error)."""
    command = [sys.executable, "-m", "mfa_native", *arguments]
    if terminal:
        leader, follower = pty.openpty()
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=follower if terminal else subprocess.PIPE,
                               cwd=cwd)
    chunks = []

    def read_stderr() -> None:
        while True:
            try:
                chunk = os.read(leader, 4096) if terminal else process.stderr.read1(4096)
            except OSError:   # the terminal closed with the process
                break
            if not chunk:
                break
            chunks.append(chunk)

    if terminal:
        os.close(follower)
    reader = threading.Thread(target=read_stderr)
    reader.start()
    lines, arrived = [], []
    for line in process.stdout:
        lines.append(line.decode().rstrip("\n"))
        arrived.append(time.monotonic())
    assert process.wait(timeout=600) == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    reader.join(timeout=60)
    if terminal:
        os.close(leader)
    return lines, arrived[-1] - arrived[min(2, len(arrived) - 1)], b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("where", ["terminal", "pipe", "terminal --quiet"])
def test_a_bench_prints_rows_as_it_measures_them_under_a_bar_only_on_a_terminal(where, tmp_path):
    lines, ahead, stderr = _bench(BENCH + (["--quiet"] if "quiet" in where else []), where.startswith("terminal"),
                                  tmp_path)
    assert ahead > 0.5, (ahead, lines)   # the first row came well before the last (a new process compiles)
    if where == "terminal":
        assert BAR in stderr and "<" in stderr and "bench core" in stderr, stderr[-2000:]
    else:
        assert BAR not in stderr, stderr[-2000:]
    # a table that was printed before its cells were known is still aligned: every line as wide
    # as the rule, with spaces where the rule has its gaps
    header, rule, *rows = lines
    gaps = [i for i, c in enumerate(rule) if c == " "]
    assert header.split()[0] == "what" and set(rule) == {"-", " "} and len(rows) == 4, lines
    for line in [header, *rows]:
        assert len(line) == len(rule) and all(line[i] == " " for i in gaps), lines


def test_every_bench_takes_quiet(capsys):
    for name in bench.names():
        module = importlib.import_module(f"mfa_native.bench.{name}")
        with pytest.raises(SystemExit):
            module.main(["--help"])
        assert "--quiet" in capsys.readouterr().out, name
