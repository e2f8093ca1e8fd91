"""Device traffic per kernel argument: DispatchStats.bytes_read / bytes_written and
mfa_native.profile() totals. The cpu backend counts every element loaded or stored
through a device or constant pointer exactly; Metal reports None."""

from __future__ import annotations

import numpy as np
import pytest

import mfa_native

GATHER = """
#include <metal_stdlib>
using namespace metal;

kernel void gather(device const float* values [[buffer(0)]],
                   device const uint* picks [[buffer(1)]],
                   device float* out [[buffer(2)]],
                   constant uint& n [[buffer(3)]],
                   uint i [[thread_position_in_grid]]) {
  if (i >= n) return;
  device const float* picked = values + picks[i];
  out[i] += *picked;
}
"""


@pytest.fixture
def gather():
    return mfa_native.Kernel(GATHER, "gather", device="cpu")


def run_gather(kernel, rng, n):
    values = rng.standard_normal(4 * n).astype(np.float32)
    picks = rng.integers(0, values.size, n, dtype=np.uint32)
    out = rng.standard_normal(n).astype(np.float32)
    expected = out + values[picks]
    stats = kernel([values, picks, out, np.uint32(n)], threadgroups=(n + 31) // 32, threads_per_threadgroup=32)
    np.testing.assert_array_equal(out, expected)
    return stats


def test_stats_count_each_pointer_argument_exactly(gather, rng):
    n = int(rng.integers(40, 200))
    stats = run_gather(gather, rng, n)
    # `n` is a reference argument: not a pointer, not counted.
    assert stats.bytes_read == {"values": 4 * n, "picks": 4 * n, "out": 4 * n}
    assert stats.bytes_written == {"values": 0, "picks": 0, "out": 4 * n}
    assert "bytes_read={'out': " in repr(stats)


def test_profile_records_traffic_and_sums_it_per_name(gather, rng):
    sizes = [int(rng.integers(10, 100)) for _ in range(2)]
    with mfa_native.profile() as prof:
        for n in sizes:
            run_gather(gather, rng, n)
    assert [r.bytes_read["picks"] for r in prof.records] == [4 * n for n in sizes]
    assert prof.bytes_read == {"values": 4 * sum(sizes), "picks": 4 * sum(sizes), "out": 4 * sum(sizes)}
    assert prof.bytes_written == {"values": 0, "picks": 0, "out": 4 * sum(sizes)}


def test_attention_reads_every_query_once_and_writes_every_output_once(rng):
    B, H, R, C, D = 1, 2, 32, 64, 16
    q, k, v = (rng.standard_normal((B, H, length, D)).astype(np.float16) for length in (R, C, C))
    with mfa_native.profile() as prof:
        mfa_native.attention(q, k, v, device="cpu")
    (record,) = prof.records
    assert record.bytes_read["q"] == q.nbytes
    assert record.bytes_written["o"] == q.nbytes
    for name, array in (("k", k), ("v", v)):
        assert record.bytes_read[name] > 0 and record.bytes_read[name] % array.nbytes == 0
    assert all(record.bytes_written[name] == 0 for name in ("q", "k", "v"))


@pytest.mark.skipif("metal" not in {d.kind for d in mfa_native.devices()}, reason="needs a Metal device")
def test_metal_does_not_count_traffic(rng):
    kernel = mfa_native.Kernel(GATHER, "gather", device="metal")
    stats = run_gather(kernel, rng, 64)
    assert stats.bytes_read is None and stats.bytes_written is None
