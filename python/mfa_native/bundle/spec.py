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

`deterministic` (attention, the KV-cache call and varlen, Python's argument of that name) is a
list of "run_to_run" (every kernel: two runs give the same bits) and "batch_invariant" (a
row's bits never depend on the rest of the call: its batch, lengths or split), omitted
["run_to_run"]; the backward's passes serve either.

An "attention_with_kvcache" family (the KV-cache call, Python's attention_with_kvcache:
layout bshd, no mask, forward only) takes dtype, head_dim, value_dim, gqa_ratio, causal,
window, sinks, softcap, alibi, score_mod and family as attention's, and three keys of its own:
`page_size` a list of null (a contiguous (B, Cmax, Hkv, D) cache) or page sizes (pages
(num_blocks, page_size, Hkv, D) and a block table), omitted [null]; `cache` the storage, of
"plain" (q's dtype), GGUF's "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", MLX's "affine" (a
QuantizedTensor with uint32 words and scales and biases of q's dtype; its `bits` and
`group_size` are two more keys, as the quantize family's, each omitted every value), and
"float8_e4m3fn", "float8_e5m2" (float8 arrays; calls may give q_descale, k_descale and
v_descale, any of them, the entry reading 1 for one not given), omitted every one whose
groups (GGUF's 32 values, affine's group_size) the head dims hold; a value may also be a
pair [k_cache's, v_cache's] for caches stored differently (e.g. ["float8_e4m3fn",
"float8_e5m2"]); `append` whether a call writes k and v into the cache, omitted both. Rn, the block table's
width and the page count are runtime values. The rotary embedding of an appending call (its
rotary_cos and rotary_sin) is three keys: `rotary_dim` a list of null (no rotation) or the
even number of features that turn, omitted [null]; `rotary_interleaved` and
`rotary_seqlens` (whether calls give rotary_seqlens) lists of bools, each omitted both. An
entry without an append has no rotation; the tables' length is a runtime value.

An "int8_attention" family (Python's int8_attention: q, k, v quantized to int8 on the device,
forward only, no score_mod) takes attention's other keys, head dimensions 1..256, and three
of its own, each omitted every value: `qk_scale` of "token" and "tile", `smooth_k` of true
and false, `pv` of "int8" and "float".

A "merge_attention" family (Python's merge_attention: the parts' outputs and lse merged) has
its own keys only: `value_dim` (required), `parts` (required: how many parts a call merges,
integers >= 1), dtype and layout (omitted: every one). B, Hq and R are runtime values.

A "quantize" family (Python's quantize) has `dtype` (x's), `format` ("affine" and GGUF's),
and for the affine format `bits` and `group_size` (a GGUF format has its own), each omitted
every value; x's shape is a runtime value.

A "sparse_attention" family (Python's sparse_attention: each query row attends the keys its
token list names; no causal, window or mask) takes dtype, head_dim, value_dim, gqa_ratio,
sinks, layout, softcap, alibi, score_mod, family and backward (sparse_attention_backward's
templates) as attention's, and two keys of its own: `topk_length` whether a call gives
topk_length (its kernels read the lists' lengths), omitted both; `shared_latent` whether v is
k's first Dv features (MLA's shared latent, v = k[..., :Dv]: one staged row serves both),
omitted [false] (a call whose v is a view of k is served by an entry without it too, with the
same results). topk (the lists' width), the lists' strides (a kv-head stride of 0 shares one
list among the kv heads) and every size are runtime values.

A "block_sparse_attention" family (Python's block_sparse_attention: the key blocks a BlockMask
lists per query block, attention's rules inside its partial blocks) takes attention's keys and
six of its own, which fix what its kernels bake of a call's block mask: `block_size` a list
of block sizes, each an int or a [Qb, Kb] pair of positive ints, omitted [128];
`shared_batch` and `shared_heads` whether the lists' batch (head) axis has extent 1, shared by
the batch (the query heads), each omitted both; `full_blocks` whether the mask has full lists
(full_kv_*), omitted both; `mask_bits` whether it has mask bits (kv_bit_blocks, kv_bits:
FlexAttention's mask_mod, from_torch's), omitted both; and for a backward entry `q_lists`
whether its calls give the transposed lists (checked against those the pass builds), omitted
both (a forward entry takes none: the forward reads only the kv lists). The lists' widths,
the bits' word count, the block counts and every size are runtime values.

A "sparse_topk" family (Python's sparse_topk, DeepSeek's lightning indexer: the lists
sparse_attention reads) takes `dtype` (q's and k's), `head_dim` (Di, the indexer's feature
count), `layout`, `causal` a list of true (key c is a candidate for row r iff c <= r + C - R)
and false, omitted both, and `precision` of "float" and "int8", omitted ["float"]. Its kernels
use no GPU family's tiles: one entry serves every device ("family=any"). B, the indexer
heads, R, C, topk and the strides of q, k and weights are runtime values.

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
from ..codegen.int8.problem import INT8_MAX_HEAD_DIM, PV_MODES, QK_SCALES
from ..ops.arguments import softcap_value
from ..quant_formats import AFFINE_BITS, AFFINE_GROUP_SIZES, FLOAT8_FORMATS, FORMATS, GGUF_BLOCK, GGUF_BLOCKS, QuantFormat

KEYS = ("op", "dtype", "head_dim", "value_dim", "gqa_ratio", "causal", "mask", "mask_dtype", "window", "sinks",
        "layout", "softcap", "alibi", "score_mod", "family", "backward", "deterministic")
DETERMINISTIC = ("run_to_run", "batch_invariant")   # the forward's mode (Python's `deterministic`)
KVCACHE = "attention_with_kvcache"
KVCACHE_KEYS = ("op", "dtype", "head_dim", "value_dim", "gqa_ratio", "causal", "window", "sinks", "softcap", "alibi",
                "score_mod", "family", "page_size", "cache", "bits", "group_size", "append", "rotary_dim",
                "rotary_interleaved", "rotary_seqlens", "deterministic")
VARLEN = "attention_varlen"
VARLEN_KEYS = ("op", "dtype", "head_dim", "value_dim", "gqa_ratio", "causal", "window", "sinks", "softcap", "alibi",
               "score_mod", "family", "backward", "page_size", "seqused_k", "deterministic")
RotaryFacts = tuple  # (dim, interleaved, starts: "cache_seqlens" or "rotary_seqlens"): a rotation as its kernels bake it
CACHES = ("plain", *GGUF_BLOCKS, "affine", *FLOAT8_FORMATS)   # a KV-cache entry's storages (k's and v's)
SPARSE = "sparse_attention"
SPARSE_KEYS = ("op", "dtype", "head_dim", "value_dim", "gqa_ratio", "sinks", "layout", "softcap", "alibi",
               "score_mod", "family", "backward", "topk_length", "shared_latent")
BLOCK_SPARSE = "block_sparse_attention"
BLOCK_KEYS = KEYS[:-1] + ("block_size", "shared_batch", "shared_heads", "full_blocks", "mask_bits", "q_lists")
TOPK = "sparse_topk"
TOPK_KEYS = ("op", "dtype", "head_dim", "layout", "causal", "precision")
TOPK_PRECISIONS = ("float", "int8")
ANY_FAMILY = "any"   # a sparse_topk entry's family: its kernels use no tile table
INT8 = "int8_attention"
INT8_KEYS = ("op", "dtype", "head_dim", "value_dim", "gqa_ratio", "causal", "mask", "mask_dtype", "window", "sinks",
             "layout", "softcap", "alibi", "family", "qk_scale", "smooth_k", "pv")
MERGE = "merge_attention"
MERGE_KEYS = ("op", "dtype", "value_dim", "parts", "layout")
QUANTIZE = "quantize"
QUANTIZE_KEYS = ("op", "dtype", "format", "bits", "group_size")
FAMILY_KEYS = {"attention": KEYS, KVCACHE: KVCACHE_KEYS, SPARSE: SPARSE_KEYS, TOPK: TOPK_KEYS, INT8: INT8_KEYS,
               MERGE: MERGE_KEYS, QUANTIZE: QUANTIZE_KEYS, VARLEN: VARLEN_KEYS,
               BLOCK_SPARSE: BLOCK_KEYS}   # each op's keys
ALIBI = ("none", "per_head", "per_batch")
ScoreModFacts = tuple  # (text, ((dtype, shape), ...)): a score_mod as its kernels bake it


@dataclass(frozen=True)
class EntryFacts:
    """One entry: the facts its kernels bake. mask_dtype is None without a mask ("bool" for
    a bool mask), window whether its kernels take a window (any, at run time); softcap, alibi
    and score_mod the score transforms (spec keys); op, and a KV-cache entry's page_size
    (None: contiguous), cache (its storage) and append; a sparse entry's topk_length (its
    calls give the lists' lengths) and shared_latent (v is a view of k's first Dv features); a
    sparse_topk entry's precision (its causal is "lower_right" or "none", its family ANY_FAMILY);
    a block-sparse entry's block_size (Qb, Kb), shared_batch and shared_heads (the lists'
    leading axes of extent 1), full_blocks, mask_bits and q_lists (its backward checks given
    transposed lists);
    a KV-cache entry's cache is k_cache's storage and v_cache v_cache's (CACHES), bits and
    group_size an affine one's (0 otherwise);
    an int8 entry's qk_scale, smooth_k and pv (Int8Problem's); a merge entry's parts (its
    dtype, value_dim and layout as attention's, the other facts unused); a quantize entry's
    format, bits and group_size (QuantFormat's; its dtype x's)."""

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
    topk_length: bool = False
    shared_latent: bool = False
    precision: str = "float"
    qk_scale: str = "token"
    smooth_k: bool = True
    pv: str = "int8"
    parts: int = 0
    format: str = ""
    bits: int = 0
    group_size: int = 0
    block_size: tuple[int, int] | None = None
    shared_batch: bool = False
    shared_heads: bool = False
    full_blocks: bool = False
    mask_bits: bool = False
    q_lists: bool = False
    v_cache: str = "plain"
    batch_invariant: bool = False

    def to_json(self) -> dict:
        if self.op == MERGE:
            return {"dtype": self.dtype, "value_dim": self.value_dim, "parts": self.parts, "layout": self.layout}
        if self.op == QUANTIZE:
            return {"dtype": self.dtype, "format": self.format, "bits": self.bits, "group_size": self.group_size}
        score_mod = None if self.score_mod is None else {
            "text": self.score_mod[0], "tensors": [{"dtype": d, "shape": list(s)} for d, s in self.score_mod[1]]}
        return {"dtype": self.dtype, "head_dim": self.head_dim, "value_dim": self.value_dim,
                "gqa_ratio": self.gqa_ratio, "causal": self.causal, "mask": self.mask, "mask_dtype": self.mask_dtype,
                "window": self.window, "sinks": self.sinks, "layout": self.layout,
                "softcap": self.softcap, "alibi": self.alibi, "score_mod": score_mod,
                "family": self.family, "backward": self.backward,
                **({"page_size": self.page_size, "cache": self.cache, "v_cache": self.v_cache,
                    "bits": self.bits, "group_size": self.group_size, "append": self.append,
                    "rotary": None if self.rotary is None else dict(zip(("dim", "interleaved", "starts"), self.rotary))}
                   if self.op == KVCACHE else {}),
                **({"topk_length": self.topk_length, "shared_latent": self.shared_latent} if self.op == SPARSE
                   else {}),
                **({"precision": self.precision} if self.op == TOPK else {}),
                **({"block_size": list(self.block_size), "shared_batch": self.shared_batch,
                    "shared_heads": self.shared_heads, "full_blocks": self.full_blocks, "mask_bits": self.mask_bits,
                    "q_lists": self.q_lists} if self.op == BLOCK_SPARSE else {}),
                **({"qk_scale": self.qk_scale, "smooth_k": self.smooth_k, "pv": self.pv} if self.op == INT8 else {}),
                **({"page_size": self.page_size, "seqused_k": self.seqused_k} if self.op == VARLEN else {}),
                **({"deterministic": DETERMINISTIC[self.batch_invariant]} if "deterministic" in FAMILY_KEYS[self.op]
                   else {})}


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
    if op not in FAMILY_KEYS:
        raise ValueError(f"{where}: 'op' must be one of {list(FAMILY_KEYS)}, got {op!r}")
    keys = FAMILY_KEYS[op]
    unknown = sorted(set(family) - set(keys))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; an {op} family has {list(keys)}")
    if op == MERGE:
        return _merge_entries(family, where)
    if op == QUANTIZE:
        return _quantize_entries(family, where)
    if "head_dim" not in family:
        raise ValueError(f"{where}: 'head_dim' is required (a list of head dimensions, e.g. [64, 128])")
    if op == TOPK:
        return _topk_entries(family, where)
    dtypes = _choices(_list(family, "dtype", list(DTYPES), where), DTYPES, "dtype", where)
    head_dims = _dims(_list(family, "head_dim", None, where), "head_dim", where)
    value_dims = None if family.get("value_dim") is None else _dims(_list(family, "value_dim", None, where),
                                                                     "value_dim", where)
    ratios = _list(family, "gqa_ratio", [1], where)
    for ratio in ratios:
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
            raise ValueError(f"{where}: 'gqa_ratio' values must be integers >= 1, got {ratio!r}")
    if op == SPARSE:   # a row attends exactly the keys its list names
        family = {**family, "causal": ["none"], "mask": ["none"], "window": [False]}
    causals = _choices(_list(family, "causal", list(CAUSAL), where), CAUSAL, "causal", where)
    if op == KVCACHE:   # layout bshd, no mask, forward only: the call's own
        family = {**family, "mask": ["none"], "layout": ["bshd"], "backward": False}
    if op == INT8:   # forward only, no score_mod
        family = {**family, "backward": False}
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
    modes = _choices(_list(family, "deterministic", ["run_to_run"], where), DETERMINISTIC, "deterministic", where)

    caches = _cache_keys(family, where) if op == KVCACHE else [(None, ("plain", "plain", 0, 0), False, None)]
    lists = [{}]
    if op == SPARSE:
        lists = [{"topk_length": given, "shared_latent": shared}
                 for given, shared in itertools.product(_bools(_list(family, "topk_length", [False, True], where),
                                                               "topk_length", where),
                                                        _bools(_list(family, "shared_latent", [False], where),
                                                               "shared_latent", where))]
    if op == INT8:
        lists = _int8_keys(family, head_dims, value_dims, where)
    if op == BLOCK_SPARSE:
        lists = _block_keys(family, backward, where)
    if op == VARLEN:
        caches = [(page, ("plain", "plain", 0, 0), False, None) for page in _page_sizes(family, where)]
        lists = [{"seqused_k": flag} for flag in _bools(_list(family, "seqused_k", [False], where), "seqused_k", where)]

    entries, seen = [], set()
    for dtype, d, ratio, causal, mask, window, sink, layout, cap, alibi, score_mod, gpu, mode in itertools.product(
            dtypes, head_dims, ratios, causals, masks, windows, sinks, layouts, softcaps, alibis, score_mods, families,
            modes):
        for dv, (page_size, storage, append, rotary) in itertools.product(value_dims or [d], caches):
            if not _whole_groups(storage, d, dv, family, where):
                continue
            cache, v_cache, bits, group_size = storage
            if rotary is not None and rotary[0] > d:
                raise ValueError(f"{where}: 'rotary_dim' {rotary[0]} is more than head_dim {d}")
            if dv > d and any(extra.get("shared_latent") for extra in lists):
                raise ValueError(f"{where}: 'shared_latent' reads v as k's first value_dim features: value_dim "
                                 f"must be at most head_dim, got {dv} and {d}")
            kinds = mask_dtypes if mask == "additive" else ["bool" if mask == "bool" else None]
            for mask_dtype in kinds:
                for extra in lists:
                    if op == VARLEN:   # a paged entry reads the host's key counts, with seqused_k or without
                        extra = {"seqused_k": extra["seqused_k"] and page_size is None}
                    facts = EntryFacts(dtype, d, dv, ratio, causal, mask, mask_dtype, window, sink, layout, gpu,
                                       backward and not (op == VARLEN and (extra["seqused_k"] or page_size)), cap,
                                       alibi, score_mod, op, page_size, cache, append, rotary, **extra,
                                       v_cache=v_cache, bits=bits, group_size=group_size,
                                       batch_invariant=mode == "batch_invariant")
                    if facts not in seen:
                        seen.add(facts)
                        entries.append(facts)
    return entries


def _block_sizes(family: dict, where: str) -> list[tuple[int, int]]:
    """A block-sparse family's block sizes as (Qb, Kb) pairs (an int n is (n, n))."""
    sizes = []
    for value in _list(family, "block_size", [128], where):
        pair = [value, value] if isinstance(value, int) and not isinstance(value, bool) else value
        if not (isinstance(pair, list) and len(pair) == 2 and
                all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in pair)):
            raise ValueError(f"{where}: 'block_size' values must be positive integers or [Qb, Kb] pairs of them, "
                             f"got {value!r}")
        sizes.append((pair[0], pair[1]))
    return sizes


def _block_keys(family: dict, backward: bool, where: str) -> list[dict]:
    """A block-sparse family's block_size, shared_batch, shared_heads, full_blocks, mask_bits
    and (a backward entry's) q_lists crossed (EntryFacts' fields)."""
    flags = {key: _bools(_list(family, key, [False, True], where), key, where)
             for key in ("shared_batch", "shared_heads", "full_blocks", "mask_bits", "q_lists")}
    if not backward:   # the forward reads only the kv lists
        flags["q_lists"] = [False]
    return [dict(block_size=size, **dict(zip(flags, values)))
            for size in _block_sizes(family, where) for values in itertools.product(*flags.values())]


def _topk_entries(family: dict, where: str) -> list[EntryFacts]:
    """A sparse_topk family's entries: dtype x head_dim x layout x causal x precision."""
    from ..codegen.sparse.topk_scores import check_exact
    dtypes = _choices(_list(family, "dtype", list(DTYPES), where), DTYPES, "dtype", where)
    head_dims = _dims(_list(family, "head_dim", None, where), "head_dim", where)
    layouts = _choices(_list(family, "layout", list(LAYOUTS), where), LAYOUTS, "layout", where)
    causals = _bools(_list(family, "causal", [True, False], where), "causal", where)
    precisions = _choices(_list(family, "precision", ["float"], where), TOPK_PRECISIONS, "precision", where)
    entries = []
    for dtype, d, layout, causal, precision in itertools.product(dtypes, head_dims, layouts, causals, precisions):
        if precision == "int8":
            try:
                check_exact(d)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
        entries.append(EntryFacts(dtype, d, d, 1, "lower_right" if causal else "none", "none", None, False, False,
                                  layout, ANY_FAMILY, False, op=TOPK, precision=precision))
    return entries


def _page_sizes(family: dict, where: str) -> list[int | None]:
    pages = _list(family, "page_size", [None], where)
    for page in pages:
        if page is not None and (isinstance(page, bool) or not isinstance(page, int) or page < 1):
            raise ValueError(f"{where}: 'page_size' values must be null (a contiguous cache) or integers >= 1, "
                             f"got {page!r}")
    return pages


CacheStorage = tuple   # (k_cache's storage, v_cache's, bits, group_size): a KV-cache entry's, as EntryFacts holds it


def _storages(family: dict, where: str) -> list[CacheStorage]:
    """A KV-cache family's `cache` values (a storage for both caches, or a [k's, v's] pair),
    each affine one crossed with `bits` and `group_size` (0 for the others)."""
    storages = []
    for value in _list(family, "cache", list(CACHES), where):
        pair = value if isinstance(value, list) else [value, value]
        if len(pair) != 2 or any(isinstance(x, bool) or x not in CACHES for x in pair):
            raise ValueError(f"{where}: 'cache' value {value!r} is not one of {list(CACHES)} (or a [k_cache's, "
                             "v_cache's] pair of them)")
        storages.append(tuple(pair))
    if not any("affine" in pair for pair in storages):
        for key in ("bits", "group_size"):
            if key in family:
                raise ValueError(f"{where}: {key!r} is an affine cache's: give it with 'cache' \"affine\"")
        return [(*pair, 0, 0) for pair in storages]
    bits = _choices(_list(family, "bits", list(AFFINE_BITS), where), AFFINE_BITS, "bits", where)
    group_sizes = _choices(_list(family, "group_size", list(AFFINE_GROUP_SIZES), where), AFFINE_GROUP_SIZES,
                           "group_size", where)
    shapes = list(itertools.product(bits, group_sizes))
    return [(*pair, *shape) for pair in storages for shape in (shapes if "affine" in pair else [(0, 0)])]


def _whole_groups(storage: CacheStorage, d: int, dv: int, family: dict, where: str) -> bool:
    """Whether a quantized cache's head dimensions hold whole groups (GGUF's blocks, an affine
    group): a storage the family names (and an affine one's group size) must, ValueError
    otherwise; one an omitted key brings is skipped where it does not."""
    for cache, width, name in ((storage[0], d, "head_dim"), (storage[1], dv, "value_dim")):
        group = storage[3] if cache == "affine" else GGUF_BLOCK if cache in GGUF_BLOCKS else 1
        if width % group:
            if "cache" not in family or (cache == "affine" and "group_size" not in family):
                return False
            raise ValueError(f"{where}: 'cache' {cache!r} stores groups of {group} values: {name} must be a "
                             f"multiple of {group}, got {width}")
    return True


def _cache_keys(family: dict, where: str) -> list[tuple[int | None, CacheStorage, bool, RotaryFacts | None]]:
    """A KV-cache family's (page_size, storage, append, rotary) crossed; a rotation only with an append."""
    pages = _page_sizes(family, where)
    caches = _storages(family, where)
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


def _int8_keys(family: dict, head_dims: list[int], value_dims: list[int] | None, where: str) -> list[dict]:
    """An int8 family's qk_scale, smooth_k and pv crossed (EntryFacts' fields); its head
    dimensions checked."""
    for d in head_dims + (value_dims or []):
        if d > INT8_MAX_HEAD_DIM:
            raise ValueError(f"{where}: int8_attention's head dimensions are 1..{INT8_MAX_HEAD_DIM}, got {d}")
    qk_scales = _choices(_list(family, "qk_scale", list(QK_SCALES), where), QK_SCALES, "qk_scale", where)
    smooth_ks = _bools(_list(family, "smooth_k", [True, False], where), "smooth_k", where)
    pvs = _choices(_list(family, "pv", list(PV_MODES), where), PV_MODES, "pv", where)
    return [dict(qk_scale=q, smooth_k=s, pv=p) for q, s, p in itertools.product(qk_scales, smooth_ks, pvs)]


# The attention facts of an entry whose op has none (merge_attention, quantize): unused.
_NO_ATTENTION = dict(head_dim=0, gqa_ratio=1, causal="none", mask="none", mask_dtype=None, window=False, sinks=False,
                     family="", backward=False)


def _merge_entries(family: dict, where: str) -> list[EntryFacts]:
    """A merge family's entries: dtype x value_dim x parts x layout."""
    for key in ("value_dim", "parts"):
        if key not in family:
            raise ValueError(f"{where}: {key!r} is required by a merge_attention family")
    dtypes = _choices(_list(family, "dtype", list(DTYPES), where), DTYPES, "dtype", where)
    value_dims = _dims(_list(family, "value_dim", None, where), "value_dim", where)
    counts = _list(family, "parts", None, where)
    for n in counts:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{where}: 'parts' values must be integers >= 1, got {n!r}")
    layouts = _choices(_list(family, "layout", list(LAYOUTS), where), LAYOUTS, "layout", where)
    return [EntryFacts(**_NO_ATTENTION, dtype=dtype, value_dim=dv, layout=layout, op=MERGE, parts=n)
            for dtype, dv, n, layout in itertools.product(dtypes, value_dims, counts, layouts)]


def _quantize_entries(family: dict, where: str) -> list[EntryFacts]:
    """A quantize family's entries: dtype x format, an affine format x bits x group_size."""
    dtypes = _choices(_list(family, "dtype", list(DTYPES), where), DTYPES, "dtype", where)
    formats = _choices(_list(family, "format", list(FORMATS), where), FORMATS, "format", where)
    bits = _choices(_list(family, "bits", list(AFFINE_BITS), where), AFFINE_BITS, "bits", where)
    group_sizes = _choices(_list(family, "group_size", list(AFFINE_GROUP_SIZES), where), AFFINE_GROUP_SIZES,
                           "group_size", where)
    entries = []
    for dtype, name in itertools.product(dtypes, formats):
        shapes = itertools.product(bits, group_sizes) if name == "affine" else [(None, None)]
        for b, g in shapes:
            f = QuantFormat.of(name, b, g)
            entries.append(EntryFacts(**_NO_ATTENTION, dtype=dtype, value_dim=0, layout="", op=QUANTIZE,
                                      format=f.name, bits=f.bits, group_size=f.group_size))
    return entries


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
