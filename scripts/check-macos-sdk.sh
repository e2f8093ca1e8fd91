#!/usr/bin/env bash
# Compile-checks everything that must build on macOS against real macOS SDK
# headers, on a machine without a Mac (clang, no linking):
#   1. the Objective-C++ Metal backend, src/metal/*.mm, and the C ABI's Metal
#      path, src/c_abi/ (with -Werror);
#   2. C++ units the cpu backend translates from generated kernels, against
#      Apple's libc++ (this is how an ambiguity between the shim's math and
#      libc++'s global float overloads was found).
# Usage: scripts/check-macos-sdk.sh <SDK: an SDK folder or a hexops/xcode-frameworks git dir>
# Needs clang++ (apt-get install -y clang-19) and mfa_native installed (pip install .).
set -euo pipefail
cd "$(dirname "$0")/.."
sdk="${1:?usage: scripts/check-macos-sdk.sh <SDK folder or hexops/xcode-frameworks git dir>}"
check="${OBJCXX_CHECK:-scripts/objcxx-check.sh}"

bash "$check" -q --werror "$sdk" src/metal/*.mm -- -Iinclude -Isrc
# The C ABI as a Metal build compiles it (mfa_call_encode_metal's path).
bash "$check" -q --werror "$sdk" src/c_abi/*.cpp include/mfa/mfa.h -- -Iinclude -Isrc -DMFA_HAVE_METAL

# Translate a spread of kernels into a scratch cache, then check each unit.
cache="$(mktemp -d)"
trap 'rm -rf "$cache"' EXIT
MFA_NATIVE_CACHE_DIR="$cache" MFA_NATIVE_DEVICE=cpu python3 - <<'PY'
import numpy as np
import mfa_native
from mfa_native.sample_kernels import gemm

rng = np.random.default_rng(0)
gemm(rng.standard_normal((9, 9)).astype(np.float32), rng.standard_normal((9, 9)).astype(np.float32))
for dtype in (np.float32, np.float16):
    q = rng.standard_normal((1, 2, 9, 16)).astype(dtype)
    kv = rng.standard_normal((1, 1, 40, 16)).astype(dtype)
    o, lse = mfa_native.attention(q, kv, kv, causal=True, sinks=np.zeros(2, np.float32), return_lse=True)
    mfa_native.attention_backward(q, kv, kv, o, lse, o, causal=True, mask=rng.random((9, 40)) < 0.8)
    mfa_native.attention(q[:, :, :1], kv, kv, window=(8, 0))  # decode
PY
shim=$(ls -d "$cache"/shim-* | head -n 1)
for target in arm64-apple-macos14 x86_64-apple-macos14; do
  bash "$check" -q --target "$target" "$sdk" "$cache"/kernels/*.cpp -- -I"$shim" -w
done
