"""A memory estimate before a CPU sweep starts: model-size points must not swap the host or wake the OOM killer.

A case holds its inputs several times over: the inputs, their fp64 copies for the reference, a clone for the check,
and one clone per timed input set. The estimate is MEMORY_FACTOR x the op's cost-model bytes (each input read once,
each output written once); a case whose estimate exceeds the memory available now is skipped with the figure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from spark_bench.sweep import Case

MEMORY_FACTOR = 8  # measured: moe.experts --preset kimi-linear peaked at 19.3 GB RSS for 2.35 GB of cost-model bytes


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def estimate_bytes(reg, case: Case) -> float | None:
    try:
        return float(reg.get(case.op).cost(case.params, case.dtype).bytes) * MEMORY_FACTOR
    except Exception:  # noqa: BLE001 - a plugin's broken cost model is reported by the case itself
        return None


def guard(reg, cases: Sequence[Case], available: int | None = None) -> tuple[list[Case], str | None]:
    """On CPU, skip the cases whose estimate exceeds the available memory; returns (cases, a warning or None)."""
    available = available_bytes() if available is None else available
    if available is None:
        return list(cases), None
    out, skipped, worst = [], 0, 0.0
    for case in cases:
        need = estimate_bytes(reg, case) if case.device.startswith("cpu") and not case.skip else None
        if need is not None and need > available:
            skipped += 1
            worst = max(worst, need)
            why = (f"needs ~{need / 1e9:.1f} GB ({MEMORY_FACTOR}x its cost-model bytes), "
                   f"{available / 1e9:.1f} GB available")
            case = dataclasses.replace(case, skip=why)
        out.append(case)
    if not skipped:
        return out, None
    return out, (f"{skipped} case(s) skipped: they need up to ~{worst / 1e9:.1f} GB of host memory "
                 f"({MEMORY_FACTOR}x their cost-model bytes), {available / 1e9:.1f} GB available")
