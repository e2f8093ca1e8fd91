"""The cpu backend's kernel disk cache: `cache info` (location, entries, size, limit) or `cache clear`."""

from __future__ import annotations

import argparse
import sys

from .. import _core


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["info", "clear"],
                        help="info: where the cache is, its entries, size and limit; "
                             "clear: remove every entry no process is loading")


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes} bytes ({nbytes / scale:.1f} {unit})"
    return f"{nbytes} bytes"


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "info":
            info = _core.cpu_kernel_cache_info()
            print(f"kernel cache: {info['dir']}")
            print(f"  entries: {info['entries']}")
            print(f"  size: {_size(info['bytes'])}")
            print(f"  limit: {_size(info['max_bytes'])} (MFA_NATIVE_CACHE_MAX_BYTES; least recently used go first)")
        else:
            cleared = _core.cpu_kernel_cache_clear()
            print(f"kernel cache: {cleared['dir']}")
            print(f"  removed {cleared['entries']} entries, {_size(cleared['bytes'])}")
            if cleared["in_use"]:
                print(f"  kept {cleared['in_use']} entries another process was loading")
    except ValueError as error:  # a malformed MFA_NATIVE_CACHE_MAX_BYTES
        print(f"cache: {error}", file=sys.stderr)
        return 2
    return 0
