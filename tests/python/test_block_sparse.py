"""Block-sparse attention (FlexAttention's BlockMask) against a float64 dense reference built from
the same rules: random lists with and without full blocks, unequal block sizes from 8 to 256,
lengths that are not multiples of them, broadcast list axes, every masking rule, sinks, GQA,
both layouts, transposed lists given and built on the device. Outputs are poisoned (conftest)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from test_attention import DTYPES, TOLERANCE, make_inputs

import mfa_native
import mfa_native.reference
from mfa_native import BlockMask
from mfa_native.reference import block_sparse_attention_backward_reference, block_sparse_attention_reference
from mfa_native.work import useful_block_sparse_matrix_ops


def random_lists(rng, lead, rows, targets, width, *, allow_duplicates=True):
    """(num_blocks, indices): per row a random count (0..width) of random targets, padding after it."""
    counts = rng.integers(0, width + 1, (*lead, rows)).astype(np.int32)
    if allow_duplicates:
        listed = rng.integers(0, targets, (*lead, rows, width))
    else:
        listed = np.argsort(rng.random((*lead, rows, targets)), axis=-1)[..., :width]
    padding = rng.integers(-5, 2**31 - 1, listed.shape)  # past the count anything goes
    listed = np.where(np.arange(width) < counts[..., None], listed, padding)
    return counts, listed.astype(np.int32)


def transposed(counts, listed, key_blocks):
    """FlexAttention's q lists from kv lists: per key block, the query blocks listing it (in order)."""
    lead, rows = counts.shape[:2], counts.shape[2]
    entries = [[[[] for _ in range(key_blocks)] for _ in range(lead[1])] for _ in range(lead[0])]
    for b in range(lead[0]):
        for h in range(lead[1]):
            for i in range(rows):
                for j in listed[b, h, i, :counts[b, h, i]]:
                    entries[b][h][j].append(i)
    width = max(1, max(len(e) for per_b in entries for per_h in per_b for e in per_h))
    q_counts = np.zeros((*lead, key_blocks), np.int32)
    q_listed = np.full((*lead, key_blocks, width), 7, np.int32)
    for b in range(lead[0]):
        for h in range(lead[1]):
            for j in range(key_blocks):
                e = entries[b][h][j]
                q_counts[b, h, j] = len(e)
                q_listed[b, h, j, :len(e)] = e
    return q_counts, q_listed


