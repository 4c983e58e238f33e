"""Terminal output: the progress display of a sweep and the tables of results (rich)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from spark_bench.results import FAILED

STATUS_STYLE = {"ok": "green", "mismatch": "bold red", "error": "red", "crash": "bold red", "timeout": "red",
                "oom": "red", "skipped": "dim"}


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 160)


def fmt_params(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def clip_params(params: dict[str, Any], width: int = 60) -> str:
    """The params that fit in `width` characters, whole `axis=value` items only, then '…'."""
    text = ""
    for item in (f"{k}={v}" for k, v in params.items()):
        if len(text) + len(item) + (1 if text else 0) > width:
            return (text + " …") if text else item[: max(1, width - 1)] + "…"
        text = f"{text} {item}" if text else item
    return text


def fmt_num(value: float | None, digits: int = 3) -> str:
    """`digits` significant digits, so a small value never reads as zero (0.00146, not 0.0); '-' for None."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if abs(value) >= 10 ** digits:
        return f"{value:.0f}" if abs(value) < 1e9 else f"{value:.3e}"
    return f"{value:.{digits}g}"


def fmt_pct(value: float | None, digits: int = 3) -> str:
    """A percentage with significant digits: '45.7%', '0.0123%' (never '0.0%' for a real small value)."""
    return f"{fmt_num(value, digits)}%" if value is not None else "-"


def latency_cell(rec: dict[str, Any]) -> str:
    t = rec.get("timing")
    if not t:
        return "-"
    spread = f" ±{fmt_pct(100 * t['rel_ci'], 2)}" if t.get("rel_ci") is not None else ""
    return f"{fmt_num(t['median'], 4)}{spread}"


def results_table(records: Sequence[dict[str, Any]], title: str = "", limit: int = 400) -> Table:
    table = Table(title=title or None, show_lines=False, header_style="bold")
    for col, justify in [("op", "left"), ("backend", "left"), ("params", "left"), ("dtype", "left"),
                         ("status", "left"), ("median µs", "right"), ("GB/s", "right"), ("TFLOP/s", "right"),
                         ("err ratio", "right"), ("peak MB", "right"), ("timer / labels", "left")]:
        table.add_column(col, justify=justify, overflow="fold")
    shown = sorted((r for r in records if r["status"] != "skipped"),  # skipped ones are listed under "Not measured"
                   key=lambda r: (r["op"], r["dtype"], [str(v).zfill(12) for v in r["params"].values()], r["backend"]))
    for rec in shown[:limit]:
        status = rec["status"]
        check = rec.get("check") or {}
        timer = (rec.get("timing") or {}).get("timer", "")
        labels = ", ".join([timer, *rec.get("labels", [])]).strip(", ")
        table.add_row(escape(rec["op"]), escape(rec["backend"]), escape(fmt_params(rec["params"])), rec["dtype"],
                      f"[{STATUS_STYLE.get(status, '')}]{status}[/]", latency_cell(rec), fmt_num(rec.get("gbps")),
                      fmt_num(rec.get("tflops")), fmt_num(check.get("err_ratio"), 2), fmt_num(peak_mb(rec)),
                      escape(labels))
    if len(shown) > limit:
        table.caption = f"{len(shown) - limit} more cases not shown (see the HTML report)"
    return table


def peak_mb(rec: dict[str, Any]) -> float | None:
    """The case's peak memory in MB (`memory` of the record): the device peak on a GPU, else the worker's peak RSS
    (a high-water mark that includes the worker's earlier cases); None when not recorded."""
    mem = rec.get("memory") if isinstance(rec.get("memory"), dict) else {}
    for key in ("device_peak_bytes", "rss_peak_bytes"):
        value = mem.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value / 1e6
    return None


def failures_table(records: Sequence[dict[str, Any]]) -> Table | None:
    """Every failed case on its own row; skipped cases one row per (op, backend, reason) with their count, as the
    HTML report groups them (`report.model.problems`): a missing peer skips every point of its op."""
    from spark_bench.report.model import problems

    failed, skipped = problems(records)
    if not failed and not skipped:
        return None
    table = Table(title="Not measured", header_style="bold")
    for col in ("status", "case", "reason"):
        table.add_column(col, overflow="fold")
    for rec in failed:
        table.add_row(f"[{STATUS_STYLE.get(rec['status'], '')}]{rec['status']}[/]",
                      escape(f"{rec['op']} {rec['backend']} {fmt_params(rec['params'])} {rec['dtype']}"),
                      escape(first_line(rec.get("error"))))
    for group in skipped:
        cases = f"{group['count']} cases" if group["count"] > 1 else "1 case"
        table.add_row(f"[{STATUS_STYLE['skipped']}]skipped[/]", escape(f"{group['op']} {group['backend']} ({cases})"),
                      escape(first_line(group["reason"])))
    return table


def first_line(error: str | None) -> str:
    return error.splitlines()[0][:300] if error else ""


def summary_line(summary: dict[str, int]) -> str:
    parts = [f"{summary['cases']} cases"] + [f"{n} {s}" for s, n in summary.items() if s != "cases" and n]
    return ", ".join(parts)


def backend_label(case) -> str:
    """The backend, and the forced kernel configs of a `tune` candidate: 'triton[BK=64,num_warps=4]'."""
    configs = getattr(case, "configs", None)
    if not configs:
        return case.backend
    from spark_bench.tune.space import config_id

    return f"{case.backend}[{';'.join(config_id(c) for c in configs.values())}]"


class SweepProgress:
    """A rich progress bar with the current case, its phase and an ETA on a terminal; one line per finished case
    otherwise (CI logs)."""

    def __init__(self, total: int, out: Console) -> None:
        self.out, self.total, self.done, self.skipped = out, total, 0, 0
        self.live = out.is_terminal
        self.started = time.monotonic()
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=out,
                                 transient=True) if self.live else None
        self.task = self.progress.add_task("starting", total=total) if self.progress else None

    def __enter__(self) -> SweepProgress:
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress:
            self.progress.stop()

    def phase(self, case, phase: str) -> None:
        if self.progress:
            params = escape(clip_params(case.params))
            text = f"{escape(case.op)} [bold]{escape(backend_label(case))}[/] {params} {case.dtype}: {phase}"
            self.progress.update(self.task, description=text)

    def result(self, case, record: dict[str, Any]) -> None:
        self.done += 1
        if record["status"] == "skipped":  # costs nothing: it must not speed up the ETA of the cases that run
            self.skipped += 1
        if self.progress:  # the bar counts the cases that run: skipped ones leave its total
            self.progress.update(self.task, completed=self.done - self.skipped, total=self.total - self.skipped)
            if record["status"] in FAILED:
                detail = (f"{case.op} {backend_label(case)} {fmt_params(case.params)} {case.dtype}: "
                          f"{record.get('error') or ''}")
                self.out.print(f"[{STATUS_STYLE[record['status']]}]{record['status']}[/] {escape(detail[:200])}")
            return
        elapsed = time.monotonic() - self.started
        measured = self.done - self.skipped
        eta = elapsed / measured * (self.total - self.done) if measured else 0.0
        self.out.print(f"[{self.done}/{self.total} {elapsed:.0f}s eta {eta:.0f}s] {record['status']:8s} "
                       f"{case.op} {backend_label(case)} {fmt_params(case.params)} {case.dtype} "
                       f"{latency_cell(record)} us",
                       markup=False, soft_wrap=True)  # one line per case in logs, however long
