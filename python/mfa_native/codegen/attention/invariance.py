"""Batch-invariant mode (`deterministic="batch_invariant"`): a query row's output and lse bits
depend on its own query, keys and values only, never on the batch, R, its place in a varlen
batch, or whether the call decodes, verifies or prefills.

Every path then does the same float operations in the same order for a row:

- the keys are cut into splits of a fixed length (`split_keys`: SPLIT_KEYS rounded up to whole
  key blocks, a function of the head dims, dtype and tile family alone), counted from the
  row's sequence's first key; each split runs its own online softmax from (MASKED, 0, 0), in
  key blocks at fixed offsets from the split's start, and the splits' states are merged in
  order (`merge`) into the running total, which starts at the sink (or nothing);
- the one-pass kernel merges each split in registers as it ends; the split-KV pair stores the
  splits' states (attention_partial) and attention_combine merges them in the same order with
  the same arithmetic, so whether a call splits over threadgroups (which still depends on the
  device and the call's sizes) changes no bit;
- the tile row (key block, tile types) is a function of the head dims, dtype, storage and
  family: the key block is the staged one (rows.py) whether this call's threadgroups stage
  their blocks or pack heads (both depend on R) or not, and a walk's first block is aligned to
  the block grid (a window's left side only masks keys). A row's products do not depend on
  the other rows of its tiles (each element of an 8x8 product is its own row's dot product),
  so packing a kv head's query heads into one tile, or a row's place in it, changes no bit.

Blocks or splits a row does not see add exact zeros (a removed key's probability is 0 and the
state's rescale is exp2(0) = 1), so a prefill row that walks the blocks of its simdgroup's
later rows gets the bits of a decode row that stops at its last key.
"""

from __future__ import annotations

from ..kernel.accumulators import Accumulator
from ..kernel.msl import loop
from ..kernel.tiles import tiles

SPLIT_KEYS = 256   # keys per split (rounded up to whole key blocks): the length split-KV cuts in the mode


def split_keys(key_block: int) -> int:
    """The mode's keys per split for kernels walking `key_block` keys a step: SPLIT_KEYS rounded
    up to whole blocks."""
    return -(-SPLIT_KEYS // key_block) * key_block


def _down(value: str, first_key: str, step: int) -> str:
    """MSL of `value` moved down to the grid of `step` keys that starts at `first_key`."""
    if first_key == "0":
        return f"{value} / {step} * {step}"
    return f"{first_key} + ({value} - {first_key}) / {step} * {step}"


def aligned_begin(name: str, first_key: str, block: int) -> list[str]:
    """MSL that moves `name` (the first key a walk visits) down to the block grid that starts
    at `first_key`, the sequence's first key."""
    return [f"{name} = {_down(name, first_key, block)};"
            "  // batch-invariant: blocks at fixed offsets of the sequence's first key"]


def merge(total: tuple[str, str], part: tuple[str, str], elements: list[str]) -> list[str]:
    """MSL merging a split's softmax state `part` = (m, l) into the running `total` = (m, l), both
    log2 domain, then `elements` (lines of `merged` for the output elements). Explicit fma, so
    every kernel that merges does exactly these operations."""
    (m, l), (m_part, l_part) = total, part
    return ["{",
            f"  const float m_merged = max_nan({m}, {m_part});  // a NaN in either stays",
            f"  const float to_total = exp2({m} - m_merged);  // exp2(0) = 1 for an empty split",
            f"  const float to_merged = exp2({m_part} - m_merged);",
            f"  {l} = fma({l_part}, to_merged, {l} * to_total);",
            *("  " + line for line in elements),
            f"  {m} = m_merged;",
            "}"]


def merged(target: str, value: str) -> str:
    """The merge of one unnormalized output element `value` into `target` (inside `merge`)."""
    return f"{target} = fma({value}, to_merged, {target} * to_total);"


def _each_element(width: int, line) -> list[str]:
    """`line(e)` for the lane's elements e (0, 1) of every tile t of a `width`-wide accumulator."""
    return loop(f"ushort t = 0; t < {tiles(width)}; ++t", [line(e) for e in (0, 1)])


def total_state(part: Accumulator) -> tuple[Accumulator, list[str]]:
    """The running total of the mode's forward kernel, declared after the kernel's own state
    (m, l and the accumulator `part`), which it starts from: m_total, l_total and its
    accumulator; the kernel's state then holds one split at a time."""
    total = Accumulator(f"{part.name}_total", part.width, part.block, part.simdgroups)
    return total, (["", "// Batch-invariant: the merged splits so far, from the initial state."]
                   + ["float m_total = m;", "float l_total = l;"] + total.declare("O of the merged splits"))


def split_walk(split_keys: int, part: Accumulator, total: Accumulator, begin: str, end: str, first_key: str,
               walk) -> list[str]:
    """The forward kernel's walk over [begin, end) in the mode: per split of `split_keys` keys
    from `first_key`, the kernel's state reset, `walk(split_begin, split_end)` (its online
    softmax over the split's keys), and the split merged into the total."""
    reset = ["m = MASKED;", "l = 0.0f;"] + _each_element(part.width, lambda e: f"{part.element('t', e)} = 0.0f;")
    elements = _each_element(part.width, lambda e: merged(total.element("t", e), part.element("t", e)))
    body = reset + walk("split_begin", "split_end") + ["", "// This split, merged into the total."]
    body += merge(("m_total", "l_total"), ("m", "l"), elements)
    return (["", f"// Batch-invariant: splits of {split_keys} keys from the sequence's first key, each its own "
             "softmax state, merged in order.",
             f"for (int split_first = {_down(begin, first_key, split_keys)}; "
             f"split_first < {end}; split_first += {split_keys}) {{",
             f"  const int split_begin = max({begin}, split_first);",
             f"  const int split_end = min({end}, split_first + {split_keys});"]
            + ["  " + line for line in body] + ["}"])


def total_as_state(part: Accumulator, total: Accumulator) -> list[str]:
    """The merged total becomes the kernel's state, which its finish stores."""
    return (["", "// The merged splits are the row's state.", "m = m_total;", "l = l_total;"]
            + _each_element(part.width, lambda e: f"{part.element('t', e)} = {total.element('t', e)};"))
