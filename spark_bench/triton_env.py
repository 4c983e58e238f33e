"""Where Triton kernels run: compiled on a CUDA GPU, or under the interpreter (TRITON_INTERPRET=1) on CPU tensors.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any plugin imports its kernels.
`configure()` sets it on a machine without CUDA (unless the user set it either way); the CLI sets it in the worker
processes of a `--device cpu` sweep.
"""

from __future__ import annotations

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


# Set while `spark_bench.kernelgate.capture` records launches without a GPU: the SM count of the target described.
_capture_sm_count: int | None = None


def set_capture_sm_count(count: int | None) -> None:
    global _capture_sm_count
    _capture_sm_count = count


def sm_count(device) -> int:
    """Streaming multiprocessors of `device` for wrappers that size their grids by it: the GPU's own count, the
    capture target's while launches are captured offline, 1 for the interpreter and CPU."""
    if _capture_sm_count is not None:
        return _capture_sm_count
    if interpreting() or getattr(device, "type", str(device)) != "cuda":
        return 1
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count
