"""Availability probes for backends: each returns None when the backend can run on the device, else the reason."""

from __future__ import annotations

import functools
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
    return interpreter_fault()


def _run_loop_bound() -> int:
    """One interpreted launch of a loop bounded by program-id arithmetic, as most of our kernels have; its sum."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _loop_bound(out, n):
        acc = 0
        for i in range(tl.program_id(0), n + tl.program_id(0)):
            acc += i
        tl.store(out, acc)

    out = torch.zeros(1, dtype=torch.int32)
    _loop_bound[(1,)](out, 3)
    return int(out.item())


@functools.cache
def interpreter_fault(run: Callable[[], int] = _run_loop_bound) -> str | None:
    """Why the installed Triton's interpreter cannot run our kernels, or None; one tiny launch, once per process.
    Triton 3.6's interpreter indexes with int() of a one-element array, which numpy 2.4 refuses: every loop whose
    bound is a program-id expression fails ("only 0-dimensional arrays can be converted to Python scalars").
    Triton 3.9 (CI's) and 3.6 with numpy 2.3 are fine. The GPU never interprets."""
    import numpy
    import triton

    try:
        got = run()
    except Exception as exc:  # any failure of the interpreter itself makes every kernel fail the same way
        cause = exc.__cause__ or exc
        return (f"triton {triton.__version__}'s interpreter fails with numpy {numpy.__version__} "
                f"({type(cause).__name__}: {str(cause)[:80]}); pip install 'numpy<2.4' or a newer triton")
    return None if got == 3 else f"triton {triton.__version__}'s interpreter ran a loop wrongly (sum {got}, not 3)"


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
