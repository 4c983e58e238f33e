"""Feeding spark-bench timings into pytest-benchmark: a timer that replays our samples, and fingerprint comparison.

pytest-benchmark's `benchmark.pedantic(target, rounds=n)` reads its timer twice per round (before and after the
target). `ReplayTimer` answers 0.0 then the next sample (seconds), so round i lasts exactly sample i and
pytest-benchmark's statistics, JSON, saved runs and --benchmark-compare-fail all see spark-bench's device times.
The timer reaches the fixture through the item's `benchmark(timer=...)` marker, pytest-benchmark's public way to
choose a timer; its name (`spark_bench.cuda-event`, ...) lands in the JSON's `options.timer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest


class ReplayTimer:
    """A pytest-benchmark timer that replays preloaded samples (seconds), one per timed round."""

    def __init__(self) -> None:
        self.__name__ = "spark_bench"
        self._samples: list[float] = []
        self._next = 0
        self._in_round = False

    def load(self, samples_s: Sequence[float], timer_name: str) -> None:
        self._samples, self._next, self._in_round = [float(s) for s in samples_s], 0, False
        self.__name__ = f"spark_bench.{timer_name}"

    def __call__(self) -> float:
        if not self._in_round:
            self._in_round = True
            return 0.0
        self._in_round = False
        if self._next >= len(self._samples):
            raise RuntimeError("ReplayTimer: more rounds than loaded samples")
        self._next += 1
        return self._samples[self._next - 1]

    @property
    def exhausted(self) -> bool:
        return self._next == len(self._samples)


def attach_replay_timer(item: pytest.Item) -> ReplayTimer:
    """Give the item a fresh ReplayTimer through its `benchmark` marker, keeping the marker's other settings."""
    existing = item.get_closest_marker("benchmark")
    timer = ReplayTimer()
    item.add_marker(pytest.mark.benchmark(**{**(existing.kwargs if existing else {}), "timer": timer}), append=False)
    return timer


def replay_timer(item: pytest.Item) -> ReplayTimer:
    marker = item.get_closest_marker("benchmark")
    timer = marker.kwargs.get("timer") if marker else None
    if not isinstance(timer, ReplayTimer):
        raise RuntimeError(f"{item.nodeid}: its benchmark marker's timer is not spark-bench's (was it overridden?)")
    return timer


def feed(benchmark: Any, item: pytest.Item, timing: dict[str, Any]) -> None:
    """Make spark-bench's timing record (samples in us) the benchmark's statistics."""
    timer = replay_timer(item)
    if getattr(benchmark, "_timer", timer) is not timer:
        raise RuntimeError("pytest-benchmark did not take the timer of the benchmark marker")
    samples_s = [s * 1e-6 for s in timing["samples"]]
    timer.load(samples_s, timing["timer"])
    benchmark.pedantic(_nothing, rounds=len(samples_s), iterations=1, warmup_rounds=0)
    if benchmark.enabled and not timer.exhausted:
        raise RuntimeError("pytest-benchmark did not replay every spark-bench sample")


def _nothing() -> None:
    return None


def not_timed(benchmark: Any) -> None:
    """A case that failed before timing: keep pytest-benchmark from warning that its fixture went unused."""
    if getattr(benchmark, "_mode", "absent") is None:
        benchmark._mode = "spark-bench: failed before timing"


TIMING_FIELDS = ("timer", "converged", "stop_reason", "rel_ci", "ci_low", "ci_high", "l2_flush", "calls_per_sample",
                 "setup_s")


def timing_info(timing: dict[str, Any]) -> dict[str, Any]:
    """The extra_info fields of a spark-bench timing record (us): how it was timed, its median and CI, its count."""
    info = {k: timing.get(k) for k in TIMING_FIELDS}
    info["median_us"], info["samples"] = timing.get("median"), timing.get("n")
    return info


def fingerprint_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """None when both fingerprints identify the same device and stack (and the same weights, with
    --spark-weights), else what differs (sections that are not objects read as empty)."""
    wa, wb = _weights_id(saved), _weights_id(current)
    weights = None if wa == wb else f"weights {wa or 'random'} -> {wb or 'random'}"
    if saved.get("fingerprint_id") == current.get("fingerprint_id"):
        return weights
    from spark_bench.fingerprint import stack_difference  # imports torch: only when the fingerprints differ

    return stack_difference(saved, current) + (f", {weights}" if weights else "")


def _section(fp: dict[str, Any], name: str) -> dict[str, Any]:
    value = fp.get(name)
    return value if isinstance(value, dict) else {}


def _weights_id(fp: dict[str, Any]) -> str | None:
    """The weights a fingerprint was measured on (docs/weights.md): file, layer and content hashes."""
    w = fp.get("weights")
    if not w:
        return None
    if not isinstance(w, dict):
        return f"malformed ({w!r})"
    routing = _section(w, "routing").get("sha256")
    acts = _section(w, "activations").get("sha256")
    return (f"{w.get('path')} layer {w.get('layer')} sha256 {str(w.get('sha256'))[:12]}"
            + (f" routing {str(routing)[:12]}" if routing else "") + (f" activations {str(acts)[:12]}" if acts else ""))
