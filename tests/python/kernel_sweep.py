"""The sweeps that rerun the suite's generated kernels under a cpu-backend check (the race
detector, exact bounds): which tests make those kernels (all of them under -m exhaustive, a
sample holding every kernel family by default), and how a sweep runs them in a child pytest
whose environment turns the check on for every kernel it builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Tests whose kernels cover the generators: split-KV decode, sinks (infinite ones too),
# backward, block and token lists, the Kernel API, quantized storage, head dims past 256 (the
# K-then-V stage, the tiled sparse dK/dV), per-head kernels staging their blocks (stage_kv,
# stage_q_dout), packed heads staging the pages of varlen sequences, one call of every
# declared op (test_poison: the indexer, the merge, from_mask, the quantizers, int8), and the
# Metal 4 tensor-op kernels (forward, backward, packed decode, int8).
GENERATED_KERNEL_TESTS = [
    "tests/python/test_poison.py",
    "tests/python/test_infinite_sinks.py",
    "tests/python/test_attention.py::test_split_kv_decode",
    "tests/python/test_attention.py::test_sinks",
    "tests/python/test_attention_backward.py::test_sinks",
    "tests/python/test_attention_backward.py::test_decode_shapes",
    "tests/python/test_block_sparse.py",
    "tests/python/test_flex.py",
    "tests/python/test_sparse.py",
    "tests/python/test_head_dims.py::test_forward",
    "tests/python/test_head_dims.py::test_sparse_backward",
    "tests/python/test_head_dims.py::test_backward",
    "tests/python/test_kernel.py",
    "tests/python/test_quantize.py::test_head_tensors",
    "tests/python/test_stage_kv.py",
    "tests/python/test_varlen_paged.py::test_gqa_sinks_and_the_decode_of_packed_heads",
    "tests/python/test_tensor_op_attention.py::test_forward",
    "tests/python/test_tensor_op_attention.py::test_backward",
    "tests/python/test_tensor_op_attention.py::test_packed_heads_decode",
    "tests/python/test_tensor_op_attention.py::test_int8_products_are_exact",
]


# The default run's sample of them (-m exhaustive sweeps them all): a kernel of every family
# still, one call of every declared op (test_poison), the split-KV pair, staged K/V in the
# forward and in both backward kernels, head dims past 256, and tensor-op products (one case of
# the backward's two kernels). The Kernel API's own kernels run under both checks in CI's
# compiler sweep (scripts/compiler-sweep.sh), with every compiler, and in the exhaustive step.
SAMPLED_KERNEL_TESTS = [
    "tests/python/test_poison.py",
    "tests/python/test_attention.py::test_split_kv_decode",
    "tests/python/test_stage_kv.py::test_forward_staged",
    "tests/python/test_stage_kv.py::test_backward_staged",
    "tests/python/test_head_dims.py::test_forward",
    "tests/python/test_tensor_op_attention.py::test_backward[float16-D64-Dv64]",
]


def run_sweep(variable: str, value: str, tests: list[str], workers: int = 1) -> None:
    """Runs `tests` in a child pytest with `variable`=`value`; every one must pass, none skip.
    The exhaustive sweeps give the child two workers (each file on one): such a sweep is the
    longest test of its run, and alone on one core it would leave the other idle at the run's
    end; the default run's short samples keep one (two cost more than they save there)."""
    root = Path(__file__).resolve().parents[2]
    environment = {name: text for name, text in os.environ.items() if not name.startswith("PYTEST_XDIST")}
    environment[variable] = value
    parallel = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *parallel, *tests],
                            cwd=root, env=environment, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
