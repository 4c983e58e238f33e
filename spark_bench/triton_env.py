"""Where Triton kernels run: compiled on a CUDA GPU, or under the interpreter (TRITON_INTERPRET=1) on CPU tensors.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any plugin imports its kernels.
`configure()` sets it on a machine without CUDA (unless the user set it either way); the CLI sets it in the worker
processes of a `--device cpu` sweep.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator

ENV = "TRITON_INTERPRET"


def interpreting() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0")


def configure(device: str | None = None) -> None:
    """Turn the interpreter on for CPU work: always for device 'cpu', and by default where CUDA is absent."""
    if device is not None and device.startswith("cpu"):
        os.environ[ENV] = "1"
        return
    if ENV in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ[ENV] = "1"


@contextlib.contextmanager
def interpreted_launches() -> Iterator[list[int]]:
    """[number of Triton launches the interpreter ran inside the block]: a backend that launches Triton kernels on a
    CPU without declaring the 'interpreted' label (`probes.triton_labels`) is labelled by the runner all the same, so
    an interpreter's time is never shown as a kernel's. Counts nothing unless a kernel was defined interpreted."""
    count = [0]
    interp = sys.modules.get("triton.runtime.interpreter")
    if interp is None or not interpreting():
        yield count
        return
    executor = interp.GridExecutor
    saved = executor.__call__

    def counted(self, *args, **kwargs):
        count[0] += 1
        return saved(self, *args, **kwargs)

    executor.__call__ = counted
    try:
        yield count
    finally:
        executor.__call__ = saved


# Set while `spark_bench.kernelgate.capture` records launches without a GPU: the target described
# (spark_bench.kernelgate.targets.Target: its name and SM count answer the queries below).
_capture_target = None


def set_capture_target(target) -> None:
    global _capture_target
    _capture_target = target


def sm_count(device) -> int:
    """Streaming multiprocessors of `device` for wrappers that size their grids by it: the GPU's own count, the
    capture target's while launches are captured offline, 1 for the interpreter and CPU."""
    if _capture_target is not None:
        return _capture_target.sm_count
    if interpreting() or getattr(device, "type", str(device)) != "cuda":
        return 1
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def target_name() -> str | None:
    """The GPU family launches go to, which selects a config space's per-target rules: the capture target's name
    offline, the current CUDA device's family (sm_80 / sm_90a / sm_100a, `kernelgate.targets.family`), None for the
    interpreter and CPU."""
    if _capture_target is not None:
        return _capture_target.name
    if interpreting():
        return None
    import torch

    return _family_of(torch.cuda.current_device()) if torch.cuda.is_available() else None


@functools.cache
def _family_of(index: int) -> str | None:
    import torch

    from spark_bench.kernelgate.targets import family

    major, minor = torch.cuda.get_device_capability(index)
    return family(f"{major}.{minor}")