def make_block_mask(rng, *, B, H, R, C, q_block, k_block, full, given, lead=None):
    rows, cols = -(-R // q_block), -(-C // k_block)
    lead = lead or (B, H)
    lists = dict(zip(("kv_num_blocks", "kv_indices"), random_lists(rng, lead, rows, cols, cols + 1)))
    if full:
        lists.update(zip(("full_kv_num_blocks", "full_kv_indices"), random_lists(rng, lead, rows, cols, 2)))
    if given:
        lists.update(zip(("q_num_blocks", "q_indices"),
                         transposed(lists["kv_num_blocks"], lists["kv_indices"], cols)))
        if full:
            lists.update(zip(("full_q_num_blocks", "full_q_indices"),
                             transposed(lists["full_kv_num_blocks"], lists["full_kv_indices"], cols)))
    return BlockMask(**lists, block_size=(q_block, k_block), shape=(R, C))


CASES = [
    dict(dims=dict(R=40, C=56, D=16), blocks=(16, 16), full=True, given=False, kwargs=dict(causal=True)),
    dict(dims=dict(R=37, C=70, D=24, Dv=8), blocks=(8, 24), full=False, given=True, kwargs={}),
    dict(dims=dict(Hq=4, Hkv=2, R=50, C=45, D=16), blocks=(24, 8), full=True, given=True,
         kwargs=dict(window=(9, 3), sinks=True), lead=(1, 4)),
    dict(dims=dict(B=2, R=33, C=130, D=8, layout="bshd"), blocks=(32, 64), full=True, given=False,
         kwargs=dict(causal="upper_left", mask="bool", layout="bshd"), lead=(2, 1)),
    dict(dims=dict(R=20, C=300, D=32, dtype="float16"), blocks=(8, 256), full=True, given=False,
         kwargs=dict(mask="additive")),
    dict(dims=dict(Hq=2, R=256, C=96, D=16, dtype="bfloat16"), blocks=(256, 40), full=True, given=True,
         kwargs=dict(causal=True, sinks=True)),
    # Block sizes that are not multiples of 8: block boundaries inside the kernels' 8-row tiles.
    dict(dims=dict(R=3, C=130, D=16), blocks=(1, 64), full=True, given=False, kwargs={}),   # FlexAttention's decode
    dict(dims=dict(Hq=4, Hkv=2, R=19, C=23, D=8), blocks=(5, 3), full=True, given=True,
         kwargs=dict(window=(4, 2))),
    dict(dims=dict(R=40, C=50, D=16), blocks=(12, 20), full=False, given=False, kwargs=dict(causal=True)),
]


def arguments(rng, case):
    dims = dict(case["dims"])
    q, k, v = make_inputs(rng, **dims)
    B, Hq, R, C = dims.get("B", 1), dims.get("Hq", 2), dims["R"], dims["C"]
    kwargs = dict(case["kwargs"])
    if kwargs.get("sinks"):
        kwargs["sinks"] = rng.standard_normal(Hq).astype(np.float32)
    if kwargs.get("mask") == "bool":
        kwargs["mask"] = rng.random((B, 1, R, C)) > 0.3
    elif kwargs.get("mask") == "additive":
        mask = rng.standard_normal((R, C)).astype(np.float32)
        mask[rng.random((R, C)) < 0.2] = -np.inf
        kwargs["mask"] = mask
    lead = case.get("lead") or (1, 1)
    block_mask = make_block_mask(rng, B=B, H=Hq, R=R, C=C, q_block=case["blocks"][0], k_block=case["blocks"][1],
                                 full=case["full"], given=case["given"], lead=lead)
    return q, k, v, block_mask, kwargs


def dtype_name(x) -> str:
    return {np.dtype(t): name for name, t in DTYPES.items()}[x.dtype]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['blocks']}-{sorted(c['kwargs'])}")
def test_forward_matches_the_dense_reference(rng, case):
    q, k, v, block_mask, kwargs = arguments(rng, case)
    out, lse = mfa_native.block_sparse_attention(q, k, v, block_mask, return_lse=True, **kwargs)
    expected, expected_lse = block_sparse_attention_reference(q, k, v, block_mask, return_lse=True, **kwargs)
    tolerance = TOLERANCE[dtype_name(q)]
    assert out.dtype == q.dtype and out.shape == expected.shape
    assert relative_l2(out, expected) < tolerance
    empty = np.isneginf(expected_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], expected_lse[~empty], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['blocks']}-{sorted(c['kwargs'])}")
def test_backward_matches_the_dense_reference(rng, case):
    q, k, v, block_mask, kwargs = arguments(rng, case)
    o, lse = mfa_native.block_sparse_attention(q, k, v, block_mask, return_lse=True, **kwargs)
    do = rng.standard_normal(o.shape).astype(q.dtype)
    grads = mfa_native.block_sparse_attention_backward(q, k, v, o, lse, do, block_mask, **kwargs)
    expected = block_sparse_attention_backward_reference(q, k, v, do, block_mask, out=o, **kwargs)
    assert len(grads) == len(expected) == (4 if "sinks" in kwargs else 3)
    tolerance = 10 * TOLERANCE[dtype_name(q)]
    for grad, reference in zip(grads, expected):
        assert relative_l2(grad, reference) < tolerance


def test_given_and_built_transposed_lists_give_the_same_bits(rng):
    case = dict(CASES[2], given=False)
    q, k, v, built, kwargs = arguments(rng, case)
    given = BlockMask(**built.arrays, **dict(zip(("q_num_blocks", "q_indices"),
                                                   transposed(built.kv_num_blocks, built.kv_indices, 6))),
                      **dict(zip(("full_q_num_blocks", "full_q_indices"),
                                 transposed(built.full_kv_num_blocks, built.full_kv_indices, 6))),
                      block_size=built.block_size)
    o, lse = mfa_native.block_sparse_attention(q, k, v, built, return_lse=True, **kwargs)
    do = rng.standard_normal(o.shape).astype(np.float32)
    with mfa_native.profile() as prof:
        first = mfa_native.block_sparse_attention_backward(q, k, v, o, lse, do, built, **kwargs)
    assert prof.records[0].kernel == "attention_transpose_lists"
    again = mfa_native.block_sparse_attention_backward(q, k, v, o, lse, do, built, **kwargs)
    from_given = mfa_native.block_sparse_attention_backward(q, k, v, o, lse, do, given, **kwargs)
    for a, b, c in zip(first, again, from_given):
        np.testing.assert_array_equal(a, b)   # deterministic: no atomics
        np.testing.assert_array_equal(a, c)


