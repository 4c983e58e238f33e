"""The `torch_compile` backend every op gets from its eager `torch` backend, and the recompile counter.

Compilation happens in the backend's setup (its time is recorded as setup_s, never in the latency); the runner
counts Dynamo frame compilations during the timed region and flags any (`recompiled-in-timing`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from spark_bench.op import Backend, Op


def compile_count() -> int:
    """Frames Dynamo has compiled so far in this process (0 when torch._dynamo was never imported)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    if dynamo_utils is None:
        return 0
    return int(dynamo_utils.counters["stats"].get("unique_graphs", 0))


def _torch_compile_probe(device: str) -> str | None:
    import torch

    if device.startswith("cpu"):
        import shutil

        if shutil.which("cc") is None and shutil.which("gcc") is None:
            return "torch.compile on CPU needs a C compiler"
    if not hasattr(torch, "compile"):
        return "torch.compile missing"
    return None


def add_torch_compile(op: Op, source: str = "torch", name: str = "torch_compile", **compile_kwargs: Any) -> Backend:
    """Register `name` = torch.compile(op.backends[source].fn). Compiled per case (dynamic=False by default, so a
    new shape compiles anew, in setup)."""
    eager = op.backends[source]
    options = {"dynamic": False, **compile_kwargs}

    def setup(fn: Callable[..., Any], inputs: dict[str, Any]) -> Callable[..., Any]:
        import torch

        compiled = torch.compile(eager.fn, **options)
        compiled(**inputs)  # compile now, in setup, not in the first timed call
        return compiled

    def not_set_up(**inputs: Any) -> Any:
        raise RuntimeError(f"{op.name}/{name} must be called through its setup (it compiles there)")

    probe = eager.probe

    def combined_probe(device: str) -> str | None:
        return (probe(device) if probe else None) or _torch_compile_probe(device)

    return op.add_backend(Backend(name, not_set_up, probe=combined_probe, setup=setup, traced=True,
                                  doc=f"torch.compile({source}), {options}"))
