"""The same kernels on the metal and the cpu device, compared.

Runs where a Metal device is present (the macOS workflow, on a Mac whose GPU
is Apple7 or newer) and is skipped everywhere else. Each kernel's MSL text is
identical on both devices: hand-written kernels exercise the Metal backend's
paths (SIMD-group functions, threadgroup memory, function constants,
simdgroup_matrix, zero-copy and staged host memory, several dispatches in one
batch), and attention kernels generated for the Metal GPU's family run
unchanged on the cpu backend. Outputs are poisoned (NaN) before every run, and
both devices are also checked against a float64 reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import relative_l2
from ml_dtypes import bfloat16

import mfa_native
from mfa_native import _core
from mfa_native.reference import attention_reference
from mfa_native.runtime.devices import tuned_as, tuning_facts
from mfa_native.sample_kernels import gemm

_DEVICES = {device.kind: device for device in mfa_native.devices()}
if "metal" not in _DEVICES:
    pytest.skip("no Metal device here: metal needs macOS 14+ and an Apple GPU of family Apple7 or newer",
                allow_module_level=True)
METAL, CPU = _DEVICES["metal"], _DEVICES["cpu"]


def poisoned(shape, dtype=np.float32) -> np.ndarray:
    return np.full(shape, np.nan, dtype=dtype)


def page_aligned(n: int, dtype, page: int, misalign: int = 0) -> np.ndarray:
    """An uninitialized array of n elements whose data starts `misalign` bytes after a page boundary."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(n * itemsize + 2 * page, np.uint8)
    start = (-raw.ctypes.data) % page + misalign
    return raw[start:start + n * itemsize].view(dtype)


def test_metal_device_reports_an_apple_gpu():
    properties = METAL.properties
    assert properties["gpu_family"] in {"apple7", "apple8", "apple9", "apple10"}
    assert properties["metal_language"] in {"3.1", "3.2", "4.0"}
    assert properties["gpu_cores"] == "unknown" or int(properties["gpu_cores"]) > 0
    assert METAL.limits["max_threads_per_threadgroup"] == 1024
    assert METAL.limits["max_threadgroup_memory"] == 32 * 1024
    assert METAL.name


def test_metal_device_reports_tensor_ops_on_an_m5_with_macos_26_2():
    """Metal 4 tensor ops: an Apple10 GPU on macOS 26.2 or later, unless MFA_NATIVE_TENSOR_OPS=off."""
    properties = METAL.properties
    macos = tuple(int(part) for part in properties["macos"].split("."))
    expected = (properties["gpu_family"] == "apple10" and macos >= (26, 2, 0)
                and os.environ.get("MFA_NATIVE_TENSOR_OPS") != "off")
    assert METAL.tuning.tensor_ops is expected and tuning_facts(METAL).tensor_ops is expected


def test_metal_refuses_a_tensor_op_kernel_where_it_has_no_tensor_ops():
    if METAL.tuning.tensor_ops:
        pytest.skip("this Metal device runs tensor ops")
    source = "#include <metal_stdlib>\n#include <metal_tensor>\nkernel void k(device float* x [[buffer(0)]]) {}\n"
    with pytest.raises(ValueError, match="uses Metal 4 tensor ops.*does not run"):
        METAL.library(source)


SIMD_AND_THREADGROUP = """
#include <metal_stdlib>
using namespace metal;
kernel void block_sums(device const float* x [[buffer(0)]],
                       device float* sums [[buffer(1)]],
                       device float* mixed [[buffer(2)]],
                       threadgroup float* partial [[threadgroup(0)]],
                       uint i [[thread_position_in_grid]],
                       uint group [[threadgroup_position_in_grid]],
                       uint lane [[thread_index_in_simdgroup]],
                       uint simdgroup [[simdgroup_index_in_threadgroup]],
                       uint simdgroups [[simdgroups_per_threadgroup]]) {
  const float v = x[i];
  mixed[i] = simd_prefix_inclusive_sum(v) + simd_shuffle_xor(v, 3u) * simd_max(v);
  const float s = simd_sum(v);
  if (lane == 0) partial[simdgroup] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simdgroup == 0) {
    const float t = simd_sum(lane < simdgroups ? partial[lane] : 0.0f);
    if (lane == 0) sums[group] = t;
  }
}
"""


