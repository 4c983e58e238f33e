"""The timing engine: warm-up by time, cache flush before every timed call, adaptive stopping.

Timers (each result records which one produced it):
- `cpu-perf_counter`: host monotonic clock around each call (CPU devices); the last-level cache is flushed by
  writing a buffer of its size (read from sysfs, allocated once) before each call, outside the timed span.
- `cuda-event`: a CUDA event pair around each call; the L2 is flushed by zeroing a buffer of 2x the device's L2
  (allocated once per device) before each call, outside the event pair; each batch of calls is enqueued behind a
  GPU-side hold, so the host's launch time stays out (nvbench's blocking kernel). Events still inflate kernels under
  ~10 us (the event pair's own overhead).
- `cuda-graph`: for small ops. A graph of `n` calls, each preceded by the flush, is replayed between events; a graph
  of the `n` flushes alone is replayed right after each replay of it, and each sample is the pair's difference:
  per-call time = (t_graph_i - t_flush_graph_i) / n. tritonbench subtracts the flush graph's median from every
  sample instead, which leaves the flush's own noise out of the CI; the paired difference keeps it in. A difference
  below 0 (the call is lost in the flush's noise) is stored as 0 and counted in `clamped_samples`.
`mode="auto"` uses events for calls estimated at >= 50 us and the graph below that, falling back to events (and saying
so in `notes`) when the call cannot be captured.

Stopping: after `warmup_s` of calls, sample until the median's 95% CI half-width is under `target_rel_ci` of the median
with at least `min_samples` (and 6: below that the "CI" is the range, a 75% one at 3 samples) samples and `min_time_s`
elapsed, or until `max_time_s` / `max_samples` (recorded as `stop_reason`; `converged` says whether the final CI met
the target with those samples, whatever stopped the sampling; `ci_level` is the CI's exact coverage).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spark_bench.stats import MIN_CI_SAMPLES, rel_ci, summarize

Call = Callable[[], Any]
GRAPH_BELOW_US = 50.0
TIMER_MODES = {"cuda-graph": "graph", "cuda-event": "events"}  # a result's timing.timer -> the mode that reproduces it


@dataclasses.dataclass(frozen=True)
class TimingConfig:
    warmup_s: float = 0.1
    min_samples: int = 10
    max_samples: int = 2000
    min_time_s: float = 0.2
    max_time_s: float = 5.0
    target_rel_ci: float = 0.01
    flush: bool = True
    mode: str = "auto"  # auto | events | graph (CUDA); CPU devices always use the host clock
    graph_target_us: float = 500.0  # unroll the graph until its calls (the flushes not counted) take about this long
    graph_calls: int | None = None  # or exactly this many calls per replay (run --like: the base's calls_per_sample)

    @classmethod
    def quick(cls) -> TimingConfig:
        return cls(warmup_s=0.01, min_samples=3, max_samples=200, min_time_s=0.0, max_time_s=0.5, target_rel_ci=0.05)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def kept_timer(timing: dict[str, Any] | None) -> str | None:
    """The timer that reproduces a stored timing, for `run --like` and the pytest gate to keep: 'events', 'graph:N'
    (the graph at its N calls per replay: another N amortises the launch gaps otherwise), or None (CPU, untimed)."""
    timing = timing if isinstance(timing, dict) else {}
    mode = TIMER_MODES.get(str(timing.get("timer")))
    calls = timing.get("calls_per_sample")
    if mode == "graph" and isinstance(calls, int) and not isinstance(calls, bool) and calls > 0:
        return f"graph:{calls}"
    return mode


def with_kept_timer(cfg: TimingConfig, kept: str | None) -> TimingConfig:
    """`cfg` timing by a kept timer ('events', 'graph' or 'graph:N', see kept_timer) in place of auto's probe."""
    if not kept or cfg.mode != "auto":
        return cfg
    mode, _, calls = kept.partition(":")
    return dataclasses.replace(cfg, mode=mode, graph_calls=int(calls) if calls.isdigit() else cfg.graph_calls)


