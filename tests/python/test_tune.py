"""The tuner: its candidate space (enumerated from the tables' row types and DOMAINS), every
candidate of its covering design checked against the float64 reference on the cpu backend,
each kernel timed on its own and its columns chosen by its own time, and the per-device
tuned table: written, read back and used by that device only, ignored with
MFA_NATIVE_TUNING=off, and a damaged one ignored with a warning."""

from __future__ import annotations

import itertools
import json
import math
import warnings
from dataclasses import dataclass, fields, replace
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import relative_l2

import mfa_native
from mfa_native import codegen
from mfa_native.__main__ import main
from mfa_native.codegen.kernel import tables, tuned
from mfa_native.reference import attention_reference
from mfa_native.runtime.devices import forget_tuning, tuning_facts
from mfa_native.tuning import candidates, kernels, sweep
from mfa_native.tuning.problems import TuningProblem

CPU = mfa_native.default_device()
FAMILY = CPU.tuning.family                # the GPU family, "apple9": its built-in rows only
DEVICE_FAMILY = tuning_facts(CPU).family  # the family carrying the cpu device's tuned table
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


@pytest.mark.exhaustive
@pytest.mark.parametrize("direction", list(tables.DIRECTION_ROWS))
def test_every_candidate_matches_the_reference(spaces, direction, rng):
    """The whole covering design (every pair of values): 121 forward and 186 backward candidates, about
    300 kernels (11 min with a cold kernel cache on 2 cores); .ci/run runs it in its opt-in step."""
    _check_every(spaces[direction], rng)


@pytest.mark.parametrize("direction", list(tables.DIRECTION_ROWS))
def test_candidates_with_every_value_dtype_and_head_dim_match_the_reference(spaces, direction, rng):
    """The default run's sample of the design: every column value, dtype and (D, Dv) pair at least once."""
    _check_every(sweep.each_value(spaces[direction]), rng)


@pytest.mark.parametrize("direction", list(tables.DIRECTION_ROWS))
def test_the_sample_holds_every_value_dtype_and_head_dim_of_the_space(spaces, direction):
    space, sample = spaces[direction], sweep.each_value(spaces[direction])
    assert set(sample) <= set(space) and len(sample) < len(space) / 4
    rows = [row for _, row in sample]
    for column, domain in candidates.columns(tables.DIRECTION_ROWS[direction]).items():
        assert {getattr(row, column) for row in rows} == set(domain), column
    assert {p.dtype for p, _ in sample} == {"float32", "float16", "bfloat16"}
    assert {(p.head_dim, p.value_dim) for p, _ in sample} == set(sweep.CHECK_HEAD_DIMS)


def _forward_threadgroups(rng, R=40):
    q = rng.standard_normal((1, 2, R, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 50, 32)).astype(np.float32) for _ in range(2))
    with mfa_native.profile() as profiled:
        out = mfa_native.attention(q, k, v)
    assert relative_l2(out, attention_reference(q, k, v)) < 1e-5
    return profiled.records[0].threadgroups


def _tuned_row(query_rows: int = 8):
    """A row for the first forward range that differs from the built-in one in its query rows."""
    built_in = tables.built_in_row("forward", FAMILY, "float32", 32)
    return replace(built_in, query_rows=query_rows, key_block=16, cache_q=not built_in.cache_q, stage_apart=False,
                   o_block=32)


