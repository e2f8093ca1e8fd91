"""Which keys some query may attend: int8 attention's statistics run over those keys only.

A key is attended when at least one query row of a query head of its (batch, kv head) may
see it under the masking rules: causal (either alignment), the window, a bool mask entry
that is True, an additive mask value that is not removed (above MASKED_BELOW; NaN stays).
The test is the dense kernels' own (`masking.query_range`, `allowed_terms`, `mask_allows`),
so int8 attention and attention agree on which keys a row sees.

`int8_attended_keys` stores one flag per key, k_attended[b, h_kv, j] (1: attended, 0: no
query may attend it). The quantizers read it: K's and V's means are over the attended keys,
their scales over the attended values, and a key no query attends is stored as integers 0,
so its values (even NaN) reach neither a statistic nor the output. It runs only when a rule
may remove keys (`limits_keys`: causal upper left, a window, a mask); without one every
key is attended.

One thread per key, walking the query rows that may see it from the first (`query_range`),
until one does. Without a mask the first row decides, in one step; with a mask the walk
reads the key's column of the mask up to its first allowed row.
"""

from __future__ import annotations

from functools import lru_cache

from ..attention import operands
from ..attention.masking import allowed_terms, mask_allows, mask_key_pointer, mask_of_query, query_range
from ..kernel.msl import BUILTINS_LANE, indent, loop, offset
from ..kernel.plan import GridAxis, LaunchPlan
from ..kernel.sizes import Extent
from ..kernel.source import KernelSource, assemble
from . import operands as int8_operands
from .problem import Int8Descriptor

ATTENDED_KERNEL = "int8_attended_keys"
KEYS_PER_GROUP = 32
FLAGS = "k_attended"


def limits_keys(x: Int8Descriptor) -> bool:
    """Whether a masking rule may leave a key to no query (then the pass finds which). Causal
    lower right alone never does: the last row sees every key."""
    rules = x.attention.rules
    return rules.causal == "upper_left" or rules.window is not None or rules.mask != "none"


def key_flags(x: Int8Descriptor, kv_head: str) -> list[str]:
    """Defines `key_attended`, the flags of the keys of (batch b, kv head `kv_head`), when the
    pass has them (limits_keys); nothing otherwise."""
    if not limits_keys(x):
        return []
    return [f"device const char* key_attended = {FLAGS} + (ulong(b) * Hkv + {kv_head}) * C;"]


def attended(x: Int8Descriptor, key: str) -> str | None:
    """The condition that key `key` is attended (reads key_attended); None when every key is."""
    return f"key_attended[{key}] != 0" if limits_keys(x) else None


def flag_operands(x: Int8Descriptor) -> list:
    """The flags as a kernel operand to read, when the pass has them."""
    return int8_operands.reads(x, FLAGS) if limits_keys(x) else []


def _heads_differ(x: Int8Descriptor) -> bool:
    """Whether the mask differs between the query heads of a kv head (the other rules do not)."""
    rules = x.attention.rules
    return rules.mask != "none" and x.attention.gqa_ratio > 1 and offset("h", rules.mask_layout.strides[1]) is not None


def _rows_walk(x: Int8Descriptor) -> list[str]:
    """attended ||= whether some row of query head h may see key key_first. Reads b, h,
    query_begin, query_end, diagonal (when the rules use it), key_first."""
    rules = x.attention.rules
    terms = allowed_terms(rules, "row", "int(key_first)", "true")[1:]
    lines = []
    if rules.mask != "none":
        lines += ["const uint key_read = key_first;", mask_key_pointer(rules)]
        terms.append(mask_allows(rules, mask_of_query(rules, "row")))
    test = " && ".join(terms) or "true"
    return lines + loop("int row = query_begin; row < query_end && !attended; ++row",
                        [f"attended = {test};"], unroll=False)


def _body(x: Int8Descriptor) -> list[str]:
    d = x.attention
    walk = _rows_walk(x)
    if _heads_differ(x):
        walk = loop(f"uint slot = 0; slot < {d.gqa_ratio} && !attended; ++slot",
                    [f"const uint h = h_kv * {d.gqa_ratio} + slot;"] + walk, unroll=False)
    elif d.rules.mask != "none":
        walk = [f"const uint h = h_kv * {d.gqa_ratio};  // its query heads share the mask"] + walk
    inner = query_range(d.rules) + ["", "// The rows that may see the key, until one does (without a mask, the first).",
                                    "bool attended = false;"]
    inner += walk + [f"{FLAGS}[(ulong(b) * Hkv + h_kv) * C + key_first] = attended ? 1 : 0;"]
    return (["// Key key_first of (batch b, kv head h_kv) per thread.", "const uint b = group.z;",
             "const uint h_kv = group.y;", f"const uint key_first = group.x * {KEYS_PER_GROUP} + lane;",
             "if (key_first < C) {"] + indent(inner) + ["}"])


@lru_cache(maxsize=64)
def generate_attended(x: Int8Descriptor) -> KernelSource:
    """The kernel storing which keys some query may attend (see the module docstring)."""
    d = x.attention
    ops = operands.reads(d, "mask") + int8_operands.writes(x, FLAGS) + operands.sizes(d)
    grid = (GridAxis(Extent(1, ("C",)), KEYS_PER_GROUP), GridAxis(Extent(1, ("Hkv",))), GridAxis(Extent(1, ("B",))))
    plan = LaunchPlan(ATTENDED_KERNEL, tuple(ops), grid, KEYS_PER_GROUP, d.sizes)
    summary = [f"int8 attention: which keys some query may attend, {d.rules.describe()}"]
    return assemble(plan, summary=summary, builtins=BUILTINS_LANE, body=_body(x))
