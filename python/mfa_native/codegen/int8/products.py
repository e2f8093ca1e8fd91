"""The product step of int8 attention: integer products of int8 tiles, and the bound that
keeps them exact.

Every int8 value (-127..127, and P's 0..127) is exact in `half`, and a product of two
is an integer of at most 127 * 127 = 16129 in magnitude, exact in float32. A float32
accumulator adds such integers exactly while every partial sum stays below 2**24 in
magnitude, whatever the order of the additions. So `simdgroup_multiply_accumulate` of
half tiles into float tiles gives the same bits as an int32 pipeline on every Apple GPU,
provided each accumulator sums few enough products:

- S = Q K^T sums D products per element: D * 127**2 < 2**24, so D <= 1040;
- P V sums the products of one aligned block of P_BLOCK keys (P is quantized per block,
  so each block's integer sum is scaled into the float output on its own):
  P_BLOCK * 127**2 < 2**24.

`check_exact` refuses what could exceed the bound; the int8 codegen calls it for every
problem.

`int8_products` is the one place the int8 kernels multiply: the loads of its right
operand are the caller's, the tiles and the multiply-accumulate are here. A Metal 4
tensor-op path (int8 x int8 -> int32 on M5's matrix units) replaces this function and
INT8_TILE: the contract is that `result` ends holding the exact integer sums.
"""

from __future__ import annotations

from typing import Callable

from ..kernel.msl import indent, loop

INT8_MAX = 127            # int8 values are symmetric: -127..127 (P: 0..127)
EXACT_INTEGERS = 2**24    # float32 holds every integer of smaller magnitude exactly
P_BLOCK = 64              # keys per P-quantization block: [0, 64), [64, 128), ...
INT8_TILE = "simdgroup_half8x8"   # an 8x8 tile of int8 values, exact in half


def largest_sum(terms: int) -> int:
    """The largest magnitude a sum of `terms` int8 x int8 products can reach."""
    return terms * INT8_MAX * INT8_MAX


def check_exact(*, head_dim: int, value_block: int = P_BLOCK) -> None:
    """Raises ValueError unless every integer sum of the int8 kernels stays below 2**24:
    Q K^T over `head_dim` features, P V over `value_block` keys."""
    for what, terms in ((f"Q K^T over D = {head_dim} features", head_dim),
                        (f"P V over a block of {value_block} keys", value_block)):
        if largest_sum(terms) >= EXACT_INTEGERS:
            raise ValueError(f"int8 products of {what} can reach {largest_sum(terms)} = {terms} * {INT8_MAX}**2, "
                             f"not below 2**24 = {EXACT_INTEGERS}: float32 accumulation would not be exact")


def int8_products(result: str, *, left: str, load_right: Callable[[str], list[str]], inner: int, outer: int,
                  visible: str) -> list[str]:
    """result[o] += sum over i < inner of left[i] . R(i, o), for o < outer: `left` is an array
    of INT8_TILE, `result` of simdgroup_float8x8 (it holds exact integers), and
    `load_right(target)` gives the lines that load the int8 tile R(i, o) into `target`
    (they may read i and o). Pairs (i, o) where `visible` is false are skipped."""
    body = [f"{INT8_TILE} right;"] + load_right("right")
    body.append(f"simdgroup_multiply_accumulate({result}[o], {left}[i], right, {result}[o]);")
    return loop(f"ushort i = 0; i < {inner}; ++i",
                loop(f"ushort o = 0; o < {outer}; ++o", [f"if ({visible}) {{"] + indent(body) + ["}"]))
