#!/usr/bin/env bash
# Smoke tests of an installed mfa_native (a wheel in an environment of its own):
# import, `info`, `demo` and a test subset, run from an empty directory so that
# nothing of the source tree is on sys.path. cibuildwheel runs it after each
# build; tests/python/test_wheel.py runs it here on the manylinux wheel.
# Usage: wheel-smoke.sh [PYTHON]
set -euo pipefail
python=${1:-python}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$(mktemp -d)"

"$python" -c "import mfa_native; print('mfa_native from', mfa_native.__file__)"
"$python" -m mfa_native info
"$python" -m mfa_native demo --seq 64
# The Kernel API, passes, attention, the C++ embedder, the CLI, the disk cache;
# in the test suite's own kernel cache (tests/python/conftest.py), warm after a run.
env -u MFA_NATIVE_CACHE_DIR "$python" -m pytest -q -p no:cacheprovider \
  "$root/tests/python/test_kernel.py" "$root/tests/python/test_runner.py" \
  "$root/tests/python/test_attention.py" "$root/tests/python/test_embedding.py" \
  "$root/tests/python/test_info_diagnosis.py" "$root/tests/python/test_cache_cli.py"