def test_only_listed_blocks_are_visited(rng):
    """Issued matrix work equals the useful tiles of the listed blocks (a block listed twice counts twice)."""
    R = C = 256
    q, k, v = make_inputs(rng, Hq=1, R=R, C=C, D=8)
    block_mask = make_block_mask(rng, B=1, H=1, R=R, C=C, q_block=32, k_block=64, full=True, given=False)
    for kwargs in ({}, {"causal": True}):
        with mfa_native.profile() as prof:
            out = mfa_native.block_sparse_attention(q, k, v, block_mask, **kwargs)
        (record,) = prof.records
        if record.simdgroup_matrix_ops is None:
            pytest.skip("this backend does not count simdgroup_matrix operations")
        assert record.simdgroup_matrix_ops == useful_block_sparse_matrix_ops(block_mask, 1, 1, R, C, 8, 8, **kwargs)
        assert relative_l2(out, block_sparse_attention_reference(q, k, v, block_mask, **kwargs)) < 1e-4
    # Every block listed once, as partial: the dense kernel's work, tile for tile.
    every = BlockMask(np.full((1, 1, 8), 4, np.int32), np.tile(np.arange(4, dtype=np.int32), (1, 1, 8, 1)),
                      block_size=(32, 64))
    with mfa_native.profile() as prof:
        mfa_native.block_sparse_attention(q, k, v, every, causal=True)
        mfa_native.attention(q, k, v, causal=True)
    assert prof.records[0].simdgroup_matrix_ops == prof.records[1].simdgroup_matrix_ops == \
        useful_block_sparse_matrix_ops(every, 1, 1, R, C, 8, 8, causal=True)


def bad(message, exception=ValueError):
    return pytest.raises(exception, match=message)


def test_bad_block_masks_are_refused(rng):
    num, idx = np.ones((1, 1, 3), np.int32), np.zeros((1, 1, 3, 2), np.int32)
    with bad("int32", TypeError):
        BlockMask(num.astype(np.int64), idx)
    with bad("kv_indices .* must extend"):
        BlockMask(num, idx[:, :, :2])
    with bad("must be positive"):
        BlockMask(num, idx, block_size=(0, 16))
    with bad("pass both or neither"):
        BlockMask(num, idx, full_kv_num_blocks=num)
    with bad("block_size", TypeError):
        BlockMask(num, idx, block_size="128")
    q, k, v = make_inputs(rng, R=40, C=30, D=8)
    with bad("ceil\\(R / Q_BLOCK\\)"):
        mfa_native.block_sparse_attention(q, k, v, BlockMask(num, idx, block_size=8))
    with bad("outside 0..1"):
        mfa_native.block_sparse_attention(q, k, v, BlockMask(num, idx + 2, block_size=16))
    with bad("must be in 0..2"):
        mfa_native.block_sparse_attention(q, k, v, BlockMask(num * 3, idx, block_size=16))
    with bad("block_mask.shape"):
        mfa_native.block_sparse_attention(q, k, v, BlockMask(num, idx, block_size=16, shape=(40, 31)))
    with bad("leading axes"):
        lists = BlockMask(np.ones((1, 3, 3), np.int32), np.zeros((1, 3, 3, 2), np.int32), block_size=16)
        mfa_native.block_sparse_attention(q, k, v, lists)
    with bad("block_mask must be", TypeError):
        mfa_native.block_sparse_attention(q, k, v, (num, idx))
    good = BlockMask(num, idx, block_size=16)
    mfa_native.block_sparse_attention(q, k, v, good)
    good.kv_indices[0, 0, 0, 0] = 9   # contents change between warm calls: checked again
    with bad("outside 0..1"):
        mfa_native.block_sparse_attention(q, k, v, good)


