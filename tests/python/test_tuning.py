"""Device.tuning: the typed facts code generation tunes for, per backend."""

from __future__ import annotations

import mfa_native
from mfa_native import codegen


def test_cpu_tunes_for_the_current_generation_with_two_threadgroups_per_worker():
    cpu = next(d for d in mfa_native.devices() if d.kind == "cpu")
    assert cpu.tuning.family == "apple9"
    assert cpu.tuning.parallel_threadgroups == 2 * int(cpu.properties["worker_threads"])
    assert "family='apple9'" in repr(cpu.tuning)


def test_every_device_reports_a_family_codegen_has_tables_for():
    for device in mfa_native.devices():
        tuning = device.tuning
        assert tuning.family in codegen.FAMILIES
        assert isinstance(tuning.parallel_threadgroups, int) and tuning.parallel_threadgroups > 0
