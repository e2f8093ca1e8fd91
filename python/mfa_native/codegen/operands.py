"""The operands of the attention kernels, each defined once: its element type, what it
holds and, for intermediates, its extent. A kernel reads or writes an operand
(`reads`, `writes`); the name is the MSL identifier and the pass buffer it binds,
and the order in a plan is the buffer index."""

from __future__ import annotations

from .descriptor import AttentionFacts
from .msl import MSL_TYPES
from .plan import Operand
from .sizes import SIZES_OPERAND, Extent

ROWS = Extent(1, ("B", "Hq", "R"))                 # one value per (batch, query head, query row)
SPLIT_ROWS = Extent(1, ("S", "B", "Hq", "R"))      # ... per split, for split-KV

# name -> (element: "tensor" (the problem's dtype), "mask" or an MSL scalar type; what it holds)
_CATALOG = {
    "q": ("tensor", "queries"),
    "k": ("tensor", "keys"),
    "v": ("tensor", "values"),
    "k_scales": ("scale", "affine scales of the quantized k, one per group"),
    "k_biases": ("scale", "affine biases of the quantized k, one per group"),
    "v_scales": ("scale", "affine scales of the quantized v, one per group"),
    "v_biases": ("scale", "affine biases of the quantized v, one per group"),
    "mask": ("mask", "mask: True = attend, or added to the logits"),
    "sinks": ("float", "(Hq,) extra logit per head, no value"),
    "o": ("tensor", "attention's output, laid out like q (Dv wide)"),
    "lse": ("float", "(B, Hq, R) natural-log softmax denominators"),
    "o_partial": ("float", "(S, B, Hq, R, Dv) unnormalized output per split"),
    "ml_partial": ("float", "(S, B, Hq, R, 2) softmax max (log2) and sum per split"),
    "dout": ("tensor", "gradient of the output (dO), laid out like o"),
    "dq": ("tensor", "gradient of q, laid out like q"),
    "dk": ("tensor", "gradient of k, laid out like k"),
    "dv": ("tensor", "gradient of v, laid out like v"),
    "delta": ("float", "(B, Hq, R) D = rowsum(dO o O)"),
    "sink_grad": ("float", "(B, Hq, R) each row's share of dsinks, -p_sink D"),
    "dsinks": ("float", "(Hq,) gradient of the sinks"),
    # Block-sparse lists, (B|1, H|1, blocks[, width]) int32 (FlexAttention's BlockMask).
    "kv_num_blocks": ("int", "partial key blocks per query block"),
    "kv_indices": ("int", "the partial key blocks of each query block, counted part first"),
    "full_kv_num_blocks": ("int", "full key blocks per query block"),
    "full_kv_indices": ("int", "the full key blocks of each query block"),
    "q_num_blocks": ("int", "partial query blocks per key block"),
    "q_indices": ("int", "the partial query blocks of each key block"),
    "full_q_num_blocks": ("int", "full query blocks per key block"),
    "full_q_indices": ("int", "the full query blocks of each key block"),
    "q_counts": ("int", "partial query blocks per key block, built from the kv lists"),
    "q_starts": ("int", "where each key block's partial query blocks start in q_entries"),
    "q_entries": ("int", "the partial query blocks of every key block, in key-block order"),
    "full_q_counts": ("int", "full query blocks per key block, built from the kv lists"),
    "full_q_starts": ("int", "where each key block's full query blocks start in full_q_entries"),
    "full_q_entries": ("int", "the full query blocks of every key block, in key-block order"),
    "indices": ("int", "(B, Hkv|1, R, topk) the keys each query row attends; entries < 0 or >= C skipped"),
    "topk_length": ("int", "(B, R) how many entries of each list to read"),
    "p_slots": ("float", "(B, Hq, R, T) P of every listed slot, for the key side"),
    "ds_slots": ("float", "(B, Hq, R, T) dS of every listed slot, for the key side"),
    "key_counts": ("int", "(B, Hkv, C) how many (query, slot) entries list each key"),
    "key_starts": ("int", "(B, Hkv, C) where each key's entries start in key_entries"),
    "key_entries": ("int", "(B, Hkv, R * T) query * T + slot of every listing, by key"),
    "block_class": ("int", "(B, H, NQ, NK) 0: no pair allowed, 1: some, 2: all (BlockMask.from_mask)"),
}

# The lists a kernel walking keys reads, and those a kernel walking queries reads.
KEY_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
GIVEN_QUERY_LISTS = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
BUILT_QUERY_LISTS = ("q_counts", "q_starts", "q_entries", "full_q_counts", "full_q_starts", "full_q_entries")


