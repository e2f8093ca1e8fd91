"""Property tests of the public API (issue "Hardening", part 7): random valid calls of every op
match the reference; random invalid ones raise ValueError or TypeError naming the argument,
never anything else, never a crash or a hang. Hypothesis runs derandomized (conftest), so a
warm run compiles nothing new."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mfa_native
from mfa_native import BlockMask
from mfa_native.reference import block_sparse_attention_backward_reference, block_sparse_attention_reference

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def valid_call(seed: int) -> dict:
    """One valid set of arguments for every op: q, k, v, o, lse, do, sinks, a mask, a block mask."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 2, 9, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 12, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 12, 8)).astype(np.float32)
    o, lse = mfa_native.attention(q, k, v, return_lse=True)
    block_mask = BlockMask(np.ones((1, 1, 2), np.int32), np.zeros((1, 1, 2, 2), np.int32), block_size=8)
    return dict(q=q, k=k, v=v, o=o, lse=lse, do=rng.standard_normal(o.shape).astype(np.float32),
                sinks=rng.standard_normal(2).astype(np.float32), mask=rng.random((9, 12)) > 0.2,
                block_mask=block_mask)


# argument -> [(bad value given the valid call, words the error must contain)]
MUTATIONS = {
    "q": [(lambda c: c["q"].astype(np.int32), "q"), (lambda c: c["q"][0], "q"), (lambda c: [1.0], "q"),
          (lambda c: c["q"].astype(np.float64), "q"), (lambda c: c["q"][:, :, :, :4], "head dimension"),
          (lambda c: np.concatenate([c["q"], c["q"][:, :1]], axis=1), "head count")],
    "k": [(lambda c: c["k"].astype(np.float16), "k"), (lambda c: c["k"][:, :, :5], "v must have k")],
    "v": [(lambda c: c["v"][..., :0], "Dv"), (lambda c: "v", "v")],
    "scale": [(lambda c: "1", "scale"), (lambda c: float("nan"), "scale"), (lambda c: True, "scale")],
    "causal": [(lambda c: "yes", "causal"), (lambda c: 2, "causal")],
    "window": [(lambda c: (1,), "window"), (lambda c: (1.5, 0), "window"), (lambda c: (-2, 0), "window")],
    "mask": [(lambda c: c["mask"].astype(np.int8), "mask"), (lambda c: c["mask"][:3], "mask")],
    "sinks": [(lambda c: c["sinks"][:1], "sinks"), (lambda c: c["sinks"].astype(np.int64), "sinks")],
    "layout": [(lambda c: "bsdh", "layout")],
    "device": [(lambda c: "gpu", "device"), (lambda c: 3, "device")],
    "return_lse": [(lambda c: "no", "return_lse")],
    "qk_scale": [(lambda c: "row", "qk_scale"), (lambda c: ["token"], "qk_scale")],
    "smooth_k": [(lambda c: 1, "smooth_k"), (lambda c: None, "smooth_k")],
    "pv": [(lambda c: "int4", "pv"), (lambda c: 8, "pv")],
    "o": [(lambda c: c["o"].astype(np.float16), "o"), (lambda c: c["o"][:, :1], "o")],
    "lse": [(lambda c: c["lse"].astype(np.float64), "lse"), (lambda c: c["lse"][..., :3], "lse")],
    "do": [(lambda c: c["do"][..., :2], "do"), (lambda c: c["do"].astype(np.float16), "do")],
    "block_mask": [(lambda c: (1, 2), "block_mask"),
                   (lambda c: BlockMask(np.ones((1, 1, 2), np.int32), np.full((1, 1, 2, 2), 7, np.int32),
                                        block_size=8), "kv_indices"),
                   (lambda c: BlockMask(np.ones((1, 1, 5), np.int32), np.zeros((1, 1, 5, 2), np.int32),
                                        block_size=8), "kv_num_blocks")],
}

