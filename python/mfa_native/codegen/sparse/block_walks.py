"""The MSL of the block-lists walks: the key blocks a forward or dQ simdgroup visits, and the
query blocks a dK/dV simdgroup visits (the key-visit facet's `keys` and `queries` for
BlockLists).

A simdgroup owns 8 rows (queries, or keys in dK/dV). A block of any positive size may cut
them: when the lane axis' block size is not a multiple of 8, the simdgroup walks the lists
of every block its 8 rows touch, one after the other, with the rows outside the block
removed by one more allowed term (`uint(row - block_row0) < Qb`), so each row sees exactly
its own block's lists. On the other axis a listed block is a range [begin, end) of any
alignment, which the kernel's tile loop takes as it takes a window's.

With mask bits (BlockLists.bits), a partial block also reads its pair's bit: block number p
(kv_bit_blocks of the query block plus the entry's place in its list; for dK/dV the built
q_bit_blocks) holds the bits p * Qb * Kb + r * Kb + c for row r, key c of the block, bit
i in word i / 32 at i % 32. Full blocks read none.
"""

from __future__ import annotations

from dataclasses import replace

from ..attention.visits import Steps
from ..attention.masking import MaskRules
from ..kernel.msl import indent


def full_rules(rules: MaskRules) -> MaskRules:
    """The rules inside a full block: only an additive mask (added to every visited pair)."""
    if rules.mask == "additive":
        return MaskRules("none", None, rules.mask, rules.mask_dtype, rules.mask_layout)
    return MaskRules("none", None, "none", None, None)


def list_base(f, blocks: str, head: str = "h") -> str:
    """Index of the first of `blocks` entries of this (batch b, head) in a (B|1, H|1, blocks) list."""
    b = "0" if f.batch_broadcast else "b"
    h = "0" if f.head_broadcast else head
    return f"(ulong({b}) * {f.heads} + {h}) * {blocks}"


def spans(block: int) -> bool:
    """Whether blocks of this size may cut a simdgroup's 8 rows."""
    return block % 8 != 0


def bit_term(f) -> str:
    """The allowed term of a pair's mask bit, with block_row0, block_key0 and bits_at defined."""
    at = f"(bits_at + ulong({{query}} - block_row0) * {f.k_block} + ulong({{key}} - block_key0))"
    return f"((uint(kv_bits[{at} >> 5]) >> uint({at} & 31)) & 1u) != 0u"


def _rules(f, rules: MaskRules, within: str | None, partial: bool) -> MaskRules:
    """The rules of a partial (or full) block: the rows outside the block removed where blocks
    cut the simdgroup's rows; a partial block's mask bits."""
    terms = rules.terms + ((within,) if within else ()) + ((bit_term(f),) if partial and f.bits else ())
    return replace(rules if partial else full_rules(rules), terms=terms)


def _visit(what: str, count: str, listed: str, defines: list[str], begin: str, end: str,
           steps: list[str]) -> list[str]:
    body = [f"const int listed = {listed};", *defines, f"const int block_begin = {begin};",
            f"const int block_end = {end};"]
    return ["{  // " + what, f"  const int count = {count};", "  for (int n = 0; n < count; ++n) {"] \
        + indent(body + steps, 2) + ["  }", "}"]


def _blocks_of_rows(first: str, last: str, block: int, index: str, at: str, origin: str,
                    body: list[str], needs_origin: bool) -> list[str]:
    """`body` for the block of the simdgroup's rows first.. (`index` the block, `at` its list
    row, `origin` its first row), or for each block they touch when blocks cut them."""
    if not spans(block):
        lines = [f"const ulong {at} = {index.format(block=f'{first} / {block}')};"]
        if needs_origin:
            lines.append(f"const int {origin} = int({first} / {block}) * {block};")
        return lines + body
    head = [f"const ulong {at} = {index.format(block='row_block')};",
            f"const int {origin} = row_block * {block};"]
    return [f"const int block_last = int(min({first} + 7, {last})) / {block};  // the last block these rows touch",
            f"for (int row_block = int({first} / {block}); row_block <= block_last; ++row_block) {{"] \
        + indent(head + body) + ["}"]


def key_walk(f, d, steps: Steps) -> list[str]:
    """The key blocks listed for a forward or dQ simdgroup's query rows (q_first..)."""
    within = f"uint({{query}} - block_row0) < {f.q_block}u" if spans(f.q_block) else None
    bits = [f"const ulong bits_at = ulong(kv_bit_blocks[list_at] + n) * {f.q_block * f.k_block};",
            f"const int block_key0 = listed * {f.k_block};"] if f.bits else []
    body = _visit("partial blocks: the masking rules apply", "q_first < R ? kv_num_blocks[list_at] : 0",
                  "kv_indices[list_at * Wp + n]", bits, f"max(listed * {f.k_block}, key_begin)",
                  f"min(listed * {f.k_block} + {f.k_block}, key_end)",
                  steps(_rules(f, d.rules, within, True), "block_begin", "block_end"))
    if f.full:
        body += _visit("full blocks: every pair allowed", "q_first < R ? full_kv_num_blocks[list_at] : 0",
                       "full_kv_indices[list_at * Wf + n]", [], f"listed * {f.k_block}",
                       f"min(listed * {f.k_block} + {f.k_block}, int(C))",
                       steps(_rules(f, d.rules, within, False), "block_begin", "block_end"))
    return ["", "// The key blocks listed for this simdgroup's query block(s): partial, then full."] + \
        _blocks_of_rows("q_first", "R - 1", f.q_block, f"{list_base(f, 'NQ')} + {{block}}", "list_at",
                        "block_row0", body, f.bits)


def query_walk(f, d, steps: Steps) -> list[str]:
    """The query blocks listed for a dK/dV simdgroup's keys (key_first..), head h."""
    within = f"uint({{key}} - block_key0) < {f.k_block}u" if spans(f.k_block) else None
    kinds = [("q", "partial blocks: the masking rules apply", True, "query_begin", "query_end", "Wp")]
    if f.full:
        kinds.append(("full_q", "full blocks: every pair allowed", False, "0", "int(R)", "Wf"))
    body = []
    for prefix, what, partial, low, high, width in kinds:
        entry = f"{list_base(f, f'NQ * {width}')} + {prefix}_starts[block_at] + n"
        bits = [f"const ulong bits_at = ulong(q_bit_blocks[{entry}]) * {f.q_block * f.k_block};",
                f"const int block_row0 = listed * {f.q_block};"] if partial and f.bits else []
        body += _visit(what, f"key_first < C ? {prefix}_counts[block_at] : 0", f"{prefix}_entries[{entry}]", bits,
                       f"max(listed * {f.q_block}, {low})", f"min(listed * {f.q_block} + {f.q_block}, {high})",
                       steps(_rules(f, d.rules, within, partial), "block_begin", "block_end"))
    return ["", "// The query blocks listed for this simdgroup's key block(s): partial, then full."] + \
        _blocks_of_rows("key_first", "C - 1", f.k_block, f"{list_base(f, 'NK')} + {{block}}", "block_at",
                        "block_key0", body, f.bits)
