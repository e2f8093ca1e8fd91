"""The exp2-domain softmax, as MSL lines: logits S * scale * log2(e) + bias (`logits`),
probabilities exp2(logit - reference) (`probabilities`), the forward kernels' online
softmax step (`online_softmax`), and the backward's denominators (`lse2`) and
dS = P o (dP - D) (`gradient_of_scores`)."""

from __future__ import annotations

from typing import Sequence

from ..kernel.msl import loop
from ..kernel.accumulators import Accumulator
from .scores import Element, chain, has_slope


# Sinks take FlashMLA's infinite values: -inf is no sink; +inf takes every weight (O = 0,
# lse = +inf). In the running state +inf enters as the largest finite logit, so that the
# rescales stay exp2(0) = 1 and every key's weight exp2(s - FLT_MAX) = 0 (no inf - inf).
SINK = "sinks[h] * LOG2E"


def sink_state() -> list[str]:
    """The online softmax's initial state with a sink: the sink is one more logit, with no value."""
    return [f"float m = {SINK} == INFINITY ? FLT_MAX : {SINK};  // the sink: one more logit, with no value",
            "float l = 1.0f;"]


def stored_lse(*, m: str, denominator: str, sinks: bool) -> str:
    """lse (natural log) of a row from its log2-domain max and denominator: -inf for a row with
    nothing in its denominator, +inf where an infinite sink takes every weight."""
    lse = f"{denominator} != 0.0f ? ({m} + log2({denominator})) * LN2 : -INFINITY"
    return f"{SINK} == INFINITY ? INFINITY : ({lse})" if sinks else lse


def sink_probability(lse2: str) -> str:
    """p_sink = exp2(sink - lse2), 1 where both are the same infinity (the sink took every weight)."""
    return f"({SINK} == {lse2} ? 1.0f : exp2({SINK} - {lse2}))"


def logits(d, count: int, scores_tile: str, also: Sequence[str] = (), keep_slopes: bool = False,
           at: Element | None = None) -> list[str]:
    """s[i] = T(score * scale * log2(e)) + bias for allowed elements (MASKED stays MASKED), T
    being `d`'s chain of score transforms (scores.py; none: the identity) at the element's
    positions `at`, then `also`. With `keep_slopes` (the backward's), score_slope[i] = T's
    derivative, for `gradient_of_scores`. Reads s (from `bias`)."""
    scaled = f"{scores_tile}[j].thread_elements()[e] * {d.scale_log2e}"
    if not d.scores:
        return loop(f"int j = 0; j < {count}; ++j", loop("int e = 0; e < 2; ++e", [
            "const int i = j * 2 + e;", f"s[i] = s[i] != MASKED ? {scaled} + s[i] : MASKED;", *also]))
    steps, logit, slope = chain(d.scores, "x", at)
    kept = [f"score_slope[i] = {slope};"] if keep_slopes and slope is not None else []
    return ([f"float score_slope[{2 * count}];  // d T / d x of each element"] if kept else []) + loop(
        f"int j = 0; j < {count}; ++j", loop("int e = 0; e < 2; ++e", [
            "const int i = j * 2 + e;", f"const float x = {scaled};", *steps,
            f"s[i] = s[i] != MASKED ? {logit} + s[i] : MASKED;", *kept, *also]))


def probabilities(count: int, target: str, reference: str, also: Sequence[str] = ()) -> list[str]:
    """target[j] = exp2(s - reference) for allowed elements, 0 for removed ones, then `also`
    (with `p` the element's probability). Reads s."""
    return loop(f"int j = 0; j < {count}; ++j", loop("int e = 0; e < 2; ++e", [
        f"const float p = s[j * 2 + e] != MASKED ? exp2(s[j * 2 + e] - {reference}) : 0.0f;",
        f"{target}[j].thread_elements()[e] = p;",
        *also,
    ]))


def online_softmax(d, key_tiles: int, output: Accumulator | None = None, at: Element | None = None) -> list[str]:
    """One step of the forward's online softmax over `key_tiles` tiles of scores in p_tile at
    positions `at`: the new running max m, the rescale of l and the output (`output`, default
    the register tiles o_tile), probabilities in p_tile. Reads p_tile, s (the bias), m, l, the
    output."""
    lines = ["", "// Online softmax: new running max, rescale, probabilities.", "float block_max = MASKED;"]
    lines += logits(d, key_tiles, "p_tile", ["block_max = max_nan(block_max, s[i]);"], at=at)
    lines += [
        "block_max = max_nan(block_max, simd_shuffle_xor(block_max, 1));",
        "block_max = max_nan(block_max, simd_shuffle_xor(block_max, 8));",
        "const float m_new = max_nan(m, block_max);  // a NaN logit makes the row NaN",
        "const float correction = exp2(m - m_new);  // 1 when the max holds, 0 when m was MASKED",
        "m = m_new;",
        "float block_sum = 0.0f;",
    ]
    lines += probabilities(key_tiles, "p_tile", "m", ["block_sum += p;"])
    lines += [
        "block_sum += simd_shuffle_xor(block_sum, 1);",
        "block_sum += simd_shuffle_xor(block_sum, 8);",
        "l = l * correction + block_sum;",
    ]
    return lines + (output or Accumulator("o_tile", d.value_dim)).scale("correction")


def lse2(target: str, at: str) -> list[str]:
    """target = the log2-domain lse at index `at`; -MASKED (P = 0) where lse = -inf (no key)."""
    return [f"const float lse_value = lse[{at}];",
            f"{target} = lse_value == -INFINITY ? -MASKED : lse_value * LOG2E;  // a NaN row stays NaN"]


def gradient_of_scores(count: int, delta: str, transforms: Sequence = ()) -> list[str]:
    """dS = P o (dP - D), written over dP; through score `transforms` with a derivative, times
    each element's slope (`logits(keep_slopes=True)`)."""
    slope = " * score_slope[j * 2 + e]" if has_slope(transforms) else ""
    return (["", f"// dS = P o (dP - D){' o dT/dx' if slope else ''}, in place of dP."]
            + loop(f"int j = 0; j < {count}; ++j", loop("int e = 0; e < 2; ++e", [
                "dp_tile[j].thread_elements()[e] = p_tile[j].thread_elements()[e] * "
                f"(dp_tile[j].thread_elements()[e] - {delta}){slope};"])))
