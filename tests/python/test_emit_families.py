"""`python -m mfa_native emit KIND`: every kernel family codegen builds, not only attention's forward
(source, --plan, --json template and --json --sizes pass), each exactly what its op runs; and the
command lines of `--help` list every emit kind and every benchmark."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import mfa_native
from mfa_native import codegen
from mfa_native.__main__ import main as cli_main
from mfa_native.codegen.int8.problem import Int8Problem
from mfa_native.codegen.storage import quantize as codegen_quantize
from mfa_native.quant_formats import QuantFormat
from mfa_native.runtime.runner import PreparedPass
from mfa_native.runtime.templates import PassTemplate, evaluate

GQA = ["--head-dim", "64", "--q-heads", "4", "--kv-heads", "2", "--q-len", "32"]

# kind, extra flags, the kernels its pass runs in order
KINDS = [
    ("attention", [], ["attention_forward"]),
    ("attention-backward", ["--sinks"], ["attention_backward_dq", "attention_backward_dkdv",
                                         "attention_backward_dsinks"]),
    ("sparse-attention", ["--topk", "16"], ["sparse_attention_forward"]),
    ("int8-attention", [], ["int8_key_mean", "int8_quantize_k", "int8_quantize_q", "int8_quantize_v",
                            "int8_attention_forward"]),
    ("int8-attention", ["--pv", "float", "--no-smooth-k"], ["int8_quantize_k", "int8_quantize_q",
                                                            "int8_attention_forward"]),
    ("quantize", ["--format", "q4_0"], ["quantize"]),
    ("sparse-topk", ["--topk", "8", "--causal", "lower_right"], ["sparse_topk_stream", "sparse_topk_merge"]),
    ("merge", ["--parts", "3"], ["attention_merge"]),
]


def emit(capsys, *args: str) -> str:
    assert cli_main(["emit", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("kind, extra, kernels", KINDS, ids=[f"{k}{''.join(e[:2])}" for k, e, _ in KINDS])
def test_every_kind_prints_its_kernels_plan_and_template(capsys, kind, extra, kernels):
    source = emit(capsys, kind, *GQA, *extra)
    assert re.findall(r"^kernel void (\w+)\(", source, re.M) == kernels
    plan = emit(capsys, kind, *GQA, *extra, "--plan")
    assert re.findall(r"^kernel (\w+):", plan, re.M) == kernels
    assert "[[buffer(0)]]" in plan
    template = PassTemplate.from_json(emit(capsys, kind, *GQA, *extra, "--json"))
    assert [k.entry for k in template.kernels] == kernels
    assert "".join(k.source for k in template.kernels) == source
    name, value = ("groups", 4 * 32 * 64 // 32) if kind == "quantize" else ("B", 2)   # q4_0's guard pins groups
    evaluated = mfa_native.PassDescription.from_json(emit(capsys, kind, *GQA, *extra, "--json", "--sizes",
                                                          f"{name}={value}"))
    assert [k.entry for k in evaluated.kernels] == kernels
    sizes = next(b for b in evaluated.buffers if b.role == "constant").value
    assert sizes[template.sizes.index(name)] == value


def test_the_captured_templates_are_the_ops_passes(capsys):
    """int8 attention's and quantize's builders return evaluated passes; the template emit prints
    for them evaluates to exactly that pass."""
    problem = codegen.AttentionProblem(1, 4, 2, 32, 32, 64, 64, dtype="float16", causal="lower_right", sinks=True,
                                       aligned=codegen.ALLOCATED)   # emit's problems: allocated arrays
    template = PassTemplate.from_json(emit(capsys, "int8-attention", *GQA, "--causal", "lower_right", "--sinks",
                                           "--qk-scale", "tile", "--json"))
    expected = codegen.int8_attention_pass(Int8Problem(problem, qk_scale="tile"))
    assert evaluate(template, codegen.call_sizes(problem)) == expected

    template = PassTemplate.from_json(emit(capsys, "quantize", *GQA, "--bits", "4", "--group-size", "32", "--json"))
    descriptor = codegen_quantize.QuantizeDescriptor("float16", QuantFormat.of("affine", 4, 32))
    assert evaluate(template, {"groups": 4 * 32 * 2}) == codegen_quantize.quantize_pass(descriptor, (1, 4, 32, 64))


def test_an_emitted_pass_runs_and_gives_the_ops_results(capsys, rng):
    """The quantize and sparse_topk passes emit prints, run as they are, give the ops' results."""
    device = next(d for d in mfa_native.devices() if d.kind == "cpu")
    x = rng.standard_normal((1, 4, 32, 64)).astype(np.float16)
    description = mfa_native.PassDescription.from_json(emit(capsys, "quantize", *GQA, "--bits", "4", "--json",
                                                            "--sizes", "groups=128"))
    data, scales, biases = PreparedPass(description, device).run([x])
    expected = mfa_native.quantize(x, bits=4, device="cpu")
    for got, want in ((data, expected.data), (scales, expected.scales), (biases, expected.biases)):
        np.testing.assert_array_equal(got, want)

    q = rng.standard_normal((1, 4, 32, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 48, 16)).astype(np.float32)
    weights = rng.standard_normal((1, 4, 32)).astype(np.float32)
    description = mfa_native.PassDescription.from_json(emit(
        capsys, "sparse-topk", "--head-dim", "16", "--q-heads", "4", "--q-len", "32", "--kv-len", "48", "--topk", "8",
        "--dtype", "float32", "--causal", "lower_right", "--json", "--sizes", "K=8"))
    indices, _ = PreparedPass(description, device).run([q, k, weights])
    np.testing.assert_array_equal(indices, mfa_native.sparse_topk(q, k, weights, 8))


@pytest.mark.parametrize("args, message", [
    (["quantize", "--head-dim", "48"], "multiple of the group size"),
    (["quantize", "--head-dim", "64", "--bits", "7"], "bits"),
    (["sparse-topk", "--head-dim", "64", "--causal", "upper_left"], "lower_right"),
    (["sparse-attention", "--head-dim", "64", "--topk", "0"], "--topk"),
    (["int8-attention", "--head-dim", "300"], "256"),
    (["merge", "--head-dim", "64", "--parts", "0"], "--parts"),
])
def test_bad_problems_are_refused_with_a_message(capsys, args, message):
    assert cli_main(["emit", *args]) == 2
    assert message in capsys.readouterr().err


def run_help(*args: str) -> str:
    env = dict(os.environ, COLUMNS="1000")   # no wrapping (argparse breaks lines at hyphens)
    return subprocess.run([sys.executable, "-m", "mfa_native", *args, "--help"], capture_output=True, text=True,
                          check=True, env=env).stdout


def test_help_lists_every_emit_kind_and_every_benchmark():
    from mfa_native.cli import bench, emit as emit_cli

    benchmarks = bench.names()
    assert {"attention", "core", "host", "int8_accuracy", "sparse"} <= set(benchmarks)
    top = " ".join(run_help().split())
    bench_line = top[top.index("bench "):top.index(" cache ")]
    assert all(name in bench_line for name in benchmarks), bench_line
    described = run_help("bench")
    for name in benchmarks:
        assert re.search(rf"^  {name} +\S", described, re.M), (name, described)
    emit_help = run_help("emit")
    emit_line = top[top.index(" emit "):top.index(" info ")]
    for kind in emit_cli.KINDS:
        assert re.search(rf"^  {kind} +\S", emit_help, re.M), kind
        assert kind in emit_line, emit_line
