"""Triton kernels for the KDA ops, one module per algorithm stage."""
