"""One declaration per op: every public op is built from it, and what it derives (the function,
its docstring, the warm path, the caller's array kind, the torch schema) follows a change of
the declaration alone."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import mfa_native
from conftest import relative_l2
from mfa_native.ops.attention import ATTENTION, LSE, OUTPUT
from mfa_native.ops.declaration import OPS, Arg, Call, Op, Out
from mfa_native.ops.empty import empty_call, filled
from mfa_native.ops.warm import Checked

PUBLIC = [getattr(mfa_native, name) for name in mfa_native.__all__
          if inspect.isfunction(getattr(mfa_native, name)) and hasattr(getattr(mfa_native, name), "declaration")]


def test_every_public_op_is_declared():
    names = {f.__name__ for f in PUBLIC} | {"block_mask_from_mask"}
    assert names == {"attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
                     "attention_with_kvcache",
                     "block_sparse_attention", "block_sparse_attention_backward",
                     "int8_attention", "merge_attention", "quantize", "sparse_attention",
                     "sparse_attention_backward", "sparse_topk", "block_mask_from_mask"}
    assert names <= set(OPS)


@pytest.mark.parametrize("op", sorted(OPS), ids=str)
def test_the_function_is_the_declaration(op):
    op = OPS[op]
    function = op.function
    assert list(inspect.signature(function).parameters) == [a.name for a in op.arguments] + \
        (["device"] if op.takes_device else [])
    for a in op.arguments:
        assert f"    {a.name}: " in function.__doc__, a.name
        assert inspect.signature(function).parameters[a.name].default is a.default
    assert (op.backward is None) == (op.no_backward is not None), "an op says how it is differentiated, or why not"
    if op.backward is not None:
        backward = op.backward_op
        assert set(op.gradients.values()) <= {o.name for o in backward.outputs}
        assert set(op.gradients) <= {a.name for a in op.arguments if a.grad}


def _doubled(call: Call, device):
    """A toy op's prepare: its one array doubled (plus `offset`, the argument added below)."""
    x = np.asarray(call.x, np.float32)
    checked = Checked({"x": x}, {"x": None})
    extra = call.values.get("offset", 0.0)
    PREPARES.append(call.values.get("offset"))
    return empty_call(["x"], call.op.array_names, checked,
                      lambda inputs: [_scaled(inputs[0], extra)], lambda outputs: outputs[0])


def _scaled(x: np.ndarray, offset: float) -> np.ndarray:
    out = filled(x.shape, np.float32, 0)
    out[...] = 2 * x + offset
    return out


PREPARES: list = []
X = Arg("x", "array", leading=True, keyword=False, doc="the input.")


def test_adding_an_argument_is_one_change(rng):
    """The worked example of docs/design.md: one more Arg in the declaration gives the function
    its parameter, the docstring its line, the warm path its key and the prepare its value."""
    before = Op("toy_doubled", "2 x.", arguments=(X,), outputs=(Out("y", "2 x"),), prepare=_doubled,
                no_backward="toy_doubled is a toy")
    after = Op("toy_doubled_offset", "2 x + offset.", arguments=(X, Arg("offset", "option", default=0.0,
                                                                         doc="added to every element.")),
               outputs=(Out("y", "2 x + offset"),), prepare=_doubled, no_backward="toy_doubled_offset is a toy")
    try:
        x = rng.standard_normal((3, 4)).astype(np.float32)
        assert "offset" not in inspect.signature(before.function).parameters
        assert list(inspect.signature(after.function).parameters) == ["x", "offset", "device"]
        assert "    offset: added to every element." in after.function.__doc__
        PREPARES.clear()
        assert np.array_equal(after.function(x, offset=1.5), 2 * x + 1.5)
        assert np.array_equal(after.function(x, offset=1.5), 2 * x + 1.5)   # warm: no second prepare
        assert np.array_equal(after.function(x, offset=-1.0), 2 * x - 1.0)  # a new value, a new signature
        assert PREPARES == [1.5, -1.0]
        torch = pytest.importorskip("torch")
        y = after.function(torch.from_numpy(x), offset=0.5)                 # the caller's kind comes back
        assert type(y) is torch.Tensor and np.array_equal(y.numpy(), 2 * x + 0.5)
    finally:
        del OPS["toy_doubled"], OPS["toy_doubled_offset"]


def test_the_torch_schema_comes_from_the_declaration():
    pytest.importorskip("torch")
    from mfa_native.torch.library import schema

    assert schema(ATTENTION) == ("(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? sinks, Tensor? alibi_slopes, "
                                 "Tensor[] score_mod_tensors, float? scale, str causal, int[]? window, float? softcap, "
                                 "str? score_mod, str layout, str deterministic) -> (Tensor, Tensor)")
    assert schema(OPS["attention_backward"]).startswith("(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, "
                                                        "Tensor do, Tensor? mask, Tensor? sinks,")


def test_results_follow_the_outputs_asked_for():
    call = Call(ATTENTION, {"return_lse": False})
    assert call.results == "o"
    assert Call(ATTENTION, {"return_lse": True}).results == ("o", "lse")
    assert (OUTPUT.when, LSE.when) == (None, "return_lse")


