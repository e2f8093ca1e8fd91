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


def test_bench_attention_scores_shows_what_each_transform_reads(capsys):
    """softcap reads nothing more than no transform; ALiBi reads its slopes once per thread and
    head, and nothing else more; the issued work is the same for every transform."""
    assert main(["bench", "attention", "--scores", "--only", "decode 1 head", "--repeat", "1"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        for name in ("none", "softcap 30", "ALiBi", "softcap + ALiBi"):
            if f"  {name}  " in line:
                rows[name] = line.split()[-3:]   # mma issued, bytes read, the transforms' bytes
    assert set(rows) == {"none", "softcap 30", "ALiBi", "softcap + ALiBi"}
    assert len({row[0] for row in rows.values()}) == 1
    assert rows["softcap 30"][1:] == rows["none"][1:] and rows["none"][2] == "0"
    slopes = int(rows["ALiBi"][2])
    assert 0 < slopes <= 4 * 32 * 64 and int(rows["ALiBi"][1]) == int(rows["none"][1]) + slopes
    assert rows["softcap + ALiBi"][1:] == rows["ALiBi"][1:]
