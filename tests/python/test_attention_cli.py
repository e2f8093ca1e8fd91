"""`python -m mfa_native demo` and `bench attention` print what they promise."""

from __future__ import annotations

from mfa_native.__main__ import main


def test_demo_checks_a_causal_multi_head_attention(capsys):
    assert main(["demo", "--seq", "40", "--heads", "4", "--head-dim", "16"]) == 0
    out = capsys.readouterr().out
    assert "q (1, 4, 40, 16), k (1, 2, 40, 16)" in out and "causal" in out
    assert "relative L2 error vs float64 reference" in out and "(ok," in out
    assert "warm call" in out and " ms" in out


def test_bench_attention_prints_time_and_issued_against_useful_work(capsys):
    assert main(["bench", "attention", "--only", "decode", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "config" in line)
    for column in ("ms", "mma issued", "mma useful", "issued/useful"):
        assert column in header
    row = next(line for line in out.splitlines() if line.strip().startswith("decode") and "B1" in line)
    assert row.split()[-1] == "1.000"  # decode issues exactly the useful tiles
