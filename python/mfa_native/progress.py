"""Progress bars for long work (precompile, ...): tqdm's, on standard error, shown only on a
terminal and never when the caller asks for quiet."""

from __future__ import annotations

from tqdm import tqdm


def bar(total: int, description: str, *, unit: str, quiet: bool = False) -> tqdm:
    """A bar counting `total` `unit`s with an ETA; a silent one when `quiet` or when standard
    error is not a terminal (tqdm's disable=None)."""
    return tqdm(total=total, desc=description, unit=unit, disable=True if quiet else None, leave=False,
                dynamic_ncols=True)
