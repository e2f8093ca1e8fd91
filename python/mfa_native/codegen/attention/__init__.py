"""The dense attention family: problem, facets (keys.py, rows.py; storage from the storage
wing), descriptor, masking and softmax blocks, the forward, combine, backward and dsinks
kernels, and their passes. Imports only the kernel and storage floors."""
