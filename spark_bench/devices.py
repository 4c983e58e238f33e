"""Device names on the command line: `cpu`, `cuda`, `cuda:N`; validated with one-line errors."""

from __future__ import annotations

import re

from spark_bench.sweep import UsageError

# the device names torch takes: cuda, cuda:N (no cudax, cuda:, cuda:01 or non-ASCII digits)
CUDA_DEVICE = re.compile(r"cuda(:(0|[1-9][0-9]*))?", flags=re.ASCII)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def chosen_device(device: str | None) -> str:
    """--device as given (checked), or the default when it was not given: an empty value is refused, not taken for
    the default."""
    return check_device(default_device() if device is None else device)


def check_device(device: str) -> str:
    if device == "cpu":
        return device
    if not CUDA_DEVICE.fullmatch(device):
        raise UsageError(f"unknown device {device!r}; choose from cpu, cuda, cuda:N")
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"device {device!r} is not available here (torch.cuda.is_available() is False); "
                         "use --device cpu")
    index, count = device.partition(":")[2], torch.cuda.device_count()
    if index and int(index) >= count:
        raise UsageError(f"device {device!r} does not exist here: {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def use_device(device: str) -> None:
    """Make `device` the process's current CUDA device; nothing for `cpu` or a bare `cuda` (the current one stays).

    torch.cuda.set_device refuses a torch.device without an index ("Expected a torch.device with a specified index"):
    passing it `cuda` killed every worker at start-up on the first GPU run (2026-12-05), so only `cuda:N` sets it."""
    index = device.partition(":")[2]
    if device.startswith("cuda") and index:
        import torch

        torch.cuda.set_device(int(index))
