"""Loaded runs and the views the report and `compare` build on: case keys, swept axes, peaks, per-op summaries."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from spark_bench.results import ResultsError, is_number, load_run
from spark_bench.telemetry.roofline import flops_peak

__all__ = ["ResultsError", "RunData", "load_runs"]

# Axes a sweep usually runs along, in order of preference when two have as many values.
SWEEP_PREFERENCE = ("tokens", "seq_len", "batch", "rows", "cols", "experts", "hidden", "inter", "heads", "topk")
FAILED = ("mismatch", "error", "crash", "timeout", "oom")
NOT_A_CONTENDER = ("reference",)  # the fp32 reference is timed for context, never "the fastest backend"
MAX_BOX_SAMPLES = 256  # raw samples embedded per case for the box plots


@dataclasses.dataclass
class RunData:
    path: Path
    run: dict[str, Any]
    results: list[dict[str, Any]]
    label: str = ""

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.run.get("fingerprint") or {}

    @property
    def device_name(self) -> str:
        return str((self.fingerprint.get("device") or {}).get("name") or "unknown device")

    @property
    def on_cpu(self) -> bool:
        return (self.fingerprint.get("device") or {}).get("type") == "cpu"

    @property
    def device_text(self) -> str:
        """'NVIDIA H200', or 'CPU (AMD EPYC)': a CPU run's times are host code, never a GPU kernel's."""
        return f"CPU ({self.device_name})" if self.on_cpu else self.device_name


def load_runs(run_dirs: Iterable[str | Path]) -> list[RunData]:
    """Load each run directory; raises ResultsError (one line) on a missing or malformed one."""
    runs = []
    for d in run_dirs:
        path = Path(d)
        run, results = load_run(path)
        latest = {r.get("case_id"): r for r in results}  # a resumed case keeps its last record
        for r in latest.values():  # a tune's candidates are backends of their own in every table and chart
            r["backend"] = record_backend(r)
        runs.append(RunData(path, run, list(latest.values())))
    _label_runs(runs)
    return runs


def record_backend(r: dict[str, Any]) -> str:
    """The backend of a stored case, with the configs a `tune` forced on it, 'triton[BT=32,num_warps=4]', or its
    re-timing, 'triton (repeat 1)'."""
    sources = r.get("config_source") if isinstance(r.get("config_source"), dict) else {}
    configs = r.get("config") if isinstance(r.get("config"), dict) else {}
    forced = [c for k, c in configs.items() if sources.get(k) == "candidate" and isinstance(c, dict)]
    return labelled_backend(str(r.get("backend")), forced, r.get("repeat"))


def labelled_backend(backend: str, forced: Sequence[Any], repeat: Any = 0) -> str:
    """`backend`, then the configs forced on it and which re-timing it is: 'triton[BK=64,num_warps=4] (repeat 1)'."""
    if forced:
        from spark_bench.tune.space import config_id

        backend += f"[{';'.join(config_id(c) for c in forced)}]"
    return backend + (f" (repeat {repeat})" if repeat else "")


def _label_runs(runs: Sequence[RunData]) -> None:
    """Short, distinct labels: the device when devices differ, else the commit, else the run id."""
    if len(runs) == 1:
        runs[0].label = str(runs[0].run.get("run_id") or runs[0].path.name)
        return
    candidates = [
        [r.device_name for r in runs],
        [str((r.fingerprint.get("git") or {}).get("commit") or "?")[:8] for r in runs],
        [str(r.run.get("run_id") or r.path.name) for r in runs],
    ]
    for labels in candidates:
        if len(set(labels)) == len(labels):
            break
    else:
        labels = [f"{i + 1}:{r.path.name}" for i, r in enumerate(runs)]
    for r, label in zip(runs, labels, strict=True):
        r.label = label


# --- cases -----------------------------------------------------------------------------------------------------------
def params_json(params: dict[str, Any]) -> str:
    return json.dumps(params or {}, sort_keys=True, separators=(",", ":"), default=str)


def params_text(params: dict[str, Any], skip: Iterable[str] = ()) -> str:
    skip = set(skip)
    return " ".join(f"{k}={v}" for k, v in sorted((params or {}).items()) if k not in skip) or "-"


def select_runs(runs: Sequence[RunData], ops: tuple[str, ...] = (), backends: tuple[str, ...] = ()) -> None:
    """Keep, in place, only the cases the op and backend globs select (all for none); ResultsError (one line,
    naming what the runs have) when they select nothing."""
    from spark_bench.selection import record_matches, select_records

    if ops or backends:
        select_records([r for run in runs for r in run.results], ops=ops, backends=backends)
        for run in runs:
            run.results = [r for r in run.results if record_matches(r, ops=ops, backends=backends)]


def match_key(r: dict[str, Any]) -> tuple[str, str, str, str]:
    """How a case is recognised in another run: (op, backend, params, dtype); the device is the run's business."""
    return (r.get("op", "?"), r.get("backend", "?"), params_json(r.get("params")), str(r.get("dtype")))


