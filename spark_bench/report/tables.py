"""Rows of the page's interactive tables (sorted, filtered and exported to CSV by the page script)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from spark_bench.console import peak_mb
from spark_bench.report.compare import CaseDiff
from spark_bench.report.model import (
    RunData,
    deciding_check,
    failure_text,
    natural_key,
    number,
    params_text,
    roofline_pct,
    speedups,
    time_unit,
    timing,
)

SEVERITY = {"broken": 0, "slower": 1, "failing": 2, "noisy": 3, "missing": 4, "faster": 5, "fixed": 6, "new": 7}


def _col(name: str, title: str = "", **kw: Any) -> dict[str, Any]:
    return {"name": name, **({"title": title} if title else {}), **kw}


def cases_table(runs: Sequence[RunData], baseline: str) -> dict[str, Any]:
    multi = len(runs) > 1
    unit = time_unit([r for run in runs for r in run.results])
    columns = ([_col("run")] if multi else []) + [
        _col("op"), _col("backend"), _col("dtype"), _col("params", cls="code"), _col("status", tag="st"),
        _col(f"median_{unit}", "median time per call (a cuda-graph median of 0: below the timer's resolution)"),
        _col(f"p10_{unit}"), _col(f"p90_{unit}"),
        _col("rel_iqr_%", "interquartile range / median", sig=3), _col("n", "samples"), _col("timer"),
        _col("device", "where the case ran: a CPU's times are host code, never a GPU kernel's"),
        _col("GB/s", "the cost model's minimum bytes / median time: not measured traffic"),
        _col("TFLOP/s", "the cost model's FLOPs / median time"),
        _col("roofline_%", "best fraction of a roof (see the summary)", sig=3),
        _col("roof", "which roof, and whether its peak was measured on this device or taken from the datasheet"),
        _col(f"x_{baseline}", f"speedup over {baseline}", sig=3), _col("err_ratio", "RMS(out-ref)/RMS(ref)"),
        _col("energy_uJ", "energy per call, measured on calls back to back without the L2 flush (warm L2, eager "
                          "launches; power.regime): not the regime of the latency columns"),
        _col("peak_MB", "peak memory of the case: device bytes on a GPU (max_memory_allocated), else the worker's "
                        "peak RSS (a high-water mark over the worker's earlier cases too)"),
        _col("labels"), _col("error", cls="err"),
    ]
    weights = any(r.get("weights") for run in runs for r in run.results)
    if weights:  # runs on a weight file: what each case ran on (docs/weights.md)
        columns.insert(len(columns) - 1, _col("weights", "the weight file, layer and routing the case ran on"))
    rows = []
    for run in runs:
        sp = {}
        for op_results in _group(run.results).values():
            sp.update(speedups(op_results, baseline))
        for r in sorted(run.results, key=lambda r: (str(r.get("op")), natural_key(r), str(r.get("backend")))):
            t = timing(r) or {}
            med = number(t.get("median"))
            iqr = number(t.get("iqr"))
            pct = roofline_pct(r, run.run) if t else None
            energy = number((r.get("power") or {}).get("energy_j_per_call"))
            rows.append(([run.label] if multi else []) + [
                r.get("op"), r.get("backend"), r.get("dtype"), params_text(r.get("params") or {}), r.get("status"),
                med, number(t.get("p10")), number(t.get("p90")), 100 * iqr / med if iqr is not None and med else None,
                t.get("n"), t.get("timer"), run.device_text, number(r.get("gbps")), number(r.get("tflops")),
                *(pct or (None, None)), sp.get(id(r)), number(deciding_check(r).get("err_ratio")),
                energy * 1e6 if energy is not None else None, peak_mb(r), ", ".join(map(str, r.get("labels") or [])),
                *([r.get("weights") or ""] if weights else []),
                failure_text(r) if r.get("status") != "ok" else (r.get("error") or ""),
            ])
    return {"columns": columns, "rows": rows}


def _group(results: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        out.setdefault(str(r.get("op")), []).append(r)
    return out


def comparison_table(runs: Sequence[RunData], diffs: dict[int, list[CaseDiff]],
                     metric: str = "median") -> dict[str, Any]:
    """The verdicts' table: each side's `metric` (compare --metric) and its ratio."""
    multi = len(diffs) > 1
    unit = time_unit([x for ds in diffs.values() for d in ds for x in (d.base, d.new)])
    columns = ([_col("run")] if multi else []) + [
        _col("op"), _col("backend"), _col("dtype"), _col("params", cls="code"), _col(f"base_{metric}_{unit}"),
        _col(f"new_{metric}_{unit}"), _col("ratio", f"new / base {metric} time: > 1 is slower", sig=4),
        _col("ratio_ci_low", sig=4), _col("ratio_ci_high", sig=4), _col("p", "Mann-Whitney U, two-sided"),
        _col("verdict", tag="v"), _col("note", cls="err"),
    ]
    rows = []
    for ri, ds in diffs.items():
        for d in sorted(ds, key=lambda d: (SEVERITY.get(d.verdict.verdict, 9), -abs(math.log(d.verdict.ratio or 1.0)))):
            v = d.verdict
            tb, tn = (timing(d.base) if d.base else None), (timing(d.new) if d.new else None)
            rows.append(([runs[ri].label] if multi else []) + [
                d.op, d.backend, d.dtype, params_text(d.params), tb.get(metric) if tb else None,
                tn.get(metric) if tn else None, v.ratio, v.ratio_lo, v.ratio_hi, v.p_value, v.verdict, v.note])
    return {"columns": columns, "rows": rows}
