"""How an operand is read: quantized formats (formats.py), the storage facet (stored.py),
staging K/V rows in threadgroup memory (staging.py), and `quantize`'s kernel. Imports only
the kernel floor."""
