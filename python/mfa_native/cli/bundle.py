"""Write a bundle of attention pass templates for C++ programs: `bundle -o FILE --spec SPEC.json`; `bundle --list FILE`."""

from __future__ import annotations

import argparse
import json
import sys

from ..bundle import BundleError, build_payload, entries_of, entry_line, read_bundle, write_bundle
from ..bundle import metallib
from ..progress import bar


def summary() -> str:
    return "write a bundle of pass templates (MSL included) for C++ embedders, or --list one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Writes one file holding the pass templates (MSL source included) of the attention problem families "
        "SPEC declares, for include/mfa/attention.hpp's mfa::attention (no Python at run time). SPEC is JSON: "
        '{"families": [{"op": "attention", "dtype": [...], "head_dim": [...], "value_dim": [...] or null, '
        '"gqa_ratio": [...], "causal": [...], "mask": [...], "mask_dtype": [...], "window": [false, true], '
        '"sinks": [...], "layout": [...], "softcap": [null, ...], "alibi": [...], "score_mod": [...], '
        '"family": [...], "backward": true}]}; '
        "every list is crossed with the others and an omitted key takes every value it can "
        "(head_dim is required; see mfa_native/bundle/spec.py).")
    parser.add_argument("-o", "--output", metavar="FILE", help="the bundle file to write")
    parser.add_argument("--spec", metavar="SPEC.json", help="the spec (a path, or - for standard input)")
    parser.add_argument("--list", metavar="FILE", dest="list_file", help="print the entries of bundle FILE")
    parser.add_argument("--metallib", action="store_true",
                        help="also store each kernel compiled to a Metal library (macOS with a Metal device only), "
                             "so an app compiles no source at run time")
    parser.add_argument("--quiet", action="store_true",
                        help="do not print the entries written (nor the progress bar a terminal shows)")


def run(args: argparse.Namespace) -> int:
    if args.list_file:
        if args.output or args.spec:
            print("bundle: --list takes no -o or --spec", file=sys.stderr)
            return 2
        try:
            payload = read_bundle(args.list_file)
        except (OSError, BundleError, ValueError) as error:
            print(f"bundle: {args.list_file}: {error}", file=sys.stderr)
            return 1
        for record in payload["entries"]:
            print(entry_line(record["op"], record["facts"], len(record["forward"]), len(record["backward"])))
        if payload.get("metallibs"):
            print(f"({len(payload['metallibs'])} compiled Metal libraries)")
        return 0
    if not args.output or not args.spec:
        print("bundle: give -o FILE and --spec SPEC.json (or --list FILE)", file=sys.stderr)
        return 2
    try:
        if args.metallib:
            metallib.check_available()
        text = sys.stdin.read() if args.spec == "-" else open(args.spec, encoding="utf-8").read()
        entries = entries_of(json.loads(text))
    except (OSError, ValueError, RuntimeError) as error:
        print(f"bundle: {error}", file=sys.stderr)
        return 1
    with bar(len(entries), "bundle", unit="entry", quiet=args.quiet) as progress:
        def written(line: str) -> None:
            if not args.quiet:
                progress.write(line)   # above the bar
            progress.update()

        payload = build_payload(entries, written)
    if args.metallib:
        payload["metallibs"] = metallib.compile_all(payload)
    size = write_bundle(args.output, payload)
    if not args.quiet:
        print(f"wrote {args.output}: {len(entries)} entries, {size} bytes")
    return 0
