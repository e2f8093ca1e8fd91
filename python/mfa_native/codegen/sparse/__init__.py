"""List-driven attention: block lists (FlexAttention's BlockMask) and token lists (DeepSeek
sparse attention) as cases of the key-visit facet, their kernels, BlockMask.from_mask's pass,
and the lightning indexer (topk.py). Builds on the attention wing."""
