"""Generates the payload of a bundle: each entry's facts and its pass templates.

An entry's kernels bake its facts (dtype, head dims, GQA ratio, masking, layout, score
transforms, GPU family); its templates keep B, Hq, Hkv, R and C (and the device's parallel
threadgroups P) symbolic, and so the inputs' strides, the scale and, for a window entry, the
window's sides (AttentionProblem.runtime_strides / runtime_scale / runtime_window). Codegen
still picks tiles by the lengths (fewer query rows for short R, the split-KV pair for
decode), each choice a template whose guards say for which sizes it was made, so an entry
holds one template per choice: those generated at lengths that reach every choice, each
kept once. A reader takes the first template whose guards hold, the one
codegen would have generated for the call.

Payload (JSON): {"format": "mfa_native.bundle", "template_schema": 1, "generator": ...,
"declarations": {"attention": {...}, "attention_backward": {...}}, "entries": [{"op": "attention",
"facts": {...}, "forward": [template, ...], "backward": [template, ...]}], "metallibs": {}}.
Templates are PassTemplate.to_json's objects (runtime/templates.py); facts are
EntryFacts.to_json's; declarations are the ops' Op.declaration_data() (ops/rules.py), the
rules the C++ binder checks a call's arrays by.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from typing import Callable

from ..codegen import (PACKING, AttentionBackwardProblem, AttentionProblem, BlockLists, CacheKeys, Int8Problem,
                       PagedSequences, SequenceRanges, TokenLists, attention_backward_template, attention_template,
                       int8_attention_template, packs_plain_heads)
from ..codegen.attention import merge as codegen_merge
from ..codegen.attention.rotary import Rotary
from ..codegen.attention.score_mod import ScoreMod
from ..codegen.sparse import topk as topk_codegen
from ..codegen.storage import quantize as codegen_quantize
from ..codegen.storage.float8 import Float8Storage
from ..codegen.storage.stored import PLAIN, QuantizedStorage
from ..quant_formats import FLOAT8_FORMATS, QuantFormat
from ..ops.attention import score_transforms
from ..ops import block_lists as lists_rules
from ..ops.declaration import OPS
from ..runtime.templates import SCHEMA_VERSION, PassTemplate
from .spec import BLOCK_SPARSE, INT8, KVCACHE, MERGE, QUANTIZE, SPARSE, TOPK, VARLEN, EntryFacts

# Lengths that reach every tile choice: rows per threadgroup are halved from the table's
# (at most 256) down to 8 while half still cover the length, so 1 and 2**k + 1 reach each.
LENGTHS = (1, 9, 17, 33, 65, 129, 257)
NO_SPLIT = (64, 1)                 # (C, P): too few keys to split, whatever the device
SPLIT = (1 << 15, 1 << 20)         # (C, P): a decode that splits
MAX_SPLIT_ROWS = 32                # decode rows that may split (the packed facet's bound)


def query_lengths(facts: EntryFacts) -> list[int]:
    """R values that reach every rows choice: LENGTHS, and where GQA heads pack as tile rows
    (packing.PACKING: the threadgroup takes the R * ratio pairs rounded up to whole 8-row tiles),
    the first R of every 8 pairs up to the packing bound, and the first R past it."""
    ratio = facts.gqa_ratio
    lengths = set(LENGTHS)
    if packs_plain_heads(ratio, 1):
        lengths |= {8 * band // ratio + 1 for band in range(PACKING.max_pairs // 8)}
        lengths.add(PACKING.max_pairs // ratio + 1)
    return sorted(lengths)


def problem(facts: EntryFacts, q_len: int, kv_len: int, batch: int = 1, kv_heads: int = 1) -> AttentionProblem:
    """The contiguous problem of `facts` with these lengths, batch and kv heads (strides, the
    scale and, with facts.window, the window's sides as runtime sizes; the window unbounded);
    for a KV-cache entry, its cache read over kv_len rows (`cache_keys`); for a sparse entry, its
    token lists (`token_lists`); for a block-sparse entry, its block lists (`block_lists`)."""
    p = AttentionProblem(
        batch=batch, q_heads=facts.gqa_ratio * kv_heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, head_dim=facts.head_dim,
        value_dim=facts.value_dim, dtype=facts.dtype, layout=facts.layout, causal=facts.causal,
        runtime_window=facts.window, runtime_strides=True, runtime_scale=True,
        mask=facts.mask, mask_dtype=facts.mask_dtype if facts.mask == "additive" else None, sinks=facts.sinks,
        return_lse=True, scores=scores(facts), batch_invariant=facts.batch_invariant)
    if facts.op == SPARSE:
        return token_lists(p, facts)
    if facts.op == BLOCK_SPARSE:
        return block_lists(p, facts)
    if facts.op == VARLEN:   # packed sequences, not packing heads (the backward's; forward_templates packs)
        return replace(p, keys=sequence_keys(facts, kv_len, None))
    return cache_keys(p, facts) if facts.op == KVCACHE else p


def sequence_keys(facts: EntryFacts, kv_len: int, max_queries: int | None) -> SequenceRanges:
    """A varlen entry's keys for a bound on every sequence's queries (None: no head packing):
    packed (rows of cu_seqlens_k, or their first seqused_k) or pages following each other."""
    if facts.page_size is None:
        return SequenceRanges(2, max_queries, facts.seqused_k)
    return PagedSequences(2, max_queries, page_size=facts.page_size,
                          pages_per_sequence=max(-(-kv_len // facts.page_size), 1))


def token_lists(p: AttentionProblem, facts: EntryFacts, topk: int = 16) -> AttentionProblem:
    """`p` attending token lists as sparse_attention binds them (ops/sparse.py): contiguous
    (B, Hkv, R, topk) lists, and (B, R) lengths when the entry takes them. With runtime strides
    (every bundle's) the lists' strides and topk are runtime sizes, so these values are examples."""
    lengths = (p.q_len, 1) if facts.topk_length else None
    strides = (p.kv_heads * p.q_len * topk, p.q_len * topk, topk, 1)
    return replace(p, keys=TokenLists(topk, strides, lengths, facts.shared_latent))


def block_lists(p: AttentionProblem, facts: EntryFacts, width: int = 4, words: int = 4) -> AttentionProblem:
    """`p` visiting block lists as block_sparse_attention binds a BlockMask (ops/block_mask.py):
    the lists the entry's mask has, their leading axes shared or not. The lists' widths and
    the bits' words are runtime sizes (Wp, Wf, Wq, Wqf, Wb), so `width` and `words` are examples."""
    full, given = facts.full_blocks, facts.q_lists
    return replace(p, keys=BlockLists(*facts.block_size, facts.shared_batch, facts.shared_heads, width,
                                      width if full else None, width if given else None,
                                      width if full and given else None, words if facts.mask_bits else None))


def cache_keys(p: AttentionProblem, facts: EntryFacts) -> AttentionProblem:
    """`p` reading a KV cache as attention_with_kvcache binds one (ops/kvcache.py): contiguous
    or pages following each other, appending a row when the entry appends. A quantized or
    float8 cache's fields are laid out contiguous, their rows shared by every batch when paged
    (stride 0): two batches, so the stride is generated as the literal 0 it is. A float8
    cache's descale is (B, Hkv) contiguous (the C++ op packs what a call gives so), and a
    float8 k_cache's entry always reads q_descale (1 where a call gives none: the same bits)."""
    page = facts.page_size
    rotary = None
    if facts.rotary is not None:   # q's rows turn at consecutive positions with causal or a window (ops/kvcache.py)
        dim, interleaved, starts = facts.rotary
        rotary = Rotary(dim, interleaved, facts.causal != "none" or facts.window, starts)
    p = replace(p, batch=2, keys=CacheKeys(int(facts.append), page, -(-p.kv_len // page) if page else None, page,
                                           rotary, 1 if rotary else 0))
    return replace(p, k_storage=cache_storage(p, facts, facts.cache, p.head_dim, True),
                   v_storage=cache_storage(p, facts, facts.v_cache, p.value_dim, False))


def cache_storage(p: AttentionProblem, facts: EntryFacts, cache: str, width: int, keys: bool):
    """The storage facet of one cache (`cache` a spec storage name, `width` its features) as the
    C++ op binds it: rows (B, C, Hkv, -) contiguous, batch stride 0 when paged."""
    if cache == "plain":
        return PLAIN

    def rows(row: int) -> tuple[int, int, int, int]:   # logical (batch, head, sequence, -) strides
        return (0 if facts.page_size else p.kv_len * p.kv_heads * row, row, p.kv_heads * row, 1)
    if cache in FLOAT8_FORMATS:
        descale = (p.kv_heads, 1)
        return Float8Storage(FLOAT8_FORMATS[cache], rows(width), descale, descale if keys else None)
    quant = QuantFormat.of(cache, facts.bits or None, facts.group_size or None)
    groups = rows(quant.groups(width)) if quant.affine else None
    return QuantizedStorage(quant, rows(quant.data_width(width)), facts.dtype if quant.affine else None, groups,
                            groups)


def scores(facts: EntryFacts) -> tuple:
    """The entry's chain of score transforms, as the ops build it (softcap, ALiBi, score_mod)."""
    alibi_per_batch = None if facts.alibi == "none" else facts.alibi == "per_batch"
    return score_transforms(facts.softcap, alibi_per_batch) + (() if facts.score_mod is None
                                                                else (ScoreMod(*facts.score_mod),))


def _unique(templates) -> list[dict]:
    seen, kept = set(), []
    for template in templates:
        record = asdict(template)
        text = json.dumps(record, sort_keys=True)
        if text not in seen:
            seen.add(text)
            kept.append(json.loads(text))
    return kept


# A varlen forward's per-sequence query bound (max_seqlen_q, else total_q; at least 1), a
# runtime size: heads pack when it and the GQA ratio fit PACKING, each bound baked in its own
# kernels, so the entry holds one packed template per bound, guarded "Qb == bound", and the
# unpacked ones guarded by the bound not packing. Each also derives VARLEN_UNIT, the queries
# of its forward units (the bound, or 8), the unit of the q_units table a reader builds.
VARLEN_BOUND = "Qb"
VARLEN_UNIT = "Qu"


def with_bound(template, guard: str | None, unit: int) -> dict:
    """A varlen forward template (a codegen PassTemplate) taking VARLEN_BOUND among its sizes,
    with `guard` over it (None: none) after codegen's guards, deriving VARLEN_UNIT = `unit`."""
    record = json.loads(json.dumps(asdict(template)))
    record["sizes"].append(VARLEN_BOUND)
    record["derived"].append([VARLEN_UNIT, str(unit)])
    if guard is not None:
        record["guards"].append(guard)
    return record


def without_bound(record: dict) -> dict:
    """A template `with_bound` made, as codegen generated it."""
    return {**record, "sizes": [s for s in record["sizes"] if s != VARLEN_BOUND],
            "derived": [d for d in record["derived"] if d[0] != VARLEN_UNIT],
            "guards": [g for g in record["guards"] if VARLEN_BOUND not in g]}


def varlen_forward_templates(facts: EntryFacts) -> list[dict]:
    """A varlen entry's forward: the packed template of every bound that packs (ratio >= 2),
    then the unpacked ones for every rows choice (guarded by a bound that does not pack)."""
    ratio, family = facts.gqa_ratio, facts.family
    packed = []
    if packs_plain_heads(ratio, 1):
        for bound in range(1, PACKING.max_pairs // ratio + 1):
            p = replace(problem(facts, bound, 64), keys=sequence_keys(facts, 64, bound))
            packed.append(with_bound(attention_template(p, family=family, parallel_threadgroups=1),
                                     f"{VARLEN_BOUND} == {bound}", bound))
    unpacked = f"{VARLEN_BOUND} * {ratio} > {PACKING.max_pairs}" if packed else None
    plain = [with_bound(attention_template(problem(facts, r, 64), family=family, parallel_threadgroups=1), unpacked, 8)
             for r in LENGTHS]
    return _unique_records(packed + plain)


def _unique_records(records: list[dict]) -> list[dict]:
    seen, kept = set(), []
    for record in records:
        text = json.dumps(record, sort_keys=True)
        if text not in seen:
            seen.add(text)
            kept.append(record)
    return kept


def forward_templates(facts: EntryFacts) -> list[dict]:
    """The forward's templates (lse always stored: a caller that does not want it gets an
    intermediate; the output is the same); a sparse_topk entry's pass (`topk_template`), a merge
    or quantize entry's one template (every size a runtime value)."""
    if facts.op == TOPK:
        return _unique([topk_template(facts)])
    if facts.op == MERGE:
        descriptor = codegen_merge.describe_merge(dtype=facts.dtype, value_dim=facts.value_dim, parts=facts.parts,
                                                  layout=facts.layout)
        return _unique([codegen_merge.merge_template(descriptor)])
    if facts.op == QUANTIZE:   # x's groups the one runtime size
        quant = QuantFormat.of(facts.format, facts.bits, facts.group_size)
        return _unique([codegen_quantize.quantize_template(codegen_quantize.QuantizeDescriptor(facts.dtype, quant))])
    if facts.op == VARLEN:
        return varlen_forward_templates(facts)
    lengths = query_lengths(facts)
    if facts.op == INT8:   # no split-KV pair: the tiles depend on R alone
        return _unique(int8_attention_template(int8_problem(facts, problem(facts, r, NO_SPLIT[0])), family=facts.family)
                       for r in lengths)
    points = [(r, *NO_SPLIT) for r in lengths] + [(r, *SPLIT) for r in lengths if r <= MAX_SPLIT_ROWS]
    return _unique(attention_template(problem(facts, r, c), family=facts.family, parallel_threadgroups=p)
                   for r, c, p in points)


def topk_descriptor(facts: EntryFacts, shape: dict[str, int] | None = None,
                    strides: dict[str, tuple[int, ...]] | None = None) -> topk_codegen.TopkDescriptor:
    """A sparse_topk entry's descriptor for a call of `shape` (B, Hi, R, C, K, Di; an example by
    default) and logical `strides`, every stride but the features' a runtime size."""
    shape = shape or {"B": 2, "Hi": 2, "R": 3, "C": 5, "K": 4, "Di": facts.head_dim}
    if strides is None:
        B, Hi, R, C, Di = (shape[n] for n in ("B", "Hi", "R", "C", "Di"))
        strides = {"q": (Hi * R * Di, R * Di, Di, 1), "k": (C * Di, 0, Di, 1), "weights": (Hi * R, R, 1, 0)}
    return topk_codegen.describe_topk(dtype=facts.dtype, shape=shape, strides=strides, layout=facts.layout,
                                      causal=facts.causal != "none", precision=facts.precision,
                                      runtime_strides=True)


def topk_template(facts: EntryFacts) -> PassTemplate:
    """The template of a sparse_topk entry: one, whatever the sizes (splits are derived)."""
    return topk_codegen.topk_template(topk_descriptor(facts))


def int8_problem(facts: EntryFacts, p: AttentionProblem) -> Int8Problem:
    """`p` as int8 attention with the entry's quantization choices."""
    return Int8Problem(p, qk_scale=facts.qk_scale, smooth_k=facts.smooth_k, pv=facts.pv)


def backward_templates(facts: EntryFacts) -> list[dict]:
    """The backward's templates; a sparse entry's read v on its own, as sparse_attention_backward
    binds it whether or not v is a view of k."""
    facts = replace(facts, shared_latent=False)
    return _unique(attention_backward_template(AttentionBackwardProblem(problem(facts, r, c)), family=facts.family)
                   for r in query_lengths(facts) for c in LENGTHS)


def entry_line(op: str, facts: dict, forward: int, backward: int) -> str:
    """One readable line per entry (the C++ Bundle::entries() prints the same)."""
    if op == TOPK:
        return (f"{op} {facts['dtype']} Di={facts['head_dim']} causal={'yes' if facts['causal'] != 'none' else 'no'} "
                f"layout={facts['layout']} precision={facts['precision']} family={facts['family']} "
                f"templates={forward}+{backward}")
    if op == QUANTIZE:
        return (f"{op} {facts['dtype']} format={facts['format']} bits={facts['bits']} "
                f"group_size={facts['group_size']} templates={forward}+{backward}")
    if op == MERGE:
        return (f"{op} {facts['dtype']} Dv={facts['value_dim']} parts={facts['parts']} layout={facts['layout']} "
                f"templates={forward}+{backward}")
    mask = facts["mask"] if facts["mask"] != "additive" else f"additive:{facts['mask_dtype']}"
    mode = " deterministic=batch_invariant" if facts.get("deterministic") == "batch_invariant" else ""
    cache = ""
    if op == SPARSE:
        cache = (f" topk_length={'yes' if facts['topk_length'] else 'no'} "
                 f"shared_latent={'yes' if facts['shared_latent'] else 'no'}")
    if op == BLOCK_SPARSE:
        cache = (f" block_size={facts['block_size'][0]}x{facts['block_size'][1]} "
                 f"shared_batch={'yes' if facts['shared_batch'] else 'no'} "
                 f"shared_heads={'yes' if facts['shared_heads'] else 'no'} "
                 f"full_blocks={'yes' if facts['full_blocks'] else 'no'} "
                 f"mask_bits={'yes' if facts['mask_bits'] else 'no'} q_lists={'yes' if facts['q_lists'] else 'no'}")
    if op == VARLEN:
        cache = f" page_size={facts['page_size'] or 'none'} seqused_k={'yes' if facts['seqused_k'] else 'no'}"
    if op == KVCACHE:
        cache = f" page_size={facts['page_size'] or 'none'} cache={storage_text(facts)} "
        cache += f"append={'yes' if facts['append'] else 'no'}"
        if facts["rotary"]:
            rotary = facts["rotary"]
            cache += (f" rotary_dim={rotary['dim']} rotary_interleaved={'yes' if rotary['interleaved'] else 'no'} "
                      f"rotary_starts={rotary['starts']}")
    elif op == INT8:
        cache = f" qk_scale={facts['qk_scale']} smooth_k={'yes' if facts['smooth_k'] else 'no'} pv={facts['pv']}"
    return (f"{op} {facts['dtype']} D={facts['head_dim']} Dv={facts['value_dim']} gqa={facts['gqa_ratio']} "
            f"causal={facts['causal']} mask={mask} window={'yes' if facts['window'] else 'no'} sinks={'yes' if facts['sinks'] else 'no'} "
            f"layout={facts['layout']}{scores_text(facts)}{cache}{mode} family={facts['family']} "
            f"templates={forward}+{backward}")


def storage_text(facts: dict) -> str:
    """A KV-cache entry line's storage: "q8_0", "float8_e4m3fn,float8_e5m2" (k's, v's where they
    differ), an affine one followed by " bits=4 group_size=64"."""
    text = facts["cache"] if facts["v_cache"] == facts["cache"] else f"{facts['cache']},{facts['v_cache']}"
    return text + (f" bits={facts['bits']} group_size={facts['group_size']}" if facts["bits"] else "")


def scores_text(facts: dict) -> str:
    """An entry line's score transforms: " softcap=30 alibi=per_head score_mod=<the first 12 hex
    digits of its text's sha256>", each only when the entry has it."""
    text = "" if facts["softcap"] is None else f" softcap={facts['softcap']:.9g}"
    text += "" if facts["alibi"] == "none" else f" alibi={facts['alibi']}"
    if facts["score_mod"] is not None:
        text += f" score_mod={hashlib.sha256(facts['score_mod']['text'].encode()).hexdigest()[:12]}"
    return text


def build_payload(entries: list[EntryFacts], progress: Callable[[str], None] | None = None) -> dict:
    records = []
    for facts in entries:
        record = {"op": facts.op, "facts": facts.to_json(), "forward": forward_templates(facts),
                  "backward": backward_templates(facts) if facts.backward else []}
        records.append(record)
        if progress:
            progress(entry_line(facts.op, record["facts"], len(record["forward"]), len(record["backward"])))
    from .. import __version__
    return {"format": "mfa_native.bundle", "template_schema": SCHEMA_VERSION, "generator": f"mfa_native {__version__}",
            "declarations": declarations(), "entries": records, "metallibs": {}}


def declarations() -> dict[str, dict]:
    """The declaration data of the ops that declare their checks as data (every op a bundle
    serves), by name, and of a block mask's lists (what the C++ binder reads)."""
    return {**{name: op.declaration_data() for name, op in OPS.items() if op.checks is not None},
            lists_rules.NAME: lists_rules.declaration_data()}


def choose(templates: list[dict], sizes: dict[str, int]) -> dict | None:
    """The first of an entry's templates whose guards hold for `sizes` (what the C++ reader
    picks), or None."""
    from ..runtime.expressions import evaluate
    for template in templates:
        env = dict(sizes)
        for name, expression in template["derived"]:
            env[name] = evaluate(expression, env)
        if all(evaluate(guard, env) for guard in template["guards"]):
            return template
    return None
