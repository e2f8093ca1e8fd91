"""Block-sparse attention from a bundle: mfa::block_sparse_attention and its backward (through
_core's test hooks) on the cpu backend give Python's mfa_native.block_sparse_attention and
block_sparse_attention_backward bit for bit (partial and full blocks, per-head lists beside
lists shared by the heads or the batch, mask bits, from_mask's rule, GQA, both layouts, given
transposed lists), from entries whose templates keep the lists' widths, the bits' length and
the scale at run time; and the same bad calls raise the same exception with the same message,
in Python's order, before anything is written."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import mfa_native
from mfa_native import _core
from mfa_native.bundle import entries_of
from mfa_native.bundle.file import pack
from mfa_native.bundle.spec import BLOCK_SPARSE
from mfa_native.bundle.writer import (backward_templates, block_lists, build_payload, entry_line, forward_templates,
                                      problem)
from mfa_native.ops.block_mask import BITS, PAIRS
from mfa_native.ops.flex_bits import bit_blocks

from conftest import SEEDS, poison
from test_bundle import assert_chosen_are_codegens
from test_bundle_cpp import cpp_options, view

LISTS = tuple(name for pair in PAIRS for name in pair) + BITS
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
BASE = {"op": BLOCK_SPARSE, "family": ["apple9"], "causal": ["none"], "mask": ["none"], "window": [False],
        "sinks": [False], "shared_batch": [False], "mask_bits": [False], "full_blocks": [False]}
FAMILIES = [
    # "lists": partial and full blocks per query head, causal inside partial ones, GQA, backward
    # with and without the transposed lists
    {**BASE, "dtype": ["float32"], "head_dim": [32], "gqa_ratio": [2], "causal": ["lower_right"], "layout": ["bhsd"],
     "block_size": [16], "shared_heads": [False], "full_blocks": [True], "q_lists": [False, True], "backward": True},
    # "bits": FlexAttention's mask bits in (16, 8) blocks, lists shared by the heads, sinks and a softcap
    {**BASE, "dtype": ["float16"], "head_dim": [32], "layout": ["bshd"], "sinks": [True], "softcap": [20.0],
     "block_size": [[16, 8]], "shared_heads": [True], "mask_bits": [True], "q_lists": [False], "backward": True},
    # "rule": from_mask's lists (shared by batch and heads) and its rule (a window and a bool mask)
    {**BASE, "dtype": ["bfloat16"], "head_dim": [64], "value_dim": [32], "gqa_ratio": [2], "mask": ["bool"],
     "window": [True], "layout": ["bhsd"], "block_size": [8], "shared_batch": [True], "shared_heads": [True],
     "full_blocks": [True]},
]
B, HKV = 2, 2


@pytest.fixture(scope="module")
def bundle():
    return _core._Bundle.from_bytes(pack(build_payload(entries_of({"families": FAMILIES}))))


def _kv_lists(rng, lead: tuple[int, int], query_blocks: int, key_blocks: int, repeats: bool) -> tuple:
    """Random (counts, indices) for `lead` (B|1, H|1): each query block lists some key blocks
    (a repeat where `repeats`), padded with entries that are never read."""
    width = key_blocks + 1
    counts = rng.integers(0, width + 1 if repeats else key_blocks + 1, lead + (query_blocks,)).astype(np.int32)
    indices = rng.integers(-9, 99, lead + (query_blocks, width)).astype(np.int32)
    for at in np.ndindex(*counts.shape):
        chosen = rng.permutation(key_blocks)[:counts[at]]
        if counts[at] > key_blocks:
            chosen = np.append(chosen, chosen[0])   # a block listed twice counts twice
        indices[at][:counts[at]] = chosen
    return counts, indices


def _transposed(counts: np.ndarray, indices: np.ndarray, key_blocks: int) -> tuple:
    """The q lists of (counts, indices): per key block the query blocks listing it, as often as listed."""
    lead, query_blocks = counts.shape[:2], counts.shape[2]
    listed = [[[[] for _ in range(key_blocks)] for _ in range(lead[1])] for _ in range(lead[0])]
    for b, h, i in np.ndindex(*counts.shape):
        for j in indices[b, h, i, :counts[b, h, i]]:
            listed[b][h][j].append(i)
    width = max(1, max(len(q) for row in listed for head in row for q in head))
    q_counts = np.zeros(lead + (key_blocks,), np.int32)
    q_indices = np.full(lead + (key_blocks, width), -1, np.int32)
    for b, h, j in np.ndindex(*q_counts.shape):
        q_counts[b, h, j] = len(listed[b][h][j])
        q_indices[b, h, j, :q_counts[b, h, j]] = listed[b][h][j][::-1]   # any order
    return q_counts, q_indices


def _problem(rng, case: str, q_lists: bool = False):
    """One call's arguments for a named case: q, k, v, the block mask's parts (lists by name,
    block_size, shape, rule) and the op's other arguments (numpy, as Python takes them)."""
    layout = "bshd" if case == "bits" else "bhsd"
    t = DTYPES[{"lists": "float32", "bits": "float16", "rule": "bfloat16"}[case]]
    ratio = 1 if case == "bits" else 2
    d, dv = (64, 32) if case == "rule" else (32, 32)
    q_block, k_block = {"lists": (16, 16), "bits": (16, 8), "rule": (8, 8)}[case]
    r, c = int(rng.integers(1, 50)), int(rng.integers(1, 50))

    def four(heads: int, rows: int, width: int) -> np.ndarray:
        shape = (B, heads, rows, width) if layout == "bhsd" else (B, rows, heads, width)
        return rng.standard_normal(shape).astype(t)
    q, k, v = four(ratio * HKV, r, d), four(HKV, c, d), four(HKV, c, dv)
    query_blocks, key_blocks = -(-r // q_block), -(-c // k_block)
    args: dict = {"layout": layout}
    mask = {"block_size": (q_block, k_block), "shape": (r, c), "rule": None}
    if case == "rule":
        allowed = rng.random((1, 1, r, c)) < 0.8
        window = (int(rng.integers(0, 20)), int(rng.integers(-1, 5)))
        built = mfa_native.BlockMask.from_mask(allowed, window=window, R=r, C=c, block_size=8, device="cpu")
        mask.update(lists={name: built.array(name) for name in LISTS if built.array(name) is not None},
                    rule=built.rule)
        return q, k, v, mask, args
    lists = {}
    if case == "lists":   # full lists shared by the heads beside per-head partial ones: bound broadcast
        args["causal"] = "lower_right"
        lists["kv_num_blocks"], lists["kv_indices"] = _kv_lists(rng, (B, ratio * HKV), query_blocks, key_blocks, True)
        lists["full_kv_num_blocks"], lists["full_kv_indices"] = _kv_lists(rng, (B, 1), query_blocks, key_blocks, False)
        if q_lists:   # the transpose of the kv lists as the kernels read them (broadcast to per head)
            for prefix in ("", "full_"):
                counts, indices = (lists[f"{prefix}kv_{n}"] for n in ("num_blocks", "indices"))
                lead = (B, ratio * HKV)
                counts, indices = np.broadcast_to(counts, lead + counts.shape[2:]), \
                    np.broadcast_to(indices, lead + indices.shape[2:])
                lists[f"{prefix}q_num_blocks"], lists[f"{prefix}q_indices"] = _transposed(counts, indices, key_blocks)
    else:   # bits: partial blocks only, each pair's bit random (mostly set), sinks and softcap
        lists["kv_num_blocks"], lists["kv_indices"] = _kv_lists(rng, (B, 1), query_blocks, key_blocks, True)
        bits = max(1, int(lists["kv_num_blocks"].sum()) * q_block * k_block)
        words = rng.integers(-2**31, 2**31, -(-bits // 32), dtype=np.int64).astype(np.int32)
        lists.update(kv_bit_blocks=bit_blocks(lists["kv_num_blocks"]), kv_bits=words | np.int32(0x7f7f7f7f))
        args.update(sinks=rng.standard_normal(ratio * HKV).astype(np.float32), softcap=20.0, scale=0.3)
    mask["lists"] = lists
    return q, k, v, mask, args


def _block_mask(mask: dict) -> mfa_native.BlockMask:
    """Python's BlockMask of the parts (with the rule from_mask gave it)."""
    built = mfa_native.BlockMask(**mask["lists"], block_size=mask["block_size"], shape=mask["shape"])
    built.rule = mask["rule"]
    return built


def _hook_mask(mask: dict) -> dict:
    """The hooks' block mask arguments."""
    parts = {"lists": {name: view(a) for name, a in mask["lists"].items()}, "block_size": mask["block_size"],
             "seq_lengths": mask["shape"]}
    rule = mask["rule"]
    if rule is not None:
        parts.update(rule_causal=rule.causal, rule_window=rule.window,
                     rule_mask=None if rule.mask is None else view(rule.mask))
    return parts


CASES = ["lists", "bits", "rule"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_python_bit_for_bit(bundle, case, seed):
    rng = np.random.default_rng([CASES.index(case), seed])
    q, k, v, mask, args = _problem(rng, case)
    o, lse = mfa_native.block_sparse_attention(q, k, v, _block_mask(mask), return_lse=True, device="cpu", **args)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _core._bundle_block_sparse_attention("cpu", bundle, view(q), view(k), view(v), out=view(out), lse=view(rows),
                                         **_hook_mask(mask), **cpp_options(args))
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows, lse)
    assert np.isfinite(rows).any()


# (case, given q lists): float32 lists built on the device or given; float16 mask bits with sinks.
BACKWARD_CASES = {"built": ("lists", False), "given": ("lists", True), "bits": ("bits", False)}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", BACKWARD_CASES)
def test_backward_matches_python_bit_for_bit(bundle, name, seed):
    case, q_lists = BACKWARD_CASES[name]
    rng = np.random.default_rng([10 + list(BACKWARD_CASES).index(name), seed])
    q, k, v, mask, args = _problem(rng, case, q_lists)
    block_mask = _block_mask(mask)
    o, lse = mfa_native.block_sparse_attention(q, k, v, block_mask, return_lse=True, device="cpu", **args)
    dout = rng.standard_normal(o.shape).astype(o.dtype)
    grads = mfa_native.block_sparse_attention_backward(q, k, v, o, lse, dout, block_mask, device="cpu", **args)
    mine = [poison(g.shape, g.dtype) for g in grads]
    dsinks = view(mine[3]) if len(mine) == 4 else None
    _core._bundle_block_sparse_attention_backward("cpu", bundle, view(q), view(k), view(v), view(o), view(lse),
                                                  view(dout), dq=view(mine[0]), dk=view(mine[1]), dv=view(mine[2]),
                                                  dsinks=dsinks, **_hook_mask(mask), **cpp_options(args))
    for got, expected in zip(mine, grads):
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_strided_lists_match_python(bundle):
    """Lists given as views that are not contiguous (counts transposed in memory, indices a slice
    of wider rows) are copied as Python's BlockMask copies them."""
    rng = np.random.default_rng(12)
    q, k, v, mask, args = _problem(rng, "lists")
    lists = mask["lists"]
    counts, indices = lists["kv_num_blocks"], lists["kv_indices"]
    lists["kv_num_blocks"] = np.ascontiguousarray(counts.transpose(2, 1, 0)).transpose(2, 1, 0)
    wider = rng.integers(-5, 5, indices.shape[:3] + (2 * indices.shape[3],)).astype(np.int32)
    wider[..., :indices.shape[3]] = indices
    lists["kv_indices"] = wider[..., :indices.shape[3]]
    o, lse = mfa_native.block_sparse_attention(q, k, v, _block_mask(mask), return_lse=True, device="cpu", **args)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _core._bundle_block_sparse_attention("cpu", bundle, view(q), view(k), view(v), out=view(out), lse=view(rows),
                                         **_hook_mask(mask), **cpp_options(args))
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows, lse)


def test_an_empty_problem_writes_zeros_and_the_sinks(bundle):
    rng = np.random.default_rng(4)
    q, k, v, mask, args = _problem(rng, "bits")
    k, v = k[:, :0], v[:, :0]   # no keys: no key blocks, nothing counted
    mask["shape"] = (mask["shape"][0], 0)
    mask["lists"]["kv_num_blocks"][:] = 0
    o, lse = mfa_native.block_sparse_attention(q, k, v, _block_mask(mask), return_lse=True, device="cpu", **args)
    out, rows = poison(o.shape, o.dtype), poison(lse.shape, np.float32)
    _core._bundle_block_sparse_attention("cpu", bundle, view(q), view(k), view(v), out=view(out), lse=view(rows),
                                         **_hook_mask(mask), **cpp_options(args))
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))
    np.testing.assert_array_equal(rows, lse)


