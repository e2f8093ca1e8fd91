"""Shared fixtures: fresh random inputs for every test, poisoned outputs, relative L2 error.

Tests compile kernels into their own cache (never the user's ~/.cache/mfa_native), kept
between runs so that a warm test run compiles nothing new, and hypothesis runs
derandomized for the same reason.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

os.environ.setdefault("MFA_NATIVE_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"mfa_native-tests-{os.getuid()}"))
settings.register_profile("mfa_native", derandomize=True, database=None, deadline=None)
settings.load_profile("mfa_native")


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded per test, so failures reproduce but inputs differ between tests."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# A bit-for-bit test's seeds: one in the default run, five more under -m exhaustive.
SEEDS = [pytest.param(0, id="seed0"), *(pytest.param(s, marks=pytest.mark.exhaustive, id=f"seed{s}")
                                       for s in range(1, 6))]


# Float poison: a quiet NaN whose payload no kernel produces (a NaN a kernel computes or carries
# from a NaN input is 0x7fc00000's), so a byte comparison tells an unwritten element from a NaN
# written on purpose; by the float's width.
POISON_BITS = {2: 0x7E5A, 4: 0x7FE5A5A5, 8: 0x7FFCA5A5A5A5A5A5}


def poison(shape, dtype) -> np.ndarray:
    """NaN everywhere (POISON_BITS), or for integers the dtype's most negative value (its
    largest, unsigned), which no kernel stores as a count, an index or a symmetric int8 value
    (-128): an element a kernel never writes shows."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" or dtype.name == "bfloat16":
        bits = POISON_BITS[dtype.itemsize] if dtype.name != "bfloat16" else POISON_BITS[4] >> 16
        return np.full(shape, bits, dtype=f"uint{8 * dtype.itemsize}").view(dtype)
    if dtype == np.bool_:
        value = True
    else:
        value = np.iinfo(dtype).min if dtype.kind == "i" else np.iinfo(dtype).max
    return np.full(shape, value, dtype=dtype)


def untouched(*arrays: np.ndarray) -> bool:
    """Whether every element of `arrays` still holds its poison (byte for byte): nothing wrote them."""
    return all(np.array_equal(np.asarray(a).view(np.uint8), poison(a.shape, a.dtype).view(np.uint8)) for a in arrays)


def poisoned(allocate):
    """The runner's allocator `allocate` (shape, dtype, device) with its arrays poisoned: the
    outputs stay the memory it gives (device pool buffers), only their contents change."""
    def poisoned_allocate(shape, dtype, device):
        out = allocate(shape, dtype, device)
        out[...] = poison(shape, dtype)
        return out
    poisoned_allocate.poisons = True
    return poisoned_allocate


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every op's outputs start as NaN instead of whatever the device pool (or the caller's
    framework, for MLX arrays and MPS tensors) holds."""
    from mfa_native.runtime import frameworks, runner

    monkeypatch.setattr(runner, "_allocate", poisoned(runner._allocate))
    for framework in frameworks.FRAMEWORKS:
        monkeypatch.setattr(framework, "empty", _poisoned(framework.empty, framework))


def _poisoned(empty, framework):
    def allocate(shape, dtype, like):
        out = empty(shape, dtype, like)
        if not framework.on_metal(out):
            framework.as_numpy(out, "out")[...] = poison(shape, dtype)
        return out
    return allocate


def relative_l2(actual: np.ndarray, expected: np.ndarray) -> float:
    """||actual - expected|| / ||expected|| in float64; NaN anywhere fails (returns inf)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if not np.all(np.isfinite(actual)):
        return float("inf")
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-300))