def config_for(device: str, quick: bool = False, **overrides: Any) -> TimingConfig:
    """The timing budget of a sweep: `quick`, the CPU default (1 s a case) or the GPU default; overrides whose value
    is None are ignored. A CPU sweep of quick shapes (`run` without --full) passes quick=True: docs/overhead.md."""
    if quick:
        cfg = TimingConfig.quick()
    elif device.startswith("cpu"):
        cfg = TimingConfig(warmup_s=0.05, min_samples=5, min_time_s=0.05, max_time_s=1.0, target_rel_ci=0.02)
    else:
        cfg = TimingConfig()
    return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def for_interpreted(cfg: TimingConfig) -> TimingConfig:
    """The budget of a backend that runs interpreted (Triton on a CPU): no warm-up calls (the check has just run the
    same call, and an interpreter has nothing to warm), the same stopping rule. Its time is the interpreter's, never
    the kernel's, and is labelled so wherever it is shown."""
    return dataclasses.replace(cfg, warmup_s=0.0)


def for_stages(cfg: TimingConfig, n_stages: int) -> TimingConfig:
    """The budget of each of a composite backend's `n_stages` stages: they share the case's warm-up and time budget
    (each still takes at least `min_samples`), so a breakdown never costs more than the case it breaks down."""
    n = max(1, n_stages)
    return dataclasses.replace(cfg, warmup_s=cfg.warmup_s / n, min_time_s=cfg.min_time_s / n,
                               max_time_s=cfg.max_time_s / n)


