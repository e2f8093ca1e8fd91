"""When plain K/V packs the query heads of a kv head as the rows of the tiles (attention/rows.py's
PackedHeads), as a one-row table of the same readable form as the tile tables (tables.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .tables import parse_rows


@dataclass(frozen=True)
class PackingRow:
    """When plain (float) K/V packs the query heads of a kv head as the rows of the tiles
    (attention/rows.PACKED_HEADS; quantized K/V always packs): grouped queries, at least
    `min_gqa_ratio` query heads per kv head, and at most `max_pairs` (query, head) pairs per
    kv head, so one threadgroup holds every pair and reads each K/V row once."""

    min_gqa_ratio: int
    max_pairs: int


# Decode (R = 1) and speculative-decode verification (R up to 32 at GQA ratio 4, 16 at 8):
# R * ratio pairs fill ceil(R * ratio / 8) tiles per key tile instead of ratio * ceil(R / 8),
# and K/V is read once per kv head instead of once per query head. One row for every family
# (the rows facet is chosen before the family is known); retune on hardware.
_PACKING_TEXT = """
    # min_gqa_ratio  max_pairs
          2            128
"""
(PACKING,) = parse_rows(_PACKING_TEXT, PackingRow)


def packs_plain_heads(gqa_ratio: int, q_len: int) -> bool:
    """Whether PACKING packs a plain-storage problem with this GQA ratio and query length."""
    return gqa_ratio >= PACKING.min_gqa_ratio and q_len * gqa_ratio <= PACKING.max_pairs


def packing_condition(gqa_ratio: int) -> str:
    """packs_plain_heads(gqa_ratio, R) as a size expression over R (a template's guard)."""
    if gqa_ratio < PACKING.min_gqa_ratio:
        return "0"
    return f"R * {gqa_ratio} <= {PACKING.max_pairs}"
