"""Which keys (or, in the dK/dV kernel, which queries) a simdgroup visits: one dense range,
or the blocks a BlockMask lists. Either way each visited range goes through the same
`steps(rules, begin, end)`: the kernel's loop of tiles over [begin, end) with those rules.

Block lists (FlexAttention's BlockMask): the simdgroup's 8 rows lie in one block (block
sizes are multiples of 8), so its list is uniform across the simdgroup and every lane takes
the same loop trips. Partial blocks apply the masking rules and are clipped to the dense
visible range; full blocks apply only the additive mask (a score modification) and the
bounds. A block listed twice is visited twice.

Per key block the transposed lists (its query blocks) come from the caller (q_indices,
padded like kv_indices) or from `attention_transpose_lists` in the same pass (counts,
starts and entries, in query-block order).
"""

from __future__ import annotations

from typing import Callable

from .descriptor import AttentionFacts, BlockFacts, MaskRules
from .msl import indent

Steps = Callable[[MaskRules, str, str], list[str]]


def full_rules(rules: MaskRules) -> MaskRules:
    """The rules inside a full block: only an additive mask (added to every visited pair)."""
    if rules.mask == "additive":
        return MaskRules("none", None, rules.mask, rules.mask_dtype, rules.mask_layout)
    return MaskRules("none", None, "none", None, None)


def list_base(f: BlockFacts, blocks: str, head: str = "h") -> str:
    """Index of the first of `blocks` entries of this (batch b, head) in a (B|1, H|1, blocks) list."""
    b = "0" if f.batch_broadcast else "b"
    h = "0" if f.head_broadcast else head
    return f"(ulong({b}) * {f.heads} + {h}) * {blocks}"


def _visit(what: str, count: str, listed: str, begin: str, end: str, steps: list[str]) -> list[str]:
    body = [f"const int listed = {listed};", f"const int block_begin = {begin};", f"const int block_end = {end};"]
    return ["{  // " + what, f"  const int count = {count};", "  for (int n = 0; n < count; ++n) {"] \
        + indent(body + steps, 2) + ["  }", "}"]


def keys(d: AttentionFacts, steps: Steps) -> list[str]:
    """The key ranges of a forward or dQ simdgroup (rows q_first..): [key_begin, key_end),
    or its query block's listed key blocks. Reads q_first, R, C, key_begin, key_end."""
    if d.blocks is None:
        return steps(d.rules, "key_begin", "key_end")
    f = d.blocks
    lines = ["", "// The key blocks listed for this simdgroup's query block: partial, then full.",
             f"const ulong list_at = {list_base(f, 'NQ')} + q_first / {f.q_block};"]
    lines += _visit("partial blocks: the masking rules apply", "q_first < R ? kv_num_blocks[list_at] : 0",
                    "kv_indices[list_at * Wp + n]", f"max(listed * {f.k_block}, key_begin)",
                    f"min(listed * {f.k_block} + {f.k_block}, key_end)",
                    steps(d.rules, "block_begin", "block_end"))
    if f.full:
        lines += _visit("full blocks: every pair allowed", "q_first < R ? full_kv_num_blocks[list_at] : 0",
                        "full_kv_indices[list_at * Wf + n]", f"listed * {f.k_block}",
                        f"min(listed * {f.k_block} + {f.k_block}, int(C))",
                        steps(full_rules(d.rules), "block_begin", "block_end"))
    return lines


def queries(d: AttentionFacts, steps: Steps) -> list[str]:
    """The query ranges of a dK/dV simdgroup (keys key_first..) for query head h:
    [query_begin, query_end), or the query blocks listed for its key block. Reads
    key_first, h, R, C, query_begin, query_end."""
    if d.blocks is None:
        return steps(d.rules, "query_begin", "query_end")
    f = d.blocks
    lines = ["", "// The query blocks listed for this simdgroup's key block: partial, then full.",
             f"const ulong block_at = {list_base(f, 'NK')} + key_first / {f.k_block};"]
    kinds = [("q", "partial blocks: the masking rules apply", d.rules, "query_begin", "query_end", "Wq")]
    if f.full:
        kinds.append(("full_q", "full blocks: every pair allowed", full_rules(d.rules), "0", "int(R)", "Wqf"))
    for prefix, what, rules, low, high, width in kinds:
        if f.transposed_given:
            count = f"{prefix}_num_blocks[block_at]"
            listed = f"{prefix}_indices[block_at * {width} + n]"
        else:
            count = f"{prefix}_counts[block_at]"
            listed = f"{prefix}_entries[{list_base(f, 'NQ * Wp' if prefix == 'q' else 'NQ * Wf')} " \
                     f"+ {prefix}_starts[block_at] + n]"
        lines += _visit(what, f"key_first < C ? {count} : 0", listed, f"max(listed * {f.q_block}, {low})",
                        f"min(listed * {f.q_block} + {f.q_block}, {high})", steps(rules, "block_begin", "block_end"))
    return lines