# --- cache flush --------------------------------------------------------------------------------------------------
def cpu_llc_bytes() -> int:
    """Largest CPU cache from sysfs (the last level), capped at 64 MiB; 32 MiB when unknown."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with open(path) as f:
            text = f.read().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return min(max(sizes, default=32 << 20), 64 << 20)


@functools.cache
def _flush_buffer(device: str) -> torch.Tensor:
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        l2 = int(getattr(props, "L2_cache_size", 0) or (50 << 20))
        nbytes = 2 * l2
    else:
        nbytes = cpu_llc_bytes()
    return torch.zeros(nbytes // 4, dtype=torch.int32, device=device)  # pages touched now, not in the first sample


def flusher(device: str, enabled: bool) -> Call:
    if not enabled:
        return lambda: None
    buf = _flush_buffer(device)
    return buf.zero_


# --- the stopping rule ------------------------------------------------------------------------------------------
class _Stopper:
    def __init__(self, cfg: TimingConfig) -> None:
        self.cfg = cfg
        self.start = time.perf_counter()
        # the CI is a 95% one from MIN_CI_SAMPLES on (below, the range: 75% at 3 samples), so no earlier convergence
        self.next_ci_check = max(cfg.min_samples, MIN_CI_SAMPLES)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def reason(self, samples: Sequence[float]) -> str | None:
        n, cfg, elapsed = len(samples), self.cfg, self.elapsed()
        if n >= cfg.max_samples:
            return "max_samples"
        if n >= 1 and elapsed >= cfg.max_time_s:
            return "max_time"
        if n >= self.next_ci_check and elapsed >= cfg.min_time_s:
            self.next_ci_check = n + max(1, n // 20)  # the CI is re-evaluated every ~5% more samples
            if rel_ci(samples) <= cfg.target_rel_ci:
                return "converged"
        return None


def _warmup(call_at: Callable[[int], Any], seconds: float, sync: Call) -> int:
    """Calls for `seconds` (at least one call when seconds > 0, none when it is 0)."""
    start, i = time.perf_counter(), 0
    while seconds > 0:
        call_at(i)
        i += 1
        sync()
        if time.perf_counter() - start >= seconds:
            return i
    return i


def _record(samples_us: list[float], stop: str, timer: str, cfg: TimingConfig, warmup_s: float, measure_s: float,
            **extra: Any) -> dict[str, Any]:
    stats = summarize(samples_us)
    converged = stop == "converged" or (stats["rel_ci"] is not None and stats["rel_ci"] <= cfg.target_rel_ci
                                        and stats["n"] >= max(cfg.min_samples, MIN_CI_SAMPLES))
    return {"timer": timer, "unit": "us", **stats, "samples": [round(s, 4) for s in samples_us],
            "converged": converged, "stop_reason": stop, "warmup_s": round(warmup_s, 4),
            "measure_s": round(measure_s, 4), "l2_flush": cfg.flush, **extra}


# --- timers -----------------------------------------------------------------------------------------------------
def time_cpu(calls: Sequence[Call], cfg: TimingConfig) -> dict[str, Any]:
    flush = flusher("cpu", cfg.flush)
    t0 = time.perf_counter()
    _warmup(lambda i: calls[i % len(calls)](), cfg.warmup_s, lambda: None)
    warm = time.perf_counter() - t0
    stopper, samples, i = _Stopper(cfg), [], 0
    while (stop := stopper.reason(samples)) is None:
        flush()
        call = calls[i % len(calls)]
        start = time.perf_counter_ns()
        call()
        samples.append((time.perf_counter_ns() - start) / 1e3)
        i += 1
    return _record(samples, stop, "cpu-perf_counter", cfg, warm, stopper.elapsed(), calls_per_sample=1)


HOLD_START_US = 1000.0  # the first batch's stream hold; doubled after each batch the GPU caught up with,
HOLD_MAX_US = 64_000.0  # up to this
CYCLES_PER_US = 2000  # torch.cuda._sleep spins clock cycles: at SM clocks <= 2 GHz a hold lasts at least this long


def _hold(us: float) -> None:
    """Keep the stream busy for about `us` while the host enqueues the batch behind it (nvbench's blocking kernel)."""
    torch.cuda._sleep(int(us * CYCLES_PER_US))


def time_cuda_events(calls: Sequence[Call], cfg: TimingConfig, device: str, batch: int = 16,
                     notes: Sequence[str] = (), hold: bool = True) -> dict[str, Any]:
    """Each sample is an event pair around one call, the flush before it outside the pair. Each batch of samples is
    enqueued behind a GPU-side hold, so a call's host-side launch time (the Python wrapper, Triton's launcher) is not
    in its time: without it, on the first H200 run (2026-12-05), kda.gate's 3.6 us kernel timed 60.5 us (do_bench
    6.2, the graph timer 3.6), and the auto mode, fooled by that probe, would have kept events for it. A batch in
    which the GPU reached a call's start event before the host had enqueued the call (the hold ran out: a gap is in
    that sample) is discarded and the hold doubled, up to HOLD_MAX_US and while max_time_s lasts; `hold_us` and
    `holds_expired` say what it took. hold=False (a call that waits for the GPU itself): no hold, gaps and all."""
    flush = flusher(device, cfg.flush)
    sync = torch.cuda.synchronize
    t0 = time.perf_counter()
    _warmup(lambda i: calls[i % len(calls)](), cfg.warmup_s, sync)
    warm = time.perf_counter() - t0
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(batch)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(batch)]
    stopper, samples, i = _Stopper(cfg), [], 0
    hold_us, expired, late_kept = (HOLD_START_US if hold else 0.0), 0, 0
    while (stop := stopper.reason(samples)) is None:
        take = min(batch, cfg.max_samples - len(samples))  # the stopping rule is read between batches only
        if hold:
            _hold(hold_us)
        late = False
        for j in range(take):
            flush()
            starts[j].record()
            calls[i % len(calls)]()
            ends[j].record()
            late = late or (hold and starts[j].query())  # passed already: the GPU waited for this call's launch
            i += 1
        sync()
        if late and hold_us < HOLD_MAX_US and stopper.elapsed() < cfg.max_time_s:
            expired += 1
            hold_us = min(2 * hold_us, HOLD_MAX_US)
            continue
        late_kept += late
        samples.extend(s.elapsed_time(e) * 1e3 for s, e in zip(starts[:take], ends[:take], strict=True))
    notes = list(notes)
    if late_kept:
        notes.append(f"{late_kept} batches were enqueued slower than the GPU ran them behind a {hold_us / 1e3:g} ms "
                     "hold: their times may include launch gaps")
    return _record(samples, stop, "cuda-event", cfg, warm, stopper.elapsed(), calls_per_sample=1, notes=notes,
                   hold_us=hold_us, holds_expired=expired)


class CaptureFailed(RuntimeError):
    """A graph capture failed; torch 2.11's allocator may still believe a capture is underway (pytorch#180395), so
    every later capture and empty_cache() of this process can fail: `capture_failed()` tells the worker to restart."""


_capture_failed = False


def capture_failed() -> bool:
    """Whether a graph capture failed in this process (then no later capture here can be trusted to work)."""
    return _capture_failed


