"""`mfa_native.torch.attention`: mfa_native's attention for torch tensors, differentiable
(derived from the op's declaration: library.py)."""

from __future__ import annotations

from ..ops.attention import ATTENTION
from .library import torch_function

attention = torch_function(ATTENTION)