def classify(allowed, q_block, k_block):
    """numpy: (B, H, NQ, NK) block classes, 0 none, 1 some, 2 all of the pairs that exist."""
    B, H, R, C = allowed.shape
    rows, cols = -(-R // q_block), -(-C // k_block)
    classes = np.zeros((B, H, rows, cols), int)
    for i in range(rows):
        for j in range(cols):
            block = allowed[:, :, i * q_block:(i + 1) * q_block, j * k_block:(j + 1) * k_block]
            classes[:, :, i, j] = np.where(block.all(axis=(2, 3)), 2, np.where(block.any(axis=(2, 3)), 1, 0))
    return classes


def ordered(selected):
    """FlexAttention's (num_blocks, indices): the selected blocks ascending, then the others."""
    return selected.sum(-1).astype(np.int32), np.argsort(~selected, axis=-1, kind="stable").astype(np.int32)


@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(causal="upper_left", window=(20, 3)), dict(mask="bool"),
                                    dict(mask="additive", window=(-1, 0))])
def test_from_mask_classifies_like_numpy(rng, kwargs):
    B, H, R, C, block_size = 2, 3, 77, 50, (16, 24)
    kwargs = dict(kwargs)
    if kwargs.get("mask") == "bool":
        mask = rng.random((B, 1, R, C)) > 0.01
        mask[:, :, :32, 24:] = False      # whole blocks out
        kwargs["mask"] = mask
    elif kwargs.get("mask") == "additive":
        mask = rng.standard_normal((R, C)).astype(np.float32)
        mask[40:, :] = -np.inf
        kwargs["mask"] = mask
    block_mask = BlockMask.from_mask(R=R, C=C, block_size=block_size, B=B, H=H, **kwargs)
    allowed = np.broadcast_to(mfa_native.reference.allowed_keys(R, C, kwargs.get("causal", False),
                                                               kwargs.get("window")), (B, H, R, C))
    mask = kwargs.get("mask")
    if mask is not None:
        allowed = allowed & (np.broadcast_to(mask, allowed.shape) if mask.dtype == np.bool_ else
                             np.broadcast_to(mask > -1e30, allowed.shape))
    classes = classify(allowed, *block_size)
    for prefix, c in (("kv", classes), ("q", classes.transpose(0, 1, 3, 2))):
        for full, kind in (("", 1), ("full_", 2)):
            num, indices = ordered(c == kind)
            np.testing.assert_array_equal(getattr(block_mask, f"{full}{prefix}_num_blocks"), num)
            np.testing.assert_array_equal(getattr(block_mask, f"{full}{prefix}_indices"), indices)
    assert block_mask.shape == (R, C) and block_mask.block_size == block_size
    # Used with the same rules, it gives dense attention's result.
    q, k, v = make_inputs(rng, B=B, Hq=H, Hkv=1, R=R, C=C, D=16)
    out = mfa_native.block_sparse_attention(q, k, v, block_mask, **kwargs)
    assert relative_l2(out, mfa_native.reference.attention_reference(q, k, v, **kwargs)) < 1e-4


def test_from_mask_refuses_bad_arguments():
    with bad("R must be an int", TypeError):
        BlockMask.from_mask(R=3.0, C=5)
    with bad("must be positive"):
        BlockMask.from_mask(R=16, C=16, block_size=-4)
    with bad("mask must be boolean", TypeError):
        BlockMask.from_mask(np.zeros((4, 4), np.int8), R=4, C=4, block_size=8)
    with bad("does not broadcast"):
        BlockMask.from_mask(np.zeros((3, 4), bool), R=4, C=4, block_size=8)


