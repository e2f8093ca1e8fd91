"""`mfa_native.torch.attention`: mfa_native's attention for torch tensors, differentiable."""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from .library import CAUSAL, attention_op


def attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, causal: bool | str = False,
              mask: Tensor | None = None, window: Sequence[int] | None = None, sinks: Tensor | None = None,
              layout: str = "bhsd", return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """`mfa_native.attention` on torch tensors, through `torch.ops.mfa_native.attention`:
    autograd gives q, k, v and sinks their gradients (the mask gets none, lse is not
    differentiable), torch.compile traces it (fullgraph), and torch allocates the output.

    Arguments and results are `mfa_native.attention`'s (see its docstring), without
    `device`: CPU tensors run on the default device, MPS tensors on the metal device.
    """
    if causal not in CAUSAL or not isinstance(causal, (bool, str)):
        raise ValueError(f"causal must be False, True, 'lower_right' or 'upper_left', got {causal!r}")
    o, lse = attention_op(q, k, v, mask, sinks, scale, CAUSAL[causal], None if window is None else list(window),
                          layout)
    return (o, lse) if return_lse else o