def timers(results: Iterable[dict[str, Any]]) -> list[str]:
    """The timers of the timed cases ('cuda-event', 'cuda-graph', 'cpu-perf_counter'), sorted."""
    return sorted({str(t.get("timer") or "?") for r in results for t in [timing(r)] if t})


def timed_on(runs: Sequence[RunData], results: Iterable[dict[str, Any]]) -> str:
    """Where and how `results` were timed: 'on CPU (AMD EPYC) · timer cpu-perf_counter'; runs of different machines
    (device fingerprints) on one chart say so."""
    devices = list(dict.fromkeys(run.device_text for run in runs))
    machines = {run.fingerprint.get("fingerprint_id") for run in runs}
    used = timers(results)
    return (f"on {' and '.join(devices)}" + (" (different machines on one axis)" if len(machines) > 1 else "")
            + f" · timer {', '.join(used) or 'none'}" + (" (mixed: see each point)" if len(used) > 1 else ""))


def timing(r: dict[str, Any]) -> dict[str, Any] | None:
    t = r.get("timing")
    return t if r.get("status") == "ok" and isinstance(t, dict) and is_number(t.get("median")) else None


def untimed_status(r: dict[str, Any]) -> str:
    """Why a case has no usable timing, as every part of the report names it: its status, or "no timing" for a case
    that checked ok but stored no usable timing (the legend and the latency chart's ✕ marks say the same)."""
    return "no timing" if r.get("status") == "ok" else str(r.get("status"))


def time_unit(records: Iterable[dict[str, Any] | None]) -> str:
    """The time unit of the first timed record ("us" when none is timed or it states none)."""
    return next((t.get("unit") or "us" for r in records if r for t in [timing(r)] if t), "us")


def interpreted_backends(results: Iterable[dict[str, Any]]) -> set[str]:
    """Backends with a case labelled `interpreted` (Triton on CPU): their times measure the interpreter."""
    return {str(r.get("backend")) for r in results if "interpreted" in (r.get("labels") or [])}


def number(x: Any) -> float | None:
    return float(x) if is_number(x) else None


def by_op(results: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    ops: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        ops[str(r.get("op", "?"))].append(r)
    return dict(sorted(ops.items()))


def swept_axis(results: Sequence[dict[str, Any]]) -> str | None:
    """The numeric axis with the most distinct values (ties broken by SWEEP_PREFERENCE), or None; only an axis every
    case has a number for (a case without it could not be placed on the chart)."""
    values: dict[str, set] = defaultdict(set)
    for r in results:
        for k, v in (r.get("params") or {}).items():
            if is_number(v):
                values[k].add(v)
    everywhere = [k for k in values if all(is_number((r.get("params") or {}).get(k)) for r in results)]
    multi = [k for k in everywhere if len(values[k]) > 1]
    if not multi:
        return None
    rank = {k: i for i, k in enumerate(SWEEP_PREFERENCE)}
    return max(multi, key=lambda k: (len(values[k]), -rank.get(k, len(rank)), k))


def natural_key(r: dict[str, Any]) -> tuple:
    """Order cases by their parameters with numbers as numbers (heads=4 before heads=16), then dtype."""
    items = sorted((r.get("params") or {}).items())
    key = tuple((k, (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))) for k, v in items)
    return key, str(r.get("dtype"))


def combo_key(r: dict[str, Any], swept: str | None) -> str:
    """Every parameter but the swept one, plus the dtype: one chart per combination."""
    return f"{params_text(r.get('params') or {}, skip=[swept] if swept else [])} {r.get('dtype')}".strip()


def log_scale(values: Iterable[float]) -> bool:
    """Log axis when positive values span two decades or more."""
    v = [x for x in values if is_number(x) and x > 0]
    return bool(v) and max(v) / min(v) >= 100.0


