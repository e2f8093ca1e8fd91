"""FlexAttention's BlockMask as mfa_native's (`BlockMask.from_torch`): its lists as they are, and
its mask rule (mask_mod) as one bit per (query, key) pair of each partial block.

FlexAttention applies mask_mod inside the partial blocks (kv_indices; full_kv_indices need
none). The conversion evaluates it there once, with torch, vectorized (torch.vmap over the
pairs, as create_block_mask evaluates it), and packs the results (block_mask.BITS): partial
block p, numbered in list order (batch, head, query block, then place in the list), holds
pair (r, c) at bit p * Qb * Kb + r * Kb + c. So the bits take partial blocks x Qb x Kb / 8
bytes (rounded up to whole int32 words, at least one), never R x C. Positions past the sequence
lengths in edge blocks are evaluated at the last position (FlexAttention's mask_mod may
index per-token tensors) and never read.

mask_mod is called with the lists' batch and head indices: lists with size-1 leading axes
(create_block_mask with B or H None) evaluate it for b = 0 or h = 0, as create_block_mask
built the lists, so a mask_mod that depends on b or h needs lists with those axes.

FlexAttention's no-op mask (one block of 2**30 and seq_lengths (1, 1), what flex_attention
uses without a block mask) converts to one partial block of 2**30 with no bits and no
lengths: every key, for any (R, C).
"""

from __future__ import annotations

import numpy as np

from . import arguments as check
from .block_mask import PAIRS, BlockMask

LARGE_BLOCK = 1 << 30        # torch.nn.attention.flex_attention._LARGE_SPARSE_BLOCK_SIZE
PAIRS_PER_CALL = 1 << 20     # pairs evaluated per vmap call (bounds the index tensors' memory)
_CONVERTED: dict[int, tuple[object, BlockMask]] = {}   # id -> (torch mask, its conversion)
_KEPT = 16


def as_block_mask(block_mask) -> BlockMask:
    """A mfa_native BlockMask as it is; a torch one converted (once per object)."""
    if isinstance(block_mask, BlockMask):
        return block_mask
    if _is_flex_mask(block_mask):
        return converted_once(block_mask)
    raise TypeError(f"block_mask must be a mfa_native.BlockMask or a torch.nn.attention.flex_attention.BlockMask, "
                    f"got {type(block_mask).__name__}")


def _is_flex_mask(x) -> bool:
    return type(x).__name__ == "BlockMask" and hasattr(x, "mask_mod") and hasattr(x, "kv_indices")


def converted_once(torch_mask) -> BlockMask:
    """`converted` of a torch BlockMask, kept for the last few masks (a training loop passes the
    same mask every step: its mask_mod is evaluated once). A mask changed in place after its
    first use is not seen again: convert it anew with BlockMask.from_torch."""
    kept = _CONVERTED.get(id(torch_mask))
    if kept is not None and kept[0] is torch_mask:
        return kept[1]
    block_mask = converted(BlockMask, torch_mask)
    if len(_CONVERTED) >= _KEPT:
        _CONVERTED.pop(next(iter(_CONVERTED)))
    _CONVERTED[id(torch_mask)] = (torch_mask, block_mask)
    return block_mask


def converted(cls, torch_mask) -> BlockMask:
    """The BlockMask (of class `cls`) of a torch BlockMask: lists, block size, lengths, mask bits."""
    block_size = tuple(int(s) for s in torch_mask.BLOCK_SIZE)
    if block_size == (LARGE_BLOCK, LARGE_BLOCK):
        return everything(cls)
    arrays = {name: _host(getattr(torch_mask, name), name) for pair in PAIRS for name in pair}
    shape = tuple(int(s) for s in torch_mask.seq_lengths)
    bits = {}
    if not _is_noop(torch_mask.mask_mod):
        bits = mask_bits(torch_mask.mask_mod, arrays["kv_num_blocks"], arrays["kv_indices"], block_size, shape,
                         device=torch_mask.kv_num_blocks.device)
    return cls(**arrays, **bits, block_size=block_size, shape=shape)


def everything(cls=BlockMask) -> BlockMask:
    """FlexAttention's no-op mask: one partial block of 2**30, no bits, no lengths (any R, C)."""
    return cls(np.ones((1, 1, 1), np.int32), np.zeros((1, 1, 1, 1), np.int32), block_size=LARGE_BLOCK)


def _host(x, name: str) -> np.ndarray | None:
    if x is None:
        return None
    return check.as_array(x.detach().cpu(), name)


def _is_noop(mask_mod) -> bool:
    from torch.nn.attention.flex_attention import noop_mask
    return mask_mod is None or mask_mod is noop_mask


def bit_blocks(counts: np.ndarray) -> np.ndarray:
    """kv_bit_blocks: per list row, the number of its first partial block (rows in C order)."""
    flat = counts.astype(np.int64).ravel()
    return (np.cumsum(flat) - flat).reshape(counts.shape).astype(np.int32)


def mask_bits(mask_mod, counts: np.ndarray, indices: np.ndarray, block_size: tuple[int, int],
              lengths: tuple[int, int], *, device=None) -> dict[str, np.ndarray]:
    """kv_bit_blocks and kv_bits: mask_mod(b, h, q_idx, kv_idx) for every pair of every counted
    partial block (see the module docstring)."""
    import torch

    q_block, k_block = block_size
    R, C = lengths
    listed = np.arange(indices.shape[3]) < counts[..., None]
    b, h, i, n = np.nonzero(listed)           # C order: the blocks' numbers
    if len(b) == 0:
        return {}                             # no partial block: no bits to read
    j = indices[b, h, i, n].astype(np.int64)
    pairs = q_block * k_block
    step = 32 * max(1, PAIRS_PER_CALL // (32 * pairs))   # blocks per call: whole words per call
    rows, cols = np.arange(q_block)[:, None], np.arange(k_block)[None, :]
    evaluate = torch.vmap(mask_mod, in_dims=(0, 0, 0, 0))
    packed = []
    for start in range(0, len(b), step):
        at = slice(start, start + step)
        shape = (len(b[at]), q_block, k_block)
        index = [np.broadcast_to(x, shape) for x in (b[at, None, None], h[at, None, None],
                 np.minimum(i[at, None, None] * q_block + rows, max(R - 1, 0)),
                 np.minimum(j[at, None, None] * k_block + cols, max(C - 1, 0)))]
        tensors = [torch.from_numpy(np.array(x, dtype=np.int64).ravel()).to(device) for x in index]
        allowed = evaluate(*tensors).to(torch.bool).cpu().numpy()
        packed.append(np.packbits(np.broadcast_to(allowed, tensors[0].shape), bitorder="little"))
    data = np.concatenate(packed)
    data = np.concatenate([data, np.zeros(-len(data) % 4, np.uint8)])   # whole words
    return {"kv_bit_blocks": bit_blocks(counts), "kv_bits": data.view("<i4").astype(np.int32)}
