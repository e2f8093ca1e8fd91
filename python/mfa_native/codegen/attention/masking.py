"""Masking: which (query, key) pairs are allowed, as MSL lines.

`MaskRules` are the facts the kernels bake (causal, window, mask). From them: the visible
range of the other sequence (`key_range`, `query_range`), the allowed test of one pair
(`allowed_terms`, `mask_allows`), and the additive mask in the log2 domain (`bias`), which also skips
blocks a mask removes.

`Bounds` say where a simdgroup's sequences lie, as MSL expressions: the whole [0, R) and
[0, C) (`DENSE_BOUNDS`), or one packed sequence's ranges of the queries and keys (varlen,
sequences.py), in whose global positions the same rules hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel.layouts import OperandLayout
from ..kernel.msl import MSL_TYPES, loop, offset


@dataclass(frozen=True)
class MaskRules:
    """The facts that decide which keys a query may see, as the kernels bake them."""

    causal: str
    window: tuple[int | str, int | str] | None   # (left, right): literals (-1 unbounded) or runtime size names
    mask: str
    mask_dtype: str | None
    mask_layout: OperandLayout | None
    terms: tuple[str, ...] = ()   # more conditions on a pair, MSL with {query} and {key} (a key-visit case's)

    @property
    def window_sides(self) -> tuple[str | None, str | None]:
        """The bounded sides of the window, (left, right), as MSL ints: a literal, or a runtime
        size's value (whose unbounded value, C or R, removes no key); None where unbounded."""
        if self.window is None:
            return None, None
        return tuple(_side(side) for side in self.window)  # type: ignore[return-value]

    @property
    def uses_diagonal(self) -> bool:
        return self.causal == "lower_right" or self.window_sides != (None, None)

    @property
    def limits_keys_above(self) -> bool:
        """Whether some rule removes keys after a query's diagonal."""
        return self.causal != "none" or self.window_sides[1] is not None

    def describe(self) -> str:
        """One line for a generated kernel's header."""
        window = "none" if self.window is None else f"(left {self.window[0]}, right {self.window[1]})"
        mask = self.mask if self.mask == "none" else f"{self.mask} ({self.mask_dtype})"
        return f"causal {self.causal}, window {window}, mask {mask}"


@dataclass(frozen=True)
class Bounds:
    """The queries [q_begin, q_end) and keys [k_begin, k_end) a simdgroup's rows belong to, as
    MSL expressions; `origin` (None: 0) is k_begin - q_begin, the key upper-left causal lines
    up with the first query."""

    q_begin: str = "0"
    q_end: str = "R"
    k_begin: str = "0"
    k_end: str = "C"
    origin: str | None = None

    @staticmethod
    def _int(value: str) -> str:
        return value if value.isdigit() else f"int({value})"

    @property
    def first_key(self) -> str:
        """k_begin as an int: where a batch-invariant walk's blocks and splits start."""
        return self._int(self.k_begin)

    @property
    def diagonal(self) -> str:
        """The definition of `diagonal`: key j lines up with query j - diagonal (lower right)."""
        return f"const int diagonal = int({self.k_end}) - int({self.q_end});"

    def shifted(self, position: str) -> str:
        """`position` + origin (upper-left causal's key of a query, or query of a key with a minus)."""
        return position if self.origin is None else f"{position} + {self.origin}"


def _side(side: int | str) -> str | None:
    """A window side as an MSL int: a literal (None for -1, unbounded) or `int(name)` of a
    runtime size (uint32 in the struct, below 2**31: the API checks the lengths)."""
    if isinstance(side, str):
        return f"int({side})"
    return None if side == -1 else str(side)


def _plus_one(side: str) -> str:
    """`side` + 1, folded for a literal (so a baked window's MSL reads `4`, not `3 + 1`)."""
    return str(int(side) + 1) if side.isdigit() else f"{side} + 1"


DENSE_BOUNDS = Bounds()
MASKED_BELOW = "-1.0e30f"   # additive mask values at or below this remove the key (see reference.py)


