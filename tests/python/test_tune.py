"""The tuner: its candidate space (enumerated from the tables' row types and DOMAINS), every
candidate of its covering design checked against the float64 reference on the cpu backend,
and the tuned table: written, read back and used, ignored with MFA_NATIVE_TUNING=off, and a
damaged one ignored with a warning."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, fields, replace

import numpy as np
import pytest
from conftest import relative_l2

import mfa_native
from mfa_native import codegen
from mfa_native.__main__ import main
from mfa_native.codegen.kernel import tables, tuned
from mfa_native.reference import attention_reference
from mfa_native.tuning import candidates, sweep
from mfa_native.tuning.problems import TuningProblem

CPU = mfa_native.default_device()
FAMILY = CPU.tuning.family
# The operand-caching columns: every pair of their values must be checked.
CACHING = {"forward": ("cache_q", "stage_apart", "o_block"),
           "backward": ("cache_q", "cache_dout", "cache_k", "cache_v", "dq_block", "dk_block", "dv_block")}


@pytest.fixture
def tuning_dir(tmp_path, monkeypatch):
    """Tuned tables in a directory of the test's own (never the shared test cache)."""
    monkeypatch.setenv(tuned.ENV, str(tmp_path))
    tuned.forget()
    yield tmp_path
    monkeypatch.delenv(tuned.ENV)
    tuned.forget()


@pytest.fixture(scope="module")
def spaces():
    return {direction: sweep.check_space(direction, FAMILY, CPU) for direction in tables.DIRECTION_ROWS}


def test_candidates_come_from_the_row_type_and_its_domains():
    @dataclass(frozen=True)
    class Row:
        max_head_dim: int
        a: int
        b: bool

    tables.DOMAINS[Row] = {"a": (1, 2, 3), "b": (False, True)}
    try:
        assert candidates.columns(Row) == {"a": (1, 2, 3), "b": (False, True)}
        rows = [Row(max_head_dim=64, **design) for design in candidates.covering(candidates.columns(Row))]
    finally:
        del tables.DOMAINS[Row]
    assert len(set(rows)) == 6   # two columns: every pair is every row
    for row_type in tables.DIRECTION_ROWS.values():
        assert set(candidates.columns(row_type)) == {f.name for f in fields(row_type)} - {"max_head_dim"}


def test_the_covering_design_holds_every_pair(rng):
    factors = {f"f{i}": tuple(range(int(rng.integers(1, 5)))) for i in range(int(rng.integers(2, 7)))}
    designs = candidates.covering(factors)
    for a, b in itertools.combinations(factors, 2):
        assert {(d[a], d[b]) for d in designs} == set(itertools.product(factors[a], factors[b]))
    assert len(designs) < math.prod(len(v) for v in factors.values()) or len(factors) == 2


@pytest.mark.parametrize("direction", list(tables.DIRECTION_ROWS))
def test_the_checked_space_covers_every_value_dtype_head_dim_and_caching_pair(spaces, direction):
    space = spaces[direction]
    rows = [row for _, row in space]
    for column, domain in candidates.columns(tables.DIRECTION_ROWS[direction]).items():
        assert {getattr(row, column) for row in rows} == set(domain), column
    for a, b in itertools.combinations(CACHING[direction], 2):
        domains = candidates.columns(tables.DIRECTION_ROWS[direction])
        assert {(getattr(r, a), getattr(r, b)) for r in rows} == set(itertools.product(domains[a], domains[b]))
    problems = [problem for problem, _ in space]
    assert {p.dtype for p in problems} == {"float32", "float16", "bfloat16"}
    # The 16-bit columns meet every dtype both ways (p16: rounded P and dS, or float ones).
    for column in ("tiles16", "p16"):
        assert {(p.dtype, getattr(row, column)) for p, row in space} == \
            set(itertools.product(("float32", "float16", "bfloat16"), (True, False)))
    assert {(p.head_dim, p.value_dim) for p in problems} == set(sweep.CHECK_HEAD_DIMS)


def _check_every(space, rng):
    failed = [r for r in sweep.check(space, CPU, rng, report=lambda *a: None) if not r.outcome.passed]
    assert not failed, [(r.problem.describe(), r.row, r.outcome.error) for r in failed]


@pytest.mark.parametrize("direction", list(tables.DIRECTION_ROWS))
def test_every_candidate_matches_the_reference(spaces, direction, rng):
    """The whole covering design: 111 forward and 165 backward candidates (13 min here with a cold kernel cache on
    a shared 2-core machine)."""
    _check_every(spaces[direction], rng)


def _forward_threadgroups(rng, R=40):
    q = rng.standard_normal((1, 2, R, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 50, 32)).astype(np.float32) for _ in range(2))
    with mfa_native.profile() as profiled:
        out = mfa_native.attention(q, k, v)
    assert relative_l2(out, attention_reference(q, k, v)) < 1e-5
    return profiled.records[0].threadgroups


