"""Helpers for seeded input factories: one generator per case, random data on the target device.

Never time on zeros (a bf16 GEMM ran 13% faster on zeros than on random data on an H200): every factory draws
random values with the distribution the model would see.
"""

from __future__ import annotations

import torch

from spark_bench.dtypes import torch_dtype


def generator(device: str, seed: int) -> torch.Generator:
    """A seeded generator for `device`; for the `meta` device (shapes only, nothing allocated: the offline kernel
    gate) a CPU generator, which torch's meta factories accept and ignore."""
    device = torch.device(device)
    gen = torch.Generator(device="cpu" if device.type == "meta" else device)
    gen.manual_seed(int(seed))
    return gen


def is_meta(device) -> bool:
    """True for the `meta` device: shapes only. Factories return `torch.empty` there: the kernel gate builds tens of
    thousands of inputs, and a meta randn * std + mean still runs torch's Python reference kernels (~1 ms each)."""
    return torch.device(device).type == "meta"


def randn(shape, gen: torch.Generator, *, dtype="fp32", device="cpu", std: float = 1.0, mean: float = 0.0):
    if is_meta(device):
        return torch.empty(shape, dtype=torch_dtype(dtype), device=device)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if std != 1.0:
        x.mul_(std)
    if mean != 0.0:
        x.add_(mean)
    return x.to(torch_dtype(dtype))


def uniform(shape, gen: torch.Generator, low: float, high: float, *, dtype="fp32", device="cpu"):
    if is_meta(device):
        return torch.empty(shape, dtype=torch_dtype(dtype), device=device)
    x = torch.rand(shape, generator=gen, device=device, dtype=torch.float32)
    return (x * (high - low) + low).to(torch_dtype(dtype))


def log_uniform(shape, gen: torch.Generator, low: float, high: float, *, dtype="fp32", device="cpu"):
    import math

    if is_meta(device):
        return torch.empty(shape, dtype=torch_dtype(dtype), device=device)
    x = uniform(shape, gen, math.log(low), math.log(high), device=device)
    return x.exp().to(torch_dtype(dtype))


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host (CPU) copy of a device input; a `meta` tensor (shapes only) stays as it is."""
    return t if t.device.type == "meta" else t.cpu()