def _entry(lists: dict, name: str, value: int) -> None:
    """Sets the first counted entry of `name` (its count made at least 1) to `value`."""
    counts = lists[name.replace("indices", "num_blocks")]
    counts[0, 0, 0] = max(counts[0, 0, 0], 1)
    lists[name][0, 0, 0, 0] = value


# What changes from a good call of a case (in the dict {"q", "lists", "mask", "args"}).
BAD_CALLS = {
    "block size": ("lists", lambda c: c["mask"].update(block_size=(0, 16))),
    "kv_num_blocks dtype": ("lists", lambda c: c["lists"].update(
        kv_num_blocks=c["lists"]["kv_num_blocks"].astype(np.float32))),
    "kv_indices rank": ("lists", lambda c: c["lists"].update(kv_indices=c["lists"]["kv_indices"][0])),
    "indices not extending counts": ("lists", lambda c: c["lists"].update(kv_indices=c["lists"]["kv_indices"][:1])),
    "a pair without its partner": ("lists", lambda c: c["lists"].pop("full_kv_indices")),
    "full_q without q": ("lists", lambda c: c["lists"].update(full_q_num_blocks=c["lists"]["full_kv_num_blocks"],
                                                              full_q_indices=c["lists"]["full_kv_indices"])),
    "leading axes": ("lists", lambda c: c["lists"].update(
        full_kv_num_blocks=np.repeat(c["lists"]["full_kv_num_blocks"], 3, axis=1),
        full_kv_indices=np.repeat(c["lists"]["full_kv_indices"], 3, axis=1))),
    "bits without their partner": ("bits", lambda c: c["lists"].pop("kv_bits")),
    "bit blocks' shape": ("bits", lambda c: c["lists"].update(kv_bit_blocks=c["lists"]["kv_bit_blocks"][:1])),
    "attention's before the lists": ("lists", lambda c: (c.update(q=c["q"][..., :16]),
                                                         c["lists"]["kv_num_blocks"].__isub__(99))),
    "scale": ("lists", lambda c: c["args"].update(scale=float("inf"))),
    "shape": ("lists", lambda c: c["mask"].update(shape=(c["mask"]["shape"][0] + 1, c["mask"]["shape"][1]))),
    "lists' batch": ("lists", lambda c: c["lists"].update({n: np.concatenate([a, a[:1]])
                                                           for n, a in c["lists"].items()})),
    "block count": ("lists", lambda c: c["lists"].update(kv_num_blocks=np.concatenate(
        [c["lists"]["kv_num_blocks"]] * 2, axis=2), kv_indices=np.concatenate([c["lists"]["kv_indices"]] * 2, axis=2))),
    "count past the width": ("lists", lambda c: c["lists"]["full_kv_num_blocks"].__iadd__(99)),
    "negative count": ("lists", lambda c: c["lists"]["kv_num_blocks"].__isub__(99)),
    "entry past the blocks": ("lists", lambda c: _entry(c["lists"], "kv_indices", 1000)),
    "negative entry": ("lists", lambda c: _entry(c["lists"], "full_kv_indices", -1)),
    "negative bit block": ("bits", lambda c: c["lists"]["kv_bit_blocks"].__isub__(5)),
    "bits too short": ("bits", lambda c: c["lists"].update(kv_bits=c["lists"]["kv_bits"][:0])),
    "causal against the rule": ("rule", lambda c: c["args"].update(causal="upper_left")),
    "window against the rule": ("rule", lambda c: c["args"].update(window=(1, 1))),
    "mask against the rule": ("rule", lambda c: c["args"].update(mask=~c["mask"]["rule"].mask)),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_raise_pythons_message(bundle, case):
    kind, change = BAD_CALLS[case]
    rng = np.random.default_rng(7)
    q, k, v, mask, args = _problem(rng, kind)
    call = {"q": q, "lists": mask["lists"], "mask": mask, "args": args}
    change(call)
    q = call["q"]
    with pytest.raises((ValueError, TypeError)) as python:
        mfa_native.block_sparse_attention(q, k, v, _block_mask(mask), return_lse=True, device="cpu", **args)
    rows = q.shape[1 if kind == "bits" else 2]
    out = poison((B, 2 * HKV, rows, v.shape[3]) if kind != "bits" else (B, rows, HKV, v.shape[3]), q.dtype)
    lse = poison((B, 2 * HKV if kind != "bits" else HKV, rows), np.float32)
    with pytest.raises((ValueError, TypeError)) as cpp:
        _core._bundle_block_sparse_attention("cpu", bundle, view(q), view(k), view(v), out=view(out), lse=view(lse),
                                             **_hook_mask(mask), **cpp_options(args))
    assert (cpp.type, str(cpp.value)) == (python.type, str(python.value))
    assert np.isnan(out.astype(np.float32)).all() and np.isnan(lse).all()


def test_rule_given_again_is_the_rule(bundle):
    """causal, window and mask given as the rule has them (the mask as an equal copy) run as without them."""
    rng = np.random.default_rng(9)
    q, k, v, mask, args = _problem(rng, "rule")
    rule = mask["rule"]
    args.update(causal="none", window=rule.window, mask=rule.mask.copy())
    o = mfa_native.block_sparse_attention(q, k, v, _block_mask(mask), device="cpu", **args)
    out = poison(o.shape, o.dtype)
    _core._bundle_block_sparse_attention("cpu", bundle, view(q), view(k), view(v), out=view(out), **_hook_mask(mask),
                                         **cpp_options(args))
    np.testing.assert_array_equal(out.view(np.uint8), o.view(np.uint8))


def test_given_q_lists_that_are_not_the_transpose_raise_pythons_message(bundle):
    rng = np.random.default_rng(8)
    q, k, v, mask, args = _problem(rng, "lists", q_lists=True)
    lists = mask["lists"]
    b, h, j = np.argwhere(lists["q_num_blocks"] > 0)[0]
    lists["q_num_blocks"][b, h, j] -= 1   # a query block missing from a key block's list
    o, lse = mfa_native.block_sparse_attention(q, k, v, _block_mask(mask), return_lse=True, device="cpu", **args)
    with pytest.raises(ValueError) as python:
        mfa_native.block_sparse_attention_backward(q, k, v, o, lse, o, _block_mask(mask), device="cpu", **args)
    grads = [poison(x.shape, x.dtype) for x in (q, k, v)]
    with pytest.raises(ValueError) as cpp:
        _core._bundle_block_sparse_attention_backward("cpu", bundle, view(q), view(k), view(v), view(o), view(lse),
                                                      view(o), dq=view(grads[0]), dk=view(grads[1]),
                                                      dv=view(grads[2]), **_hook_mask(mask), **cpp_options(args))
    assert str(cpp.value) == str(python.value)
    assert "q_indices is not the transpose of kv_indices" in str(cpp.value)


def test_a_call_the_bundle_lacks_lists_its_entries(bundle):
    rng = np.random.default_rng(3)
    q, k, v, mask, args = _problem(rng, "bits")
    mask["lists"]["kv_num_blocks"][:] = 0
    mask["lists"].pop("kv_bits"), mask["lists"].pop("kv_bit_blocks")   # that family's entry reads bits
    out = poison((B, q.shape[1], HKV, 32), np.float16)
    with pytest.raises(ValueError, match=r"(?s)no entry for block_sparse_attention float16 .* block_size=16x8 "
                                         r"shared_batch=no shared_heads=yes full_blocks=no mask_bits=no .*it holds:\n"
                                         r"  block_sparse_attention float32"):
        _core._bundle_block_sparse_attention("cpu", bundle, view(q), view(k), view(v), out=view(out),
                                             **_hook_mask(mask), **cpp_options(args))
    assert np.isnan(out.astype(np.float32)).all()


def test_entry_lines_are_pythons(bundle):
    payload = build_payload(entries_of({"families": FAMILIES}))
    assert bundle.entries() == [entry_line(r["op"], r["facts"], len(r["forward"]), len(r["backward"]))
                                for r in payload["entries"]]
    assert "block_size=16x8 shared_batch=no shared_heads=yes full_blocks=no mask_bits=yes q_lists=no" in \
        bundle.entries()[2]


@pytest.mark.parametrize("facts", entries_of({"families": FAMILIES}), ids=lambda f: f"{f.dtype}-q_lists{f.q_lists}")
def test_entry_templates_are_codegens_for_every_size(facts):
    """For lengths, list widths and bit words across their ranges, the entry's first template
    whose guards hold is the template codegen generates for that call."""
    forward, backward = forward_templates(facts), backward_templates(facts) if facts.backward else []
    for r in (1, 9, 33, 300):
        for c in (1, 64, 5000):
            for width in (1, 7, 300):
                p = block_lists(problem(facts, r, c, batch=2, kv_heads=2), facts, width, 3 * width)
                assert_chosen_are_codegens(facts, p, forward, backward, (r, c, width))


@pytest.mark.parametrize("family, message", [
    ({"op": BLOCK_SPARSE, "head_dim": [8], "topk_length": [True]}, "unknown keys"),
    ({"op": BLOCK_SPARSE, "head_dim": [8], "block_size": [0]}, "'block_size' values must be positive"),
    ({"op": BLOCK_SPARSE, "head_dim": [8], "block_size": [[8, 8, 8]]}, "'block_size' values must be positive"),
    ({"op": BLOCK_SPARSE, "head_dim": [8], "q_lists": [1]}, "'q_lists' values must be true or false"),
])
def test_block_sparse_spec_errors_name_the_key(family, message):
    with pytest.raises(ValueError, match=message):
        entries_of({"families": [family]})


def test_a_forward_entry_takes_no_q_lists():
    entries = entries_of({"families": [{"op": BLOCK_SPARSE, "head_dim": [8], "dtype": ["float32"],
                                        "family": ["apple9"], "layout": ["bhsd"], "causal": ["none"],
                                        "mask": ["none"], "window": [False], "sinks": [False], "block_size": [16],
                                        "shared_batch": [True], "shared_heads": [True], "full_blocks": [False],
                                        "mask_bits": [False]}]})
    assert [(e.q_lists, e.block_size) for e in entries] == [(False, (16, 16))]