def test_a_declaration_is_checked():
    with pytest.raises(ValueError, match="kind must be one of"):
        Arg("x", "tensor", doc="")
    with pytest.raises(ValueError, match="declared twice"):
        Op("attention", "", arguments=(), outputs=(), prepare=_doubled)


@pytest.mark.parametrize("op, module, not_inputs", [("attention_with_kvcache", "kvcache_rules", set()),
                                                    ("attention_varlen", "varlen_rules", {"o", "lse", "do"}),
                                                    ("attention_varlen_backward", "varlen_rules", set())])
def test_python_checks_by_the_declaration_the_core_reads(op, module, not_inputs):
    """The rules an op's Python checks run by (its module's RULES, checked in their order) are
    its declaration's, in the declaration's order: the order the C++ binder checks them in."""
    from importlib import import_module

    from mfa_native.ops.rules import rule_data
    rules = import_module(f"mfa_native.ops.{module}").RULES
    declared = [a for a in OPS[op].declaration_data()["arrays"] if a["name"] in rules and a["role"] == "input"]
    assert set(rules) - {a["name"] for a in declared} == not_inputs   # every rule but the backward's own inputs
    assert [a["name"] for a in declared] == [name for name in rules if name in [a["name"] for a in declared]]
    for a in declared:
        assert a == rule_data(a["name"], rules[a["name"]], a["role"], a["optional"], a["each"])


# -- the runner for every op: warm paths, the device merge, one empty path ---------------------------------


def _prepares(op_name: str, call, monkeypatch) -> int:
    """How many first calls (prepares) two identical calls of `call` make."""
    op = OPS[op_name]
    op.calls.clear()
    seen = []
    real = op.prepare
    monkeypatch.setattr(op, "prepare", lambda c, d: seen.append(1) or real(c, d))
    call()
    call()
    return len(seen)


def test_indexer_from_mask_quantizers_and_merge_take_the_warm_path(rng, monkeypatch):
    q = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 24, 16)).astype(np.float32)
    w = rng.random((1, 2, 8)).astype(np.float32)
    assert _prepares("sparse_topk", lambda: mfa_native.sparse_topk(q, k, w, 4), monkeypatch) == 1
    assert _prepares("block_mask_from_mask", lambda: mfa_native.BlockMask.from_mask(causal=True, R=40, C=40,
                                                                                    block_size=16), monkeypatch) == 1
    from mfa_native.ops.int8_attention import int8_quantized
    assert _prepares("int8_quantized", lambda: int8_quantized(q, k, k), monkeypatch) == 1
    o = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
    lse = rng.standard_normal((1, 2, 8)).astype(np.float32)
    assert _prepares("merge_attention", lambda: mfa_native.merge_attention([o, o], [lse, lse]), monkeypatch) == 1


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_merge_runs_on_the_device_and_keeps_nan(rng, dtype, poisoned_outputs):
    B, Hq, R, Dv = 2, 3, 5, 24
    parts = [rng.standard_normal((B, Hq, R, Dv)).astype(dtype) for _ in range(3)]
    lses = [(3 * rng.standard_normal((B, Hq, R))).astype(np.float32) for _ in range(3)]
    lses[1][0, 0, 0] = np.nan       # NaN in one part's lse: that row is NaN, not -inf
    for lse in lses:
        lse[1, 2, 3] = -np.inf      # a row that saw no key anywhere: 0 and -inf
    lses[0][1, 1, 1] = -np.inf      # a part that saw no key of one row: it adds nothing
    with mfa_native.profile() as recorded:
        o, lse = mfa_native.merge_attention(parts, lses)
    assert [r.kernel for r in recorded.records] == ["attention_merge"]
    expected_o, expected_lse = mfa_native.ops.merge.MERGE_ATTENTION.reference(parts, lses)
    assert np.isnan(o[0, 0, 0]).all() and np.isnan(lse[0, 0, 0])
    assert np.all(o[1, 2, 3] == 0) and lse[1, 2, 3] == -np.inf
    keep = np.ones((B, Hq, R), bool)
    keep[0, 0, 0] = keep[1, 2, 3] = False
    assert not np.isnan(o[keep]).any() and not np.isnan(lse[keep]).any()
    assert relative_l2(o[keep], expected_o[keep]) < (1e-6 if dtype == "float32" else 1e-3)
    assert relative_l2(lse[keep], expected_lse[keep]) < 1e-6


def test_one_empty_path_gives_the_callers_kind(rng, poisoned_outputs):
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 2, 0, 16)
    k = torch.randn(1, 2, 5, 16)
    o, lse = mfa_native.attention(q, k, k, return_lse=True)
    assert type(o) is torch.Tensor and o.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)
    x = torch.randn(0, 64)
    assert type(mfa_native.quantize(x).data) is torch.Tensor
    indices = mfa_native.sparse_topk(torch.randn(1, 2, 3, 16), torch.randn(1, 1, 0, 16), torch.rand(1, 2, 3), 4)
    assert type(indices) is torch.Tensor and (indices == -1).all()
    o, lse = mfa_native.merge_attention([torch.randn(1, 0, 3, 4)], [torch.randn(1, 0, 3)])
    assert type(o) is torch.Tensor and o.shape == (1, 0, 3, 4)
