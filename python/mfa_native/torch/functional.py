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

attention = torch_function(ATTENTION, example="""
    import torch
    import torch.nn.functional as F
    import mfa_native.torch

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 32, requires_grad=True) for _ in range(3))   # (B, H, R or C, D)
    o = mfa_native.torch.attention(q, k, v, causal=True)
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # R = C: both causal alignments agree
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    assert torch.allclose(o, expected, atol=1e-5)
    assert all(torch.allclose(g, e, atol=1e-4) for g, e in zip(grads, expected_grads))
    """)
sparse_attention = torch_function(SPARSE_ATTENTION, example="""
    import numpy as np
    import torch
    import mfa_native.torch
    from mfa_native.reference import sparse_attention_reference

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 32, requires_grad=True) for _ in range(3))
    indices = torch.randint(0, 16, (1, 1, 16, 4), dtype=torch.int32)   # 4 keys per query row
    o = mfa_native.torch.sparse_attention(q, k, v, indices)
    o.sum().backward()   # through mfa_native.sparse_attention_backward
    expected = sparse_attention_reference(*(x.detach().numpy() for x in (q, k, v)), indices.numpy())
    assert np.allclose(o.detach().numpy(), expected, atol=1e-4) and q.grad.shape == q.shape
    """)
block_sparse_attention = torch_function(BLOCK_SPARSE_ATTENTION, example="""
    import numpy as np
    import torch
    import torch.nn.functional as F
    import mfa_native
    import mfa_native.torch

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 32, requires_grad=True) for _ in range(3))
    # Blocks of 8: query block 0 visits key block 0, query block 1 key blocks 0 and 1.
    block_mask = mfa_native.BlockMask(np.array([[[1, 2]]], dtype=np.int32),
                                      np.array([[[[0, 0], [0, 1]]]], dtype=np.int32), block_size=8)
    o = mfa_native.torch.block_sparse_attention(q, k, v, block_mask, causal=True)
    (dq,) = torch.autograd.grad(o.sum(), q)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # these blocks with causal: causal
    (expected_dq,) = torch.autograd.grad(expected.sum(), q)
    assert torch.allclose(o, expected, atol=1e-5) and torch.allclose(dq, expected_dq, atol=1e-4)
    """)
int8_attention = torch_function(INT8_ATTENTION, example="""
    import torch
    import torch.nn.functional as F
    import mfa_native.torch

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 32) for _ in range(3))
    o = mfa_native.torch.int8_attention(q, k, v, causal=True)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    print(float((o - exact).norm() / exact.norm()))   # about 0.01: int8 products
    q.requires_grad_()
    try:
        mfa_native.torch.int8_attention(q, k, v, causal=True).sum().backward()
    except NotImplementedError as error:
        print(error)   # int8_attention has no backward: ...
    """)
