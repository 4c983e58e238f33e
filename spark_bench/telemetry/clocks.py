"""Clock health: throttle detection (nvbench's rule), a back-off helper, and the pre-run check.

A measurement is `throttled` when the SM clock fell below 75% of the default SM clock, or a power/thermal cap reason
(sw_power_cap, hw_slowdown, sw/hw_thermal_slowdown, hw_power_brake_slowdown) was set. Nothing here changes clocks or
power settings; it only reads and warns.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from spark_bench.telemetry.nvml import CAP_REASONS_MASK, MIG_NOTE, Source, open_source, reason_names

SM_CLOCK_FLOOR = 0.75  # nvbench discards samples below 75% of the default SM clock
IDLE_CLOCK_FRACTION = 0.5


def throttle_findings(sm_mhz: float | None, default_sm_mhz: float | None, reasons: int | None, *,
                      floor: float = SM_CLOCK_FLOOR) -> list[str]:
    """Why a sample or window counts as throttled (empty: it does not)."""
    found = []
    if sm_mhz is not None and default_sm_mhz and sm_mhz < floor * default_sm_mhz:
        found.append(f"SM clock {sm_mhz:.0f} MHz < {floor:.0%} of default {default_sm_mhz:.0f} MHz")
    capped = reason_names((reasons or 0) & CAP_REASONS_MASK)
    if capped:
        found.append("clock-event reasons: " + ", ".join(capped))
    return found


class ThrottleGuard:
    """nvbench-style back-off for the runner: `check()` reads the clock and reasons now and returns the findings
    (empty when fine); `wait()` sleeps 0.05 s, doubling per consecutive call up to max_backoff_s; `reset()` after
    a good sample. Typical use: discard a sample (or energy window) whose check() is non-empty, wait(), redo."""

    def __init__(self, source: Source, *, floor: float = SM_CLOCK_FLOOR, backoff_s: float = 0.05,
                 max_backoff_s: float = 2.0) -> None:
        self.source, self.floor = source, floor
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.default_sm_mhz = source.default_sm_clock_mhz()
        self._next = backoff_s

    def check(self) -> list[str]:
        return throttle_findings(self.source.sm_clock_mhz(), self.default_sm_mhz, self.source.clock_event_reasons(),
                                 floor=self.floor)

    def wait(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self.max_backoff_s)
        self.source.sleep(delay)
        return delay

    def reset(self) -> None:
        self._next = self.backoff_s


def _visible(pid: int) -> bool:
    """Whether `pid` is a process of this PID namespace (NVML gives host PIDs: inside a container it is not)."""
    return os.path.exists(f"/proc/{pid}")


def preflight(device: Any = 0, *, source: Source | None = None, own_pids: Iterable[int] = ()) -> dict[str, Any]:
    """Pre-run check of a GPU: {"ok", "warnings": [one line each], "records": {...}, "reason"}. Warns (the caller
    prints them: logging them too printed each twice on the first H200 run) when other processes use the GPU, the
    clocks look idle, the power limit is below its default, or a cap reason
    is already set. `reason` says why nothing could be checked (no NVML); then ok is None.

    `own_pids`: the run's own processes besides this one (its prestarted workers, which may hold a CUDA context
    by now): never "other processes". A PID this process cannot see (another PID namespace: NVML reports host PIDs
    inside a container) cannot be told apart from the run's own: such processes are warned of only when there are
    more of them than the run has processes, and then as "at least" the difference."""
    if source is None:
        source, why = open_source(device)
        if source is None:
            return {"ok": None, "warnings": [], "records": {}, "reason": why}
    sm, default_sm = source.sm_clock_mhz(), source.default_sm_clock_mhz()
    limit, default_limit = source.power_limit_w(), source.default_power_limit_w()
    reasons = source.clock_event_reasons()
    ours = {os.getpid(), *own_pids}
    listed = [p for p in (source.processes() or []) if p.get("pid") not in ours]
    others = [p for p in listed if _visible(p["pid"])]
    unseen = [p for p in listed if not _visible(p["pid"])]
    power, power_field = source.power_w()
    records = {
        "device_name": source.device_name(), "driver": source.driver_version(), "sm_mhz": sm,
        "mem_mhz": source.mem_clock_mhz(), "default_sm_mhz": default_sm, "temp_c": source.temperature_c(),
        "power_w": power, "power_field": power_field, "power_limit_w": limit, "default_power_limit_w": default_limit,
        "reasons": reason_names(reasons), "other_processes": others, "unidentified_processes": unseen,
        "mig": source.mig, "missing": dict(source.missing),
    }
    warnings = [MIG_NOTE + ": a net energy per call includes theirs"] if source.mig else []
    if others:
        pids = ", ".join(str(p["pid"]) for p in others[:8])
        warnings.append(f"{len(others)} other process(es) use this GPU (pid {pids}): timings and energy will be "
                        "disturbed")
    if len(unseen) > len(ours):  # each of the run's own processes could be one of them, not more
        warnings.append(f"{len(unseen)} process(es) use this GPU under PIDs of another namespace (a container's "
                        f"host PIDs), at least {len(unseen) - len(ours)} of them not this run's: timings and energy "
                        "will be disturbed")
    if sm is not None and default_sm and sm < IDLE_CLOCK_FRACTION * default_sm:
        warnings.append(f"clocks look idle (SM {sm:.0f} MHz of default {default_sm:.0f} MHz): keep warm-up on so "
                        "the first cases are not measured while the GPU ramps up")
    if limit is not None and default_limit and limit < default_limit - 0.5:
        warnings.append(f"power limit {limit:.0f} W is below the default {default_limit:.0f} W: results are "
                        "power-capped (spark-bench never changes it)")
    capped = reason_names((reasons or 0) & CAP_REASONS_MASK)
    if capped:
        warnings.append("clocks already held down before the run: " + ", ".join(capped))
    return {"ok": not warnings, "warnings": warnings, "records": records, "reason": None}
