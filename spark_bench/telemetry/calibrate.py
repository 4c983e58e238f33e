"""Measure the achievable peaks of the current device: memory bandwidth and dense matmul rate per dtype.

Bandwidth: a large device-to-device copy (dst.copy_(src)), counting bytes read + written (2x the tensor), well above
L2 (GPU) or the last-level cache (CPU). Matmul: square n x n x n products of random data (never zeros: a bf16 GEMM
runs faster on zeros), 2 n^3 FLOPs each, for bf16, fp16, tf32 (fp32 inputs, TF32 tensor cores) and fp32 (IEEE).
Each rate is the best batch of back-to-back calls (CUDA events on GPU, perf_counter on CPU) after a warm-up: a peak
is what the device can reach, and other load on the machine only ever slows a batch down.
The CPU sizes are moderate so `spark-bench calibrate --device cpu` finishes in seconds.

On a GPU, NVML is sampled every 20 ms while it measures, and each peak keeps what its timed batches ran at
(`clocks`: SM clock min/median, median power, clock-event reasons, samples throttled by nvbench's rule): a peak
measured under a power cap or at low clocks is then labelled so (the first H200 run's bf16 matmul gave 680 TFLOP/s
where such machines gave 769-798, and nothing said at what clock).

On a CPU, other work on the machine lowers every batch alike (a test suite on all cores gave peaks 10x low, which
the cache then served to every later run). So the entry records the load (`load`): the load average before measuring
and the share of the CPUs other processes used while measuring (from /proc/stat, less this process's own time). A CPU
measured while busy (`busy`: load average >= BUSY_LOAD per CPU, or others' share >= BUSY_SHARE) is not cached by a
run's implicit calibration. The share matters: the load average lags by a minute, so a burst just before (a run's
workers importing torch) halved a 2-core VM's peaks unseen; a run now measures a CPU's peaks before its workers start.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GPU = {"copy_bytes": 2 * 2**30, "matmul_n": {"bf16": 8192, "fp16": 8192, "tf32": 8192, "fp32": 8192},
       "budget_s": 1.0, "warmup_s": 0.5}
CPU = {"copy_bytes": 64 * 2**20, "matmul_n": {"fp32": 1024, "bf16": 256, "fp16": 256},
       "budget_s": 0.4, "warmup_s": 0.1}
BATCH_S = 0.02  # one timed sample: back-to-back calls for about this long
BUSY_LOAD = 0.5  # 1-minute load average per CPU at or above which a CPU calibration counts as taken while busy
BUSY_SHARE = 0.25  # share of all CPUs used by other processes while measuring at or above which it counts as busy


def machine_load() -> dict[str, Any]:
    """The host's 1-minute load average and CPU count (load average None where the OS has none)."""
    try:
        load = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        load = None
    return {"loadavg_1min": load, "cpus": os.cpu_count()}


def _proc_stat() -> tuple[float, int] | None:
    """(seconds all CPUs spent busy since boot, CPUs) from /proc/stat; None where there is none (not Linux)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        ticks = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError, IndexError):
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK"), sum(line.startswith("cpu") for line in lines) - 1


def cpu_meter() -> Callable[[], float | None]:
    """Start measuring; the returned function gives the share of all CPUs (0-1) that other processes used since
    (None where it cannot tell). Others' time is the system's busy time less this process's (all its threads)."""
    start, own, wall = _proc_stat(), os.times(), time.monotonic()

    def others_share() -> float | None:
        end, now = _proc_stat(), os.times()
        elapsed = time.monotonic() - wall
        if start is None or end is None or end[1] < 1 or elapsed <= 0:
            return None
        others = (end[0] - start[0]) - ((now.user + now.system) - (own.user + own.system))
        return round(min(1.0, max(0.0, others / (elapsed * end[1]))), 3)

    return others_share


def was_busy(load: dict[str, Any], device: str) -> bool:
    """A CPU calibration with other work running: its peaks are low. (GPU peaks do not depend on the host's load.)"""
    if device.startswith("cuda"):
        return False
    avg, cpus, share = load.get("loadavg_1min"), load.get("cpus"), load.get("others_cpu_share")
    return (avg is not None and bool(cpus) and avg / cpus >= BUSY_LOAD) or (share is not None and share >= BUSY_SHARE)