def test_a_written_table_is_read_back_and_used_by_its_device_only(tuning_dir, rng):
    built_in_groups = _forward_threadgroups(rng)
    path = tuned.write(DEVICE_FAMILY, CPU.name, {"forward": {"float32": [_tuned_row()]}})
    assert path == tuning_dir / "cpu.json" and tuned.source(DEVICE_FAMILY) == "tuned"
    assert json.loads(path.read_text())["family"] == FAMILY
    assert tables.tile_row(DEVICE_FAMILY, "float32", 32) == _tuned_row()
    built_in = tables.built_in_row("forward", FAMILY, "float32", 32)
    assert tables.tile_row(FAMILY, "float32", 32) == built_in   # no device, no table
    # Keyed by dtype: the float16 row of the same head dimension is still the built-in one.
    assert tables.tile_row(DEVICE_FAMILY, "float16", 32) == tables.built_in_row("forward", FAMILY, "float16", 32)
    problem = codegen.AttentionProblem(1, 2, 2, 40, 50, 32, 32, dtype="float32")
    source = codegen.attention_pass(problem, family=DEVICE_FAMILY).kernels[0].source
    assert "O paged through threadgroup memory 32 features at a time" in source
    assert _forward_threadgroups(rng) == 2 * 5 != built_in_groups   # 40 rows, 8 per threadgroup, 2 heads


class _FakeDevice:
    """What tuning_facts reads of a device: its backend's tuning facts."""

    def __init__(self, model: str) -> None:
        self.tuning = SimpleNamespace(family=FAMILY, parallel_threadgroups=40, model=model, tensor_ops=False)


def test_two_devices_of_one_family_keep_tables_of_their_own(tuning_dir):
    pro, max_ = _FakeDevice("Apple M3 Pro, 18 GPU cores"), _FakeDevice("Apple M3 Max, 40 GPU cores")
    try:
        pro_family, max_family = tuning_facts(pro).family, tuning_facts(max_).family
    finally:
        forget_tuning()
    assert tuned.table_path(pro_family) == tuning_dir / "Apple-M3-Pro-18-GPU-cores.json"
    assert tuned.table_path(max_family) == tuning_dir / "Apple-M3-Max-40-GPU-cores.json"
    tuned.write(pro_family, "Apple M3 Pro", {"forward": {"float32": [_tuned_row(8)]}})
    assert tables.tile_row(pro_family, "float32", 32) == _tuned_row(8)
    assert tables.tile_row(max_family, "float32", 32) == tables.built_in_row("forward", FAMILY, "float32", 32)
    assert tuned.source(max_family) == "built-in" and "not written yet" in tuned.location(max_family)
    tuned.write(max_family, "Apple M3 Max", {"forward": {"float32": [_tuned_row(32)]}})
    assert (tables.tile_row(pro_family, "float32", 32), tables.tile_row(max_family, "float32", 32)) == (_tuned_row(8), _tuned_row(32))
    assert tables.native_bfloat(pro_family) == tables.native_bfloat(FAMILY)   # the family's facts stay its own


def test_a_model_without_letters_or_digits_is_refused():
    with pytest.raises(ValueError, match="model must name a device"):
        tuned.device_family(FAMILY, " ,;")


def test_tuning_off_ignores_the_table(tuning_dir, rng, monkeypatch):
    tuned.write(DEVICE_FAMILY, CPU.name, {"forward": {"float32": [_tuned_row()]}})
    monkeypatch.setenv(tuned.ENV, "off")
    tuned.forget()
    assert tuned.source(DEVICE_FAMILY) == "built-in"
    assert tuned.location(DEVICE_FAMILY) == "none (MFA_NATIVE_TUNING=off)"
    built_in = tables.built_in_row("forward", FAMILY, "float32", 32)
    assert tables.tile_row(DEVICE_FAMILY, "float32", 32) == built_in
    assert _forward_threadgroups(rng) == 2 * math.ceil(40 / built_in.query_rows)
    with pytest.raises(ValueError, match="MFA_NATIVE_TUNING=off"):
        tuned.write(DEVICE_FAMILY, CPU.name, {"forward": {"float32": [_tuned_row()]}})


@pytest.mark.parametrize("text", ["{not json",
                                  '{"format": 2, "family": "%s", "forward": {"float32": [{"query_rows": 8}]}}',
                                  '{"format": 2, "family": "%s", "forward": [{"query_rows": 8}]}',
                                  '{"format": 99, "family": "%s"}', '{"format": 2, "family": "apple7"}'])
