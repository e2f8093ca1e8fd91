"""ctest's runner of the C++ examples (attention_example, decode_example, c_abi): writes the
example's bundle with the Python CLI, then runs the example on it. Given a Python twin
(decode_example: examples/cpp/decode_twin.py), runs it too, both on the cpu backend (where the
C++ API's results are Python's bit for bit), and fails unless both print the same last line.
Exits 77 (ctest: skipped) when mfa_native is not importable (a C++-only build with no
installed package).
    usage: run_example.py EXAMPLE SPEC BUNDLE [TWIN]"""

import os
import subprocess
import sys

example, spec, bundle = sys.argv[1:4]
twin = sys.argv[4] if len(sys.argv) > 4 else None
try:
    from mfa_native.__main__ import main
except ImportError as error:
    print(f"skipped: mfa_native is not importable here ({error})")
    sys.exit(77)
if main(["bundle", "-o", bundle, "--spec", spec, "--quiet"]) != 0:
    sys.exit(1)
if twin is None:
    sys.exit(subprocess.run([example, bundle]).returncode)

env = {**os.environ, "MFA_NATIVE_DEVICE": "cpu"}
lines = []
for command in ([example, bundle], [sys.executable, twin]):
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    print(f"$ {' '.join(command)}\n{result.stdout}{result.stderr}", end="")
    if result.returncode != 0:
        sys.exit(1)
    lines.append(result.stdout.strip().splitlines()[-1:])
if lines[0] != lines[1] or not lines[0]:
    print(f"the example and its twin differ: {lines[0]} != {lines[1]}")
    sys.exit(1)
