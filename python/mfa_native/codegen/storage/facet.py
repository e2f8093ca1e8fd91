"""How k or v is stored: the storage facet's two bases and its registry.

A case is a problem-side `Storage` (in `AttentionProblem.k_storage`, `v_storage`: whether it
packs heads) whose `describe` gives its kernel-side `StorageFacts` (in the descriptor: its
buffers, pointers, staging and pass inputs). Every member is declared here once, with its
type and what it means; its default is the plain case's (elements of the problem's dtype at
the tensor's own strides, one buffer), and `describe` is abstract. A new case is one module
and one line registering its problem-side class (`@STORAGES.register`); its buffers besides
the data are its own (`catalog`), so no list elsewhere names them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

from ..kernel.facets import Cases
from ..kernel.layouts import OperandLayout, Strides
from ..kernel.msl import MSL_TYPES, offset
from ..kernel.tiles import head_pointer

STORAGES = Cases("storage")
"""The registered storage cases (problem side), by name: `valid_for(...)["k_storage"]`."""


class Storage(ABC):
    """The problem side of a storage case: what an `AttentionProblem` knows of a stored k or v."""

    packs_heads: bool = False
    """Whether a threadgroup stages K/V rows once for every query head of a kv head (packed
    heads, rows.PACKED_HEADS): a quantized row is worth decoding once."""

    @abstractmethod
    def describe(self, width: int, field: Callable[[int, Strides], OperandLayout]) -> StorageFacts:
        """The kernel-side facts of a tensor `width` features wide; `field(columns, strides)` is
        the layout of a field whose rows are `columns` elements wide."""


class StorageFacts:
    """The kernel side of a storage case: what a kernel generator asks of a stored k or v."""

    def catalog(self, name: str) -> dict[str, tuple[str, str]]:
        """Its buffers besides the data when it stores tensor `name` (k or v): buffer ->
        (element: "scale" or an MSL scalar type, what it holds). None for plain storage."""
        return {}

    def fields(self, name: str) -> tuple[str, ...]:
        """The buffers it binds for tensor `name`: the data (named `name`), then its catalog's."""
        return (name, *self.catalog(name))

    def written(self, name: str) -> tuple[str, ...]:
        """The buffers an append to tensor `name` writes: all its fields (a float8 cache's
        descales are read only)."""
        return self.fields(name)

    def element(self, buffer: str, dtype: str) -> str:
        """The MSL element type of `buffer` (one of `fields`) of a problem of `dtype`."""
        return MSL_TYPES[dtype]

    def purpose(self, purpose: str) -> str:
        """What the data buffer holds, given what the tensor holds (the catalog's line)."""
        return purpose

    def pointers(self, name: str, layout: OperandLayout, head: str, dtype: str, const: bool = True) -> list[str]:
        """`{name}_head`: the first element of (batch b, head `head`) (writable unless `const`),
        and the pointers of its other buffers."""
        return [head_pointer(name, layout, head, MSL_TYPES[dtype], const)]

    def layout(self, buffer: str, layout: OperandLayout) -> OperandLayout:
        """The layout of one of its buffers (`fields`), given the tensor's: the tensor's own."""
        return layout

    def stage(self, name: str, stage: str, width: int, layout: OperandLayout, rows: int, dtype: str, key: str,
              valid: str) -> list[str]:
        """MSL staging `rows` rows of tensor `name` (`width` features) into threadgroup memory
        `stage`, row `slot` being key `key` (an expression of slot) when `valid`, else zeros;
        the threadgroup's threads share the work (member, threads). Plain: a copy."""
        at = offset("ulong(key)", layout.strides[2]) or "0"   # 0: k broadcast along the keys
        return [f"for (uint e = member; e < {rows * width}u; e += threads) {{",
                f"  const int slot = int(e / {width});",
                f"  const int key = {key};",
                f"  {stage}[e] = {valid} ? {name}_head[{at} + e % {width}] : {MSL_TYPES[dtype]}(0);",
                "}"]

    def inputs(self, name: str, shape: tuple, layout: OperandLayout, dtype: str, spec: Callable) -> dict:
        """The pass inputs it declares: `spec(dtype, logical shape, logical strides)` each, the
        strides those `layout` compiled in."""
        return {name: spec(dtype, shape, layout.strides)}
