"""Bundles: one file holding the pass templates (MSL included) of the problem families a
spec declares, for programs that run attention without Python (include/mfa/attention.hpp).

`file` is the format (a small binary header, then a JSON payload), `spec` reads a bundle
spec into the crossed list of entries, `writer` generates each entry's templates.
"""

from .file import FORMAT_VERSION, BundleError, read_bundle, write_bundle
from .spec import EntryFacts, entries_of
from .writer import build_payload, entry_line

__all__ = ["FORMAT_VERSION", "BundleError", "EntryFacts", "build_payload", "entries_of", "entry_line",
           "read_bundle", "write_bundle"]
