"""Bundle specs: which attention problem families a bundle holds.

    {"families": [{"op": "attention", "dtype": ["float16"], "head_dim": [64, 128],
                   "value_dim": null, "gqa_ratio": [1, 4], "causal": ["none", "lower_right"],
                   "mask": ["none"], "window": [false, true], "sinks": [false],
                   "layout": ["bhsd"], "backward": true}]}

Every list is crossed with the others. An omitted key takes every value it can: dtype,
causal, mask, mask_dtype (an additive mask's element type), window, sinks, layout and family
(the GPU tile tables, FAMILIES) take all of theirs. The keys without a finite set of values
are these: head_dim is required; value_dim omitted or null is head_dim; gqa_ratio
omitted is [1]. The scale is no key: every entry's kernels read it at run time (its float32
bits), so one entry serves every scale.

The score transforms are the model's formula, so each omitted is none: `softcap` a list of
caps (null: none; a number above 0), `alibi` of "none", "per_head" (slopes (Hq,)) and
"per_batch" (slopes (B, Hq)), `score_mod` of null or a traced score_mod, {"text": its
expression's text (mfa_native.torch.score_mod.trace), "tensors": [{"dtype": "float" or
"int", "shape": [...]}, ...] (the captured tensors as the kernels read them: float32 or
int32, contiguous, of these shapes)}. The slopes and the tensors are a call's arguments.

An "attention_with_kvcache" family (the KV-cache call, Python's attention_with_kvcache:
layout bshd, no mask, forward only) takes dtype, head_dim, value_dim, gqa_ratio, causal,
window, sinks, softcap, alibi and family as attention's, and three keys of its own:
`page_size` a list of null (a contiguous (B, Cmax, Hkv, D) cache) or page sizes (pages
(num_blocks, page_size, Hkv, D) and a block table), omitted [null]; `cache` the storage, of
"plain" (q's dtype) and GGUF's "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", omitted every one;
`append` whether a call writes k and v into the cache, omitted both. Rn, the block table's
width and the page count are runtime values. The rotary embedding of an appending call (its
rotary_cos and rotary_sin) is three keys: `rotary_dim` a list of null (no rotation) or the
even number of features that turn, omitted [null]; `rotary_interleaved` and
`rotary_seqlens` (whether calls give rotary_seqlens) lists of bools, each omitted both. An
entry without an append has no rotation; the tables' length is a runtime value.

An "attention_varlen" family (packed sequences, Python's attention_varlen with cu_seqlens_q
and cu_seqlens_k: layout bshd, no mask) takes attention's keys but mask and layout, and
two keys of its own: `page_size` a list of null (packed k and v, rows of
cu_seqlens_k) or page sizes (pages (num_blocks, page_size, Hkv, D) and a block table, forward
only), omitted [null]; `seqused_k` whether packed calls give seqused_k (each sequence uses its
first seqused_k keys), a list of bools, omitted [false] (a paged entry serves calls with and
without it). `backward: true` adds attention_varlen_backward's templates to the packed
entries without seqused_k (the others are forward-only, as Python's). The
sequences' count and lengths, and the per-sequence query bound that decides whether a
forward packs query heads (max_seqlen_q, else total_q), are runtime values: the entry holds
the packed forward of every bound that packs, each guarded by it (writer.py's VARLEN_BOUND).

`window` is false (the entry serves calls without a window) or true (it serves every window
(left, right), -1 unbounded, and calls without one too: the sides reach its kernels as
runtime sizes, an unbounded side as a value that removes no key). Sequence lengths, batch
and head counts stay runtime values: one entry serves every length. So do the inputs'
strides: every entry's kernels read q, k, v, the mask (and the backward's o and dout)
strides at run time, so any view with a unit feature axis and a mask broadcast with stride 0
run in place. `backward: true` adds attention_backward's templates to each entry (omitted:
forward only).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from ..codegen import FAMILIES, MAX_HEAD_DIM
from ..codegen.attention.score_mod import ScoreMod
from ..codegen.attention.problem import CAUSAL, DTYPES, LAYOUTS, MASKS
from ..ops.arguments import softcap_value
from ..quant_formats import GGUF_BLOCK, GGUF_BLOCKS

KEYS = ("op", "dtype", "head_dim", "value_dim", "gqa_ratio", "causal", "mask", "mask_dtype", "window", "sinks",
        "layout", "softcap", "alibi", "score_mod", "family", "backward")
KVCACHE = "attention_with_kvcache"
KVCACHE_KEYS = ("op", "dtype", "head_dim", "value_dim", "gqa_ratio", "causal", "window", "sinks", "softcap", "alibi",
                "family", "page_size", "cache", "append", "rotary_dim", "rotary_interleaved", "rotary_seqlens")
VARLEN = "attention_varlen"
VARLEN_KEYS = ("op", "dtype", "head_dim", "value_dim", "gqa_ratio", "causal", "window", "sinks", "softcap", "alibi",
               "score_mod", "family", "backward", "page_size", "seqused_k")
RotaryFacts = tuple  # (dim, interleaved, starts: "cache_seqlens" or "rotary_seqlens"): a rotation as its kernels bake it
CACHES = ("plain", *GGUF_BLOCKS)   # a KV-cache entry's storage
ALIBI = ("none", "per_head", "per_batch")
ScoreModFacts = tuple  # (text, ((dtype, shape), ...)): a score_mod as its kernels bake it


@dataclass(frozen=True)
class EntryFacts:
    """One entry: the facts its kernels bake. mask_dtype is None without a mask ("bool" for
    a bool mask), window whether its kernels take a window (any, at run time); softcap, alibi
    and score_mod the score transforms (spec keys); op, and a KV-cache entry's page_size
    (None: contiguous), cache (its storage) and append."""

    dtype: str
    head_dim: int
    value_dim: int
    gqa_ratio: int
    causal: str
    mask: str
    mask_dtype: str | None
    window: bool
    sinks: bool
    layout: str
    family: str
    backward: bool
    softcap: float | None = None
    alibi: str = "none"
    score_mod: ScoreModFacts | None = None
    op: str = "attention"
    page_size: int | None = None
    cache: str = "plain"
    append: bool = False
    rotary: RotaryFacts | None = None
    seqused_k: bool = False

    def to_json(self) -> dict:
        score_mod = None if self.score_mod is None else {
            "text": self.score_mod[0], "tensors": [{"dtype": d, "shape": list(s)} for d, s in self.score_mod[1]]}
        return {"dtype": self.dtype, "head_dim": self.head_dim, "value_dim": self.value_dim,
                "gqa_ratio": self.gqa_ratio, "causal": self.causal, "mask": self.mask, "mask_dtype": self.mask_dtype,
                "window": self.window, "sinks": self.sinks, "layout": self.layout,
                "softcap": self.softcap, "alibi": self.alibi, "score_mod": score_mod,
                "family": self.family, "backward": self.backward,
                **({"page_size": self.page_size, "cache": self.cache, "append": self.append,
                    "rotary": None if self.rotary is None else dict(zip(("dim", "interleaved", "starts"), self.rotary))}
                   if self.op == KVCACHE else {}),
                **({"page_size": self.page_size, "seqused_k": self.seqused_k} if self.op == VARLEN else {})}


def _list(family: dict, key: str, default, where: str) -> list:
    value = family.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {key!r} must be a non-empty list, got {value!r}")
    return value


def _choices(values: list, allowed, key: str, where: str) -> list:
    for value in values:
        if isinstance(value, bool) or value not in allowed:
            raise ValueError(f"{where}: {key!r} value {value!r} is not one of {list(allowed)}")
    return values


def _dims(values: list, key: str, where: str) -> list[int]:
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_HEAD_DIM:
            raise ValueError(f"{where}: {key!r} values must be integers in 1..{MAX_HEAD_DIM}, got {value!r}")
    return values


def _bools(values: list, key: str, where: str) -> list[bool]:
    for value in values:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {key!r} values must be true or false, got {value!r}")
    return values


def _softcaps(values: list, where: str) -> list[float | None]:
    """Each cap as the ops check it (ops/arguments.softcap_value)."""
    try:
        return [softcap_value(v) for v in values]
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: 'softcap' values: {error}") from None


def _score_mods(values: list, where: str) -> list[ScoreModFacts | None]:
    """Each score_mod as (text, ((dtype, shape), ...)), checked as a kernel would take it."""
    facts = []
    for value in values:
        if value is None:
            facts.append(None)
            continue
        tensors = value.get("tensors", []) if isinstance(value, dict) else None
        if not (isinstance(value, dict) and isinstance(value.get("text"), str) and isinstance(tensors, list)
                and set(value) <= {"text", "tensors"}
                and all(isinstance(t, dict) and t.get("dtype") in ("float", "int") and isinstance(t.get("shape"), list)
                        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in t["shape"])
                        for t in tensors)):
            raise ValueError(f'{where}: \'score_mod\' values are null or {{"text": str, "tensors": [{{"dtype": "float" '
                             f'or "int", "shape": [positive ints]}}, ...]}}, got {value!r}')
        fact = (value["text"], tuple((t["dtype"], tuple(t["shape"])) for t in tensors))
        try:
            ScoreMod(*fact)
        except ValueError as error:
            raise ValueError(f"{where}: 'score_mod' {error}") from None
        facts.append(fact)
    return facts


def _family_entries(family: dict, where: str) -> list[EntryFacts]:
    if not isinstance(family, dict):
        raise ValueError(f"{where} must be an object, got {family!r}")
    if "scale" in family:
        raise ValueError(f"{where}: 'scale' is not a key: every entry takes the scale at run time (a call's scale)")
    op = family.get("op")
    if op not in ("attention", KVCACHE, VARLEN):
        raise ValueError(f"{where}: 'op' must be \"attention\", \"{KVCACHE}\" or \"{VARLEN}\", got {op!r}")
    keys = {"attention": KEYS, KVCACHE: KVCACHE_KEYS, VARLEN: VARLEN_KEYS}[op]
    unknown = sorted(set(family) - set(keys))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; an {op} family has {list(keys)}")
    if "head_dim" not in family:
        raise ValueError(f"{where}: 'head_dim' is required (a list of head dimensions, e.g. [64, 128])")
    dtypes = _choices(_list(family, "dtype", list(DTYPES), where), DTYPES, "dtype", where)
    head_dims = _dims(_list(family, "head_dim", None, where), "head_dim", where)
    value_dims = None if family.get("value_dim") is None else _dims(_list(family, "value_dim", None, where),
                                                                     "value_dim", where)
    ratios = _list(family, "gqa_ratio", [1], where)
    for ratio in ratios:
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
            raise ValueError(f"{where}: 'gqa_ratio' values must be integers >= 1, got {ratio!r}")
    causals = _choices(_list(family, "causal", list(CAUSAL), where), CAUSAL, "causal", where)
    if op == KVCACHE:   # layout bshd, no mask, forward only: the call's own
        family = {**family, "mask": ["none"], "layout": ["bshd"], "backward": False}
    if op == VARLEN:    # layout bshd, no mask: the call's own
        family = {**family, "mask": ["none"], "layout": ["bshd"]}
    masks = _choices(_list(family, "mask", list(MASKS), where), MASKS, "mask", where)
    mask_dtypes = _choices(_list(family, "mask_dtype", list(DTYPES), where), DTYPES, "mask_dtype", where)
    windows = _bools(_list(family, "window", [False, True], where), "window", where)
    sinks = _bools(_list(family, "sinks", [False, True], where), "sinks", where)
    layouts = _choices(_list(family, "layout", list(LAYOUTS), where), LAYOUTS, "layout", where)
    softcaps = _softcaps(_list(family, "softcap", [None], where), where)
    alibis = _choices(_list(family, "alibi", ["none"], where), ALIBI, "alibi", where)
    score_mods = _score_mods(_list(family, "score_mod", [None], where), where)
    families = _choices(_list(family, "family", list(FAMILIES), where), FAMILIES, "family", where)
    backward = family.get("backward", False)
    if not isinstance(backward, bool):
        raise ValueError(f"{where}: 'backward' must be true or false, got {backward!r}")

    variants = [(*cache, False) for cache in _cache_keys(family, where)] if op == KVCACHE else (
        _varlen_keys(family, where) if op == VARLEN else [(None, "plain", False, None, False)])

    entries = []
    for dtype, d, ratio, causal, mask, window, sink, layout, cap, alibi, score_mod, gpu in itertools.product(
            dtypes, head_dims, ratios, causals, masks, windows, sinks, layouts, softcaps, alibis, score_mods, families):
        for dv, (page_size, cache, append, rotary, seqused_k) in itertools.product(value_dims or [d], variants):
            if cache != "plain" and (d % GGUF_BLOCK or dv % GGUF_BLOCK):
                raise ValueError(f"{where}: 'cache' {cache!r} stores blocks of {GGUF_BLOCK} values: head_dim and "
                                 f"value_dim must be multiples of {GGUF_BLOCK}, got {d} and {dv}")
            if rotary is not None and rotary[0] > d:
                raise ValueError(f"{where}: 'rotary_dim' {rotary[0]} is more than head_dim {d}")
            kinds = mask_dtypes if mask == "additive" else ["bool" if mask == "bool" else None]
            for mask_dtype in kinds:
                entries.append(EntryFacts(dtype, d, dv, ratio, causal, mask, mask_dtype, window, sink, layout,
                                          gpu, backward and not seqused_k and page_size is None, cap, alibi,
                                          score_mod, op, page_size, cache, append, rotary, seqused_k))
    return entries


def _page_sizes(family: dict, where: str) -> list[int | None]:
    pages = _list(family, "page_size", [None], where)
    for page in pages:
        if page is not None and (isinstance(page, bool) or not isinstance(page, int) or page < 1):
            raise ValueError(f"{where}: 'page_size' values must be null (a contiguous cache) or integers >= 1, "
                             f"got {page!r}")
    return pages


def _varlen_keys(family: dict, where: str) -> list[tuple]:
    """A varlen family's (page_size, "plain", False, None, seqused_k) crossed, once each: a
    paged entry's seqused_k is False (its kernels read the keys the host computes either way)."""
    used = _bools(_list(family, "seqused_k", [False], where), "seqused_k", where)
    variants = ((page, "plain", False, None, flag and page is None) for page in _page_sizes(family, where)
                for flag in used)
    return list(dict.fromkeys(variants))


