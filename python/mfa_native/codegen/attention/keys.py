"""The dense family's key-visit case, `DENSE`: every key of the visible range [key_begin,
key_end) that causal and window leave (and, in the dK/dV kernel, every query of [query_begin,
query_end)), in the dense kernels. It is the facet's defaults (visits.py) and the split-KV cut
of [0, C); its kernel side needs nothing of the problem, so it is its own facts.
"""

from __future__ import annotations

from .rows import PACKED_HEADS, PER_HEAD
from .visits import KEY_VISITS, KeyVisit, KeyWalk


def storage_rows(p):
    """The rows facet of a problem whose keys form a range: heads packed when K/V storage asks."""
    return PACKED_HEADS if p.k_storage.packs_heads or p.v_storage.packs_heads else PER_HEAD


@KEY_VISITS.register
class DenseKeys(KeyVisit, KeyWalk):
    """Every key of the visible range."""

    split_length = "C"   # split-KV may cut the keys [0, C) for decode

    def describe(self, p, family: str, baked) -> DenseKeys:
        return self


DENSE = DenseKeys()