OPS = {
    "attention": (lambda a: mfa_native.attention(a["q"], a["k"], a["v"], **a["options"]),
                  ("q", "k", "v", "scale", "causal", "window", "mask", "sinks", "layout", "device", "return_lse")),
    "attention_backward": (lambda a: mfa_native.attention_backward(a["q"], a["k"], a["v"], a["o"], a["lse"], a["do"],
                                                                   **a["options"]),
                           ("q", "k", "v", "o", "lse", "do", "scale", "causal", "window", "mask", "sinks",
                            "layout", "device")),
    "int8_attention": (lambda a: mfa_native.int8_attention(a["q"], a["k"], a["v"], **a["options"]),
                       ("q", "k", "v", "scale", "causal", "window", "mask", "sinks", "layout", "device", "return_lse",
                        "qk_scale", "smooth_k", "pv")),
    "block_sparse_attention": (lambda a: mfa_native.block_sparse_attention(a["q"], a["k"], a["v"], a["block_mask"],
                                                                           **a["options"]),
                               ("q", "k", "v", "block_mask", "scale", "causal", "window", "mask", "sinks",
                                "layout", "device", "return_lse")),
    "block_sparse_attention_backward": (
        lambda a: mfa_native.block_sparse_attention_backward(a["q"], a["k"], a["v"], a["o"], a["lse"], a["do"],
                                                             a["block_mask"], **a["options"]),
        ("q", "k", "v", "o", "lse", "do", "block_mask", "scale", "causal", "mask", "sinks", "device")),
}
POSITIONAL = ("q", "k", "v", "o", "lse", "do", "block_mask")


@st.composite
def invalid_calls(draw):
    op = draw(st.sampled_from(sorted(OPS)))
    call, arguments = OPS[op]
    name = draw(st.sampled_from([a for a in arguments if a in MUTATIONS]))
    mutate, words = draw(st.sampled_from(MUTATIONS[name]))
    return op, name, mutate, words, draw(st.integers(0, 3))


@SETTINGS
@given(invalid_calls())
def test_invalid_arguments_raise_a_clear_error_naming_them(case):
    op, name, mutate, words, seed = case
    call, arguments = OPS[op]
    valid = valid_call(seed)
    given_ = {n: valid[n] for n in POSITIONAL}
    given_["options"] = {}
    bad = mutate(valid)
    if name in POSITIONAL:
        given_[name] = bad
    else:
        given_["options"][name] = bad
    with pytest.raises((ValueError, TypeError)) as error:
        call(given_)
    assert words in str(error.value), f"{op}({name}=...) raised {error.value!r}"


@st.composite
def block_sparse_problems(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    R, C = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    q_block, k_block = draw(st.sampled_from([8, 16])), draw(st.sampled_from([8, 24]))
    rows, cols = -(-R // q_block), -(-C // k_block)
    counts = rng.integers(0, cols + 1, (1, 1, rows)).astype(np.int32)
    listed = rng.integers(0, cols, (1, 1, rows, cols + 1)).astype(np.int32)
    full = {}
    if draw(st.booleans()):
        full = dict(full_kv_num_blocks=rng.integers(0, 2, (1, 1, rows)).astype(np.int32),
                    full_kv_indices=rng.integers(0, cols, (1, 1, rows, 1)).astype(np.int32))
    block_mask = BlockMask(counts, listed, block_size=(q_block, k_block), **full)
    q = rng.standard_normal((1, 2, R, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, C, 8)).astype(np.float32) for _ in range(2))
    options = dict(causal=draw(st.sampled_from([False, True, "upper_left"])),
                   window=draw(st.sampled_from([None, (4, 1)])))
    if draw(st.booleans()):
        options["sinks"] = rng.standard_normal(2).astype(np.float32)
    return q, k, v, block_mask, options, rng


@settings(SETTINGS, max_examples=20)
@given(block_sparse_problems())
def test_random_block_sparse_problems_match_the_reference(problem):
    q, k, v, block_mask, options, rng = problem
    out, lse = mfa_native.block_sparse_attention(q, k, v, block_mask, return_lse=True, **options)
    assert relative_l2(out, block_sparse_attention_reference(q, k, v, block_mask, **options)) < 1e-4
    do = rng.standard_normal(out.shape).astype(np.float32)
    grads = mfa_native.block_sparse_attention_backward(q, k, v, out, lse, do, block_mask, **options)
    for grad, reference in zip(grads, block_sparse_attention_backward_reference(q, k, v, do, block_mask, out=out,
                                                                                **options)):
        # Absolute as well as relative: a row seeing one key has a gradient that cancels to 0.
        assert np.linalg.norm(grad - reference) <= 1e-3 * np.linalg.norm(reference) + 1e-5
