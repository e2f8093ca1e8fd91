"""FlexAttention for real: torch's BlockMask converted with its mask_mod (mask bits in the partial
blocks), against torch.nn.attention.flex_attention.flex_attention itself (eager, CPU, forward:
FlexAttention has no CPU backward) and, for gradients, against float64 torch autograd of dense
attention under torch's own create_mask(mask_mod) (what flex_attention's backward differentiates),
and the float64 reference (reference.block_visits reads the bits). Small problems: flex's eager
path materializes the scores."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from test_attention import make_inputs

import mfa_native
from mfa_native import BlockMask
from mfa_native.reference import block_sparse_attention_backward_reference, block_sparse_attention_reference

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
# flex_attention run eagerly, as the comparison it is here: its notes on that are not ours.
pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.filterwarnings("ignore:return_lse is deprecated")]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(window):
    return lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= window


def prefix(length):
    return lambda b, h, q_idx, kv_idx: kv_idx < length


def documents(rng, length, count):
    """A document mask: pairs of the same document (random boundaries)."""
    ids = torch.from_numpy(np.sort(rng.integers(0, count, length)))
    return lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx]


def mask_mods(rng, R):
    """FlexAttention's test masks: causal, sliding window, prefix LM, documents, and combinations."""
    return {"causal": causal,
            "sliding": flex.and_masks(causal, sliding(20)),
            "prefix_lm": flex.or_masks(prefix(24), causal),
            "documents": documents(rng, R, 4),
            "causal_documents": flex.and_masks(causal, documents(rng, R, 3)),
            "heads": lambda b, h, q_idx, kv_idx: (q_idx + h * 7 - kv_idx) % 3 != 0}


CASES = [("causal", (32, 32)), ("sliding", (16, 24)), ("prefix_lm", (32, 16)), ("documents", (1, 64)),
         ("causal_documents", (20, 12)), ("heads", (16, 16))]


def tensors(rng, **dims):
    return tuple(torch.from_numpy(x) for x in make_inputs(rng, **dims))


def dense_gradients(q, k, v, do, allowed, scale=None):
    """float64 autograd of dense attention where `allowed` (B|1, H|1, R, C) holds; rows with no
    allowed key give 0, as FlexAttention."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    ratio = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(ratio, 1), v.repeat_interleave(ratio, 1)
    s = (q @ kk.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    s = s.masked_fill(~allowed, -torch.inf)
    p = torch.nan_to_num(torch.softmax(s, -1))
    out = p @ vv
    out.backward(do.double())
    return out.detach(), (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("name, block_size", CASES, ids=[c[0] for c in CASES])
def test_from_torch_keeps_the_mask_mod(rng, name, block_size):
    """Converted without repeating any rule, the mask gives flex_attention's output and lse, and
    the gradients of attention under the mask_mod; the bits take only the partial blocks."""
    B, Hq, R, C = 1, 2, 96, 96
    mask_mod = mask_mods(rng, R)[name]
    heads = Hq if name == "heads" else None
    torch_mask = flex.create_block_mask(mask_mod, B=None, H=heads, Q_LEN=R, KV_LEN=C, device="cpu",
                                        BLOCK_SIZE=block_size)
    block_mask = BlockMask.from_torch(torch_mask)
    partial = int(torch_mask.kv_num_blocks.sum())
    lists = sum(a.nbytes for a in block_mask.arrays.values()) + block_mask.kv_bit_blocks.nbytes
    assert block_mask.nbytes <= lists + partial * block_size[0] * block_size[1] / 8 + 3   # whole int32 words
    q, k, v = tensors(rng, B=B, Hq=Hq, R=R, C=C, D=16)
    out, lse = mfa_native.block_sparse_attention(q, k, v, block_mask, return_lse=True)
    expected, expected_lse = flex.flex_attention(q, k, v, block_mask=torch_mask, return_lse=True)
    assert relative_l2(out.numpy(), expected.numpy()) < 1e-5
    np.testing.assert_allclose(lse.numpy(), expected_lse.numpy(), atol=1e-5)
    do = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
    grads = mfa_native.block_sparse_attention_backward(q, k, v, out, lse, do, block_mask)
    allowed = flex.create_mask(mask_mod, 1, Hq, R, C, device="cpu")
    _, dense = dense_gradients(q, k, v, do, allowed)
    reference = block_sparse_attention_backward_reference(q.numpy(), k.numpy(), v.numpy(), do.numpy(), block_mask,
                                                          out=out.numpy())
    for grad, want, ref in zip(grads, dense, reference):
        assert relative_l2(grad.numpy(), want.numpy()) < 1e-5
        assert relative_l2(grad.numpy(), ref) < 1e-5


def test_block_sparse_attention_takes_torch_block_masks_with_autograd(rng):
    """A torch BlockMask goes to block_sparse_attention as it is (converted once), and tensors
    that require grad get the gradients of flex_attention's math (GQA, a scale, empty rows)."""
    R, C, Hq, Hkv = 40, 72, 4, 2
    mask_mod = flex.and_masks(lambda b, h, q_idx, kv_idx: q_idx >= 8, prefix(50))   # rows 0..7 see nothing
    torch_mask = flex.create_block_mask(mask_mod, B=None, H=None, Q_LEN=R, KV_LEN=C, device="cpu",
                                        BLOCK_SIZE=(16, 24))
    q, k, v = (x.requires_grad_() for x in tensors(rng, Hq=Hq, Hkv=Hkv, R=R, C=C, D=8))
    out, lse = mfa_native.block_sparse_attention(q, k, v, torch_mask, scale=0.3, return_lse=True)
    expected, expected_lse = flex.flex_attention(q.detach(), k.detach(), v.detach(), block_mask=torch_mask, scale=0.3,
                                                 enable_gqa=True, return_lse=True)
    assert relative_l2(out.detach().numpy(), expected.numpy()) < 1e-5
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse)) and torch.isneginf(lse[..., :8]).all()
    assert torch.all(out[..., :8, :] == 0)
    do = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
    out.backward(do)
    _, dense = dense_gradients(q.detach(), k.detach(), v.detach(), do, flex.create_mask(mask_mod, 1, 1, R, C, "cpu"),
                               scale=0.3)
    for x, want in zip((q, k, v), dense):
        assert relative_l2(x.grad.numpy(), want.numpy()) < 1e-5


