"""A block mask's lists against one problem, as plain data (rules.py): what block-sparse calls
check of a BlockMask's lists on every call, before anything runs.

BlockMask's constructor checks what holds of the lists alone (int32, their ranks, pairs given
together, leading axes that broadcast together, bits shaped like kv_num_blocks). Against a
problem, given the sizes B, Hq, R, C and the block sizes Qb, Kb: each list's leading axes are
(B or 1, H or 1), its blocks axis has the problem's block count (ceil(R / Qb) for the kv
lists, ceil(C / Kb) for the transposed q lists), its counts lie in 0 .. its width, and the
counted entries of its indices name blocks of the other side ("pages" of one block each);
every counted partial block's mask bits lie inside kv_bits. The bundle carries this as the
"block_lists" declaration (`declaration_data`); the C++ core checks an mfa::BlockMask's lists
by it.
"""

from __future__ import annotations

from typing import Any

from .rules import ArrayRule, Checks, Content, Lengths, Require, checks_data, rule_data

NAME = "block_lists"   # the declaration's name in a bundle


def _pair(prefix: str) -> dict[str, ArrayRule]:
    """A (num_blocks, indices) pair's rules: `prefix` kv, full_kv, q or full_q."""
    num, indices = f"{prefix}_num_blocks", f"{prefix}_indices"
    kv = "kv" in prefix
    blocks, targets = ("q_blocks", "k_blocks") if kv else ("k_blocks", "q_blocks")
    side = "ceil(R / Q_BLOCK)" if kv else "ceil(C / KV_BLOCK)"
    batch, heads, width = f"{prefix}_lb", f"{prefix}_lh", f"{prefix}_width"
    int32 = dict(dtypes=("int32",), reads="contiguous")
    return {
        num: ArrayRule(
            **int32, shapes=((batch, heads, blocks),),
            requires=(Require(f"({batch} == 1 || {batch} == B) && ({heads} == 1 || {heads} == Hq)",
                              f"{num} has leading axes ({{{batch}}}, {{{heads}}}), but they must be (B or 1, H or 1) "
                              "with B = {B}, H = {Hq}"),),
            contents=(Content("nonnegative", f"{num} must be in 0..{{{width}}} (the width of {indices}), got "
                                             f"{{{num}.min}}"),
                      Content("fits", f"{num} must be in 0..{{{width}}} (the width of {indices}), got {{{num}.value}}",
                              bound=width, lengths=num)),
            dtype_error=f"{num} must be int32, got {{{num}.dtype}}",
            shape_error=f"{num} has shape {{{num}.shape}}, but its last axis must be {side} = {{{blocks}}}"),
        indices: ArrayRule(
            **int32, shapes=((batch, heads, blocks, width),),
            contents=(Content("pages", f"{indices} lists block {{{indices}.value}} in its counted part (row "
                                       f"{{{indices}.row}}, entry {{{indices}.column}}), outside 0..{{{indices}.last}}",
                              bound=targets, lengths=num, page="1"),),
            dtype_error=f"{indices} must be int32, got {{{indices}.dtype}}",
            shape_error=f"{indices} {{{indices}.shape}} must extend {num} {{{num}.shape}} by one axis")}


RULES = {
    **_pair("kv"), **_pair("full_kv"), **_pair("q"), **_pair("full_q"),
    "kv_bit_blocks": ArrayRule(
        dtypes=("int32",), shapes=(("kv_lb", "kv_lh", "q_blocks"),), reads="contiguous",
        contents=(Content("nonnegative", "kv_bit_blocks must be >= 0, got {kv_bit_blocks.min}"),
                  Content("fits", "kv_bit_blocks + kv_num_blocks reach {kv_bit_blocks.value} bit blocks of {pairs} "
                                  "bits, past the {Wb} * 32 bits of kv_bits", bound="Wb * 32 / pairs",
                          lengths="bit_ends")),
        dtype_error="kv_bit_blocks must be int32, got {kv_bit_blocks.dtype}",
        shape_error="kv_bit_blocks {kv_bit_blocks.shape} must have the shape of kv_num_blocks {kv_num_blocks.shape}"),
    "kv_bits": ArrayRule(dtypes=("int32",), shapes=(("Wb",),), reads="contiguous",
                         dtype_error="kv_bits must be int32, got {kv_bits.dtype}",
                         shape_error="kv_bits must have 1 dimension, got shape {kv_bits.shape}")}
CHECKS = Checks(
    derived=(("q_blocks", "cdiv(R, Qb)"), ("k_blocks", "cdiv(C, Kb)"), ("pairs", "Qb * Kb")),
    lengths={**{f"{prefix}_num_blocks": Lengths(((f"{prefix}_num_blocks", False),))
                for prefix in ("kv", "full_kv", "q", "full_q")},
             "bit_ends": Lengths((("kv_bit_blocks", False),), plus="kv_num_blocks")})


def declaration_data() -> dict[str, Any]:
    """The lists' rules and checks as the JSON a bundle carries (an op's declaration's form)."""
    return {"op": NAME, "arrays": [rule_data(name, rule, "input", True) for name, rule in RULES.items()],
            **checks_data(CHECKS)}
