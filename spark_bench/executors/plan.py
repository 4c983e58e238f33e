"""`spark-bench run --dry-run`: the case list and an estimate of the sweep's duration from stored results.

A case's estimate is the median duration_s of the same case (case_id) in results/*/results.jsonl; else the median of
its op and backend on the same device type, then on any device; else DEFAULT_CASE_S. Skipped cases cost nothing.
"""

from __future__ import annotations

import collections
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spark_bench.sweep import Case

DEFAULT_CASE_S = 5.0


def stored_durations(root: Path) -> dict[Any, list[float]]:
    """duration_s of every stored case, keyed by case_id, by (op, backend, device type) and by (op, backend)."""
    found: dict[Any, list[float]] = collections.defaultdict(list)
    for path in sorted(Path(root).glob("*/results.jsonl")):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                rec = json.loads(line)
                seconds = float(rec["duration_s"])
                keys = (rec["case_id"], (rec["op"], rec["backend"], str(rec["device"]).partition(":")[0]),
                        (rec["op"], rec["backend"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a torn line, a failure without duration, a foreign file
            if rec.get("status") != "skipped":
                for key in keys:
                    found[key].append(seconds)
    return found


def estimate(case: Case, stored: dict[Any, list[float]]) -> tuple[float, str]:
    """(seconds, where the number comes from: case / op+backend / default / skipped)."""
    if case.skip:
        return 0.0, "skipped"
    for key, source in ((case.case_id, "case"), ((case.op, case.backend, case.device.partition(":")[0]), "op+backend"),
                        ((case.op, case.backend), "op+backend")):
        if stored.get(key):
            return statistics.median(stored[key]), source
    return DEFAULT_CASE_S, "default"


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h {m:02d}m {s:02d}s" if hours else f"{m}m {s:02d}s" if m else f"{seconds:.1f}s"


def print_plan(cases: Sequence[Case], todo: Sequence[Case], executor_text: str, workers: int | None,
               results_root: Path, echo=print) -> float:
    """Print the cases to run with their estimates and the total; returns the estimated wall seconds."""
    stored = stored_durations(results_root)
    device = cases[0].device if cases else "?"
    echo(f"spark-bench dry run: {len(cases)} cases on {device}, {len(todo)} to run, executor {executor_text}")
    sources: collections.Counter[str] = collections.Counter()
    total = 0.0
    for case in todo:
        seconds, source = estimate(case, stored)
        sources[source] += 1
        total += seconds
        params = " ".join(f"{k}={v}" for k, v in case.params.items())
        note = f"skipped: {case.skip}" if case.skip else f"~{seconds:.2f}s ({source})"
        echo(f"  {case.op} {case.backend} {params} {case.dtype}  {note}")
    basis = ", ".join(f"{n} from {s}" for s, n in sources.items()) or "nothing to run"
    echo(f"estimate: {_duration(total)} of case time ({basis}; default {DEFAULT_CASE_S:g}s per case without history)")
    wall = total / (workers or 1)
    if workers and workers > 1:
        echo(f"estimated wall time on {workers} workers: {_duration(wall)}")
    elif workers is None:
        echo("estimated wall time: the case time divided by the number of GPUs of the Ray cluster")
    return wall
