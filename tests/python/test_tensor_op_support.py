"""Whether a device runs Metal 4 tensor ops: the typed `tensor_ops` tuning fact, MFA_NATIVE_TENSOR_OPS
(read once per process, so each setting runs in a child), and the cpu device acting as an M5."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import mfa_native
from mfa_native.runtime.devices import TuningFacts, tuned_as, tuning_facts

CPU = mfa_native.devices()[-1]
TENSOR_KERNEL = "#include <metal_stdlib>\n#include <metal_tensor>\nkernel void k(device float* x [[buffer(0)]]) {}\n"


def child(args: list[str], setting: str | None) -> subprocess.CompletedProcess:
    """`python *args` with MFA_NATIVE_TENSOR_OPS set to `setting` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "MFA_NATIVE_TENSOR_OPS"}
    if setting is not None:
        env["MFA_NATIVE_TENSOR_OPS"] = setting
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)


def test_the_fact_is_a_bool_beside_the_family():
    assert type(CPU.tuning.tensor_ops) is bool
    assert type(tuning_facts(CPU).tensor_ops) is bool
    assert TuningFacts.__dataclass_fields__["tensor_ops"].type == "bool"
    assert "tensor_ops=" in repr(CPU.tuning)


@pytest.mark.parametrize("setting, expected", [(None, False), ("", False), ("auto", False), ("off", False),
                                               ("on", True)])
def test_the_cpu_device_reports_tensor_ops_only_when_switched_on(setting, expected):
    code = ("import mfa_native\nfrom mfa_native.runtime.devices import tuning_facts\n"
            "cpu = mfa_native.devices()[-1]\nprint(cpu.tuning.tensor_ops, tuning_facts(cpu).tensor_ops)")
    done = child(["-c", code], setting)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(expected)] * 2


def test_another_setting_is_refused_by_name():
    done = child(["-c", "import mfa_native\nprint(mfa_native.devices()[-1].tuning)"], "yes")
    assert done.returncode != 0
    assert "ValueError: MFA_NATIVE_TENSOR_OPS must be 'on', 'off' or 'auto' (or unset), got 'yes'" in done.stderr


def test_info_shows_tensor_ops():
    done = child(["-m", "mfa_native", "info"], "on")
    assert done.returncode == 0, done.stderr
    assert "device cpu" in done.stdout and "  tensor ops: True\n" in done.stdout


def test_tests_can_have_a_device_act_as_one_with_tensor_ops():
    with tuned_as(CPU, tensor_ops=True) as facts:
        assert facts.tensor_ops is True and tuning_facts(CPU).tensor_ops is True
    assert tuning_facts(CPU).tensor_ops is CPU.tuning.tensor_ops


def test_the_cpu_device_compiles_tensor_op_kernels_whatever_it_reports():
    assert [function.name for function in CPU.library(TENSOR_KERNEL).functions] == ["k"]
