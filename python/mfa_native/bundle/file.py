"""The bundle file format, version 4 (src/core/bundle.cpp reads the same bytes).

    offset  size  field
    0       8     magic b"MFABNDL\\0"
    8       4     format version, uint32 little-endian
    12      4     flags, uint32 little-endian (0; reserved)
    16      8     payload length in bytes, uint64 little-endian
    24      32    sha256 of the payload
    56      n     the payload: UTF-8 JSON (see writer.py)

A reader refuses a wrong magic, a version other than its own (earlier ones are refused with a
request to write the bundle again: version 1 baked windows and strides, version 2 predates score
transforms, version 3 carries no op declarations for the C++ binder), a length that disagrees with the
file's, and a checksum that does not match, before it parses anything.
"""

from __future__ import annotations

import hashlib
import json
import struct

MAGIC = b"MFABNDL\0"
FORMAT_VERSION = 4
_HEADER = struct.Struct("<8sIIQ32s")
HEADER_BYTES = _HEADER.size


class BundleError(ValueError):
    """A file that is not a bundle this version can read: damaged, truncated, or newer."""


def pack(payload: dict) -> bytes:
    """The bytes of a bundle holding `payload` (deterministic: sorted keys, no spaces)."""
    body = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(body), hashlib.sha256(body).digest()) + body


def unpack(data: bytes) -> dict:
    """The payload of bundle bytes `data`; BundleError naming what is wrong."""
    if len(data) < HEADER_BYTES:
        raise BundleError(f"not a bundle: {len(data)} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, _flags, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BundleError("not a bundle: the file does not start with the bundle magic")
    if version > FORMAT_VERSION:
        raise BundleError(f"bundle format version {version} is newer than this reader's ({FORMAT_VERSION})")
    if version < FORMAT_VERSION:
        raise BundleError(f"bundle format version {version} was written by an earlier mfa_native; this reader "
                          f"reads version {FORMAT_VERSION}: write the bundle again with `python -m mfa_native bundle`")
    body = data[HEADER_BYTES:]
    if len(body) != length:
        raise BundleError(f"bundle truncated or padded: the header says {length} payload bytes, the file has "
                          f"{len(body)}")
    if hashlib.sha256(body).digest() != digest:
        raise BundleError("bundle damaged: the payload's sha256 does not match the header's")
    return json.loads(body)


def write_bundle(path: str, payload: dict) -> int:
    """Writes `payload` as a bundle at `path`; returns the bytes written."""
    data = pack(payload)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def read_bundle(path: str) -> dict:
    with open(path, "rb") as f:
        return unpack(f.read())
