"""The report's "Tuned configs" section: for a run launched with `--tuned`, which kernels of each op ran a tuned
config, and what the tune measured for it against the declared default (the tune's numbers, on the device it ran
on, not this run's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spark_bench.report.model import RunData


def _fmt_key(key: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in key.items())


TUNED = ("tuned", "tuned-nearest")  # config_source values of a config a tuned table chose (spark_bench.tune.space)


def _fmt_config(config: dict[str, Any]) -> str:
    from spark_bench.tune.space import config_id

    return config_id(config)


def rows(run: RunData) -> list[list[Any]]:
    """[op, kernel, key, config, cases, tune cases, tuned µs, default µs, speedup, labels, measured] for each tuned
    config a case ran; the times are the tune's geometric means over its cases, not this run's medians."""
    table = ((run.run.get("spec") or {}).get("tuned") or {}).get("data") or {}
    entries = table.get("kernels") or {}
    out, seen = [], set()
    for rec in run.results:
        for kernel, source in (rec.get("config_source") or {}).items():
            if source not in TUNED:
                continue
            for entry in _entries_taken(rec, kernel, entries.get(kernel, [])):
                if (rec["op"], kernel, str(entry["key"])) not in seen:
                    seen.add((rec["op"], kernel, str(entry["key"])))
                    out.append([rec["op"], kernel, _fmt_key(entry["key"]), _fmt_config(entry["config"]),
                                _cases(run, rec["op"], kernel), entry.get("cases"), entry.get("time_us"),
                                (entry.get("default") or {}).get("time_us"),
                                f"{entry.get('speedup', 0):.3f}x" + (f" (noise ±{entry['noise']:.1%})"
                                                                       if entry.get("noise") is not None else ""),
                                ", ".join(entry.get("labels") or []),
                                entry.get("measured") or ""])
    return sorted(out, key=lambda r: (r[0], r[1], r[2]))


def _entries_taken(rec: dict[str, Any], kernel: str, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table entries a case took for `kernel`: by the keys it recorded (`tuned_key`), or, in a result written
    before it recorded them, every entry holding a config it ran (two keys may share one)."""
    keys = (rec.get("tuned_key") or {}).get(kernel)
    if keys is not None:
        return [e for e in entries if e.get("key") in keys]
    ran = (rec.get("config") or {}).get(kernel)
    return [e for e in entries if e.get("config") in (ran if isinstance(ran, list) else [ran])]


def _cases(run: RunData, op: str, kernel: str) -> str:
    """How many of the op's cases that launched `kernel` took a tuned config, and how many of those at a key that
    was never tuned (the nearest tuned key's config: source tuned-nearest)."""
    of_op = [r for r in run.results if r.get("op") == op and kernel in (r.get("config_source") or {})]
    sources = [(r.get("config_source") or {}).get(kernel) for r in of_op]
    tuned, nearest = sum(s in TUNED for s in sources), sources.count("tuned-nearest")
    return f"{tuned} of {len(of_op)}" + (f" ({nearest} at a key never tuned: the nearest one's)" if nearest else "")


def tuned_section(runs: Sequence[RunData], table_html, esc) -> str:
    """HTML (empty when no run used a tuned table); `table_html(headers, rows)` and `esc` are the page's own."""
    parts = []
    for run in runs:
        tuned = (run.run.get("spec") or {}).get("tuned")
        if not tuned:
            continue
        data = tuned.get("data") or {}
        device = (data.get("device") or {}).get("name") or "?"
        body = rows(run)
        parts.append(f"<p>{esc(run.label)}: table {esc(tuned.get('path'))}, tuned on {esc(device)} "
                     f"(updated {esc(data.get('updated'))}). The times are the tune's, default against tuned "
                     "config: geometric means over its cases at the key (`tune cases`), not this run's medians; "
                     "`tune labels` say how it timed them (e.g. interpreted).</p>")
        parts.append(table_html(["op", "kernel", "key", "tuned config", "cases with it", "tune cases",
                                 "tuned µs (geomean)", "default µs (geomean)", "speedup", "tune labels", "measured"],
                                body) if body else
                     "<p>No case of this run launched a kernel the table holds: every config was the declared "
                     "default.</p>")
    if not parts:
        return ""
    return f'<section id="tuned"><h2>Tuned configs</h2>{"".join(parts)}</section>'
