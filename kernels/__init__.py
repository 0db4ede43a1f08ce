"""Triton kernels for paged attention and their torch references (installed as ``batchgen.kernels``)."""