# --- roofline --------------------------------------------------------------------------------------------------------
def peaks(run: dict[str, Any], dtype: str | None = None) -> dict[str, dict[str, Any]]:
    """{"measured"|"datasheet": {"gbps": .., "tflops": ..}} from run["roofline"], whichever are known.

    Accepted spellings: bandwidth as `gbps`/`bw_gbps`/`bandwidth_gbps` (GB/s) or `bytes_per_s`; compute as
    `tflops_<dtype>`/`tflops` (TFLOP/s, a number or a {dtype: number} map) or `flops_per_s`.
    From a {dtype: number} map, the dtype's ceiling `flops_peak` gives (its own peak, or fp32's where that is higher,
    as on CPUs without native bf16): the roof a chart draws and the one its percentages divide by are the same.
    """
    out: dict[str, dict[str, Any]] = {}
    for source, d in ((run.get("roofline") or {}) or {}).items():
        if not isinstance(d, dict):
            continue
        p: dict[str, Any] = {}
        for k in ("gbps", "bw_gbps", "bandwidth_gbps"):
            if is_number(d.get(k)):
                p["gbps"] = float(d[k])
                break
        else:
            if is_number(d.get("bytes_per_s")):
                p["gbps"] = float(d["bytes_per_s"]) / 1e9
        for k in (f"tflops_{dtype}", "tflops"):
            v = d.get(k)
            if isinstance(v, dict):
                own = v.get(dtype)
                v = (flops_peak(v, str(dtype)) if dtype in v
                     else max((x for x in v.values() if is_number(x)), default=None))
                if is_number(own) and is_number(v) and v != own:
                    p["rate_of"] = "fp32"  # a 16-bit dtype whose fp32 rate is the higher: the ceiling is that
            if is_number(v):
                p["tflops"] = float(v)
                break
        else:
            if is_number(d.get("flops_per_s")):
                p["tflops"] = float(d["flops_per_s"]) / 1e12
        if p:
            out[str(source)] = p
    return out


def roofline_pct(r: dict[str, Any], run: dict[str, Any]) -> tuple[float, str] | None:
    """Best fraction of a roof this case reached, as (percent, "BW measured"...): the stored percentages first, else
    GB/s and TFLOP/s against the run's peaks; per roof the measured peak is preferred over the datasheet."""
    stored = r.get("roofline") or {}
    found = []
    for kind, name in (("bw", "BW"), ("flops", "FLOP/s")):
        for source in ("measured", "datasheet"):
            v = number(stored.get(f"pct_{kind}_{source}"))
            if v:  # 0: no work of that kind (or, in runs before 2026-12-04, a percentage rounded to 2 decimals)
                found.append((v, f"{name} {source}"))
                break
    if not found:
        known = peaks(run, r.get("dtype"))
        for key, name, got in (("gbps", "BW", number(r.get("gbps"))), ("tflops", "FLOP/s", number(r.get("tflops")))):
            for source in ("measured", "datasheet"):
                peak = (known.get(source) or {}).get(key)
                if got and peak:  # no FLOPs (or no bytes): no roof of that kind
                    found.append((100.0 * got / peak, f"{name} {source}"))
                    break
    return max(found) if found else None


# --- summaries -------------------------------------------------------------------------------------------------------
def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def baseline_twins(results: Sequence[dict[str, Any]], baseline: str) -> dict[int, dict[str, Any]]:
    """id(result) -> the baseline's case of the same params and dtype, for timed cases whose twin was timed too."""
    def key(r: dict[str, Any]) -> tuple[str, str]:
        return params_json(r.get("params")), str(r.get("dtype"))

    base = {key(r): r for r in results if timing(r) and r.get("backend") == baseline}
    return {id(r): base[key(r)] for r in results if timing(r) and key(r) in base}


def speedups(results: Sequence[dict[str, Any]], baseline: str,
             twins: dict[int, dict[str, Any]] | None = None) -> dict[int, float]:
    """id(result) -> baseline median / this median, for timed cases whose baseline twin was timed too (`twins`:
    baseline_twins(results, baseline), when the caller has it)."""
    twins = baseline_twins(results, baseline) if twins is None else twins
    return {id(r): timing(twins[id(r)])["median"] / timing(r)["median"] for r in results
            if id(r) in twins and timing(r)["median"] > 0 and timing(twins[id(r)])["median"]}