def key_range(rules: MaskRules, last: str | None = None, bounds: Bounds = DENSE_BOUNDS,
              first: str = "q_first") -> list[str]:
    """The keys any of the queries `first`..`last` may see (default: the simdgroup's 8 rows from
    q_first). Reads `first` and the names in `bounds`. Defines key_begin, key_end (ints, narrowed
    further by callers that split the keys) and, where the rules need them, diagonal and row_last."""
    lines = ["", "// Keys any of these rows may see: [key_begin, key_end). Whole blocks outside are never visited."]
    if rules.uses_diagonal:
        lines.append(bounds.diagonal + "  // key j lines up with query j - diagonal (lower right)")
    left, right = rules.window_sides
    if rules.limits_keys_above:
        lines.append(f"const int row_last = {last or f'int(min({first} + 7, {bounds.q_end} - 1))'};")
    begin = bounds._int(bounds.k_begin)
    lines += [f"int key_begin = {begin};", f"int key_end = {first} < {bounds.q_end} ? int({bounds.k_end}) : {begin};"]
    if rules.causal == "lower_right":
        lines.append("key_end = min(key_end, row_last + diagonal + 1);  // causal, lower right")
    elif rules.causal == "upper_left":
        lines.append(f"key_end = min(key_end, {bounds.shifted('row_last')} + 1);  // causal, upper left")
    if left is not None:
        lines.append(f"key_begin = max(key_begin, int({first}) + diagonal - {left});  // window, left")
    if right is not None:
        lines.append(f"key_end = min(key_end, row_last + diagonal + {_plus_one(right)});  // window, right")
    return lines


def query_range(rules: MaskRules, bounds: Bounds = DENSE_BOUNDS, first: str = "key_first",
                last: str | None = None) -> list[str]:
    """The queries that may see any of the keys `first`..`last` (default: the simdgroup's 8 keys
    from key_first; the mirror of key_range: key j is seen from query j - diagonal on). Reads
    `first` and the names in `bounds`. Defines query_begin, query_end and, where needed,
    diagonal and key_last."""
    lines = ["", "// Queries that may see any of these keys: [query_begin, query_end). Blocks outside are skipped."]
    if rules.uses_diagonal:
        lines.append(bounds.diagonal + "  // key j lines up with query j - diagonal (lower right)")
    left, right = rules.window_sides
    if left is not None:
        lines.append(f"const int key_last = {last or f'int(min({first} + 7, {bounds.k_end} - 1))'};")
    begin = bounds._int(bounds.q_begin)
    lines += [f"int query_begin = {begin};", f"int query_end = {first} < {bounds.k_end} ? int({bounds.q_end}) : {begin};"]
    if rules.causal == "lower_right":
        lines.append(f"query_begin = max(query_begin, int({first}) - diagonal);  // causal, lower right")
    elif rules.causal == "upper_left":
        seen = f"int({first})" if bounds.origin is None else f"int({first}) - {bounds.origin}"
        lines.append(f"query_begin = max(query_begin, {seen});  // causal, upper left")
    if left is not None:
        lines.append(f"query_end = min(query_end, key_last - diagonal + {_plus_one(left)});  // window, left")
    if right is not None:
        lines.append(f"query_begin = max(query_begin, int({first}) - diagonal - {right});  // window, right")
    return lines


def allowed_terms(rules: MaskRules, query: str, key: str, bound: str, origin: str | None = None) -> list[str]:
    """Conditions (ints) for `key` of `query` beyond the mask. `bound` keeps positions past
    the visible range (past C or R, or past a split's end) out of the last tile; the rules'
    own `terms` come right after it (so they read nothing for a position past the bound);
    `origin` shifts upper-left causal's diagonal (Bounds.origin)."""
    terms = [bound] + [term.format(query=query, key=key) for term in rules.terms]
    if rules.causal == "lower_right":
        terms.append(f"{key} <= {query} + diagonal")
    elif rules.causal == "upper_left":
        terms.append(f"{key} <= {query}" + ("" if origin is None else f" + {origin}"))
    left, right = rules.window_sides
    if left is not None:
        terms.append(f"{key} >= {query} + diagonal - {left}")
    if right is not None:
        terms.append(f"{key} <= {query} + diagonal + {right}")
    return terms


def mask_allows(rules: MaskRules, value: str) -> str:
    """The condition under which a mask `value` leaves its key: a True bool, or an additive
    value above MASKED_BELOW (a NaN leaves it, to show)."""
    return f"{value} != 0" if rules.mask == "bool" else f"!(float({value}) <= {MASKED_BELOW})"


