"""Print the devices, the kernel compiler, the cache location and the statistics."""

from __future__ import annotations

import argparse

import mfa_native


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    del args
    print(f"mfa_native {mfa_native.__version__}")
    print(f"default device: {mfa_native.default_device().kind}")
    for device in mfa_native.devices():
        print(f"\ndevice {device.kind}: {device.name}")
        for key, value in device.limits.items():
            print(f"  {key}: {value}")
        for key, value in device.properties.items():
            print(f"  {key}: {value}")
        print("  pipeline cache: " + ", ".join(f"{k}={v}" for k, v in device.cache_stats().items()))
        print("  buffer pool: " + ", ".join(f"{k}={v}" for k, v in device.pool_stats().items()))
    return 0