def test_from_torch_converts_flex_attentions_block_mask(rng):
    pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    R = C = 200  # equal lengths: FlexAttention's positions and our diagonal agree

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= 50) & (kv_idx <= q_idx)

    torch_mask = flex.create_block_mask(sliding, B=None, H=None, Q_LEN=R, KV_LEN=C, device="cpu", BLOCK_SIZE=(32, 16))
    block_mask = BlockMask.from_torch(torch_mask)
    assert block_mask.block_size == (32, 16) and block_mask.shape == (R, C)
    np.testing.assert_array_equal(block_mask.kv_indices, torch_mask.kv_indices.numpy())
    q, k, v = make_inputs(rng, Hq=2, R=R, C=C, D=16)
    out = mfa_native.block_sparse_attention(q, k, v, block_mask, causal="upper_left", window=(50, 0))
    expected = mfa_native.reference.attention_reference(q, k, v, causal="upper_left", window=(50, 0))
    assert relative_l2(out, expected) < 1e-4


def test_bytes_read_follow_the_listed_blocks(rng):
    """K and V are read only for the listed blocks: per visited 8-key tile each simdgroup loads
    8 keys x ceil(D/8) * 8 features of k (and of v), and nothing of the blocks not listed."""
    R, C, D, Dv = 64, 512, 16, 8
    q, k, v = make_inputs(rng, Hq=1, R=R, C=C, D=D, Dv=Dv)
    lists = [(np.full((1, 1, 4), n, np.int32), np.tile(np.arange(n, dtype=np.int32) * 3, (1, 1, 4, 1)))
             for n in (1, 2)]   # every query block visits key blocks 0 (and 3) of 8
    read = []
    for num, idx in lists:
        block_mask = BlockMask(num, idx, block_size=(16, 64))
        with mfa_native.profile() as prof:
            mfa_native.block_sparse_attention(q, k, v, block_mask)
        (record,) = prof.records
        if record.bytes_read is None:
            pytest.skip("this backend does not count traffic")
        tiles = useful_block_sparse_matrix_ops(block_mask, 1, 1, R, C, D, Dv) // (D // 8 + 1)
        assert record.bytes_read["k"] == tiles * 64 * (D // 8) * 4
        assert record.bytes_read["v"] == tiles * 64 * 1 * 4
        assert record.bytes_written["o"] == R * Dv * 4
        read.append(record.bytes_read["k"])
    assert read[1] == 2 * read[0]


def every_block_lists(rng, rows, cols):
    """(num_blocks, indices) (1, 1, rows[, cols]): every query block lists every key block
    once, in a random order; so every key block's q list is all of 0..rows-1."""
    listed = np.argsort(rng.random((1, 1, rows, cols)), axis=-1).astype(np.int32)
    return np.full((1, 1, rows), cols, np.int32), listed


def shuffled(counts, listed, rng):
    """The same q lists with each counted part in a random order (they compare as multisets)."""
    listed = listed.copy()
    for at in np.ndindex(counts.shape):
        listed[at][:counts[at]] = rng.permutation(listed[at][:counts[at]])
    return listed


def missing(counts, listed):
    """Key block 0's last query block left out."""
    counts = counts.copy()
    counts[..., 0] -= 1
    return counts, listed


def extra(counts, listed):
    """Key block 0 lists query block 0 once more."""
    wider = np.concatenate([listed, np.zeros_like(listed[..., :1])], axis=-1)
    return counts + np.eye(1, counts.shape[-1], dtype=np.int32), wider


def no_counts(counts, listed):
    return np.zeros_like(counts), listed


def duplicated(counts, listed):
    """Key block 0's last query block replaced by a copy of its first (the same count)."""
    listed = listed.copy()
    listed[..., 0, counts[0, 0, 0] - 1] = listed[..., 0, 0]
    return counts, listed


@pytest.mark.parametrize("prefix", ["", "full_"])
def test_given_q_lists_are_checked_against_the_kv_lists(rng, prefix):
    """The device checks the given q lists against the transpose it builds: in any order they
    pass (and the gradients match the reference); a missing, extra or duplicated query block,
    or counts of 0, is a ValueError naming the list, on warm calls too."""
    R, C, q_block, k_block = 40, 48, 16, 16
    q, k, v = make_inputs(rng, Hq=2, R=R, C=C, D=16)
    lists = {"kv": every_block_lists(rng, 3, 3), "full_kv": every_block_lists(rng, 3, 3)}
    lists.update({kind[:-2] + "q": transposed(*lists[kind], 3) for kind in ("kv", "full_kv")})
    lists[f"{prefix}q"] = lists[f"{prefix}q"][0], shuffled(*lists[f"{prefix}q"], rng)

    def block_mask(changed):
        given = dict(lists, **{f"{prefix}q": changed(*lists[f"{prefix}q"])})
        return BlockMask(**{name: a for kind, pair in given.items()
                            for name, a in zip((f"{kind}_num_blocks", f"{kind}_indices"), pair)},
                         block_size=(q_block, k_block))

    good = block_mask(lambda counts, listed: (counts, listed))
    o, lse = mfa_native.block_sparse_attention(q, k, v, good, return_lse=True)
    do = rng.standard_normal(o.shape).astype(np.float32)
    grads = mfa_native.block_sparse_attention_backward(q, k, v, o, lse, do, good)
    for grad, expected in zip(grads, block_sparse_attention_backward_reference(q, k, v, do, good, out=o)):
        assert relative_l2(grad, expected) < 1e-4
    for changed in (missing, extra, no_counts, duplicated):
        with bad(f"{prefix}q_indices"):
            mfa_native.block_sparse_attention_backward(q, k, v, o, lse, do, block_mask(changed))
    good.arrays[f"{prefix}q_num_blocks"][...] = 0   # warm: the same signature, other contents
    with bad(f"{prefix}q_indices"):
        mfa_native.block_sparse_attention_backward(q, k, v, o, lse, do, good)


def test_size_one_leading_axes_broadcast_between_lists(rng):
    """Each list's B and H axes broadcast on their own: (1, 1) kv lists beside (1, Hq) q lists
    and (B, 1) full lists, forward and backward."""
    B, Hq, R, C, q_block, k_block = 2, 4, 24, 40, 8, 16
    q, k, v = make_inputs(rng, B=B, Hq=Hq, Hkv=2, R=R, C=C, D=8)
    kv = random_lists(rng, (1, 1), 3, 3, 4)
    full = random_lists(rng, (B, 1), 3, 3, 2)
    q_lists = tuple(np.tile(a, (1, Hq) + (1,) * (a.ndim - 2)) for a in transposed(*kv, 3))
    block_mask = BlockMask(*kv, q_num_blocks=q_lists[0], q_indices=q_lists[1], full_kv_num_blocks=full[0],
                           full_kv_indices=full[1], full_q_num_blocks=transposed(*full, 3)[0],
                           full_q_indices=transposed(*full, 3)[1], block_size=(q_block, k_block))
    o, lse = mfa_native.block_sparse_attention(q, k, v, block_mask, return_lse=True, causal=True)
    assert relative_l2(o, block_sparse_attention_reference(q, k, v, block_mask, causal=True)) < 1e-4
    do = rng.standard_normal(o.shape).astype(np.float32)
    grads = mfa_native.block_sparse_attention_backward(q, k, v, o, lse, do, block_mask, causal=True)
    expected = block_sparse_attention_backward_reference(q, k, v, do, block_mask, out=o, causal=True)
    for grad, reference in zip(grads, expected):
        assert relative_l2(grad, reference) < 1e-4


def test_leading_axes_that_do_not_broadcast_are_refused(rng):
    kv = np.ones((1, 4, 3), np.int32), np.zeros((1, 4, 3, 2), np.int32)
    with bad("q_num_blocks .*leading axes"):
        BlockMask(*kv, q_num_blocks=np.zeros((1, 3, 1), np.int32), q_indices=np.zeros((1, 3, 1, 1), np.int32),
                  block_size=16)
    q, k, v = make_inputs(rng, B=2, Hq=2, R=40, C=16, D=8)
    with bad("kv_num_blocks .*leading axes"):
        mfa_native.block_sparse_attention(q, k, v, BlockMask(*kv, block_size=16))


def test_from_mask_refuses_sizes_the_kernels_cannot_address():
    with bad("R, C, B, H"):
        BlockMask.from_mask(R=2**31 - 1, C=2**31 - 1, causal=True)
    with bad("R, C, B, H"):
        BlockMask.from_mask(R=2**20, C=2**20, B=4, block_size=64)
    with bad("R must be in 0..2\\*\\*31 - 1"):
        BlockMask.from_mask(R=2**31, C=8)
    with bad("B must be in 1..2\\*\\*31 - 1"):
        BlockMask.from_mask(R=8, C=8, B=0)


@pytest.mark.parametrize("R, C", [(0, 40), (24, 0)])
def test_from_mask_of_an_empty_problem_gives_lists_the_ops_accept(rng, R, C):
    """No rows or no keys: empty lists (zero counts), with which the ops give their
    empty-problem results (as the reference: no output rows, or output 0 and lse -inf)."""
    B, H = 2, 3
    block_mask = BlockMask.from_mask(R=R, C=C, B=B, H=H, block_size=(8, 16), causal=True)
    rows, cols = -(-R // 8), -(-C // 16)
    assert block_mask.kv_indices.shape == (B, H, rows, cols) and block_mask.q_indices.shape == (B, H, cols, rows)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        np.testing.assert_array_equal(getattr(block_mask, name), 0)
    q, k, v = make_inputs(rng, B=B, Hq=H, Hkv=1, R=R, C=C, D=8)
    o, lse = mfa_native.block_sparse_attention(q, k, v, block_mask, return_lse=True, causal=True)
    expected, expected_lse = block_sparse_attention_reference(q, k, v, block_mask, causal=True, return_lse=True)
    np.testing.assert_array_equal(o, expected)
    np.testing.assert_array_equal(lse, expected_lse)
    do = rng.standard_normal(o.shape).astype(np.float32)
    grads = mfa_native.block_sparse_attention_backward(q, k, v, o, lse, do, block_mask, causal=True)
    for grad, reference in zip(grads, block_sparse_attention_backward_reference(q, k, v, do, block_mask, out=o,
                                                                                causal=True)):
        np.testing.assert_array_equal(grad, reference)


def test_from_mask_masks_carry_their_rule_into_forward_and_backward(rng):
    """A from_mask mask keeps causal, window and its mask: the calls apply them without being
    given them, the same given again changes nothing, and a contradicting one is a ValueError
    naming it (the README's document mask without mask= got 384 of 512 rows wrong)."""
    q, k, v = make_inputs(rng, Hq=2, R=64, C=64, D=16)
    do = rng.standard_normal(q.shape).astype(np.float32)
    document = np.arange(64) // 24
    doc_mask = document[:, None] == document[None, :]
    rules = [dict(causal=True), dict(causal="upper_left", window=(9, 0)), dict(mask=doc_mask),
             dict(mask=doc_mask, causal=True)]
    for rule in rules:
        block_mask = BlockMask.from_mask(R=64, C=64, block_size=16, **rule)
        expected = mfa_native.reference.attention_reference(q, k, v, **rule)
        out, lse = mfa_native.block_sparse_attention(q, k, v, block_mask, return_lse=True)
        assert relative_l2(out, expected) < 1e-5, rule
        again = mfa_native.block_sparse_attention(q, k, v, block_mask, **rule)
        assert np.array_equal(again, out)
        grads = mfa_native.block_sparse_attention_backward(q, k, v, out, lse, do, block_mask)
        for grad, reference in zip(grads, mfa_native.reference.attention_backward_reference(q, k, v, do, **rule)):
            assert relative_l2(grad, reference) < 1e-5, rule
    causal = BlockMask.from_mask(causal=True, R=64, C=64, block_size=16)
    for contradiction, name in ((dict(causal=False), "causal"), (dict(causal="upper_left"), "causal"),
                                (dict(window=(4, 0)), "window"), (dict(mask=doc_mask), "mask")):
        with pytest.raises(ValueError, match=f"^{name}"):
            mfa_native.block_sparse_attention(q, k, v, causal, **contradiction)
        with pytest.raises(ValueError, match=f"^{name}"):
            mfa_native.block_sparse_attention_backward(q, k, v, out, lse, do, causal, **contradiction)
    # Lists given by hand have no rule: causal defaults to False, as before.
    listed = BlockMask(causal.kv_num_blocks, causal.kv_indices, block_size=16)
    assert relative_l2(mfa_native.block_sparse_attention(q, k, v, listed),
                       block_sparse_attention_reference(q, k, v, listed)) < 1e-5