def bias(rules: MaskRules, count: int, position: str, first: str, allowed: list[str], mask_at: str | None,
         skip_here: bool = True) -> list[str]:
    """s[j * 2 + e] = the additive term (log2 domain) of the lane's element (position
    `first` + j * 8 + tc + e), or MASKED where it is removed; `mask_at` is the element's
    mask value. With a mask, a block no lane may see is skipped (`continue`, taken by the
    whole simdgroup alike); without `skip_here`, the simdgroup's verdict is `block_seen` (a
    uint) instead, for a kernel whose simdgroups skip together (staging.SkipVote). Reads tc,
    diagonal (when the rules use it). Defines s[2 * count]."""
    body = [f"const int {position} = {first} + j * 8 + int(tc) + e;",
            f"bool allowed = {' && '.join(allowed)};"]
    value = "0.0f"
    if rules.mask != "none":
        body.append(f"const {MSL_TYPES[rules.mask_dtype]} mask_value = {mask_at};")
        body.append(f"allowed = allowed && {mask_allows(rules, 'mask_value')};")
        if rules.mask == "additive":
            value = "float(mask_value) * LOG2E"
    body.append(f"s[j * 2 + e] = allowed ? {value} : MASKED;")
    lines = ["// Which of the lane's (query, key) pairs are allowed, and the additive mask (log2 domain).",
             f"float s[{2 * count}];"]
    lines += loop(f"int j = 0; j < {count}; ++j", loop("int e = 0; e < 2; ++e", body))
    if rules.mask != "none":
        lines += ["bool lane_sees_key = false;"]
        lines += loop(f"ushort i = 0; i < {2 * count}; ++i", ["lane_sees_key = lane_sees_key || s[i] != MASKED;"])
        if not skip_here:
            return lines + ["const uint block_seen = simd_max(uint(lane_sees_key));  // 0: the mask removes the "
                            "block for these rows"]
        lines += ["if (simd_max(uint(lane_sees_key)) == 0u) {",
                  "  continue;  // the mask removes this whole block for these rows",
                  "}"]
    return lines


def mask_row_pointer(rules: MaskRules) -> str:
    """Defines `mask_row`: the mask of the lane's query row (row_read) of head h. Reads b, h, row_read."""
    m = rules.mask_layout.strides
    terms = [x for x in (offset("ulong(b)", m[0]), offset("ulong(h)", m[1]), offset("ulong(row_read)", m[2])) if x]
    return f"device const {MSL_TYPES[rules.mask_dtype]}* mask_row = mask + ({' + '.join(terms) or '0'});"


def mask_key_pointer(rules: MaskRules) -> str:
    """Defines `mask_key`: the mask of the lane's key (key_read) for the queries of head h. Reads b, h, key_read."""
    m = rules.mask_layout.strides
    terms = [x for x in (offset("ulong(b)", m[0]), offset("ulong(h)", m[1]), offset("ulong(key_read)", m[3])) if x]
    return f"device const {MSL_TYPES[rules.mask_dtype]}* mask_key = mask + ({' + '.join(terms) or '0'});"


def mask_of_query(rules: MaskRules, query: str) -> str:
    """The mask value of `query` (a row below R) for the key of `mask_key`."""
    return f"mask_key[{offset(f'ulong({query})', rules.mask_layout.strides[2]) or '0'}]"


def bias_over_keys(rules: MaskRules, count: int, end: str = "key_end", origin: str | None = None,
                   skip_here: bool = True) -> list[str]:
    """`bias` for a query row per lane and the keys kb.. (before `end`) as elements (forward,
    dQ). Reads row, kb, `end`, mask_row (and `origin`, Bounds.origin)."""
    at = None
    if rules.mask != "none":
        at = f"mask_row[{offset('ulong(min(key, int(C) - 1))', rules.mask_layout.strides[3]) or '0'}]"
    return bias(rules, count, "key", "kb", allowed_terms(rules, "int(row)", "key", f"key < {end}", origin), at,
                skip_here)


def bias_over_queries(rules: MaskRules, count: int, end: str = "query_end", origin: str | None = None,
                      skip_here: bool = True) -> list[str]:
    """`bias` for a key row per lane and the queries qb.. (before `end`) as elements (dK/dV).
    Reads key_row, qb, `end`, mask_key (and `origin`, Bounds.origin)."""
    at = None
    if rules.mask != "none":
        at = mask_of_query(rules, "min(query, int(R) - 1)")
    return bias(rules, count, "query", "qb",
                allowed_terms(rules, "query", "int(key_row)", f"query < {end}", origin), at, skip_here)
