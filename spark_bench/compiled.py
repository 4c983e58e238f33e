"""The `torch_compile` backend every op gets from its eager `torch` backend, and the recompile counter.

Compilation happens in the backend's setup (its time is recorded as setup_s, never in the latency); the runner
counts Dynamo frame compilations during the timed region and flags any (`recompiled-in-timing`).
Setup resets Dynamo first: a worker runs many cases, and Dynamo keeps every compiled shape on the eager function's
code object for the life of the process; from the 9th shape or dtype (`recompile_limit`, 8) it silently ran the
function eagerly, and the case was timed and labelled torch_compile. A setup that compiles no graph is an error.
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
        import torch._dynamo

        torch._dynamo.reset()  # this case's shapes compile afresh, never past the recompile limit
        before = compile_count()
        compiled = torch.compile(eager.fn, **options)
        compiled(**inputs)  # compile now, in setup, not in the first timed call
        if compile_count() == before:
            raise RuntimeError(f"torch.compile compiled no graph for {op.name}/{source} in setup: Dynamo ran it "
                               "eagerly (a recompile limit or a skipped frame); the time would be eager's")
        return compiled

    def not_set_up(**inputs: Any) -> Any:
        raise RuntimeError(f"{op.name}/{name} must be called through its setup (it compiles there)")

    probe = eager.probe

    def combined_probe(device: str) -> str | None:
        return (probe(device) if probe else None) or _torch_compile_probe(device)

    return op.add_backend(Backend(name, not_set_up, probe=combined_probe, setup=setup, traced=True,
                                  doc=f"torch.compile({source}), {options}"))
