"""Shared fixtures: fresh random inputs for every test, and relative L2 error."""

from __future__ import annotations

import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded per test, so failures reproduce but inputs differ between tests."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def relative_l2(actual: np.ndarray, expected: np.ndarray) -> float:
    """||actual - expected|| / ||expected|| in float64; NaN anywhere fails (returns inf)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if not np.all(np.isfinite(actual)):
        return float("inf")
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-300))
