"""mfa_native's ops for torch tensors, differentiable: each derived from its declaration
(library.py), so `mfa_native.torch.sparse_attention` takes what `mfa_native.sparse_attention`
takes, with autograd and torch.compile (int8_attention, which has no backward, raises when a
gradient is asked through it)."""

from __future__ import annotations

from ..ops.attention import ATTENTION
from ..ops.block_sparse import BLOCK_SPARSE_ATTENTION
from ..ops.int8_attention import INT8_ATTENTION
from ..ops.sparse import SPARSE_ATTENTION
from .library import torch_function

attention = torch_function(ATTENTION)
sparse_attention = torch_function(SPARSE_ATTENTION)
block_sparse_attention = torch_function(BLOCK_SPARSE_ATTENTION)
int8_attention = torch_function(INT8_ATTENTION)