def test_a_damaged_table_is_ignored_with_a_warning(tuning_dir, rng, text):
    (tuning_dir / "cpu.json").write_text(text.replace("%s", FAMILY))
    with pytest.warns(UserWarning, match="damaged tuned table"):
        row = tables.tile_row(DEVICE_FAMILY, "float32", 32)
    assert row == tables.built_in_row("forward", FAMILY, "float32", 32)
    assert "damaged, ignored" in tuned.location(DEVICE_FAMILY)


def test_a_per_family_table_of_earlier_versions_is_not_read_and_not_warned_about(tuning_dir, rng):
    tuned.write(DEVICE_FAMILY, CPU.name, {"forward": {"float32": [_tuned_row()]}})
    (tuning_dir / "cpu.json").rename(tuning_dir / f"{FAMILY}.json")
    tuned.forget()
    built_in = tables.built_in_row("forward", FAMILY, "float32", 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tables.tile_row(DEVICE_FAMILY, "float32", 32) == built_in
        assert tables.tile_row(FAMILY, "float32", 32) == built_in


def test_a_table_of_the_old_format_is_ignored_with_a_warning(tuning_dir):
    """Format 1 rows were per direction only; they are not guessed onto a dtype."""
    old = {"format": 1, "family": FAMILY, "device": CPU.name, "forward": [vars(_tuned_row())]}
    (tuning_dir / "cpu.json").write_text(json.dumps(old))
    with pytest.warns(UserWarning, match="format 1 is older than 2.*not keyed by dtype"):
        row = tables.tile_row(DEVICE_FAMILY, "float32", 32)
    assert row == tables.built_in_row("forward", FAMILY, "float32", 32) != _tuned_row()


def test_tune_on_the_cpu_backend_refuses_to_time_and_writes_nothing(tuning_dir, capsys):
    assert main(["tune", "--device", "cpu"]) == 2
    assert "cpu time" in capsys.readouterr().err
    assert not list(tuning_dir.iterdir())


def test_info_shows_the_devices_table_and_whether_it_exists(tuning_dir, capsys):
    main(["info"])
    out = capsys.readouterr().out
    assert "tile table: built-in" in out
    assert f"tuned table: {tuning_dir / 'cpu.json'} (not written yet; MFA_NATIVE_TUNING={tuning_dir})" in out
    path = tuned.write(DEVICE_FAMILY, CPU.name, {"forward": {"float32": [_tuned_row()]}})
    main(["info"])
    out = capsys.readouterr().out
    assert "tile table: tuned" in out and f"tuned table: {path} (in use;" in out


def test_the_timing_sweep_picks_a_checked_row_per_range_and_its_table_is_used(tuning_dir, rng):
    """sweep.tune on the cpu backend (the CLI refuses to write cpu times; the sweep is the same
    on Metal): one winner per (direction, dtype, range), written and then returned by the lookup."""
    chosen = [TuningProblem("forward", "float16", 16, 16, q_len=24, kv_len=24),
              TuningProblem("forward", "float32", 24, 20, q_len=24, kv_len=24)]
    winners = sweep.tune(chosen, CPU, rng, repeats=1, report=lambda *a: None)
    assert sorted(w.dtype for w in winners) == ["float16", "float32"]
    tuned.write(DEVICE_FAMILY, CPU.name, sweep.rows_by_direction(winners))
    for winner, problem in zip(sorted(winners, key=lambda w: w.dtype), chosen):
        assert set(winner.seconds) == {"forward"} and winner.seconds["forward"] > 0
        assert winner.built_in_seconds is not None
        assert winner.row.max_head_dim == tables.built_in_row("forward", FAMILY, winner.dtype, 24).max_head_dim
        assert tables.tile_row(DEVICE_FAMILY, winner.dtype, problem.head_dim) == winner.row
    assert "forward   float16  <= " in sweep.winners_table(winners)

@pytest.mark.exhaustive   # 15 s cold; the forward sweep's test keeps the timing path in the default run
def test_the_backward_sweep_times_its_two_kernels_apart(tuning_dir, rng):
    """sweep.tune on the backward, from per-dispatch seconds: each winner's time is per kernel,
    and its row (dQ columns and dK/dV columns possibly of different candidates) is used."""
    chosen = [TuningProblem("backward", "float32", 16, 16, q_len=16, kv_len=24)]
    winners = sweep.tune(chosen, CPU, rng, repeats=1, report=lambda *a: None)
    assert len(winners) == 1
    (winner,) = winners
    assert set(winner.seconds) == {"dq", "dkdv"} and min(winner.seconds.values()) > 0
    assert set(winner.built_in_seconds) == {"dq", "dkdv"}
    tuned.write(DEVICE_FAMILY, CPU.name, sweep.rows_by_direction(winners))
    assert tables.backward_tile_row(DEVICE_FAMILY, "float32", 16) == winner.row
    assert " (dq " in sweep.winners_table(winners) and " + dkdv " in sweep.winners_table(winners)


def test_each_kernel_is_timed_by_its_own_dispatches(rng):
    q, k, v, do = (rng.standard_normal((1, 2, 20, 16)).astype(np.float32) for _ in range(4))
    o, lse = mfa_native.attention(q, k, v, return_lse=True)
    with mfa_native.profile() as profiled:
        mfa_native.attention_backward(q, k, v, o, lse, do)
    seconds = kernels.seconds_by_kernel("backward", profiled.records)
    assert set(seconds) == {"dq", "dkdv"} and min(seconds.values()) > 0
    assert math.isclose(sum(seconds.values()), profiled.seconds)
    untimed = [SimpleNamespace(kernel="attention_backward_dq", seconds=None)]
    with pytest.raises(RuntimeError, match="no time for a dispatch"):
        kernels.seconds_by_kernel("backward", untimed)
    with pytest.raises(ValueError, match="none of the backward's tuned kernels"):
        kernels.kernel_of("backward", "attention_forward")


def test_every_column_belongs_to_a_timed_kernel():
    for direction, row_type in tables.DIRECTION_ROWS.items():
        read = set(itertools.chain(*kernels.KERNEL_COLUMNS[direction].values()))
        assert read == set(candidates.columns(row_type)), direction


def _backward_row(**columns):
    return tables.BackwardTileRow(**{**vars(tables.built_in_row("backward", FAMILY, "float32", 64)), **columns})


def test_each_kernels_columns_come_from_the_candidate_fastest_in_it(rng):
    """Random per-kernel times: the combined row takes dQ's columns from the dQ winner and dK/dV's
    from the dK/dV winner among candidates with the same tiles16 (both kernels read it), and that
    tiles16 has the least total."""
    rows = [_backward_row(query_rows=qr, key_rows=kr, cache_q=cq, cache_v=cv, tiles16=t)
            for qr, kr, cq, cv, t in itertools.product((8, 16, 32), (8, 16), (True, False), (True, False),
                                                       (True, False))]
    timed = {row: {"dq": float(rng.uniform(1, 2)), "dkdv": float(rng.uniform(1, 2))} for row in rows}
    combined = kernels.fastest_per_kernel("backward", timed)
    best_total = math.inf
    for tiles16 in (True, False):
        same = [row for row in rows if row.tiles16 == tiles16]
        dq, dkdv = (min(same, key=lambda row: timed[row][kernel]) for kernel in ("dq", "dkdv"))
        if timed[dq]["dq"] + timed[dkdv]["dkdv"] < best_total:
            best_total, expected = timed[dq]["dq"] + timed[dkdv]["dkdv"], (dq, dkdv, tiles16)
    dq, dkdv, tiles16 = expected
    assert combined.tiles16 == tiles16
    assert (combined.query_rows, combined.cache_q) == (dq.query_rows, dq.cache_q)
    assert (combined.key_rows, combined.cache_v) == (dkdv.key_rows, dkdv.cache_v)
    assert combined.max_head_dim == rows[0].max_head_dim
    forward = {replace(_tuned_row(), query_rows=n): {"forward": float(t)} for n, t in ((8, 2.0), (16, 1.0), (32, 3.0))}
    assert kernels.fastest_per_kernel("forward", forward).query_rows == 16
