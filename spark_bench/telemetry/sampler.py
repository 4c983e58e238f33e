"""Power/clock timelines: a sampler on a helper thread, and the `<run_dir>/telemetry.jsonl` writer and reader.

`Sampler(source, period_s)` records one row every 10-50 ms: {t, power_w, sm_mhz, mem_mhz, temp_c, reasons}.
`RunTelemetry.start(run_dir, device)` samples for a whole run into telemetry.jsonl; the runner marks case phases with
`tele.mark(case_id, phase, start, end)` or `with tele.phase(case_id, "timing"):` (epoch seconds, so a worker process
can report its own phase times). The file format is in docs/telemetry.md.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from spark_bench.telemetry.nvml import CAP_REASONS_MASK, Source, open_source, reason_names

SCHEMA = "spark-bench/telemetry"
SCHEMA_VERSION = 1
FILENAME = "telemetry.jsonl"


class Sampler:
    """Samples the source every period_s (on the source's clock) while started; rows land in `samples` and are
    passed to `on_sample`."""

    def __init__(self, source: Source, period_s: float = 0.02,
                 on_sample: Callable[[dict[str, Any]], None] | None = None) -> None:
        if not 0 < period_s <= 1.0:
            raise ValueError(f"sampling period {period_s} s is out of range (0, 1]")
        self.source, self.period_s, self.on_sample = source, period_s, on_sample
        self.samples: list[dict[str, Any]] = []
        self.power_source: str | None = None
        self._lock = threading.Lock()
        self._handle: Any = None

    def poll(self) -> dict[str, Any]:
        row = self.source.snapshot()
        if row["power_w"] is not None:
            self.power_source = self.source.power_field
        with self._lock:
            self.samples.append(row)
        if self.on_sample is not None:
            self.on_sample(row)
        return row

    def start(self) -> Sampler:
        if self._handle is None:
            self._handle = self.source.every(self.period_s, self.poll)
        return self

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.stop()
            self._handle = None

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def between(self, t0: float, t1: float) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.samples if t0 <= r["t"] <= t1]


def integrate_power(samples: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(average W, energy J) of sampled power by the trapezoid rule; (None, None) with fewer than 2 readings."""
    points = [(r["t"], r["power_w"]) for r in samples if r.get("power_w") is not None]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None, None
    energy = sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(points, points[1:], strict=False))
    return energy / (points[-1][0] - points[0][0]), energy


