"""Print the devices, their tile tables (built-in or tuned), the kernel compiler, the cache location and the statistics."""

from __future__ import annotations

import argparse
import sys

import mfa_native
from mfa_native.codegen.kernel import tuned
from mfa_native.runtime.devices import tuning_facts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    """Prints what every device reports; a device that cannot work here (the cpu backend
    without a usable C++ compiler) gets its diagnosis instead, and the exit status is 1."""
    del args
    print(f"mfa_native {mfa_native.__version__}")
    print(f"default device: {mfa_native.default_device().kind}")
    print(f"cmake package (mfa_native_DIR): {mfa_native.cmake_dir()}")
    unusable = []
    for device in mfa_native.devices():
        print(f"\ndevice {device.kind}: {device.name}")
        for key, value in device.limits.items():
            print(f"  {key}: {value}")
        facts = tuning_facts(device)
        print(f"  tile table: {tuned.source(facts.family)}")
        print(f"  tuned table: {tuned.location(facts.family)}")
        print(f"  tensor ops: {facts.tensor_ops}")
        try:
            properties = device.properties
        except mfa_native.DeviceUnavailableError as error:
            unusable.append(device.kind)
            print(f"  cannot run kernels: {error}".replace("\n", "\n    "))
            continue
        for key, value in properties.items():
            print(f"  {key}: {value}")
        print("  pipeline cache: " + ", ".join(f"{k}={v}" for k, v in device.cache_stats().items()))
        print("  buffer pool: " + ", ".join(f"{k}={v}" for k, v in device.pool_stats().items()))
    if unusable:
        print(f"\nmfa_native info: {', '.join(unusable)} cannot run kernels here (see above)", file=sys.stderr)
        return 1
    return 0
