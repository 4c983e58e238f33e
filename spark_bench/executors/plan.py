"""`spark-bench run --dry-run`: the case list and an estimate of the sweep's duration from stored results.

A case's estimate is the median duration_s of the same case (case_id) in results/*/results.jsonl; else the median of
its op and backend on the same device type, then on any device; on a CPU, else a reference machine's quick sweep
(executors/reference.py; for the default quick sweep it says 1 min 17 s of case time, where the flat default said 26
min and the sweep took 1 min 31 s warm, 2026-12-04); else DEFAULT_CASE_S. Skipped cases cost nothing.

Interpreted cases (Triton on a CPU, TRITON_INTERPRET=1) take time in proportion to the work: the interpreter runs each
program instance in Python, and one call of a model-size point can take minutes. Their estimate without a stored twin
scales the largest stored case of the op and backend by the cost model's bytes (never below the op's median), and
without any history assumes INTERPRETED_BYTES_PER_S.
"""

from __future__ import annotations

import collections
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spark_bench.executors.reference import CPU_QUICK, SOURCE
from spark_bench.sweep import Case

DEFAULT_CASE_S = 5.0
NEWEST_RUNS = 50  # run directories read for the estimates
# Cost-model bytes per second of case time of an interpreted Triton case: measured on a 2-core EPYC, the KDA kernels
# ran at 16-325 KB/s (kda.gate fastest, the chunked and recurrent scans slowest); the slow end, so never optimistic.
INTERPRETED_BYTES_PER_S = 16e3


def stored_durations(root: Path, newest: int = NEWEST_RUNS) -> dict[Any, list[float]]:
    """duration_s of every case stored in the `newest` run directories under `root` (by the journal's mtime: a
    results tree of years of nightlies is not parsed at each sweep's start), keyed by case_id, by (op, backend,
    device type) and by (op, backend)."""
    found: dict[Any, list[float]] = collections.defaultdict(list)
    for path in _newest(Path(root).glob("*/results.jsonl"), newest):
        try:
            lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()  # a damaged byte: that line
        except OSError:
            continue
        for line in lines:
            try:
                rec = json.loads(line)
                seconds = float(rec["duration_s"])
                keys = (rec["case_id"], (rec["op"], rec["backend"], str(rec["device"]).partition(":")[0]),
                        (rec["op"], rec["backend"]))
                hash(keys)  # an op or case id that is a list or an object (a foreign or damaged file)
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
                continue  # a torn line, a failure without duration, a foreign file, a number beyond a float
            if not math.isfinite(seconds) or seconds < 0:
                continue
            if rec.get("status") != "skipped":
                for key in keys:
                    found[key].append(seconds)
                nbytes = (rec.get("cost") or {}).get("bytes") if isinstance(rec.get("cost"), dict) else None
                if isinstance(nbytes, (int, float)) and 0 < nbytes < 1e300:  # for scaling an interpreted case by
                    found[("bytes", *keys[1])].append((float(nbytes), seconds))  # its work
    return found


def _newest(paths: Any, count: int) -> list[Path]:
    dated = []
    for path in paths:
        try:
            dated.append((path.stat().st_mtime, path))
        except OSError:
            continue
    return [p for _, p in sorted(dated, reverse=True)[:count]]


def estimate(case: Case, stored: dict[Any, list[float]], interpreted_bytes: float | None = None) -> tuple[float, str]:
    """(seconds, where the number comes from: case / op+backend / default / skipped); `interpreted_bytes`: the cost
    model's bytes of a case that runs in the Triton interpreter (its time grows with them), None otherwise."""
    if case.skip:
        return 0.0, "skipped"
    if stored.get(case.case_id):
        return statistics.median(stored[case.case_id]), "case"
    dev = case.device.partition(":")[0]
    for key in ((case.op, case.backend, dev), (case.op, case.backend)):
        if stored.get(key):
            sized = stored.get(("bytes", case.op, case.backend, dev))
            return _scaled(statistics.median(stored[key]), max(sized) if sized else None, interpreted_bytes,
                           "op+backend")
    known = CPU_QUICK.get((case.op, case.backend)) if dev == "cpu" else None
    if known:  # another machine's quick CPU sweep: better than a flat default by an order of magnitude
        return _scaled(known[0], known[1:], interpreted_bytes, "reference")
    if interpreted_bytes:
        return max(DEFAULT_CASE_S, interpreted_bytes / INTERPRETED_BYTES_PER_S), "interpreted: from its bytes"
    return DEFAULT_CASE_S, "default"


def _scaled(median: float, largest: tuple[float, float] | None, interpreted_bytes: float | None,
            source: str) -> tuple[float, str]:
    """The median, or for an interpreted case of more bytes than the `largest` (bytes, seconds) seen, that case's time
    scaled by the bytes (never below the median)."""
    if interpreted_bytes and largest and 0 < largest[0] < interpreted_bytes:
        ref_bytes, ref_s = largest
        return max(median, ref_s * interpreted_bytes / ref_bytes), \
            f"interpreted: {source} x{interpreted_bytes / ref_bytes:.3g} the bytes"
    return median, source


