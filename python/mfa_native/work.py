"""The useful work of an attention problem: the simdgroup 8x8x8 multiply-accumulates a kernel
that skips everything it could skip must still issue. Tests check the kernels against it,
and benchmarks print issued against useful; both import it from here."""

from __future__ import annotations

import numpy as np

from . import reference


def allowed_tiles(q_len: int, kv_len: int, causal=False, window=None) -> int:
    """8x8 tiles of S (one head) that hold an allowed (query, key) pair."""
    return tiles_holding(reference.allowed_keys(q_len, kv_len, causal, window))


def tiles_holding(allowed: np.ndarray) -> int:
    """8x8 tiles of a (rows, keys) grid, padded to whole tiles, that hold a True entry."""
    rows, cols = (-(-n // 8) * 8 for n in allowed.shape)
    padded = np.zeros((rows, cols), dtype=bool)
    padded[:allowed.shape[0], :allowed.shape[1]] = allowed
    return int(padded.reshape(rows // 8, 8, cols // 8, 8).any(axis=(1, 3)).sum())


def useful_matrix_ops(batch: int, q_heads: int, q_len: int, kv_len: int, head_dim: int, value_dim: int,
                      causal=False, window=None) -> int:
    """8x8x8 multiply-accumulates a perfect kernel needs: for each 8x8 tile of S that holds an
    allowed (query, key) pair, ceil(D/8) for S = Q K^T and ceil(Dv/8) for O += P V."""
    tiles = allowed_tiles(q_len, kv_len, causal, window)
    return tiles * batch * q_heads * (-(-head_dim // 8) + -(-value_dim // 8))


def packed_matrix_ops(batch: int, kv_heads: int, gqa_ratio: int, q_len: int, kv_len: int, head_dim: int,
                      value_dim: int, causal=False, window=None) -> int:
    """8x8x8 multiply-accumulates of a kernel whose tile rows are the (query, head) pairs of
    one kv head (pair = query * ratio + head, packed heads: decode with grouped queries): for
    each 8x8 tile of (pairs, keys) that holds an allowed pair, ceil(D/8) + ceil(Dv/8). Without
    causal or window that is ceil(R * ratio / 8) row tiles per key tile, against useful_matrix_ops'
    ratio * ceil(R / 8) for one head at a time."""
    pairs = np.repeat(reference.allowed_keys(q_len, kv_len, causal, window), gqa_ratio, axis=0)
    return tiles_holding(pairs) * batch * kv_heads * (-(-head_dim // 8) + -(-value_dim // 8))


def useful_backward_matrix_ops(batch: int, q_heads: int, q_len: int, kv_len: int, head_dim: int, value_dim: int,
                               causal=False, window=None) -> tuple[int, int]:
    """(dQ kernel, dK/dV kernel): multiply-accumulates the two backward kernels need on the
    allowed 8x8 tiles of S. dQ: S = Q K^T, dP = dO V^T, dQ += dS K (2 ceil(D/8) + ceil(Dv/8));
    dK/dV: S, dP, dV += P^T dO, dK += dS^T Q (2 ceil(D/8) + 2 ceil(Dv/8)). The two products
    recomputed without atomics make 7 in all, against 5 for one kernel with atomics."""
    tiles = allowed_tiles(q_len, kv_len, causal, window) * batch * q_heads
    d, dv = -(-head_dim // 8), -(-value_dim // 8)
    return tiles * (2 * d + dv), tiles * (2 * d + 2 * dv)


def useful_block_sparse_matrix_ops(block_mask, batch: int, q_heads: int, q_len: int, kv_len: int, head_dim: int,
                                   value_dim: int, causal=False, window=None) -> int:
    """Multiply-accumulates of block-sparse attention that visits only listed blocks: for
    every listing of a key block by a query block, each 8x8 tile of the pair of blocks that
    holds a pair the listing allows (any pair of a full block; a pair causal and window
    allow in a partial block), times ceil(D/8) + ceil(Dv/8). A block listed twice counts twice."""
    q_block, k_block = block_mask.block_size
    rules = reference.allowed_keys(q_len, kv_len, causal, window)
    tiles = 0
    for prefix, allowed in (("", rules), ("full_", np.ones_like(rules))):
        counts, listed = getattr(block_mask, f"{prefix}kv_num_blocks"), getattr(block_mask, f"{prefix}kv_indices")
        if counts is None:
            continue
        for b in range(batch):
            for h in range(q_heads):
                lb, lh = b % counts.shape[0], h % counts.shape[1]
                for i in range(counts.shape[2]):
                    for j in listed[lb, lh, i, :counts[lb, lh, i]]:
                        block = allowed[i * q_block:(i + 1) * q_block, j * k_block:(j + 1) * k_block]
                        rows, cols = -(-block.shape[0] // 8) * 8, -(-block.shape[1] // 8) * 8
                        padded = np.zeros((rows, cols), dtype=bool)
                        padded[:block.shape[0], :block.shape[1]] = block
                        tiles += int(padded.reshape(rows // 8, 8, cols // 8, 8).any(axis=(1, 3)).sum())
    return tiles * (-(-head_dim // 8) + -(-value_dim // 8))
