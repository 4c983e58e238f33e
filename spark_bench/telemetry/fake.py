"""A scripted GPU on a virtual clock, for tests of the energy, clock and sampler logic without a GPU.

Time only moves when the test says so: `source.run(seconds)` is device work at `busy_w`, `source.sleep(seconds)` idles
at `idle_w`, and every reading taken outside a periodic callback costs `read_latency_s` of idle time (as a real NVML
call does). The energy counter publishes the true integrated energy (floored to mJ, plus `energy_start_mj`, modulo
`energy_modulus`) only at multiples of `update_period_s` after `update_phase_s`. Periodic callbacks (`every`) fire at
their exact virtual times, so a sampler sees the power of the segment in progress.

`average_window_s` > 0 makes `power_average_w` the mean power over that trailing window (NVML's default reading on
GA100+ averages ~1 s); 0 reads it instantly. `mig=True` scripts a GPU with MIG enabled.
Any scalar setting may be a callable (t, busy) -> value to script it over time. `missing` names readings the device
lacks (energy, power_instant, power_average, sm_clock, mem_clock, default_sm_clock, temperature, power_limit,
default_power_limit, clock_event_reasons, processes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from spark_bench.telemetry.nvml import ENERGY_MODULUS, Source


class _Timer:
    def __init__(self, source: FakeSource, period_s: float, fn: Callable[[], None]) -> None:
        self.source, self.period_s, self.fn, self.due = source, period_s, fn, source.t

    def stop(self) -> None:
        if self in self.source._timers:
            self.source._timers.remove(self)


class FakeSource(Source):
    kind = "fake"

    def __init__(self, *, idle_w: Any = 60.0, busy_w: Any = 400.0, update_period_s: float = 0.1,
                 update_phase_s: float = 0.0, energy_start_mj: int = 0, energy_modulus: int = ENERGY_MODULUS,
                 read_latency_s: float = 1e-4, instant_scale: float = 1.0, sm_mhz: Any = 1980.0,
                 idle_sm_mhz: Any | None = None, mem_mhz: Any = 3201.0, default_sm_mhz: float = 1980.0,
                 temp_c: Any = 45.0, power_limit_w: float = 700.0, default_power_limit_w: float = 700.0,
                 reasons: Any = 0, processes: Iterable[dict[str, Any]] = (), missing: Iterable[str] = (),
                 name: str = "Fake H200", start_t: float = 1_000_000.0, average_window_s: float = 0.0,
                 mig: bool | None = False) -> None:
        super().__init__()
        self.average_window_s, self.mig = average_window_s, mig
        self._history: list[tuple[float, float, float]] = []  # (start, end, W) segments, for average_window_s
        self.idle_w, self.busy_w, self.instant_scale = idle_w, busy_w, instant_scale
        self.update_period_s_true, self.energy_modulus = update_period_s, energy_modulus
        self.energy_start_mj, self.read_latency_s = energy_start_mj, read_latency_s
        self.sm_mhz, self.idle_sm_mhz, self.mem_mhz = sm_mhz, idle_sm_mhz, mem_mhz
        self.default_sm_mhz, self.temp_c, self.reasons = default_sm_mhz, temp_c, reasons
        self.limit_w, self.default_limit_w = power_limit_w, default_power_limit_w
        self.procs, self.absent, self.name = list(processes), set(missing), name
        self.t = start_t
        self.busy = False
        self.true_mj = 0.0  # integrated energy since start
        self.published_mj = 0.0
        self.next_update = start_t + (update_phase_s % update_period_s or update_period_s)
        self.calls = 0  # run() calls: what a test's op did
        self._timers: list[_Timer] = []
        self._in_callback = False

    # --- clock ----------------------------------------------------------------------------------------------------
    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self._advance(seconds, busy=False)

    def run(self, seconds: float) -> None:
        """Device work lasting `seconds` (the body of a test's op)."""
        self.calls += 1
        self._advance(seconds, busy=True)

    def op(self, seconds: float) -> Callable[[], None]:
        return lambda: self.run(seconds)

    def every(self, period_s: float, fn: Callable[[], None]) -> _Timer:
        timer = _Timer(self, period_s, fn)
        self._timers.append(timer)
        self._fire(timer)
        return timer

    def _value(self, setting: Any) -> Any:
        return setting(self.t, self.busy) if callable(setting) else setting

    def _power(self) -> float:
        return float(self._value(self.busy_w if self.busy else self.idle_w))

    def _fire(self, timer: _Timer) -> None:
        self._in_callback = True
        try:
            timer.fn()
        finally:
            self._in_callback = False
        timer.due += timer.period_s

    def _advance(self, seconds: float, busy: bool) -> None:
        if self._in_callback or seconds <= 0:
            return
        target, self.busy = self.t + seconds, busy
        while True:
            due = min((tm.due for tm in self._timers), default=math.inf)
            step_to = min(target, self.next_update, due)
            self.true_mj += self._power() * (step_to - self.t) * 1e3
            if self.average_window_s > 0 and step_to > self.t:
                self._history.append((self.t, step_to, self._power()))
            self.t = step_to
            if self.t >= self.next_update:
                self.published_mj = self.true_mj
                self.next_update += self.update_period_s_true
            for timer in [tm for tm in self._timers if tm.due <= self.t]:
                self._fire(timer)
            if self.t >= target:
                break
        self.busy = False

    # --- readings -------------------------------------------------------------------------------------------------
    def _reading(self, field: str, value: Callable[[], Any]) -> Any:
        if not self._in_callback:
            self._advance(self.read_latency_s, busy=False)
        if field in self.absent:
            self.missing.setdefault(field, "NVMLError_NotSupported: Not Supported")
            return None
        return value()

    def energy_mj(self) -> int | None:
        return self._reading("energy", lambda: int(self.energy_start_mj + self.published_mj) % self.energy_modulus)

    def power_instant_w(self) -> float | None:
        return self._reading("power_instant", lambda: self._power() * self.instant_scale)

    def power_average_w(self) -> float | None:
        return self._reading("power_average", self._averaged if self.average_window_s > 0 else self._power)

    def _averaged(self) -> float:
        t0 = self.t - self.average_window_s
        self._history = [seg for seg in self._history if seg[1] > t0]
        joules = sum(w * (end - max(start, t0)) for start, end, w in self._history)
        covered = sum(end - max(start, t0) for start, end, _ in self._history)
        return joules / covered if covered > 0 else self._power()

    def sm_clock_mhz(self) -> float | None:
        idle = self.idle_sm_mhz if self.idle_sm_mhz is not None else self.sm_mhz
        return self._reading("sm_clock", lambda: self._value(self.sm_mhz if self.busy else idle))

    def mem_clock_mhz(self) -> float | None:
        return self._reading("mem_clock", lambda: self._value(self.mem_mhz))

    def default_sm_clock_mhz(self) -> float | None:
        return self._reading("default_sm_clock", lambda: self.default_sm_mhz)

    def temperature_c(self) -> float | None:
        return self._reading("temperature", lambda: self._value(self.temp_c))

    def power_limit_w(self) -> float | None:
        return self._reading("power_limit", lambda: self.limit_w)

    def default_power_limit_w(self) -> float | None:
        return self._reading("default_power_limit", lambda: self.default_limit_w)

    def clock_event_reasons(self) -> int | None:
        return self._reading("clock_event_reasons", lambda: int(self._value(self.reasons)))

    def processes(self) -> list[dict[str, Any]] | None:
        return self._reading("processes", lambda: [dict(p) for p in self.procs])

    def device_name(self) -> str | None:
        return self.name

    def driver_version(self) -> str | None:
        return "fake-1.0"