def test_torch_flex_attention_is_a_drop_in(rng):
    """mfa_native.torch.flex_attention: flex_attention's arguments and results, with autograd; no
    block mask is every key; head counts that differ need enable_gqa, as in FlexAttention."""
    from mfa_native.torch import flex_attention

    R, C = 33, 64
    torch_mask = flex.create_block_mask(causal, B=None, H=None, Q_LEN=R, KV_LEN=C, device="cpu", BLOCK_SIZE=(1, 64))
    q, k, v = (x.requires_grad_() for x in tensors(rng, Hq=4, Hkv=1, R=R, C=C, D=16))
    out, lse = flex_attention(q, k, v, block_mask=torch_mask, enable_gqa=True, return_lse=True)
    expected, expected_lse = flex.flex_attention(q.detach(), k.detach(), v.detach(), block_mask=torch_mask,
                                                 enable_gqa=True, return_lse=True)
    assert relative_l2(out.detach().numpy(), expected.numpy()) < 1e-5
    np.testing.assert_allclose(lse.detach().numpy(), expected_lse.numpy(), atol=1e-5)
    do = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
    out.backward(do)
    _, dense = dense_gradients(q.detach(), k.detach(), v.detach(), do, flex.create_mask(causal, 1, 1, R, C, "cpu"))
    for x, want in zip((q, k, v), dense):
        assert relative_l2(x.grad.numpy(), want.numpy()) < 1e-5
    everything = flex_attention(q.detach(), k.detach(), v.detach(), enable_gqa=True)
    assert relative_l2(everything.numpy(), flex.flex_attention(q.detach(), k.detach(), v.detach(),
                                                               enable_gqa=True).numpy()) < 1e-5
    with pytest.raises(ValueError, match="enable_gqa"):
        flex_attention(q, k, v)


