"""Pass templates: size expressions, JSON round trips, and one template serving every call
its guards admit, with the same concrete pass as building it for that call."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mfa_native import codegen
from mfa_native.codegen import AttentionBackwardProblem, AttentionProblem, BlockLists, TokenLists
from mfa_native.quant_formats import QuantFormat
from mfa_native.runtime.expressions import evaluate as value_of
from mfa_native.runtime.templates import SCHEMA_VERSION, PassTemplate, evaluate

QUANT = codegen.QuantizedStorage(QuantFormat.of("affine", 4, 32), (0, 0, 0, 1), "float32", (0, 0, 0, 1), (0, 0, 0, 1))


def _quantized(p: AttentionProblem) -> AttentionProblem:
    """p with k and v stored 4-bit affine, contiguous fields."""
    f, rows = QUANT.format, (p.batch, p.kv_heads, p.kv_len)
    stored = []
    for width in (p.head_dim, p.value_dim):
        data = codegen.contiguous_strides(p.layout, (*rows, f.data_width(width)))
        groups = codegen.contiguous_strides(p.layout, (*rows, f.groups(width)))
        stored.append(replace(QUANT, data_strides=data, scale_strides=groups, bias_strides=groups))
    return replace(p, k_storage=stored[0], v_storage=stored[1])


def _blocks(p: AttentionProblem, q_block=16, k_block=24, **widths) -> AttentionProblem:
    cols = -(-p.kv_len // k_block)
    return replace(p, keys=BlockLists(q_block, k_block, False, True, cols, **widths))


def _tokens(p: AttentionProblem, topk=12) -> AttentionProblem:
    strides = (p.q_len * topk, 0, topk, 1)  # one (B, 1, R, topk) list shared by the kv heads
    return replace(p, keys=TokenLists(topk, strides, (p.q_len, 1)))


def _resized(p: AttentionProblem, **sizes) -> AttentionProblem:
    """p with other sizes, its tensors contiguous for them (as an op builds problems)."""
    return replace(p, **sizes, q_strides=None, k_strides=None, v_strides=None, mask_strides=None)


BASE = AttentionProblem(2, 8, 2, 40, 70, 32, 24, dtype="float16", causal="lower_right", return_lse=True)
FORWARD = {
    "dense": BASE,
    "bshd, mask, window, sinks": _resized(BASE, layout="bshd", mask="additive", window=(5, -1), sinks=True,
                                          causal="none"),
    "decode": _resized(BASE, q_len=1, kv_len=3000),
    "quantized": _quantized(_resized(BASE, q_len=3, value_dim=32)),
    "block lists": _blocks(BASE, full_width=3),
    "token lists": _tokens(BASE),
    "baked": BASE,
}


def _forward(name: str, p: AttentionProblem, **kwargs) -> PassTemplate:
    return codegen.attention_template(p, bake_lengths=name == "baked", **kwargs)


@pytest.mark.parametrize("name", FORWARD)
def test_forward_templates_round_trip_and_evaluate_to_the_pass(name):
    p = FORWARD[name]
    template = _forward(name, p, parallel_threadgroups=64)
    again = PassTemplate.from_json(template.to_json())
    assert again == template
    built = codegen.attention_pass(p, bake_lengths=name == "baked", parallel_threadgroups=64)
    assert evaluate(again, codegen.call_sizes(p, 64)) == built


@pytest.mark.parametrize("name", [n for n in FORWARD if n != "baked"])
def test_one_template_serves_other_lengths_and_batches(name):
    """A template made for one problem, evaluated for another its guards admit, is the pass
    built for that other problem: same sources, grids, shapes, strides and constants."""
    p = FORWARD[name]
    template = _forward(name, p)
    other = _resized(p, batch=3, kv_len=p.kv_len + 37, q_heads=p.q_heads * 2, kv_heads=p.kv_heads * 2)
    if isinstance(p.keys, TokenLists):
        other = _tokens(other)
    if isinstance(p.keys, BlockLists):
        other = _blocks(other, full_width=3)
    if p.k_storage is not codegen.PLAIN:
        other = _quantized(other)
    assert evaluate(template, codegen.call_sizes(other)) == codegen.attention_pass(other)


def test_guards_refuse_what_the_tiles_were_not_chosen_for():
    mha = _resized(BASE, kv_heads=8)  # GQA decode packs heads (test_packed_decode.py); MHA shrinks rows
    decode = codegen.attention_template(_resized(mha, q_len=4))  # rows shrunk to 8 for 4 queries
    with pytest.raises(ValueError, match="R <= 8"):
        evaluate(decode, codegen.call_sizes(mha))
    with pytest.raises(ValueError, match="Hq == 4 \\* Hkv"):
        evaluate(codegen.attention_template(BASE), {**codegen.call_sizes(BASE), "Hkv": 8})
    with pytest.raises(ValueError, match="needs sizes \\['C'\\]"):
        evaluate(codegen.attention_template(BASE), {k: v for k, v in codegen.call_sizes(BASE).items() if k != "C"})


def test_the_split_decision_travels_with_the_template():
    """The decode template decides split-KV per call, from the device size P, as kv_split does."""
    decode = _resized(BASE, q_len=1, kv_len=4096)
    split = codegen.attention_template(decode, parallel_threadgroups=64)
    assert [k.entry for k in split.kernels] == ["attention_partial", "attention_combine"]
    longer = _resized(decode, kv_len=9000, batch=1)
    assert evaluate(split, codegen.call_sizes(longer, 64)) == codegen.attention_pass(longer, parallel_threadgroups=64)
    assert codegen.kv_split(longer, codegen.CPU_FAMILY, 64) is not None
    with pytest.raises(ValueError, match="SPLIT"):  # too few keys to split: the one-pass template's call
        evaluate(split, codegen.call_sizes(_resized(decode, kv_len=300), 64))


BACKWARD = {"dense": BASE, "sinks, mask": _resized(BASE, sinks=True, mask="bool", layout="bshd"),
            "block lists, given q lists": _blocks(BASE, q_width=3), "token lists": _tokens(BASE)}


@pytest.mark.parametrize("name", BACKWARD)
def test_backward_templates(name):
    p = BACKWARD[name]
    problem = AttentionBackwardProblem(p)
    template = codegen.attention_backward_template(problem)
    assert PassTemplate.from_json(template.to_json()) == template
    assert evaluate(template, codegen.call_sizes(p)) == codegen.attention_backward_pass(problem)
    other = _resized(p, batch=1, kv_len=p.kv_len + 50)
    other = _tokens(other) if isinstance(p.keys, TokenLists) else other
    other = _blocks(other, q_width=3) if isinstance(p.keys, BlockLists) else other
    assert evaluate(template, codegen.call_sizes(other)) == codegen.attention_backward_pass(AttentionBackwardProblem(other))


def test_a_future_schema_is_refused():
    text = codegen.attention_template(BASE).to_json().replace(f'"schema": {SCHEMA_VERSION}', '"schema": 99')
    with pytest.raises(ValueError, match="schema 99"):
        PassTemplate.from_json(text)


@pytest.mark.parametrize("text, sizes, value", [
    ("cdiv(R * 4, 32) * B", {"R": 9, "B": 2}, 4),
    ("min(cdiv(P, TG), C / 256, 64)", {"P": 80, "TG": 3, "C": 4096}, 16),
    ("R <= 16 && S0 >= 2 && !(S < 2)", {"R": 3, "S0": 2, "S": 2}, 1),
    ("R > 16 || 0", {"R": 3}, 0),
    ("1 + 2 * 3 - 4 / 3 % 2", {}, 6),
    ("max(7, C) == C", {"C": 9}, 1),
    ("-B + 10", {"B": 3}, 7),
])
def test_size_expressions(text, sizes, value):
    assert value_of(text, sizes) == value


@pytest.mark.parametrize("text, message", [
    ("R +", "expected more"), ("R $ 2", "unexpected '\\$'"), ("pow(R, 2)", "unknown function"),
    ("cdiv(R)", "unknown function or arity"), ("Q * 2", "size 'Q' is not given"), ("R / 0", "divides by 0"),
    ("(R", "expected \\)"),
])
def test_bad_size_expressions_say_why(text, message):
    with pytest.raises(ValueError, match=message):
        value_of(text, {"R": 4})