def block_sums_reference(x: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    lanes = x.astype(np.float64).reshape(-1, 32)
    mixed = np.cumsum(lanes, axis=1) + lanes[:, np.arange(32) ^ 3] * lanes.max(axis=1, keepdims=True)
    return x.astype(np.float64).reshape(-1, group_size).sum(axis=1), mixed.reshape(-1)


def test_simdgroup_functions_and_threadgroup_memory_agree(rng):
    groups, group_size = 4, 256
    x = rng.standard_normal(groups * group_size).astype(np.float32)
    results = []
    for device in (METAL, CPU):
        sums, mixed = poisoned(groups), poisoned(x.size)
        kernel = mfa_native.Kernel(SIMD_AND_THREADGROUP, "block_sums", device=device)
        stats = kernel([x, sums, mixed], threadgroups=groups, threads_per_threadgroup=group_size,
                       threadgroup_memory=[4 * (group_size // 32)])
        assert stats.threadgroups == groups
        results.append((sums, mixed))
    expected_sums, expected_mixed = block_sums_reference(x, group_size)
    for sums, mixed in results:
        assert relative_l2(sums, expected_sums) < 1e-6
        assert relative_l2(mixed, expected_mixed) < 1e-6
    (metal_sums, metal_mixed), (cpu_sums, cpu_mixed) = results
    assert relative_l2(metal_sums, cpu_sums) < 1e-6
    assert relative_l2(metal_mixed, cpu_mixed) < 1e-6


CONSTANTS = """
#include <metal_stdlib>
using namespace metal;
constant bool NEGATE [[function_constant(0)]];
constant int OFFSET [[function_constant(1)]];
constant float SCALE [[function_constant(2)]];
constant half BIAS [[function_constant(3)]];
constant ushort REPEAT [[function_constant(4)]];
constant char SHIFT [[function_constant(5)]];
kernel void affine(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                   uint i [[thread_position_in_grid]]) {
  float v = x[i] * SCALE + float(BIAS) + float(OFFSET) + float(SHIFT);
  for (ushort r = 1; r < REPEAT; ++r) v += x[i];
  y[i] = NEGATE ? -v : v;
}
"""


@pytest.mark.parametrize("constants", [
    {"NEGATE": True, "OFFSET": -7, "SCALE": 0.37, "BIAS": 1.5, "REPEAT": 3, "SHIFT": -2},
    {"NEGATE": False, "OFFSET": 100000, "SCALE": -2.25, "BIAS": -0.125, "REPEAT": 1, "SHIFT": 5},
])
def test_function_constants_of_every_scalar_kind_agree(rng, constants):
    x = rng.standard_normal(96).astype(np.float32)
    c = constants
    expected = (x.astype(np.float64) * np.float32(c["SCALE"]) + c["BIAS"] + c["OFFSET"] + c["SHIFT"]
                + (c["REPEAT"] - 1) * x.astype(np.float64))
    expected = -expected if c["NEGATE"] else expected
    for device in (METAL, CPU):
        y = poisoned(x.size)
        mfa_native.Kernel(CONSTANTS, "affine", constants=constants, device=device)(
            [x, y], threadgroups=3, threads_per_threadgroup=32)
        assert relative_l2(y, expected) < 1e-6, device.kind


@pytest.mark.parametrize("dtype,tolerance", [(np.float32, 1e-5), (np.float16, 2e-3), (bfloat16, 1e-2)])
def test_simdgroup_matrix_gemm_agrees(rng, dtype, tolerance):
    a = rng.standard_normal((45, 70)).astype(dtype)
    b = rng.standard_normal((70, 37)).astype(dtype)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    c_metal, metal_stats = gemm(a, b, device=METAL)
    c_cpu, cpu_stats = gemm(a, b, device=CPU)
    for c in (c_metal, c_cpu):
        assert c.dtype == np.dtype(dtype)
        assert relative_l2(c.astype(np.float32), expected) < tolerance
    assert relative_l2(c_metal.astype(np.float32), c_cpu.astype(np.float32)) < tolerance
    assert metal_stats.threadgroups == cpu_stats.threadgroups
    assert metal_stats.simdgroup_matrix_ops is None  # Metal cannot count them
    assert cpu_stats.simdgroup_matrix_ops > 0
    assert metal_stats.seconds is not None and metal_stats.seconds > 0  # GPU timestamps


AFFINE = """
#include <metal_stdlib>
using namespace metal;
kernel void twice_plus_one(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                           constant uint& n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  if (i < n) y[i] = 2.0f * x[i] + 1.0f;
}
"""


@pytest.mark.parametrize("misalign", [0, 4], ids=["page_aligned_zero_copy", "unaligned_staged"])
def test_host_memory_is_wrapped_when_page_aligned_and_staged_otherwise(rng, misalign):
    page = int(METAL.properties["page_size"])
    n = page // 4 + 1000  # a length that is not a whole number of pages
    kernel = mfa_native.Kernel(AFFINE, "twice_plus_one", device=METAL)
    x = page_aligned(n, np.float32, page, misalign)
    x[:] = rng.standard_normal(n)
    y = page_aligned(n, np.float32, page, misalign)
    y[:] = np.nan
    before = METAL.pool_stats()
    kernel([x, y, np.uint32(n)], threadgroups=(n + 255) // 256, threads_per_threadgroup=256)
    after = METAL.pool_stats()
    assert relative_l2(y, 2.0 * x.astype(np.float64) + 1.0) < 1e-6
    staged = (after["hits"] + after["misses"]) - (before["hits"] + before["misses"])
    assert staged == (0 if misalign == 0 else 2)


def _two_dependent_dispatches(rng):
    """Runs y = 2x + 1, then z = 2y + 1, in one batch on page-aligned arrays; returns (x, z, stats)."""
    page = int(METAL.properties["page_size"])
    n = 3 * page // 4
    kernel = mfa_native.Kernel(AFFINE, "twice_plus_one", device=METAL)
    x = page_aligned(n, np.float32, page)
    x[:] = rng.standard_normal(n)
    y, z = page_aligned(n, np.float32, page), page_aligned(n, np.float32, page)
    y[:], z[:] = np.nan, np.nan
    batch = _core.CommandBatch(METAL)
    grid = dict(threadgroups=(n + 255) // 256, threads_per_threadgroup=256)
    keep = kernel.encode(batch, [x, y, np.uint32(n)], **grid) + kernel.encode(batch, [y, z, np.uint32(n)], **grid)
    batch.commit()
    stats = batch.wait()
    del keep
    return x, z, stats


def test_a_batch_orders_dependent_dispatches(rng):
    x, z, stats = _two_dependent_dispatches(rng)
    assert relative_l2(z, 4.0 * x.astype(np.float64) + 3.0) < 1e-6  # the second read the first's output
    assert [s.kernel for s in stats] == ["twice_plus_one"] * 2
    assert all(s.seconds is None for s in stats)  # untimed: GPU time is per command buffer, not per dispatch


def test_a_profiled_batch_times_each_dispatch_in_order(rng):
    """Inside profile() each dispatch gets its own encoder with sampled GPU timestamps, ordered
    after the one before (the second reads the first's output)."""
    with mfa_native.profile():
        x, z, stats = _two_dependent_dispatches(rng)
    assert relative_l2(z, 4.0 * x.astype(np.float64) + 3.0) < 1e-6
    assert all(s.seconds is not None and 0 < s.seconds < 1 for s in stats), stats


# Builds the AFFINE pipeline on metal in a fresh process and prints where the
# pipeline archive is ("off" when switched off).
ARCHIVE_PROBE = """
import sys
import numpy as np
import mfa_native
kernel = mfa_native.Kernel(sys.argv[1], "twice_plus_one", device="metal")
x = np.arange(64, dtype=np.float32)
y = np.full(64, np.nan, np.float32)
kernel([x, y, np.uint32(64)], threadgroups=1, threads_per_threadgroup=64)
assert np.array_equal(y, 2 * x + 1)
print(next(d for d in mfa_native.devices() if d.kind == "metal").properties["pipeline_archive"])
"""


def probe_archive(cache_dir: Path, **env: str) -> str:
    result = subprocess.run([sys.executable, "-c", ARCHIVE_PROBE, AFFINE], capture_output=True, text=True,
                            env={**os.environ, "MFA_NATIVE_CACHE_DIR": str(cache_dir), **env})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_pipeline_archive_is_written_and_a_corrupt_one_rebuilt(tmp_path):
    archive = Path(probe_archive(tmp_path))
    assert archive.parent == tmp_path / "metal"
    assert archive.stat().st_size > 0
    archive.write_bytes(b"not a Metal binary archive")
    assert probe_archive(tmp_path) == str(archive)  # the kernel still ran
    assert archive.read_bytes() not in (b"", b"not a Metal binary archive")
    assert probe_archive(tmp_path, MFA_NATIVE_METAL_ARCHIVE="0") == "off"


BROKEN = """
#include <metal_stdlib>
using namespace metal;
kernel void broken(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[i] = undefined_thing * 2.0f;
}
"""


@pytest.mark.parametrize("device", [METAL, CPU], ids=["metal", "cpu"])
def test_compile_errors_carry_the_compiler_log(device):
    with pytest.raises(mfa_native.CompileError) as failure:
        mfa_native.Kernel(BROKEN, "broken", device=device)
    assert "undefined_thing" in failure.value.log


TOLERANCE = {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 2e-2, np.dtype(bfloat16): 2e-2}


@pytest.mark.parametrize("dtype,causal,R,C,D", [
    (np.float32, False, 37, 53, 64),
    (np.float16, True, 64, 64, 128),
    (bfloat16, "upper_left", 29, 70, 40),
    (np.float32, True, 1, 90, 96),
])
def test_attention_kernels_generated_for_the_gpu_agree(rng, dtype, causal, R, C, D):
    q = rng.standard_normal((1, 4, R, D)).astype(dtype)
    k = rng.standard_normal((1, 2, C, D)).astype(dtype)
    v = rng.standard_normal((1, 2, C, D)).astype(dtype)
    outputs, records = [], []
    # Generated for the Metal GPU's family on both devices, so both run the same MSL.
    with tuned_as(CPU, family=tuning_facts(METAL).family):
        for device in (METAL, CPU):
            with mfa_native.profile() as recorded:
                outputs.append(mfa_native.attention(q, k, v, causal=causal, return_lse=True, device=device))
            records.append([(r.kernel, r.threadgroups, r.seconds) for r in recorded.records])
    expected, expected_lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    tolerance = TOLERANCE[np.dtype(dtype)]
    for out, lse in outputs:
        assert relative_l2(out, expected) < tolerance
        np.testing.assert_allclose(lse, expected_lse, rtol=tolerance, atol=tolerance)
    (metal_out, _), (cpu_out, _) = outputs
    assert relative_l2(metal_out, cpu_out) < tolerance
    metal_records, cpu_records = records
    assert [r[:2] for r in metal_records] == [r[:2] for r in cpu_records]  # same kernels, same grids
    assert all(seconds is not None for _, _, seconds in metal_records)


def test_attention_on_metal_with_its_own_tables(rng):
    q = rng.standard_normal((2, 4, 100, 64)).astype(np.float16)
    k = rng.standard_normal((2, 4, 130, 64)).astype(np.float16)
    v = rng.standard_normal((2, 4, 130, 64)).astype(np.float16)
    out = mfa_native.attention(q, k, v, causal=True, device="metal")
    assert relative_l2(out, attention_reference(q, k, v, causal=True)) < 2e-2
