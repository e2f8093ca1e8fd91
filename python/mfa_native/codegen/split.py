"""Split-KV for decode: when a few query rows per head leave the device idle, the
keys are cut into S splits that run as separate threadgroups (the partial
kernel stores each split's unnormalized O and its softmax max and sum), and a
small combine kernel merges the splits."""

from __future__ import annotations

from .descriptor import forward_key_block, forward_threadgroups
from .problem import AttentionProblem

DECODE_MAX_ROWS = 16       # only decode-shaped problems split
MIN_KEYS_PER_SPLIT = 256   # below this a split costs more than it saves
MAX_SPLITS = 64


def kv_split(problem: AttentionProblem, family: str, parallel_threadgroups: int) -> tuple[int, int] | None:
    """(splits, keys per split) when splitting fills a device that runs `parallel_threadgroups`
    threadgroups at once; None when the problem already has enough threadgroups (or keys are few)."""
    if problem.q_len > DECODE_MAX_ROWS:
        return None
    threadgroups = forward_threadgroups(problem, family)
    splits = min(-(-parallel_threadgroups // threadgroups), problem.kv_len // MIN_KEYS_PER_SPLIT, MAX_SPLITS)
    if splits < 2:
        return None
    key_block = forward_key_block(problem, family)
    keys = -(-problem.kv_len // splits)
    keys = -(-keys // key_block) * key_block  # whole key blocks per split
    splits = -(-problem.kv_len // keys)
    return (splits, keys) if splits >= 2 else None