def phase_coverage(times: list[float], cycle_ends: list[float]) -> float | None:
    """The share (0..1) of an op's invocation cycle that samples at `times` saw: 1 - the largest gap between their
    phases within the invocation each fell in (`cycle_ends`: when each invocation ended, ascending). Samples in step
    with the invocations (a period near a multiple of the cycle) see one phase: their average is aliased.
    None with fewer than 2 samples inside the invocations."""
    phases = []
    for t in times:
        i = bisect.bisect_right(cycle_ends, t)
        if 0 < i < len(cycle_ends) and cycle_ends[i] > cycle_ends[i - 1]:
            phases.append((t - cycle_ends[i - 1]) / (cycle_ends[i] - cycle_ends[i - 1]))
    if len(phases) < 2:
        return None
    phases.sort()
    gaps = [b - a for a, b in zip(phases, phases[1:], strict=False)] + [1.0 - phases[-1] + phases[0]]
    return 1.0 - max(gaps)


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Clocks, temperature and clock-event reasons over a window of samples."""

    def values(key: str) -> list[float]:
        return [r[key] for r in samples if r.get(key) is not None]

    sm, mem, temp = values("sm_mhz"), values("mem_mhz"), values("temp_c")
    mask = 0
    for r in samples:
        mask |= r.get("reasons") or 0
    seen = [r for r in samples if r.get("reasons") is not None]
    return {
        "sm_mhz_min": min(sm) if sm else None, "sm_mhz_median": statistics.median(sm) if sm else None,
        "mem_mhz_median": statistics.median(mem) if mem else None, "temp_c_max": max(temp) if temp else None,
        "reasons_mask": mask if seen else None, "reasons": reason_names(mask),
        "cap_reason_share": (sum(1 for r in seen if r["reasons"] & CAP_REASONS_MASK) / len(seen)) if seen else None,
        "samples": len(samples),
    }


def window_clocks(rows: list[dict[str, Any]], default_sm_mhz: float | None) -> dict[str, Any] | None:
    """What the samples of one measurement window saw: summarize()'s clocks and reasons, the median power, and how
    many samples were throttled by nvbench's rule (clocks.throttle_findings) with the first finding; None without
    samples (a window shorter than the period)."""
    if not rows:
        return None
    from spark_bench.telemetry.clocks import throttle_findings

    found = [f for r in rows if (f := throttle_findings(r.get("sm_mhz"), default_sm_mhz, r.get("reasons")))]
    power = [r["power_w"] for r in rows if r.get("power_w") is not None]
    return {**summarize(rows), "power_w_median": statistics.median(power) if power else None,
            "throttled_samples": len(found), "throttle": found[0] if found else []}


class TelemetryLog:
    """Appends header, sample and phase rows to a telemetry.jsonl (thread-safe, flushed about once a second)."""

    def __init__(self, path: str | Path, header: dict[str, Any], flush_every_s: float = 1.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_every_s = flush_every_s
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        new = not self.path.exists() or self.path.stat().st_size == 0
        if new:
            self._pending.append({"type": "header", "schema": SCHEMA, "schema_version": SCHEMA_VERSION, **header})
            self.flush()

    def add_sample(self, row: dict[str, Any]) -> None:
        self._add({"type": "sample", **row})

    def mark(self, case_id: str, phase: str, start: float, end: float, **extra: Any) -> None:
        self._add({"type": "phase", "case_id": case_id, "phase": phase, "start": start, "end": end, **extra}, True)

    def _add(self, row: dict[str, Any], now: bool = False) -> None:
        with self._lock:
            self._pending.append(row)
        if now or time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            rows, self._pending = self._pending, []
            self._last_flush = time.monotonic()
            if rows:
                with self.path.open("a") as fh:
                    fh.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)


class RunTelemetry:
    """A whole run's timeline: a sampler writing into <run_dir>/telemetry.jsonl, plus the case phases."""

    def __init__(self, source: Source, log: TelemetryLog, period_s: float) -> None:
        self.source, self.log = source, log
        self.sampler = Sampler(source, period_s, on_sample=self._sample)
        self.sampler.samples = _Discard()  # the file keeps the timeline; memory stays flat over long runs
        self.default_sm_mhz = source.default_sm_clock_mhz()
        self._lock = threading.Lock()
        self._watched: str | None = None  # the case whose timing phase is running
        self._timing_rows: dict[str, list[dict[str, Any]]] = {}  # its samples, until `timing_clocks` takes them

    def _sample(self, row: dict[str, Any]) -> None:
        self.log.add_sample(row)
        with self._lock:
            if self._watched is not None:
                self._timing_rows.setdefault(self._watched, []).append(row)

    def watch(self, case_id: str, phase: str) -> None:
        """A case entered `phase`: samples count towards its timing while the phase is "timing"."""
        with self._lock:
            self._watched = case_id if phase == "timing" else None
            if phase == "timing":
                self._timing_rows[case_id] = []

    def timing_clocks(self, case_id: str) -> dict[str, Any] | None:
        """The clocks the run's sampler saw while `case_id` was timed (None when it took no sample: a phase shorter
        than the period): SM clock min/median, reasons, and how many samples were throttled by nvbench's rule
        (SM clock under 75% of the default, or a power/thermal cap reason) with the first such finding."""
        with self._lock:
            rows = self._timing_rows.pop(case_id, None)
            if self._watched == case_id:
                self._watched = None
        return window_clocks(rows, self.default_sm_mhz)

    @classmethod
    def start(cls, run_dir: str | Path, device: Any = 0, *, period_s: float = 0.05,
              source: Source | None = None) -> tuple[RunTelemetry | None, str | None]:
        """(telemetry, None) sampling from now on, or (None, why not: no NVML...)."""
        if source is None:
            source, reason = open_source(device)
            if source is None:
                return None, reason
        header = {"device": str(device), "device_name": source.device_name(), "driver": source.driver_version(),
                  "source": source.kind, "period_s": period_s, "created": time.time(),
                  "power_field": source.power_w()[1], "mig": source.mig,
                  "default_sm_mhz": source.default_sm_clock_mhz(), "power_limit_w": source.power_limit_w(),
                  "default_power_limit_w": source.default_power_limit_w()}
        tele = cls(source, TelemetryLog(Path(run_dir) / FILENAME, header), period_s)
        tele.sampler.start()
        return tele, None

    def now(self) -> float:
        return self.source.now()

    def mark(self, case_id: str, phase: str, start: float, end: float, **extra: Any) -> None:
        self.log.mark(case_id, phase, start, end, **extra)

    @contextlib.contextmanager
    def phase(self, case_id: str, phase: str, **extra: Any) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.mark(case_id, phase, start, self.now(), **extra)

    def stop(self) -> None:
        self.sampler.stop()
        self.log.flush()


class _Discard(list):
    def append(self, row: Any) -> None:
        pass


def read_telemetry(path: str | Path) -> dict[str, Any]:
    """{"header": {...}, "samples": [...], "phases": [...]} of a telemetry.jsonl (or a run directory); a
    truncated last line (a killed run) is ignored."""
    path = Path(path)
    if path.is_dir():
        path = path / FILENAME
    out: dict[str, Any] = {"header": None, "samples": [], "phases": []}
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: malformed telemetry line") from None
        kind = row.pop("type", None)
        if kind == "header":
            if row.get("schema") != SCHEMA or row.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"{path}: not a {SCHEMA} v{SCHEMA_VERSION} file")
            out["header"] = row
        elif kind == "sample":
            out["samples"].append(row)
        elif kind == "phase":
            out["phases"].append(row)
    return out