def test_from_torch_of_the_no_op_mask_attends_everything(rng):
    """FlexAttention's no-op mask (one block of 2**30, seq_lengths (1, 1)) means every key, for
    any lengths, as flex_attention without a block mask."""
    q, k, v = tensors(rng, Hq=2, R=37, C=50, D=8)
    block_mask = BlockMask.from_torch(flex._create_empty_block_mask(q, k))
    assert block_mask.shape is None and block_mask.kv_bits is None
    out, lse = mfa_native.block_sparse_attention(q, k, v, block_mask, return_lse=True)
    expected = mfa_native.reference.attention_reference(q.numpy(), k.numpy(), v.numpy())
    assert relative_l2(out.numpy(), expected) < 1e-5
    do = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
    grads = mfa_native.block_sparse_attention_backward(q, k, v, out, lse, do, block_mask)
    for grad, want in zip(grads, mfa_native.reference.attention_backward_reference(q.numpy(), k.numpy(), v.numpy(),
                                                                                   do.numpy())):
        assert relative_l2(grad.numpy(), want) < 1e-5


def test_mask_bits_are_checked_against_the_lists(rng):
    counts, listed = np.ones((1, 1, 2), np.int32), np.zeros((1, 1, 2, 1), np.int32)
    with pytest.raises(ValueError, match="kv_bit_blocks and kv_bits come together"):
        BlockMask(counts, listed, block_size=8, kv_bits=np.zeros(4, np.int32))
    short = BlockMask(counts, listed, block_size=8, kv_bit_blocks=np.array([[[0, 1]]], np.int32),
                      kv_bits=np.zeros(3, np.int32))    # 2 blocks of 64 bits need 4 words
    q, k, v = make_inputs(rng, R=16, C=8, D=8)
    with pytest.raises(ValueError, match=r"reach 2 bit blocks of 64 bits, past the 3 \* 32 bits of kv_bits"):
        mfa_native.block_sparse_attention(q, k, v, short)
    bits = np.zeros(4, np.int32)
    bits[0] = 0b101    # block 0: row 0 sees keys 0 and 2
    bits[2] = -1       # block 1: rows 8..11 see every key
    block_mask = BlockMask(counts, listed, block_size=8, kv_bit_blocks=np.array([[[0, 1]]], np.int32), kv_bits=bits)
    out = mfa_native.block_sparse_attention(q, k, v, block_mask)
    assert relative_l2(out, block_sparse_attention_reference(q, k, v, block_mask)) < 1e-5
    assert np.all(out[:, :, 1:8] == 0) and np.all(out[:, :, 12:] == 0)


def test_a_block_aligned_mask_needs_no_bits(rng):
    """Documents whose boundaries fall on block edges: every listed block is full or absent, so
    the conversion stores no bits (nbytes is the lists') and still gives flex_attention's result."""
    R = C = 96
    ids = torch.arange(R) // 32 + (torch.arange(R) >= 64)   # documents of 32, 32 and 32 rows

    def aligned(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    torch_mask = flex.create_block_mask(aligned, B=None, H=None, Q_LEN=R, KV_LEN=C, device="cpu", BLOCK_SIZE=32)
    block_mask = BlockMask.from_torch(torch_mask)
    assert block_mask.kv_bits is None
    assert block_mask.nbytes == sum(a.nbytes for a in block_mask.arrays.values())
    q, k, v = tensors(rng, B=1, Hq=2, R=R, C=C, D=16)
    out = mfa_native.block_sparse_attention(q, k, v, block_mask)
    assert relative_l2(out.numpy(), flex.flex_attention(q, k, v, block_mask=torch_mask).numpy()) < 1e-5


def test_the_drop_in_takes_flex_attentions_signature_and_positions():
    """Every parameter of torch's flex_attention, in its position, kind and default; score_mod
    in its position is computed (test_score_mod.py tests it), return_aux raises naming itself;
    kernel_options are accepted (they change no result)."""
    import inspect

    from mfa_native.torch import flex_attention

    theirs = inspect.signature(flex.flex_attention).parameters
    ours = inspect.signature(flex_attention).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == \
        [(p.name, p.kind, p.default) for p in theirs.values()]
    q = torch.randn(1, 2, 16, 8)
    positional = flex_attention(q, q, q, None, None, 0.5, False, False, {"BLOCK_M": 16})
    assert torch.equal(positional, flex_attention(q, q, q, scale=0.5))
    doubled = flex_attention(q, q, q, lambda score, b, h, i, j: score * 2)
    assert torch.allclose(doubled, flex_attention(q, q, q, scale=2 / 8 ** 0.5), atol=1e-6)
    with pytest.raises(NotImplementedError, match="^return_aux"):
        flex_attention(q, q, q, return_aux=object())
