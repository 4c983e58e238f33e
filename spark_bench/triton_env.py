"""Where Triton kernels run: compiled on a CUDA GPU, or under the interpreter (TRITON_INTERPRET=1) on CPU tensors.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any plugin imports its kernels.
`configure()` sets it on a machine without CUDA (unless the user set it either way); the CLI sets it in the worker
processes of a `--device cpu` sweep.
"""

from __future__ import annotations

import functools
import os

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


# Set while `spark_bench.kernelgate.capture` records launches without a GPU: (name, SM count) of the target described.
_capture_target: tuple[str, int] | None = None


def set_capture_target(name: str | None, sm_count: int | None = None) -> None:
    global _capture_target
    _capture_target = None if name is None else (name, int(sm_count or 0))


def sm_count(device) -> int:
    """Streaming multiprocessors of `device` for wrappers that size their grids by it: the GPU's own count, the
    capture target's while launches are captured offline, 1 for the interpreter and CPU."""
    if _capture_target is not None:
        return _capture_target[1]
    if interpreting() or getattr(device, "type", str(device)) != "cuda":
        return 1
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def target_name(device=None) -> str | None:
    """The offline gate's target family of `device` (default: the current CUDA device), which selects a config
    space's per-target rules: the capture target's name offline, the GPU's family on CUDA (sm_80 / sm_90a / sm_100a,
    `spark_bench.kernelgate.targets.family`), None for the interpreter and CPU."""
    if _capture_target is not None:
        return _capture_target[0]
    if interpreting() or (device is not None and getattr(device, "type", str(device)) != "cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device is None or getattr(device, "index", None) is None else device.index
    return _family_of(index)


@functools.cache
def _family_of(index: int) -> str | None:
    import torch

    from spark_bench.kernelgate.targets import family

    return family(*torch.cuda.get_device_capability(index))
