"""The operands of the attention kernels, each defined once: its element type, what it
holds and, for intermediates, its extent. A kernel reads or writes an operand
(`reads`, `writes`); the name is the MSL identifier and the pass buffer it binds,
and the order in a plan is the buffer index."""

from __future__ import annotations

from ..kernel.msl import MSL_TYPES
from ..kernel.plan import Operand
from ..kernel.sizes import SIZES_OPERAND, Extent
from ..storage.facet import StorageFacts
from .descriptor import AttentionFacts
from .scores import buffers

ROWS = Extent(1, ("B", "Hq", "R"))                 # one value per (batch, query head, query row)
SPLIT_ROWS = Extent(1, ("S", "B", "Hq", "R"))      # ... per split, for split-KV

# name -> (element: "tensor" (the problem's dtype), "mask" or an MSL scalar type; what it holds)
_CATALOG = {
    "q": ("tensor", "queries"),
    "k": ("tensor", "keys"),
    "v": ("tensor", "values"),
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
}



def _extent(name: str, d: AttentionFacts) -> Extent | None:
    """Elements of the operands that are intermediates of some pass."""
    extents = {"o_partial": SPLIT_ROWS.times(Extent(d.value_dim)), "ml_partial": SPLIT_ROWS.times(Extent(2)),
               "delta": ROWS, "sink_grad": ROWS}
    return extents.get(name) or d.keys.extents(d).get(name)


def _stored(name: str, d: AttentionFacts) -> tuple[str, StorageFacts] | None:
    """The k or v that binds buffer `name` (k, k_scales, ...) and its storage facet, else None."""
    for tensor in "kv":
        storage = getattr(d, f"{tensor}_storage")
        if name in storage.fields(tensor):
            return tensor, storage
    return None


def _present(name: str, d: AttentionFacts) -> bool:
    """Whether the problem has operand `name`: a mask, sinks, a stored tensor's fields and the
    key facet's lists only when it uses them."""
    if _stored(name, d) is not None:
        return True
    if name == "mask":
        return d.rules.mask != "none"
    if name == "sinks":
        return d.sinks
    if name in buffers(d.scores):
        return True
    if name not in _CATALOG:
        return name in d.keys.catalog and d.keys.present(name)
    return True


def _operand(name: str, d: AttentionFacts, const: bool) -> Operand:
    tensor, storage = _stored(name, d) or (None, None)
    element, purpose = (_CATALOG.get(name) or buffers(d.scores).get(name)
                        or (storage.catalog(tensor) if storage else d.keys.catalog)[name])
    if storage is not None:
        msl = storage.element(name, d.dtype)
        purpose = storage.purpose(purpose) if element == "tensor" else purpose
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


def sizes(d: AttentionFacts) -> list[Operand]:
    """The runtime-sizes struct, unless the sizes are baked into the source."""
    if not d.sizes.fields:
        return []
    return [Operand(SIZES_OPERAND, f"constant {d.sizes.struct}&", "runtime sizes")]
