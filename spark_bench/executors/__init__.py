"""Where the cases of a sweep run: in this process, in local worker processes (one per device), or on Ray.

    make_executor("local", devices="0,1", device="cuda") -> Executor
    Executor.run(cases, RunContext, Sink): each finished record goes to Sink.result in the calling thread
See docs/scale.md.
"""

from __future__ import annotations

import re

from spark_bench.executors.base import CaseQueue, Executor, RunContext, Sink, Slot, failed_record, parse_devices
from spark_bench.sweep import UsageError

EXECUTORS = ("inprocess", "local", "ray")


def make_executor(kind: str = "local", *, device: str = "cpu", devices: str | None = None,
                  ray_address: str | None = None, retries: int = 0) -> Executor:
    """The executor named on the command line, its options checked (UsageError names what is wrong)."""
    if kind not in EXECUTORS:
        raise UsageError(f"unknown executor {kind!r}; choose from {', '.join(EXECUTORS)}")
    if retries < 0:
        raise UsageError("--retries must be 0 or more")
    if ray_address is not None and kind != "ray":
        raise UsageError("--ray-address needs --executor ray")
    if kind == "inprocess":
        if devices is not None or retries:
            raise UsageError("--executor inprocess runs one case at a time here: no --devices, no --retries")
        from spark_bench.executors.inprocess import InProcessExecutor

        return InProcessExecutor()
    if kind == "ray":
        from spark_bench.executors.ray import RayExecutor, import_ray

        if ":" in device:
            raise UsageError(f"--executor ray assigns GPUs itself: use --device cuda, not {device!r}")
        import_ray()
        count = None if devices in (None, "all") else len([d for d in devices.split(",") if d.strip()])
        return RayExecutor(address=ray_address, retries=retries, max_actors=count)
    from spark_bench.executors.local import LocalExecutor

    if devices is not None and device == "cpu":  # CPU workers are labelled cpu0, cpu1, ...: refuse a typo
        for item in devices.split(","):
            label = item.strip().partition("@")[0]
            if label and label != "all" and not re.fullmatch(r"cpu\d+", label):
                raise UsageError(f"--devices: {label!r} is not a CPU worker label; on CPU use cpu0,cpu1,... or all")
    return LocalExecutor(parse_devices(devices, device) if devices is not None else None, retries=retries)


__all__ = ["EXECUTORS", "CaseQueue", "Executor", "RunContext", "Sink", "Slot", "failed_record", "make_executor",
           "parse_devices"]
