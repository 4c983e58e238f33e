"""Availability probes for backends: each returns None when the backend can run on the device, else the reason."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from spark_bench import triton_env

Probe = Callable[[str], "str | None"]


def needs_cuda(device: str) -> str | None:
    if not device.startswith("cuda"):
        return "needs CUDA"
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA (torch.cuda.is_available() is False)"
    return None


def needs_sm(major: int, minor: int = 0) -> Probe:
    def probe(device: str) -> str | None:
        reason = needs_cuda(device)
        if reason:
            return reason
        import torch

        cap = torch.cuda.get_device_capability(torch.device(device))
        return None if cap >= (major, minor) else f"needs sm_{major}{minor} (device is sm_{cap[0]}{cap[1]})"

    return probe


def triton_kernel(device: str) -> str | None:
    """Our Triton kernels: compiled on CUDA, interpreted on CPU when TRITON_INTERPRET=1."""
    if importlib.util.find_spec("triton") is None:
        return "triton not installed"
    if device.startswith("cuda"):
        return needs_cuda(device)
    if not triton_env.interpreting():
        return "Triton on CPU tensors needs TRITON_INTERPRET=1 (set by `spark-bench run --device cpu`)"
    return None


def triton_labels(device: str) -> list[str]:
    return ["interpreted"] if not device.startswith("cuda") else []


def package(module: str, distribution: str) -> Probe:
    """A peer library: present or `'<dist> not installed'`."""

    def probe(device: str) -> str | None:
        if importlib.util.find_spec(module) is None:
            return f"{distribution} not installed (pip install {distribution})"
        return None

    return probe


def all_of(*probes: Probe) -> Probe:
    def probe(device: str) -> str | None:
        for p in probes:
            reason = p(device)
            if reason:
                return reason
        return None

    return probe
