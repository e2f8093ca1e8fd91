"""Context parallelism: attention over sequences sharded across processes, for torch.distributed
and mx.distributed alike.

- `schedule`: which queries each rank computes and which keys a block of them sees (global
  positions only);
- `agreement`: the descriptor every rank all-gathers first, so that a bad or mismatched call raises
  the same error on every rank instead of hanging one;
- `group`: what a framework's process group must do (`Group`: ring shifts, all-gathers, a few
  array operations); `torch_group` and `mlx_group` are the two;
- `ring`: ring attention forward and backward over a Group;
- `decode`: decode over a KV cache sharded by position across the ranks.

The public functions are `mfa_native.torch.ring_attention` / `sharded_decode` and
`mfa_native.mlx.ring_attention` / `sharded_decode`.
"""
