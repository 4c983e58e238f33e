"""Triton kernels. Only Triton code lives here; the ops that call them are in plugins/."""