def interpreted_bytes(case: Case) -> float | None:
    """The cost model's bytes when the case's backend runs interpreted on its device (its labels say so), else None."""
    try:
        from spark_bench.registry import registry

        op = registry().get(case.op)
        if "interpreted" not in op.backends[case.backend].labels_for(case.device):
            return None
        return float(op.cost(case.params, case.dtype).bytes)
    except Exception:  # noqa: BLE001 - a plugin's broken cost model or labels: the plain estimate stands
        return None


def case_estimates(cases: Sequence[Case], results_root: Path,
                   sources: collections.Counter[str] | None = None) -> dict[str, float]:
    """Each case's estimated seconds (case_id -> s), as `--dry-run` prints them: the weights of a sweep's ETA.
    `sources` (optional) counts where they came from (case, op+backend, reference, default, skipped, ...)."""
    stored = stored_durations(results_root)
    found = {}
    for c in cases:
        found[c.case_id], source = estimate(c, stored, None if c.skip else interpreted_bytes(c))
        if sources is not None:
            sources[source.partition(":")[0]] += 1
    return found


def fmt_duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h {m:02d}m {s:02d}s" if hours else f"{m}m {s:02d}s" if m else f"{seconds:.1f}s"


def to_run_text(todo: Sequence[Case]) -> str:
    """'18 to run, 6 skipped' of the cases left (a skipped backend is recorded, never run)."""
    skipped = sum(bool(c.skip) for c in todo)
    return f"{len(todo) - skipped} to run" + (f", {skipped} skipped" if skipped else "")


def interleave_ops(cases: Sequence[Case]) -> list[Case]:
    """The cases with their ops' parameter points taken in turn (op A's first point, op B's first, ..., then each op's
    second), each point's backends kept together and every op's own order kept: under `run --budget` the time covers
    every op's first points instead of the first ops' every point (the default GPU sweep is op after op)."""
    per_op: dict[str, dict[str, list[Case]]] = {}
    for case in cases:
        per_op.setdefault(case.op, {}).setdefault(case.group, []).append(case)
    queues = [list(points.values()) for points in per_op.values()]
    out: list[Case] = []
    for rank in range(max(map(len, queues), default=0)):
        for points in queues:
            if rank < len(points):
                out.extend(points[rank])
    return out


def print_plan(cases: Sequence[Case], todo: Sequence[Case], executor_text: str, workers: int | None,
               results_root: Path, echo=print, budget_s: float | None = None) -> float:
    """Print the cases to run with their estimates and the total (and, with `budget_s`, how many fit in it);
    returns the estimated wall seconds."""
    stored = stored_durations(results_root)
    device = cases[0].device if cases else "?"
    if budget_s is not None:  # the order a budgeted run takes (Runner.run)
        todo = [*[c for c in todo if c.skip], *interleave_ops([c for c in todo if not c.skip])]
    echo(f"spark-bench dry run: {len(cases)} cases on {device}, {to_run_text(todo)}, executor {executor_text}")
    sources: collections.Counter[str] = collections.Counter()
    per_op: dict[str, list[float]] = {}  # op -> [cases to run, skipped, seconds]
    total = 0.0
    ends: list[float] = []  # the estimated case time when each case to run ends, in sweep order
    interpreted = 0
    for case in todo:
        nbytes = None if case.skip else interpreted_bytes(case)
        interpreted += nbytes is not None
        seconds, source = estimate(case, stored, nbytes)
        sources[source.partition(":")[0]] += 1
        total += seconds
        if not case.skip:
            ends.append(total)
        row = per_op.setdefault(case.op, [0, 0, 0.0])
        row[1 if case.skip else 0] += 1
        row[2] += seconds
        params = " ".join(f"{k}={v}" for k, v in case.params.items())
        note = f"skipped: {case.skip}" if case.skip else f"~{seconds:.2f}s ({source})"
        echo(f"  {case.op} {case.backend} {params} {case.dtype}  {note}")
    if len(per_op) > 1:  # a long list's summary where it is read: at its end
        echo("per op:")
        width = max(map(len, per_op))
        for op, (run, skipped, seconds) in sorted(per_op.items(), key=lambda kv: -kv[1][2]):
            echo(f"  {op:{width}s}  {run:6d} to run  {skipped:5d} skipped  ~{fmt_duration(seconds)}")
    basis = ", ".join(f"{n} from {s}" for s, n in sources.items()) or "nothing to run"
    echo(f"estimate: {fmt_duration(total)} of case time ({basis}; default {DEFAULT_CASE_S:g}s per case without "
         "history)")
    if sources.get("reference"):
        echo(f"reference: {SOURCE} (no results of this machine's own under {results_root} for those cases)")
    if interpreted:
        echo(f"{interpreted} case(s) run in the Triton interpreter (CPU, TRITON_INTERPRET=1): their time grows with "
             f"the work, so their estimates are scaled by the cost model's bytes ({INTERPRETED_BYTES_PER_S / 1e3:g} "
             "KB/s without history); model-size points can take minutes per call")
    wall = total / (workers or 1)
    if workers and workers > 1:
        echo(f"estimated wall time on {workers} workers: {fmt_duration(wall)}")
    elif workers is None:
        echo("estimated wall time: the case time divided by the number of GPUs of the Ray cluster")
    if budget_s is not None:
        fit = sum(end / (workers or 1) <= budget_s for end in ends)
        echo(f"--budget {fmt_duration(budget_s)}: about {fit} of {len(ends)} cases fit by these estimates (in the "
             "order listed: the ops' points in turn; a point begun is finished)")
    return wall