def _extent(name: str, d: AttentionFacts) -> Extent | None:
    """Elements of the operands that are intermediates of some pass."""
    extents = {"o_partial": SPLIT_ROWS.times(Extent(d.value_dim)), "ml_partial": SPLIT_ROWS.times(Extent(2)),
               "delta": ROWS, "sink_grad": ROWS}
    if d.blocks is not None:  # block classes, and the transposed lists built on the device: per (batch|1, head|1)
        extents["block_class"] = Extent(1, ("B", "Hq", "NQ", "NK"))
        lists = Extent(1, (() if d.blocks.batch_broadcast else ("B",)) + (() if d.blocks.head_broadcast else ("Hq",)))
        for prefix, width in (("q", "Wp"), ("full_q", "Wf")):
            extents[f"{prefix}_counts"] = extents[f"{prefix}_starts"] = lists.times(Extent(1, ("NK",)))
            extents[f"{prefix}_entries"] = lists.times(Extent(1, ("NQ", width)))
    if getattr(d, "tokens", None) is not None:  # sparse-indexed backward: slots and the lists by key
        extents["p_slots"] = extents["ds_slots"] = Extent(1, ("B", "Hq", "R", "T"))
        extents["key_counts"] = extents["key_starts"] = Extent(1, ("B", "Hkv", "C"))
        extents["key_entries"] = Extent(1, ("B", "Hkv", "R", "T"))
    return extents.get(name)


# The operands of a quantized k or v, by the tensor they store.
_QUANTIZED_FIELDS = {name: name[0] for name in ("k", "k_scales", "k_biases", "v", "v_scales", "v_biases")}


def quantized(name: str, d: AttentionFacts):
    """The QuantFacts of operand `name` (k or v, or their scales and biases) when it is stored
    quantized, else None."""
    tensor = _QUANTIZED_FIELDS.get(name)
    return None if tensor is None else getattr(d, f"{tensor}_quant", None)


def _present(name: str, d: AttentionFacts) -> bool:
    """Whether the problem has operand `name`: a mask, sinks, block lists and affine scales
    only when it uses them."""
    if name.endswith(("_scales", "_biases")):
        quant = quantized(name, d)
        return quant is not None and quant.format.affine
    if name == "mask":
        return d.rules.mask != "none"
    if name == "sinks":
        return d.sinks
    if name in ("indices", "topk_length"):
        tokens = getattr(d, "tokens", None)
        return tokens is not None and (name == "indices" or tokens.lengths is not None)
    if name in KEY_LISTS or name in GIVEN_QUERY_LISTS or name in BUILT_QUERY_LISTS:
        f = d.blocks
        if f is None or (name.startswith("full_") and not f.full):
            return False
        if name in GIVEN_QUERY_LISTS:
            return f.transposed_given
        if name in BUILT_QUERY_LISTS:
            return not f.transposed_given
    return True


def _operand(name: str, d: AttentionFacts, const: bool) -> Operand:
    element, purpose = _CATALOG[name]
    quant = quantized(name, d)
    if element == "tensor" and quant is not None:
        msl, purpose = MSL_TYPES[quant.format.data_dtype], f"{purpose}, stored {quant.format.describe()}"
    elif element == "scale":
        msl = MSL_TYPES[quant.scale_dtype]
    elif element == "tensor":
        msl = MSL_TYPES[d.dtype]
    elif element == "mask":
        msl = MSL_TYPES[d.rules.mask_dtype]
    else:
        msl = element
    return Operand(name, f"device {'const ' if const else ''}{msl}*", purpose, _extent(name, d))


def reads(d: AttentionFacts, *names: str) -> list[Operand]:
    """Operands the kernel only reads, those of `names` the problem has."""
    return [_operand(n, d, True) for n in names if _present(n, d)]


def writes(d: AttentionFacts, *names: str) -> list[Operand]:
    """Operands the kernel writes, those of `names` the problem has."""
    return [_operand(n, d, False) for n in names if _present(n, d)]


def blocks_summary(d: AttentionFacts) -> str:
    """A clause for the generated header: the block-sparse facts, if any."""
    f = d.blocks
    if f is None:
        return ""
    lists = "partial and full lists" if f.full else "partial lists"
    return f"; block-sparse {f.q_block}x{f.k_block}, {lists}"


def sizes(d: AttentionFacts) -> list[Operand]:
    """The runtime-sizes struct, unless the sizes are baked into the source."""
    if not d.sizes.fields:
        return []
    return [Operand(SIZES_OPERAND, f"constant {d.sizes.struct}&", "runtime sizes")]
