"""Exceptions of the Python layer (the core's, CompileError and the others, come from _core)."""

from __future__ import annotations


class Unsupported(NotImplementedError):
    """A call mfa_native does not compute, though its arguments are valid for the function it
    stands in for (a shape, a mask or an option the original takes): a drop-in routed by
    `mfa_native.mlx.patch()` falls back to the original on this exception, and on no other.

    A subclass of NotImplementedError. Code routing its own calls to mfa_native can raise and
    catch it the same way.

    Example:
        ```python
        import numpy as np
        import mfa_native
        from mfa_native.reference import attention_reference

        def routed_attention(q, k, v):   # mfa_native where it computes the call, else the reference
            try:
                if q.dtype == np.float64:
                    raise mfa_native.Unsupported("mfa_native has no float64 kernels")
                return mfa_native.attention(q, k, v, device="cpu")
            except mfa_native.Unsupported:
                return attention_reference(q, k, v)

        q = np.random.default_rng(0).standard_normal((1, 2, 16, 32))   # float64: falls back
        print(routed_attention(q, q, q).dtype)   # float64
        assert issubclass(mfa_native.Unsupported, NotImplementedError)
        ```
    """