def op_summary(op: str, results: Sequence[dict[str, Any]], run: dict[str, Any], baseline: str) -> dict[str, Any]:
    """Fastest correct backend (geomean speedup over the baseline, else most wins), its best roofline %, counts."""
    counts: dict[str, int] = defaultdict(int)
    for r in results:
        counts[str(r.get("status"))] += 1
    sp = speedups(results, baseline)
    per_backend: dict[str, list[float]] = defaultdict(list)
    for r in results:
        if id(r) in sp and r.get("backend") not in NOT_A_CONTENDER:
            per_backend[r["backend"]].append(sp[id(r)])
    summary: dict[str, Any] = {"op": op, "counts": dict(counts), "cases": len(results), "baseline": baseline}
    if per_backend:
        ranked = sorted(per_backend, key=lambda b: (geomean(per_backend[b]), b), reverse=True)
        xs = per_backend[ranked[0]]
        summary.update(fastest=ranked[0], speedup=geomean(xs), speedup_min=min(xs), speedup_max=max(xs),
                       compared=len(xs))
        if len(ranked) > 1:
            summary["runner_up"] = (ranked[1], geomean(per_backend[ranked[1]]))
    else:
        wins: dict[str, int] = defaultdict(int)
        fastest_at: dict[str, tuple[float, str]] = {}
        for r in results:
            t = timing(r)
            if t and r.get("backend") not in NOT_A_CONTENDER:
                key = params_json(r.get("params")) + str(r.get("dtype"))
                fastest_at[key] = min(fastest_at.get(key, (math.inf, "")), (t["median"], r["backend"]))
        for _, b in fastest_at.values():
            wins[b] += 1
        if wins:
            best = max(wins, key=lambda b: (wins[b], b))
            summary.update(fastest=best, wins=wins[best], shapes=len(fastest_at))
    if summary.get("fastest"):
        pcts = [p for r in results if r.get("backend") == summary["fastest"] and timing(r)
                for p in [roofline_pct(r, run)] if p]
        if pcts:
            summary["roofline"] = max(pcts)
    return summary


def problems(results: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(failed cases, one per case; skipped cases grouped by (op, backend, reason) with a count)."""
    failed, skipped = [], {}
    for r in results:
        status = r.get("status")
        if status in FAILED or (status not in ("ok", "skipped")):
            failed.append(r)
        elif status == "skipped":
            key = (r.get("op"), r.get("backend"), r.get("error") or "no reason given")
            skipped.setdefault(key, {"op": key[0], "backend": key[1], "reason": key[2], "count": 0})["count"] += 1
    return failed, list(skipped.values())


def deciding_check(r: dict[str, Any]) -> dict[str, Any]:
    """The check whose numbers a case shows: `check` (input set 0's), or, for a mismatch that passed it, the check
    that failed: a rotated input set's (`check.input_sets`) or the recheck after timing (`recheck`)."""
    check = r.get("check") or {}
    if r.get("status") != "mismatch" or check.get("ok") is False:
        return check
    sets, recheck = check.get("input_sets") or {}, r.get("recheck") or {}
    failed = sets if "failed" in sets else recheck if recheck.get("ok") is False else None
    if failed is None:
        return check
    numbers = {k: failed.get(k) for k in ("err_ratio", "max_abs", "cosine")}
    return {**check, **numbers, "ok": False, "message": ""}  # set 0's message was its pass; `error` says the failure


def failure_text(r: dict[str, Any]) -> str:
    """What went wrong, in one paragraph: the error, or for a mismatch the failing check's numbers against its
    tolerance."""
    parts = [str(r["error"])] if r.get("error") else []
    check = deciding_check(r)
    if r.get("status") == "mismatch" or check.get("ok") is False:
        tol = check.get("tolerance") or {}
        nums = [f"{k}={check[k]:.3g}" for k in ("err_ratio", "max_abs", "cosine") if is_number(check.get(k))]
        tols = [f"{k}<={v:.3g}" for k, v in tol.items() if is_number(v)]
        if nums:
            parts.append(" ".join(nums) + (f" (tolerance {' '.join(tols)})" if tols else ""))
        if check.get("message"):
            parts.append(str(check["message"]))
    return "; ".join(parts) or "no error text recorded"


def order_statistics(samples: list[float], most: int) -> list[float]:
    """All the samples when there are at most `most`, else `most` evenly spaced order statistics (min and max kept):
    the same box plot (quartiles, whiskers, outliers) to within one rank in `most`."""
    if len(samples) <= most:
        return samples
    ranked = sorted(samples)
    return [ranked[round(i * (len(ranked) - 1) / (most - 1))] for i in range(most)]