def busy_text(entry: dict[str, Any]) -> str:
    """'busy (load average 3.1 on 2 CPUs)' or 'busy (other processes used 48% of the CPUs while measuring)' for an
    entry measured while busy, else ''."""
    if not entry.get("busy"):
        return ""
    load = entry.get("load") or {}
    share = load.get("others_cpu_share")
    if share is not None and share >= BUSY_SHARE:
        return f"busy (other processes used {share:.0%} of the CPUs while measuring)"
    return f"busy (load average {load.get('loadavg_1min')} on {load.get('cpus')} CPUs)"


def per_call_seconds(fn: Callable[[], Any], device: str, budget_s: float, warmup_s: float,
                     window: list[float] | None = None) -> tuple[float, int]:
    """(best seconds per call over the timed batches, calls timed) of fn on device, after warmup_s of warm-up.
    `window` (when given) receives the timed batches' start and end in epoch seconds (time.time(), the clock of
    NVML's samples: a source on another clock sees no samples in the window)."""
    import torch

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    start, n = time.perf_counter(), 0
    while n < 2 or time.perf_counter() - start < warmup_s:
        fn()
        sync()
        n += 1
    batch = max(1, int(BATCH_S / ((time.perf_counter() - start) / n)))
    samples: list[float] = []
    start, began = time.perf_counter(), time.time()
    while len(samples) < 3 or time.perf_counter() - start < budget_s:
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(batch):
                fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3 / batch)
        else:
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            samples.append((time.perf_counter() - t0) / batch)
    if window is not None:
        window[:] = [began, time.time()]
    return min(samples), len(samples) * batch


def measure_bandwidth(device: str, nbytes: int, budget_s: float, warmup_s: float,
                      window: list[float] | None = None) -> dict[str, Any]:
    import torch

    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds, calls = per_call_seconds(lambda: dst.copy_(src), device, budget_s, warmup_s, window)
    moved = 2 * src.numel() * src.element_size()
    return {"gbps": moved / seconds / 1e9, "bytes_moved": moved, "seconds": seconds, "calls": calls,
            "method": "dst.copy_(src), bytes read + written"}