def _tuned_row():
    """A row for the first forward range that differs from the built-in one in its query rows."""
    built_in = tables.built_in_row("forward", FAMILY, "float32", 32)
    return replace(built_in, query_rows=8, key_block=16, cache_q=not built_in.cache_q, stage_apart=False, o_block=32)


def test_a_written_table_is_read_back_and_used(tuning_dir, rng):
    built_in_groups = _forward_threadgroups(rng)
    path = tuned.write(FAMILY, "test device", {"forward": {"float32": [_tuned_row()]}})
    assert path.parent == tuning_dir and tuned.source(FAMILY) == str(path)
    assert tables.tile_row(FAMILY, "float32", 32) == _tuned_row()
    # Keyed by dtype: the float16 row of the same head dimension is still the built-in one.
    assert tables.tile_row(FAMILY, "float16", 32) == tables.built_in_row("forward", FAMILY, "float16", 32)
    problem = codegen.AttentionProblem(1, 2, 2, 40, 50, 32, 32, dtype="float32")
    source = codegen.attention_pass(problem, family=FAMILY).kernels[0].source
    assert "O paged through threadgroup memory 32 features at a time" in source
    assert _forward_threadgroups(rng) == 2 * 5 != built_in_groups   # 40 rows, 8 per threadgroup, 2 heads


def test_tuning_off_ignores_the_table(tuning_dir, rng, monkeypatch):
    tuned.write(FAMILY, "test device", {"forward": {"float32": [_tuned_row()]}})
    monkeypatch.setenv(tuned.ENV, "off")
    tuned.forget()
    assert tuned.source(FAMILY) == "built-in"
    built_in = tables.built_in_row("forward", FAMILY, "float32", 32)
    assert tables.tile_row(FAMILY, "float32", 32) == built_in
    assert _forward_threadgroups(rng) == 2 * math.ceil(40 / built_in.query_rows)


@pytest.mark.parametrize("text", ["{not json",
                                  '{"format": 2, "family": "%s", "forward": {"float32": [{"query_rows": 8}]}}',
                                  '{"format": 2, "family": "%s", "forward": [{"query_rows": 8}]}',
                                  '{"format": 99, "family": "%s"}'])
def test_a_damaged_table_is_ignored_with_a_warning(tuning_dir, rng, text):
    (tuning_dir / f"{FAMILY}.json").write_text(text.replace("%s", FAMILY) if "%s" in text else text)
    with pytest.warns(UserWarning, match="damaged tuned table"):
        row = tables.tile_row(FAMILY, "float32", 32)
    assert row == tables.built_in_row("forward", FAMILY, "float32", 32)


def test_a_table_of_the_old_format_is_ignored_with_a_warning(tuning_dir):
    """Format 1 rows were per direction only; they are not guessed onto a dtype."""
    old = {"format": 1, "family": FAMILY, "device": "test device", "forward": [vars(_tuned_row())]}
    (tuning_dir / f"{FAMILY}.json").write_text(json.dumps(old))
    with pytest.warns(UserWarning, match="format 1 is older than 2.*not keyed by dtype"):
        row = tables.tile_row(FAMILY, "float32", 32)
    assert row == tables.built_in_row("forward", FAMILY, "float32", 32) != _tuned_row()


def test_tune_on_the_cpu_backend_refuses_to_time_and_writes_nothing(tuning_dir, capsys):
    assert main(["tune", "--device", "cpu"]) == 2
    assert "cpu time" in capsys.readouterr().err
    assert not list(tuning_dir.iterdir())


def test_info_shows_the_table_in_use(tuning_dir, capsys):
    main(["info"])
    assert "tile table: built-in" in capsys.readouterr().out
    path = tuned.write(FAMILY, "test device", {"forward": {"float32": [_tuned_row()]}})
    main(["info"])
    assert f"tile table: {path}" in capsys.readouterr().out


def test_the_timing_sweep_picks_a_checked_row_per_range_and_its_table_is_used(tuning_dir, rng):
    """sweep.tune on the cpu backend (the CLI refuses to write cpu times; the sweep is the same
    on Metal): one winner per (direction, dtype, range), written and then returned by the lookup."""
    chosen = [TuningProblem("forward", "float16", 16, 16, q_len=24, kv_len=24),
              TuningProblem("forward", "float32", 24, 20, q_len=24, kv_len=24)]
    winners = sweep.tune(chosen, CPU, rng, repeats=1, report=lambda *a: None)
    assert sorted(w.dtype for w in winners) == ["float16", "float32"]
    tuned.write(FAMILY, CPU.name, sweep.rows_by_direction(winners))
    for winner, problem in zip(sorted(winners, key=lambda w: w.dtype), chosen):
        assert winner.seconds > 0 and winner.built_in_seconds is not None
        assert winner.row.max_head_dim == tables.built_in_row("forward", FAMILY, winner.dtype, 24).max_head_dim
        assert tables.tile_row(FAMILY, winner.dtype, problem.head_dim) == winner.row
    assert "forward   float16  <= " in sweep.winners_table(winners)
