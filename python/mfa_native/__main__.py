"""`python -m mfa_native <command>`: each command is a module in mfa_native/cli/."""

# A command module has add_arguments(parser) and run(args), and optionally summary(), its
# line in --help (else its docstring's first line).

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from . import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mfa_native", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    modules = {}
    for info in sorted(pkgutil.iter_modules(cli.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{cli.__name__}.{info.name}")
        modules[info.name] = module
        summary = module.summary() if hasattr(module, "summary") else (module.__doc__ or "").strip().splitlines()[0]
        sub = commands.add_parser(info.name, help=summary)
        module.add_arguments(sub)
    args = parser.parse_args(argv)
    return modules[args.command].run(args)


def run_in_a_pipe() -> int:
    """main(), quiet when the reader of stdout goes away (`python -m mfa_native info | head`):
    the rest of the output has nowhere to go, and that is not an error worth a traceback."""
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the final flush at exit fails too
        return 141  # as a shell reports a command that SIGPIPE stopped (128 + 13)


if __name__ == "__main__":
    sys.exit(run_in_a_pipe())