def measure_matmul(device: str, dtype: str, n: int, budget_s: float, warmup_s: float,
                   window: list[float] | None = None) -> dict[str, Any]:
    import torch

    from spark_bench.dtypes import torch_dtype

    tdtype = torch_dtype("fp32" if dtype == "tf32" else dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((n, n), generator=gen, device=device).to(tdtype)
    b = torch.randn((n, n), generator=gen, device=device).to(tdtype)
    out = torch.empty((n, n), device=device, dtype=tdtype)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
    try:
        seconds, calls = per_call_seconds(lambda: torch.matmul(a, b, out=out), device, budget_s, warmup_s, window)
    finally:
        torch.set_float32_matmul_precision(before)
    return {"tflops": 2 * n**3 / seconds / 1e12, "n": n, "seconds": seconds, "calls": calls}


def calibrate(device: str = "cuda", *, identity: dict[str, Any] | None = None,
              sizes: dict[str, Any] | None = None, dtypes: list[str] | None = None,
              progress: Callable[[str], None] | None = None, source: Any = None) -> dict[str, Any]:
    """Measure this device's peaks and return a roofline cache entry (see roofline.py). `source`: the telemetry
    source sampled while measuring (default: the GPU's NVML where there is one; none on a CPU)."""
    import torch

    import spark_bench
    from spark_bench.telemetry.roofline import device_identity, now_iso
    from spark_bench.timing import on_device

    identity = identity or device_identity(device)
    cuda = device.startswith("cuda")
    cfg = {**(GPU if cuda else CPU), **(sizes or {})}
    if cuda:
        total = torch.cuda.get_device_properties(torch.device(device).index or 0).total_memory
        cfg["copy_bytes"] = min(cfg["copy_bytes"], total // 8)
    say = progress or (lambda _msg: None)
    load, others_share = machine_load(), cpu_meter()
    watch = _Watch(source if source is not None or not cuda else _nvml(device))
    try:
        with on_device(device):  # cuda:N current: the copies, matmuls, events and syncs are N's
            say(f"bandwidth: copying {cfg['copy_bytes'] / 2**20:.0f} MiB")
            copy = watch.measured(measure_bandwidth, device, cfg["copy_bytes"], cfg["budget_s"], cfg["warmup_s"])
            matmul = {}
            for dtype in dtypes or list(cfg["matmul_n"]):
                n = cfg["matmul_n"][dtype]
                say(f"matmul {dtype}: {n}x{n}x{n}")
                try:
                    matmul[dtype] = watch.measured(measure_matmul, device, dtype, n, cfg["budget_s"],
                                                   cfg["warmup_s"])
                except RuntimeError as exc:  # a dtype this device's matmul does not support
                    matmul[dtype] = {"tflops": None, "n": n, "error": str(exc).splitlines()[0]}
            if cuda:
                torch.cuda.empty_cache()
            else:
                load = {**load, "others_cpu_share": others_share()}
    finally:
        watch.stop()
    return {
        "fingerprint_id": identity["fingerprint_id"], "key_source": identity["key_source"],
        "device": identity["device"], "measured_at": now_iso(),
        "bandwidth_gbps": copy["gbps"], "tflops": {d: m["tflops"] for d, m in matmul.items()},
        "details": {"copy": copy, "matmul": matmul},
        "versions": {"torch": torch.__version__, "spark_bench": spark_bench.__version__},
        "load": load, "busy": was_busy(load, device),
    }


CLOCK_PERIOD_S = 0.02  # NVML sampling period while measuring: ~50 samples in a 1 s timed phase


def _nvml(device: str) -> Any:
    from spark_bench.telemetry.nvml import open_source

    return open_source(device)[0]


class _Watch:
    """Samples `source` (None: nothing) while calibrating; `measured(fn, ...)` runs one measurement and adds the
    clocks its timed batches ran at (sampler.window_clocks; None without a source or without samples)."""

    def __init__(self, source: Any) -> None:
        from spark_bench.telemetry.sampler import Sampler

        self.default_sm_mhz = source.default_sm_clock_mhz() if source is not None else None  # before the thread
        self.sampler = Sampler(source, CLOCK_PERIOD_S).start() if source is not None else None

    def measured(self, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
        window: list[float] = []
        result = fn(*args, window=window)
        if self.sampler is not None and window:
            from spark_bench.telemetry.clocks import throttle_findings
            from spark_bench.telemetry.nvml import SW_POWER_CAP
            from spark_bench.telemetry.sampler import window_clocks

            rows = self.sampler.between(*window)
            clocks = window_clocks(rows, self.default_sm_mhz)
            if clocks is not None:  # a peak runs into the power cap by design: only slower clocks or heat count
                slowed = [f for r in rows if (f := throttle_findings(r.get("sm_mhz"), self.default_sm_mhz,
                                                                     (r.get("reasons") or 0) & ~SW_POWER_CAP))]
                clocks.update(slowed_samples=len(slowed), slowed=slowed[0] if slowed else [])
            result["clocks"] = clocks
        return result

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()


def clock_notes(entry: dict[str, Any]) -> list[str]:
    """One line per peak of a calibration entry whose timed batches ran slowed: an SM clock under nvbench's floor or
    a thermal / hardware slowdown, e.g. 'matmul bf16: 31 of 48 samples slowed (clock-event reasons:
    hw_thermal_slowdown); SM 1455 MHz median, 640 W'. The power cap alone is no note: a sustained peak reaches it on a
    healthy card (the clocks record it as `throttled_samples`, nvbench's rule for timed samples)."""
    details = entry.get("details") if isinstance(entry.get("details"), dict) else {}
    parts = [("bandwidth", details.get("copy"))]
    parts += [(f"matmul {d}", m) for d, m in (details.get("matmul") or {}).items()]
    notes = []
    for name, part in parts:
        clocks = part.get("clocks") if isinstance(part, dict) else None
        if isinstance(clocks, dict) and clocks.get("slowed_samples"):
            sm, power = clocks.get("sm_mhz_median"), clocks.get("power_w_median")
            notes.append(f"{name}: {clocks['slowed_samples']} of {clocks.get('samples', '?')} samples slowed "
                         f"({'; '.join(clocks.get('slowed') or [])}); SM {'?' if sm is None else f'{sm:.0f}'} MHz "
                         f"median, {'?' if power is None else f'{power:.0f}'} W")
    return notes
