"""mfa_native for PyTorch: custom ops, autograd, SDPA and context-parallel attention.

- `attention(q, k, v, **options)`: `mfa_native.attention` with autograd and
  torch.compile support (`torch.ops.mfa_native.attention` / `.attention_backward`); likewise
  `sparse_attention`, `block_sparse_attention` and `int8_attention` (no backward: a gradient
  asked through it raises).
- `scaled_dot_product_attention(...)`: torch.nn.functional's, computed by mfa_native.
- `sdpa_override()`: a context manager routing torch's SDPA through mfa_native.
- `ring_attention(q, k, v, group=...)`: attention over sequences sharded across ranks (shards of any
  length; causal, window and sinks by global position); `sharded_decode(q, k_cache, v_cache,
  cache_seqlens, group=...)`: decode over a KV cache sharded by position across ranks.
- `flex_attention(q, k, v, block_mask=...)`: FlexAttention's (no score_mod), with autograd.
- `flash_attn_func`, `flash_attn_kvpacked_func`, `flash_attn_qkvpacked_func`: flash-attn's dense
  functions, by its names and defaults, with autograd;
- `attention_varlen(...)` and `flash_attn_varlen_func(...)` (and its kvpacked and qkvpacked
  forms): packed sequences, the latter with flash-attn's names and results; `flash_attn_with_kvcache(...)`: a KV cache, appended in place.

Importing this module imports torch; `import mfa_native` alone does not.
"""

from __future__ import annotations

from .flash_attn import attention_varlen, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, \
    flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache
from .flex import flex_attention
from .functional import attention, block_sparse_attention, int8_attention, sparse_attention
from .ring import ring_attention, sharded_decode
from .sdpa import scaled_dot_product_attention, sdpa_override

__all__ = ["attention", "attention_varlen", "block_sparse_attention", "flash_attn_func", "flash_attn_kvpacked_func",
           "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func",
           "flash_attn_with_kvcache", "flex_attention", "int8_attention", "ring_attention",
           "scaled_dot_product_attention", "sdpa_override", "sharded_decode", "sparse_attention"]