def host_sync_of(call: Call) -> str | None:
    """Why `call` cannot be captured in a graph, when it synchronises with the host (`.item()`, `.cpu()`, nonzero):
    one call under torch's sync debug mode "error", before any capture is tried (a failed capture leaves the process
    in a broken state). None when it does not."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    except RuntimeError as exc:
        if "synchroniz" not in str(exc):  # torch: "called a synchronizing CUDA operation"; anything else is the call's
            raise
        return str(exc).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return None


def _capture(body: Call) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm the side stream (allocator pools) before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    before = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph):
            body()
    except Exception as exc:
        torch.cuda.set_stream(before)  # torch.cuda.graph's exit skips restoring it when capture_end raises
        raise CaptureFailed(f"{type(exc).__name__}: {exc}") from exc
    torch.cuda.synchronize()
    return graph


def time_cuda_graph(calls: Sequence[Call], cfg: TimingConfig, device: str, estimate_us: float) -> dict[str, Any]:
    flush = flusher(device, cfg.flush)
    n = cfg.graph_calls or int(min(1000, max(1, math.ceil(cfg.graph_target_us / max(estimate_us, 0.5)))))

    def body() -> None:
        for i in range(n):
            flush()
            calls[i % len(calls)]()

    def flush_body() -> None:
        for _ in range(n):
            flush()

    graph = _capture(body)
    flush_graph = _capture(flush_body) if cfg.flush else None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay(g: torch.cuda.CUDAGraph) -> float:
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    t0 = time.perf_counter()
    while True:  # both graphs, as the samples replay them: a first replay (its upload) is in neither's numbers
        replay(graph)
        if flush_graph is not None:
            replay(flush_graph)
        if time.perf_counter() - t0 >= cfg.warmup_s:
            break
    warm = time.perf_counter() - t0
    stopper, flushes, samples, clamped = _Stopper(cfg), [], [], 0
    while (stop := stopper.reason(samples)) is None:
        t_graph = replay(graph)
        flushes.append(replay(flush_graph) if flush_graph is not None else 0.0)
        clamped += t_graph < flushes[-1]
        samples.append(max(t_graph - flushes[-1], 0.0) / n)
    flush_per_call = statistics.median(flushes) / n  # torch's median is the lower middle value
    notes = [f"{clamped} of {len(samples)} samples were within the flush's noise and stored as 0"] if clamped else []
    return _record(samples, stop, "cuda-graph", cfg, warm, stopper.elapsed(), calls_per_sample=n,
                   flush_us_per_call_subtracted=round(flush_per_call, 4), clamped_samples=clamped,
                   **({"notes": notes} if notes else {}))


def measure(calls: Sequence[Call], device: str, cfg: TimingConfig) -> dict[str, Any]:
    """Time `calls` (one zero-arg callable per rotating input set) on `device`; returns the `timing` record. On CUDA
    the events, streams and synchronisation are `device`'s whatever the current device is (`cuda:1` from pytest)."""
    if not device.startswith("cuda"):
        return time_cpu(calls, cfg)
    with on_device(device):
        return _measure_cuda(calls, device, cfg)


def on_device(device: str) -> contextlib.AbstractContextManager[Any]:
    """Make `device` the current CUDA device (streams, events and `synchronize()` follow it); nothing on a CPU."""
    return torch.cuda.device(torch.device(device)) if device.startswith("cuda") else contextlib.nullcontext()


def _measure_cuda(calls: Sequence[Call], device: str, cfg: TimingConfig) -> dict[str, Any]:
    global _capture_failed
    torch.cuda.synchronize()
    mode, notes = cfg.mode, []
    sync = host_sync_of(calls[0])  # such a call waits for the GPU itself: no graph, and no hold (every batch late)
    if sync is not None:
        notes.append(f"it synchronises with the host ({sync}): timed with events, no stream hold, its launch "
                     "gaps in its times"[:300])
        mode = "events"
    if mode == "auto":
        probe = time_cuda_events(calls, dataclasses.replace(cfg, warmup_s=0.0, min_samples=5, max_samples=5,
                                                            max_time_s=0.5), device, batch=5)
        estimate = probe["median"]
        mode = "graph" if estimate < GRAPH_BELOW_US else "events"
    else:
        estimate = 10.0
    if mode == "graph":
        try:
            return time_cuda_graph(calls, cfg, device, estimate)
        except CaptureFailed as exc:  # dynamic allocation and the like: say so, use events, restart the worker after
            torch.cuda.synchronize()
            notes.append(f"graph capture failed, timed with events: {exc}"[:300])
            _capture_failed = True
    return time_cuda_events(calls, cfg, device, notes=notes, hold=sync is None)
