"""`emit --report`: the modelled device bytes of the forward kernel equal the cpu backend's
traffic counters; the static facts move the way the rows say; the CLI prints every alternative."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from ml_dtypes import bfloat16

import mfa_native
from mfa_native import codegen
from mfa_native.__main__ import main
from mfa_native.codegen.attention import traffic
from mfa_native.codegen.attention.descriptor import describe
from mfa_native.codegen.kernel.report import report
from mfa_native.codegen.kernel.tables import built_in_row, forced_rows
from mfa_native.runtime.devices import tuned_as
from mfa_native.tuning.kernel_report import alternatives

FAMILY = mfa_native.default_device().tuning.family
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}


@pytest.mark.parametrize("cache_q, stage_kv", [(True, False), (False, False), (True, True), (False, True)])
def test_modelled_bytes_equal_the_traffic_counters(rng, cache_q, stage_kv):
    B, H = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    R, C = int(rng.integers(9, 70)), int(rng.integers(20, 300))
    D, Dv = int(rng.integers(8, 200)), int(rng.integers(8, 200))
    dtype = str(rng.choice(list(DTYPES)))
    q = rng.standard_normal((B, H, R, D)).astype(DTYPES[dtype])
    k = rng.standard_normal((B, H, C, D)).astype(DTYPES[dtype])
    v = rng.standard_normal((B, H, C, Dv)).astype(DTYPES[dtype])
    row = replace(built_in_row("forward", FAMILY, dtype, max(D, Dv)), cache_q=cache_q, stage_kv=stage_kv)
    problem = codegen.AttentionProblem(B, H, H, R, C, D, Dv, dtype=dtype)
    device = mfa_native.default_device()
    with forced_rows(FAMILY, forward=row) as forced, tuned_as(device, family=forced):
        with mfa_native.profile() as profiled:
            mfa_native.attention(q, k, v, device=device)
        d = describe(problem, family=forced)
        modelled = traffic.forward_bytes(problem, d)
    assert traffic.modelled(problem) and d.stage_kv == (stage_kv and d.simdgroups > 1)
    counted = sum(profiled.bytes_read.values()) + sum(profiled.bytes_written.values())
    assert modelled == counted, (B, H, R, C, D, Dv, dtype)


def test_the_static_facts_follow_the_row():
    problem = codegen.AttentionProblem(1, 2, 2, 256, 256, 128, 128, dtype="float16")
    row = built_in_row("forward", FAMILY, "float16", 128)
    facts = {}
    for label, candidate in alternatives(row):
        with forced_rows(FAMILY, forward=candidate) as forced:
            kernel = codegen.attention_pass(problem, family=forced).kernels[0]
        facts[label] = report(kernel.entry, kernel.source)
    # Q in registers: its 16 tiles instead of the one re-read per step; a tile is 2 registers
    # per thread as float, 1 as half (tiles16).
    per_tile = 1 if row.tiles16 else 2
    cached, reread = ((facts["built-in"], facts["cache_q=False"]) if row.cache_q
                      else (facts["cache_q=True"], facts["built-in"]))
    assert cached.tile_registers - reread.tile_registers == per_tile * (128 // 8 - 1)
    assert facts["built-in"].threadgroup_bytes == 0
    # Paged O: one simdgroup's 8 rows x 128 floats per simdgroup of the threadgroup.
    assert facts["o_block=64"].threadgroup_bytes == row.query_rows // 8 * 8 * 128 * 4
    # Staged K/V (apple9's rows read per lane): the step's K and V rows in float16, as many of
    # the row's key block as fit 24 KiB (48 of 64 at D + Dv = 256), filled between two barriers.
    assert not row.stage_kv and facts["built-in"].barriers_per_block == 0
    assert facts["stage_kv=True"].threadgroup_bytes == 48 * 256 * 2
    assert facts["stage_kv=True"].barriers_per_block == 2


def test_emit_report_prints_every_alternative(capsys):
    assert main(["emit", "attention", "--head-dim", "64", "--report"]) == 0
    out = capsys.readouterr().out
    for label, _ in alternatives(built_in_row("forward", FAMILY, "float16", 64)):  # emit's default dtype
        assert f"\n{label:<20} attention_forward" in out
    assert main(["emit", "quantize", "--head-dim", "64", "--report"]) == 2


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_emit_report_shows_apple10s_tensor_op_rows(capsys, backward):
    """apple10's built-in rows multiply with Metal 4 tensor ops (every kernel of the pass), and
    the report's tensor_ops=False row is the simdgroup kernel of the same tiles."""
    assert main(["emit", "attention", "--head-dim", "64", "--family", "apple10", "--report",
                 *(["--backward"] if backward else [])]) == 0
    lines = capsys.readouterr().out.splitlines()
    built_in = [line for line in lines if line.startswith("built-in ")]
    plain = [line for line in lines if line.startswith("tensor_ops=False ")]
    assert built_in and all(line.endswith(" tensor_ops") for line in built_in)
    assert len(plain) == len(built_in) and all(line.endswith(" simdgroup_matrix") for line in plain)
