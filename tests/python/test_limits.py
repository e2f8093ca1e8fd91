"""Sizes and limits (issue "Hardening", part 2): sizes the kernels cannot address are refused by
name, huge windows work, empty problems give PyTorch's results, and offsets past 2**32
elements are addressed in 64 bits."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from test_attention import make_inputs

import mfa_native
from mfa_native.reference import attention_reference


def huge(shape, dtype=np.float32):
    """An array of any shape over one element (every stride 0): no memory, for size checks."""
    return np.lib.stride_tricks.as_strided(np.ones(1, dtype), shape, (0,) * len(shape))


@pytest.mark.parametrize("axis,name", [(2, "R \\(query length\\)"), (1, "Hq \\(query heads\\)"),
                                       (0, "B \\(batch\\)")])
def test_sizes_of_2_31_or_more_are_refused_by_name(axis, name):
    shape = [1, 1, 8, 16]
    shape[axis] = 2**31
    kv = [1, shape[1], 8, 16]
    kv[0] = shape[0]
    with pytest.raises(ValueError, match=f"{name} is 2147483648.*below 2\\*\\*31"):
        mfa_native.attention(huge(tuple(shape)), huge(tuple(kv)), huge(tuple(kv)))


@pytest.mark.parametrize("keys", [2**31, 2**32 - 1, 2**32, 2**40])
def test_key_lengths_the_kernels_cannot_index_are_refused(keys):
    with pytest.raises(ValueError, match="C \\(key length\\)"):
        mfa_native.attention(huge((1, 1, 4, 16)), huge((1, 1, keys, 16)), huge((1, 1, keys, 16)))


def test_sparse_lists_wider_than_the_kernels_can_index_are_refused(rng):
    q, k, v = make_inputs(rng, R=4, C=8, D=16)
    with pytest.raises(ValueError, match="indices has topk = 2147483648"):  # before a 32 GiB copy of it
        mfa_native.sparse_attention(q, k, v, huge((1, 2, 4, 2**31), np.int32))


def test_windows_wider_than_the_problem_are_unbounded(rng):
    q, k, v = make_inputs(rng, R=20, C=33, D=16)
    for window in ((2**31, 0), (2**40, 2**33), (5, 2**31 + 7)):
        out = mfa_native.attention(q, k, v, window=window)
        unbounded = tuple(-1 if side >= 2**31 else side for side in window)
        assert relative_l2(out, attention_reference(q, k, v, window=unbounded)) < 1e-4


@pytest.mark.parametrize("dims", [dict(B=0), dict(Hq=0, Hkv=0), dict(R=0)])
def test_problems_without_rows_give_empty_results(rng, dims):
    B, H, R = dims.get("B", 2), dims.get("Hq", 2), dims.get("R", 5)
    q = rng.standard_normal((B, H, R, 16)).astype(np.float32)
    k = rng.standard_normal((B, dims.get("Hkv", 2), 7, 16)).astype(np.float32)
    out, lse = mfa_native.attention(q, k, k, return_lse=True)
    assert out.shape == (B, H, R, 16) and out.size == 0 and lse.shape == (B, H, R) and lse.dtype == np.float32
    dq, dk, dv = mfa_native.attention_backward(q, k, k, out, lse, out)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    assert not dk.any() and not dv.any()


@pytest.mark.parametrize("sinks", [False, True])
def test_no_keys_give_zeros_and_lse_minus_infinity_or_the_sink(rng, sinks):
    q = rng.standard_normal((2, 3, 5, 16)).astype(np.float16)
    k = np.zeros((2, 3, 0, 16), np.float16)
    v = np.zeros((2, 3, 0, 8), np.float16)
    s = rng.standard_normal(3).astype(np.float32) if sinks else None
    out, lse = mfa_native.attention(q, k, v, sinks=s, return_lse=True)
    assert out.shape == (2, 3, 5, 8) and out.dtype == np.float16 and not out.any()
    expected = np.broadcast_to(s[None, :, None], lse.shape) if sinks else np.full(lse.shape, -np.inf)
    np.testing.assert_array_equal(lse, expected)
    grads = mfa_native.attention_backward(q, k, v, out, lse, np.ones_like(out), sinks=s)
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape] and not grads[0].any()
    if sinks:
        np.testing.assert_array_equal(grads[3], np.zeros(3, np.float32))


def test_empty_problems_match_pytorch(rng):
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k = torch.zeros(1, 2, 0, 8, requires_grad=True)
    v = torch.zeros(1, 2, 0, 8, requires_grad=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    expected.sum().backward()
    out = mfa_native.attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy())
    np.testing.assert_array_equal(out, expected.detach().numpy())
    np.testing.assert_array_equal(mfa_native.attention_backward(
        q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), out, np.full((1, 2, 4), -np.inf, np.float32),
        np.ones_like(out))[0], q.grad.numpy())


def test_offsets_past_2_32_elements_are_addressed_in_64_bits(rng, tmp_path):
    """k's rows 2**30 elements apart in a sparse file: the last ones lie past 2**32 elements
    from k's first, so a 32-bit row offset would read the wrong rows."""
    rows, stride, D = 6, 2**30, 8
    backing = np.memmap(tmp_path / "sparse.bin", dtype=np.float16, mode="w+", shape=(rows * stride,))
    k = np.lib.stride_tricks.as_strided(backing, (1, 1, rows, D), (0, 0, stride * 2, 2))
    k[...] = rng.standard_normal((1, 1, rows, D)).astype(np.float16)
    q, _, v = make_inputs(rng, Hq=1, R=3, C=rows, D=D, dtype="float16")
    out = mfa_native.attention(q, k, v)
    assert relative_l2(out, attention_reference(q, np.array(k), v)) < 2e-2


def test_block_sparse_problems_without_rows_give_empty_results(rng):
    q = rng.standard_normal((1, 2, 0, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    block_mask = mfa_native.BlockMask(np.zeros((1, 1, 0), np.int32), np.zeros((1, 1, 0, 1), np.int32), block_size=8)
    out, lse = mfa_native.block_sparse_attention(q, k, k, block_mask, return_lse=True)
    assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)
    dq, dk, dv = mfa_native.block_sparse_attention_backward(q, k, k, out, lse, out, block_mask)
    assert dq.shape == q.shape and dk.shape == k.shape and not dk.any() and not dv.any()
