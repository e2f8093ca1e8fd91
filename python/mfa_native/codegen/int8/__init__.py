"""int8 attention: the quantizer kernels, the product step and its exactness bound, the
attention kernel with integer products, and its passes. Builds on the attention wing."""
