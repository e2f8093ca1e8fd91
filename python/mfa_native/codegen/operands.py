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

# name -> (element: "tensor" (the problem's dtype), "float" or "mask"; what it holds)
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
    return {"o_partial": SPLIT_ROWS.times(Extent(d.value_dim)), "ml_partial": SPLIT_ROWS.times(Extent(2)),
            "delta": ROWS, "sink_grad": ROWS}.get(name)


def _operand(name: str, d: AttentionFacts, const: bool) -> Operand:
    element, purpose = _CATALOG[name]
    if element == "tensor":
        msl = MSL_TYPES[d.dtype]
    elif element == "mask":
        msl = MSL_TYPES[d.rules.mask_dtype]
    else:
        msl = "float"
    return Operand(name, f"device {'const ' if const else ''}{msl}*", purpose, _extent(name, d))


def reads(d: AttentionFacts, *names: str) -> list[Operand]:
    """Operands the kernel only reads; "mask" and "sinks" only when the problem has them."""
    return [_operand(n, d, True) for n in names if (n != "mask" or d.rules.mask != "none") and (n != "sinks" or d.sinks)]


def writes(d: AttentionFacts, *names: str) -> list[Operand]:
    """Operands the kernel writes."""
    return [_operand(n, d, False) for n in names]


def sizes(d: AttentionFacts) -> list[Operand]:
    """The runtime-sizes struct, unless the sizes are baked into the source."""
    if not d.sizes.fields:
        return []
    return [Operand(SIZES_OPERAND, f"constant {d.sizes.struct}&", "runtime sizes")]
