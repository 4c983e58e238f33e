"""Energy per call from NVML's energy counter: amplified, edge-aligned windows with an idle baseline subtracted.

The counter (mJ, Volta+) only moves every ~10-100 ms, so `measure_energy`:
1. infers the update period by polling (once per source; `update_period_s=` skips it);
2. measures the idle power between two counter updates (the baseline), `baseline_fraction` of the window long;
3. runs `call` back to back for >= max(min_window_s, 10 update periods, 10 invocations), starting and ending the
   window exactly on counter updates (polled after each call), so the energy read is the energy of that interval;
4. cross-checks the counter against instant power (NVML_FI_DEV_POWER_INSTANT) sampled every 20 ms on a helper
   thread and integrated, and records SM/memory clocks, temperature, power limits and clock-event reasons.
Without an energy counter the integrated instant power becomes the primary number (`source` says which). Where only
NVML's ~1 s averaged reading exists, both windows open 1 s late so it no longer holds earlier power; `sampling` says
whether the samples' phases covered the op's invocation cycle (if not, their average is aliased: a warning says so);
idle and busy power are subtracted from one meter.
Without NVML every number is None and `reason` says why; nothing raises.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

from spark_bench.telemetry.clocks import ThrottleGuard, throttle_findings
from spark_bench.telemetry.nvml import MIG_NOTE, Source, open_source
from spark_bench.telemetry.sampler import Sampler, integrate_power, phase_coverage, summarize

COUNTER = "nvml-energy-counter"
DISAGREE_WARN = 0.15  # counter vs integrated instant power
MAX_PLAUSIBLE_W = 5000.0  # above this a counter difference is a reset, not energy
AVERAGED_POWER_S = 1.0  # NVML's default power reading (nvml-power-usage) averages ~1 s on GA100+: let it settle
ALIASED_COVERAGE = 0.5  # sampled power that saw less of the op's invocation cycle than this is aliased
MIN_PHASE_SAMPLES = 8  # fewer samples than this leave gaps by chance: no aliasing verdict

POWER_KEYS = (
    "avg_w", "net_w", "idle_w", "energy_j_per_call", "energy_j_per_call_gross", "energy_j_per_call_uncertainty",
    "uncertainty_w", "idle_uncertainty_w", "rel_uncertainty", "window_s", "baseline_s", "calls",
    "calls_per_invocation", "invocation_s", "update_period_s", "cross_check", "gflop_per_j", "gflop_per_j_gross",
    "j_per_token", "j_per_token_gross", "sm_mhz_min", "sm_mhz_median", "mem_mhz_median", "default_sm_mhz",
    "temp_c_max", "power_limit_w", "default_power_limit_w", "throttle_reasons", "throttled", "throttle",
    "source", "sources", "attempts", "warnings", "missing", "reason", "regime", "sampling",
)


def null_power(reason: str) -> dict[str, Any]:
    """The power record of a case that could not be measured: every number None, `reason` says why."""
    return {**dict.fromkeys(POWER_KEYS), "reason": reason}


def counter_delta(before: int, after: int, modulus: int) -> int:
    """after - before on a counter that wraps at `modulus`."""
    return after - before if after >= before else after + modulus - before


@dataclasses.dataclass
class Edge:
    """A counter update seen between two polls: its value, the midpoint time and half the gap between the polls."""

    value: int | None
    t: float
    half_gap_s: float


def wait_edge(source: Source, step: Callable[[], None], timeout_s: float) -> Edge | None:
    """Call step() (an op call, or a short sleep) until the energy counter changes; None on timeout."""
    before, t_before = source.energy_mj(), source.now()
    start = t_before
    while before is not None:
        step()
        value, t = source.energy_mj(), source.now()
        if value is None:
            return None
        if value != before:
            return Edge(value, (t_before + t) / 2, (t - t_before) / 2)
        if t - start > timeout_s:
            return None
        t_before = t
    return None


def infer_update_period(source: Source, *, max_probe_s: float = 1.0, edges: int = 6,
                        poll_s: float = 1e-3) -> float | None:
    """Median interval between counter changes while polling every poll_s (None: it never changed twice). At very
    low power the counter may skip updates; that overestimates the period, which only lengthens the window."""
    seen: list[float] = []
    start = source.now()
    while len(seen) < edges and source.now() - start < max_probe_s:
        edge = wait_edge(source, lambda: source.sleep(poll_s), max_probe_s - (source.now() - start))
        if edge is None:
            break
        seen.append(edge.t)
    gaps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


@dataclasses.dataclass
class Window:
    t0: float
    t1: float
    energy_j: float | None  # from the counter; None: use the sampled power
    half_gaps_s: float  # edge-time uncertainty, both ends
    invocations: int  # op invocations inside [t0, t1] (busy windows)
    ends: list[float] = dataclasses.field(default_factory=list)  # when each invocation ended (busy windows)

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


def _counter_window(source: Source, head: Edge | None, tail: Edge | None, n: int) -> Window | None:
    if head is None or tail is None or head.value is None or tail.value is None:
        return None
    energy = counter_delta(head.value, tail.value, source.energy_modulus) / 1e3
    seconds = tail.t - head.t
    if seconds <= 0 or energy / seconds > MAX_PLAUSIBLE_W:
        return None
    return Window(head.t, tail.t, energy, head.half_gap_s + tail.half_gap_s, n)


def _idle_window(source: Source, seconds: float, counter: bool, poll_s: float, timeout_s: float,
                 settle_s: float = 0.0) -> Window:
    pause = lambda: source.sleep(poll_s)
    source.sleep(settle_s)  # an averaged power reading still holds the last call's power
    head = wait_edge(source, pause, timeout_s) if counter else None
    t0 = head.t if head else source.now()
    source.sleep(max(0.0, seconds - (source.now() - t0)))
    tail = wait_edge(source, pause, timeout_s) if counter else None
    return _counter_window(source, head, tail, 0) or Window(t0, source.now(), None, 0.0, 0)


def _busy_window(source: Source, call: Callable[[], Any], seconds: float, ramp_s: float, counter: bool,
                 timeout_s: float) -> Window:
    n, ends = 0, []

    def step() -> None:
        nonlocal n
        call()
        n += 1
        ends.append(source.now())

    start = source.now()
    step()
    while source.now() - start < ramp_s:  # let the power settle before the window opens
        step()
    head = wait_edge(source, step, timeout_s) if counter else None
    t0, n0 = (head.t if head else source.now()), n
    while source.now() - t0 < seconds:
        step()
    tail = wait_edge(source, step, timeout_s) if counter else None
    window = _counter_window(source, head, tail, n - n0) or Window(t0, source.now(), None, 0.0, n - n0)
    window.ends = ends
    return window


def _power_of(window: Window, sampler: Sampler) -> tuple[float | None, float, str | None]:
    """(average W, uncertainty W, source) of a window: the counter when it has energy, else sampled power."""
    if window.energy_j is not None:
        avg = window.energy_j / window.seconds
        return avg, avg * window.half_gaps_s / window.seconds + 2e-3 / window.seconds, COUNTER
    avg, _ = integrate_power(sampler.between(window.t0, window.t1))
    if avg is None:
        return None, 0.0, None
    source = f"{sampler.power_source}-integrated"
    return avg, avg * 2 * sampler.period_s / window.seconds, source


def measure_energy(call: Callable[[], Any], device: Any = 0, *, calls_per_invocation: int = 1,
                   min_window_s: float = 1.0, period_multiple: float = 10.0, baseline_fraction: float = 0.5,
                   max_window_s: float = 30.0, flops: float | None = None, tokens: float | None = None,
                   source: Source | None = None, sample_period_s: float = 0.02, update_period_s: float | None = None,
                   retries: int = 0) -> dict[str, Any]:
    """Energy per call of `call` (which runs the op, or replays a graph of `calls_per_invocation` calls, and
    synchronizes). `flops`/`tokens` are per call. `retries` redoes a throttled window after an nvbench back-off.
    Returns the `power` record of a result (keys in POWER_KEYS; docs/telemetry.md)."""
    if source is None:
        source, why = open_source(device)
        if source is None:
            return null_power(why or "NVML unavailable")
    try:
        return _measure(call, source, calls_per_invocation, min_window_s, period_multiple, baseline_fraction,
                        max_window_s, flops, tokens, sample_period_s, update_period_s, retries)
    except Exception as exc:  # an energy reading must never fail a case
        return null_power(f"energy measurement failed: {type(exc).__name__}: {exc}".splitlines()[0])


def _measure(call, source, cpi, min_window_s, period_multiple, baseline_fraction, max_window_s, flops, tokens,
             sample_period_s, update_period_s, retries) -> dict[str, Any]:
    warnings: list[str] = [MIG_NOTE] if source.mig else []
    counter = source.energy_mj() is not None
    lag = AVERAGED_POWER_S if source.power_w()[1] == "nvml-power-usage" else 0.0
    period = update_period_s or source.update_period_s
    if counter and period is None:
        period = source.update_period_s = infer_update_period(source)
        if period is None:
            counter = False
            warnings.append("the energy counter did not change while polling; using sampled power instead")
    t = source.now()
    call()
    invocation_est = source.now() - t
    window_s = min(max(min_window_s, period_multiple * (period or 0.0), 10 * invocation_est), max_window_s)
    timeout = max(10 * (period or 0.0), 1.0) + 2 * invocation_est
    sampler = Sampler(source, sample_period_s).start()
    guard = ThrottleGuard(source)
    try:
        baseline_s = max(window_s * baseline_fraction, 3 * (period or 0.0))
        idle = _idle_window(source, baseline_s, counter, 1e-3, timeout, settle_s=lag)
        for attempt in range(1, retries + 2):
            busy = _busy_window(source, call, window_s, max(min(period or sample_period_s, 0.2 * window_s), lag),
                                counter, timeout)
            stats = summarize(sampler.between(busy.t0, busy.t1))
            findings = throttle_findings(stats["sm_mhz_median"], guard.default_sm_mhz, stats["reasons_mask"])
            if not findings or attempt > retries:
                break
            guard.wait()
    finally:
        sampler.stop()
    if counter and busy.energy_j is None:
        warnings.append("the energy counter stopped updating during the window; using sampled power instead")

    avg_w, unc_w, avg_source = _power_of(busy, sampler)
    idle_w, idle_unc_w, idle_source = _power_of(idle, sampler)
    if avg_w is not None and idle_w is not None and avg_source != idle_source:  # one meter for the subtraction
        sampled = [_power_of(dataclasses.replace(w, energy_j=None), sampler) for w in (busy, idle)]
        if sampled[0][0] is not None and sampled[1][0] is not None:
            (avg_w, unc_w, avg_source), (idle_w, idle_unc_w, idle_source) = sampled
            warnings.append("the energy counter covered only one of the idle baseline and the window: both powers "
                            f"are {avg_source}, so the subtraction uses one meter")
        else:
            idle_w = idle_unc_w = None
            warnings.append(f"the idle baseline ({idle_source}) and the window ({avg_source}) come from different "
                            "meters: no net energy per call")
    if avg_w is None:
        return {**null_power("no energy counter and no power reading on this GPU"), "missing": dict(source.missing)}
    out = null_power("")
    out.update(reason=None, avg_w=avg_w, uncertainty_w=unc_w, idle_w=idle_w, idle_uncertainty_w=idle_unc_w,
               window_s=busy.seconds, baseline_s=idle.seconds, calls_per_invocation=cpi,
               calls=busy.invocations * cpi, update_period_s=period if counter else None,
               invocation_s=busy.seconds / busy.invocations if busy.invocations else None,
               source=avg_source, attempts=attempt, warnings=warnings, missing=dict(source.missing),
               sources={"avg_w": avg_source, "idle_w": idle_source, "clocks": "nvml-sampled"},
               sampling=_sampling(busy, sampler))
    aliased = out["sampling"]["aliased"]
    if aliased:
        cycle = busy.seconds / busy.invocations
        warnings.append(f"sampled power saw {out['sampling']['phase_coverage']:.0%} of the op's {1e3 * cycle:.3g} ms "
                        f"invocation cycle (a sample every {1e3 * sampler.period_s:.0f} ms, in step with it): its "
                        "average is aliased" + ("" if avg_source == COUNTER else f" and is avg_w ({avg_source})"))
    if busy.invocations:
        gross = avg_w * busy.seconds / busy.invocations / cpi
        out["energy_j_per_call_gross"] = gross
        if idle_w is not None:
            net = (avg_w - idle_w) * busy.seconds / busy.invocations / cpi
            out.update(net_w=avg_w - idle_w, energy_j_per_call=net, rel_uncertainty=(unc_w + idle_unc_w) / max(
                abs(avg_w - idle_w), 1e-9) + 1 / busy.invocations)
            out["energy_j_per_call_uncertainty"] = abs(net) * out["rel_uncertainty"]
            if net <= 0 or out["rel_uncertainty"] >= 1.0:  # no power measurably above idle: a J/call (and the
                out["energy_j_per_call"] = out["energy_j_per_call_uncertainty"] = None  # GFLOP/J from it) made up
                warnings.append(f"net power {avg_w - idle_w:+.2f} W (±{unc_w + idle_unc_w:.2f} W) is not measurably "
                                "above that of the idle baseline: no net energy per call")
        out.update(_efficiency(flops, tokens, out["energy_j_per_call"], gross))

    instant, _ = integrate_power(sampler.between(busy.t0, busy.t1))
    if avg_source == COUNTER and instant is not None:
        rel = (instant - avg_w) / avg_w if avg_w else None
        out["cross_check"] = {"avg_w": instant, "rel_diff": rel, "samples": stats["samples"],
                              "source": f"{sampler.power_source}-integrated"}
        out["sources"]["cross_check"] = out["cross_check"]["source"]
        if rel is not None and abs(rel) > DISAGREE_WARN and not aliased:
            warnings.append(f"energy counter ({avg_w:.1f} W) and integrated {sampler.power_source} "
                            f"({instant:.1f} W) disagree by {100 * rel:+.0f}%")
    out.update(sm_mhz_min=stats["sm_mhz_min"], sm_mhz_median=stats["sm_mhz_median"],
               mem_mhz_median=stats["mem_mhz_median"], default_sm_mhz=guard.default_sm_mhz,
               temp_c_max=stats["temp_c_max"], power_limit_w=source.power_limit_w(),
               default_power_limit_w=source.default_power_limit_w(), throttle_reasons=stats["reasons"],
               throttle=findings, throttled=bool(findings))
    return out


def _sampling(busy: Window, sampler: Sampler) -> dict[str, Any]:
    """How the busy window was sampled: period, samples with a power reading, the share of the op's invocation
    cycle their phases cover, and whether that makes their average aliased (never for the ~1 s averaged reading,
    which smooths any cycle shorter than its average)."""
    times = [r["t"] for r in sampler.between(busy.t0, busy.t1) if r.get("power_w") is not None]
    coverage = phase_coverage(times, busy.ends)
    cycle = busy.seconds / busy.invocations if busy.invocations else 0.0
    smoothed = sampler.power_source == "nvml-power-usage" and cycle < AVERAGED_POWER_S
    aliased = (coverage is not None and len(times) >= MIN_PHASE_SAMPLES and coverage < ALIASED_COVERAGE
               and not smoothed)
    return {"period_s": sampler.period_s, "samples": len(times), "phase_coverage": coverage, "aliased": aliased}


def _efficiency(flops: float | None, tokens: float | None, net_j: float | None, gross_j: float) -> dict[str, Any]:
    def ratio(num: float | None, den: float | None) -> float | None:
        return num / den if num is not None and den else None

    gflop = flops / 1e9 if flops else None
    return {"gflop_per_j": ratio(gflop, net_j) if net_j and net_j > 0 else None,
            "gflop_per_j_gross": ratio(gflop, gross_j),
            "j_per_token": ratio(net_j, tokens) if tokens and net_j and net_j > 0 else None,
            "j_per_token_gross": ratio(gross_j, tokens) if tokens else None}
