"""GPU telemetry (NVML power, energy, clocks, throttling), measured rooflines and profiling. See docs/telemetry.md.

    measure_energy(call, device, calls_per_invocation=, flops=, tokens=) -> result["power"]
    preflight(device) -> {"ok", "warnings", "records", "reason"}
    RunTelemetry.start(run_dir, device) -> (telemetry, reason): power/clock timeline in <run_dir>/telemetry.jsonl
    ThrottleGuard(source): nvbench-style throttle check and back-off
    roofline_for(device) -> run["roofline"];  percent_of_peak(gbps, tflops, dtype, roofline) -> result["roofline"]
    profiler_time(fn, device, iters) -> seconds per call (summed kernel time)
Without NVML (no driver) every power field is None with the reason recorded; nothing raises.
Heavy modules (torch) are imported only by the functions that need them.
"""

from spark_bench.telemetry.clocks import ThrottleGuard, preflight, throttle_findings
from spark_bench.telemetry.energy import measure_energy, null_power
from spark_bench.telemetry.nvml import Source, open_source
from spark_bench.telemetry.roofline import percent_of_peak, roofline_for
from spark_bench.telemetry.sampler import RunTelemetry, Sampler, read_telemetry


def profiler_time(fn, device: str, iters: int = 20, warmup: int = 3) -> float:
    """Seconds per call of fn from torch.profiler's summed kernel time (see telemetry.profile)."""
    from spark_bench.telemetry.profile import profiler_time as _profiler_time

    return _profiler_time(fn, device, iters, warmup)


__all__ = ["RunTelemetry", "Sampler", "Source", "ThrottleGuard", "measure_energy", "null_power", "open_source",
           "percent_of_peak", "preflight", "profiler_time", "read_telemetry", "roofline_for", "throttle_findings"]
