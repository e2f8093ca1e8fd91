"""ctest's attention_example: writes the example's bundle with the Python CLI, then runs
examples/cpp/attention on it. Exits 77 (ctest: skipped) when mfa_native is not importable
(a C++-only build with no installed package)."""

import subprocess
import sys

example, spec, bundle = sys.argv[1:4]
try:
    from mfa_native.__main__ import main
except ImportError as error:
    print(f"skipped: mfa_native is not importable here ({error})")
    sys.exit(77)
if main(["bundle", "-o", bundle, "--spec", spec, "--quiet"]) != 0:
    sys.exit(1)
sys.exit(subprocess.run([example, bundle]).returncode)
