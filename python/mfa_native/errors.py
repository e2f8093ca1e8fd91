"""Exceptions of the Python layer (the core's, CompileError and the others, come from _core)."""

from __future__ import annotations


class Unsupported(NotImplementedError):
    """A call mfa_native does not compute, though its arguments are valid for the function it
    stands in for (a shape, a mask or an option the original takes): a drop-in routed by
    `mfa_native.mlx.patch()` falls back to the original on this exception, and on no other."""
