"""Split-KV for decode: when a few query rows per head leave the device idle, the
keys are cut into S splits that run as separate threadgroups (the partial
kernel stores each split's unnormalized O and its softmax max and sum), and a
small combine kernel merges the splits.

The decision is a program over the runtime sizes and the device's parallel threadgroups P
(`derived`): the forward's threadgroups TG, the splits that would fill the device S0, the
keys per split Cs (whole key blocks), the splits S that take, and SPLIT, whether to split.
The keys cut are the key facet's `split_length`: C for dense keys, a KV cache's capacity
(Cmax, or its block table's pages) whatever its batches' attended lengths, so a split past
a batch's attended keys visits none.
A pass template carries it, so a bundle decides per call as `kv_split` does here.
"""

from __future__ import annotations

from ...runtime.expressions import evaluate
from . import invariance
from .problem import AttentionProblem

# Only decode-shaped problems split: at most the rows facet's decode_max_rows queries (16 per
# head; 32 with packed heads, whose threadgroup holds every head of a kv head).
MIN_KEYS_PER_SPLIT = 256   # below this a split costs more than it saves
MAX_SPLITS = 64
DEVICE_SIZE = "P"          # the runtime size naming the threadgroups a device runs at once


def derived(problem: AttentionProblem, family: str) -> tuple[tuple[str, str], ...]:
    """The split decision's derived sizes, in order (they read B, Hq, Hkv, R, C, P and the
    sizes of the key facet's split_length). Batch-invariant, the keys per split are the mode's
    fixed count (invariance.split_keys), whatever the call, and S is not capped at MAX_SPLITS
    (the partial state, Dv floats per split and row, stays at most R * ratio / 256 of the
    float16 K/V bytes attended); only whether to split depends on the call."""
    rows, length = problem.rows, problem.keys.split_length
    key_block = rows.key_block(problem, family)
    keys_per_split = (str(invariance.split_keys(key_block)) if problem.batch_invariant
                      else f"cdiv(cdiv({length}, max(S0, 1)), {key_block}) * {key_block}")
    return (("TG", rows.threadgroups_expression(problem, family)),
            ("S0", f"min(cdiv(P, TG), {length} / {MIN_KEYS_PER_SPLIT}, {MAX_SPLITS})"),   # length: C or Wt * page
            ("Cs", keys_per_split),
            ("S", f"cdiv({length}, Cs)"),
            ("SPLIT", f"R <= {rows.decode_max_rows} && S0 >= 2 && S >= 2"))


def kv_split(problem: AttentionProblem, family: str, parallel_threadgroups: int) -> tuple[int, int] | None:
    """(splits, keys per split) when splitting fills a device that runs `parallel_threadgroups`
    threadgroups at once; None when the problem already has enough threadgroups (or keys are few)."""
    p = problem
    sizes = dict(B=p.batch, Hq=p.q_heads, Hkv=p.kv_heads, R=p.q_len, C=p.kv_len, P=parallel_threadgroups,
                 **p.keys.sizes(p))
    for name, expression in derived(p, family):
        sizes[name] = evaluate(expression, sizes)
    return (sizes["S"], sizes["Cs"]) if sizes["SPLIT"] else None
