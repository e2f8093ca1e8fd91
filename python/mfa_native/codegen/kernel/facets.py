"""The registry of a facet's cases (the key-visit facet's, attention/visits.py; the storage
facet's, storage/facet.py): each case registers its problem-side class with one line in its own
module (`@KEY_VISITS.register`), under its class name.

That name is how a pass template's `valid_for` names the case its kernels were generated for,
so it is unique per facet, and a problem whose case is not registered makes no template.
"""

from __future__ import annotations

from typing import TypeVar

Case = TypeVar("Case", bound=type)


class Cases:
    """The registered cases of one facet: name -> problem-side class."""

    def __init__(self, facet: str) -> None:
        self.facet = facet
        self.classes: dict[str, type] = {}

    def register(self, case: Case) -> Case:
        """Registers `case` under its class name (a class decorator); a second case of the same
        name is refused (ValueError), since templates could not tell the two apart."""
        name = case.__name__
        known = self.classes.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (case.__module__, case.__qualname__):
            raise ValueError(f"a {self.facet} case named {name!r} is already registered ({known.__module__})")
        self.classes[name] = case
        return case

    def name_of(self, case: object) -> str:
        """The registered name of the case `case` is an instance of (ValueError: not registered)."""
        name = type(case).__name__
        if self.classes.get(name) is not type(case):
            raise ValueError(f"{type(case).__qualname__} is not a registered {self.facet} case: "
                             f"register it with one line in its module (@register)")
        return name