def _cache_keys(family: dict, where: str) -> list[tuple[int | None, str, bool, RotaryFacts | None]]:
    """A KV-cache family's (page_size, cache, append, rotary) crossed; a rotation only with an append."""
    pages = _page_sizes(family, where)
    caches = _choices(_list(family, "cache", list(CACHES), where), CACHES, "cache", where)
    appends = _bools(_list(family, "append", [False, True], where), "append", where)
    dims = _list(family, "rotary_dim", [None], where)
    for dim in dims:
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2):
            raise ValueError(f"{where}: 'rotary_dim' values must be null or even integers >= 2, got {dim!r}")
    interleaved = _bools(_list(family, "rotary_interleaved", [True, False], where), "rotary_interleaved", where)
    starts = ["rotary_seqlens" if given else "cache_seqlens"
              for given in _bools(_list(family, "rotary_seqlens", [False, True], where), "rotary_seqlens", where)]
    rotations = [None] * (None in dims) + [r for r in itertools.product([d for d in dims if d is not None],
                                                                         interleaved, starts)]
    return [(page, cache, append, rotary) for page, cache, append, rotary in
            itertools.product(pages, caches, appends, rotations) if append or rotary is None]


def entries_of(spec: dict | str) -> list[EntryFacts]:
    """The entries a spec (its JSON text or the parsed value) declares, in order, each once;
    ValueError naming the family and key that are wrong."""
    if isinstance(spec, str):
        spec = json.loads(spec)
    if not isinstance(spec, dict) or not isinstance(spec.get("families"), list) or not spec["families"]:
        raise ValueError('a bundle spec is {"families": [{"op": "attention", ...}, ...]}')
    seen, entries = set(), []
    for i, family in enumerate(spec["families"]):
        for entry in _family_entries(family, f"families[{i}]"):
            if entry not in seen:
                seen.add(entry)
                entries.append(entry)
    return entries
