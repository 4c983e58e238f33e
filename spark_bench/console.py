"""Terminal output: the progress display of a sweep and the tables of results (rich)."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from spark_bench.results_schema import FAILED

STATUS_STYLE = {"ok": "green", "mismatch": "bold red", "error": "red", "crash": "bold red", "timeout": "red",
                "oom": "red", "skipped": "dim"}


def console(stderr: bool = False) -> Console:
    """Rich's console: the terminal's width, else 160 columns (a log; rich's 80 folds every table). $COLUMNS is not
    followed off a terminal: tools export it on their own (pytest-xdist's workers get 80)."""
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 160)


def status_markup(status: str) -> str:
    """A status in its style, as rich markup (an unknown status unstyled, never parsed as markup)."""
    style = STATUS_STYLE.get(status)
    return f"[{style}]{escape(status)}[/]" if style else escape(status)


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


def rate_text(per_s: float, unit: str) -> str:
    """A rate with an SI prefix and 3 significant digits: 1.46 GFLOP/s, 22.5 GB/s, 989 TFLOP/s (never '0 TF')."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_s >= scale:
            return f"{fmt_num(per_s / scale)} {prefix}{unit}"
    return f"{fmt_num(per_s)} {unit}"


def ci_is_range(timing: dict) -> bool:
    """A stored timing whose "CI" is its samples' range (under stats.MIN_CI_SAMPLES = 6 samples: it covers the
    median less often than 95%, e.g. 75% at 3 samples), by its recorded `ci_level`."""
    level = timing.get("ci_level")
    return isinstance(level, (int, float)) and level < 0.945  # 6+ samples: >= 0.95; 5: 0.938


def below_resolution(timing: dict) -> bool:
    """A cuda-graph median of 0: the call was lost in the flush's noise (samples clamped to 0), not free."""
    return timing.get("median") == 0 and bool(timing.get("clamped_samples"))


def latency_cell(rec: dict[str, Any]) -> str:
    """'12.3 ±1.2%' (the median and its 95% CI's half-width); '†' marks a CI of under 6 samples, which is their range
    (it covers the median less often); a graph median lost in the flush's noise reads '< resolution'."""
    t = rec.get("timing")
    if not t:
        return "-"
    if below_resolution(t):
        return "< resolution"
    range_only = "†" if ci_is_range(t) else ""
    spread = f" ±{fmt_pct(100 * t['rel_ci'], 2)}{range_only}" if t.get("rel_ci") is not None else ""
    return f"{fmt_num(t['median'], 4)}{spread}"


def legend(records: Sequence[dict[str, Any]]) -> str:
    """What the tables' numbers are, in one line under them: measured (the median and its CI) or derived (GB/s and
    TFLOP/s from the cost model; memory)."""
    timed = [r for r in records if r.get("timing")]
    if not timed:
        return ""
    parts = ["median ±: its 95% CI" + (" († under 6 samples: their range)" if any(
        ci_is_range(r["timing"]) for r in timed) else "")]
    if any(r.get("gbps") is not None for r in timed):
        parts.append("GB/s, TFLOP/s: cost model's bytes, FLOPs / median, not measured traffic")
    gpu = any(peak_mb(r, "device_peak_bytes") is not None for r in records)
    if any(peak_mb(r) is not None for r in records):
        parts.append("peak MB: GPU's peak allocation" if gpu else
                     "peak MB: worker's peak RSS (torch, earlier cases included)")
    return " · ".join(parts)


COLUMNS = [("backend", "left"), ("params", "left"), ("dtype", "left"), ("status", "left"), ("median µs", "right"),
           ("× fastest", "right"), ("GB/s", "right"), ("TFLOP/s", "right"), ("roofline", "right"),
           ("err ratio", "right"), ("peak MB", "right"), ("labels", "left")]
OPTIONAL = {"params", "TFLOP/s", "roofline", "peak MB", "labels"}  # left out of an op's table when no row has a value
EMPTY = {"", "-", "0"}


def results_table(records: Sequence[dict[str, Any]], title: str = "", limit: int = 400,
                  among: Sequence[dict[str, Any]] | None = None) -> Group:
    """One table per op (skipped cases are listed under "Not measured"). An op's title names the axes whose value is
    the same in all its rows, and the timer when all rows share it; its params column shows the rest. `× fastest`:
    the case's median over the fastest correct backend's at the same point and dtype (1 for that one; '-' when not
    timed), the fastest taken `among` these records (default: the ones shown; `show`'s filters pass the whole run).
    Columns without a value in any row (no varying axis, no FLOPs, no labels) are left out."""
    shown = sorted((r for r in records if r["status"] != "skipped"),
                   key=lambda r: (r["op"], r["dtype"], [str(v).zfill(12) for v in r["params"].values()], r["backend"]))
    parts: list[Any] = [Text(title, style="bold")] if title else []
    fastest = fastest_medians(records if among is None else among)
    every_row = {op: list(rows) for op, rows in itertools.groupby(shown, key=lambda r: r["op"])}
    for op, rows in itertools.groupby(shown[:limit], key=lambda r: r["op"]):
        parts.append(_op_table(op, list(rows), fastest, every_row[op]))
    if len(shown) > limit:
        parts.append(Text(f"{len(shown) - limit} more cases not shown (see the HTML report)", style="dim"))
    if text := legend(shown[:limit]):
        parts.append(Text(text, style="dim"))
    return Group(*parts)


def _op_table(op: str, rows: list[dict[str, Any]], fastest: dict[tuple, float],
              selected: list[dict[str, Any]]) -> Group:
    """`rows`: those shown; `selected`: all of the op's rows (more under a limit), which the title's axes hold for."""
    from spark_bench.report.model import deciding_check, record_backend

    fixed = {k: v for k, v in rows[0]["params"].items() if all(r["params"].get(k, object()) == v for r in selected)}
    timers = {(r.get("timing") or {}).get("timer") for r in rows} - {None, ""}
    shared_timer = timers.pop() if len(timers) == 1 else None  # an untimed row (a failure) has no timer
    weights = {r.get("weights") for r in rows}
    shared_weights = weights.pop() if len(weights) == 1 else None  # else each row's labels name its own
    title = f"[bold]{escape(op)}[/]" + (f" [dim]{escape(fmt_params(fixed))}[/]" if fixed else "") \
        + (f" [dim]· timer {escape(shared_timer)}[/]" if shared_timer else "") \
        + (f" [dim]· weights {escape(shared_weights)}[/]" if shared_weights else "")
    cells = []
    for rec in rows:
        status = rec["status"]
        check = deciding_check(rec)  # a mismatch's failing numbers, not input set 0's passing ones
        timer = (rec.get("timing") or {}).get("timer", "") if shared_timer is None else ""
        own_weights = "" if shared_weights else rec.get("weights")  # not already in the title
        labels = ", ".join(x for x in [timer, *rec.get("labels", []), own_weights] if x)
        varying = {k: v for k, v in rec["params"].items() if k not in fixed}
        median, best = _median(rec), fastest.get(_point(rec))
        ratio = fmt_num(median / best, 3) if median is not None and best else "-"
        if median is not None and median == best:
            ratio = f"[bold green]{ratio}[/]"
        cells.append([escape(record_backend(rec)), escape(fmt_params(varying)) or "-", escape(rec["dtype"]),
                      status_markup(status), latency_cell(rec), ratio,
                      fmt_num(rec.get("gbps")), fmt_num(rec.get("tflops")), roofline_cell(rec),
                      fmt_num(check.get("err_ratio"), 2),
                      fmt_num(peak_mb(rec)), escape(labels)])
    keep = [i for i, (col, _) in enumerate(COLUMNS)
            if col not in OPTIONAL or any(row[i] not in EMPTY for row in cells)]
    table = Table(show_lines=False, header_style="bold")
    for i in keep:
        table.add_column(COLUMNS[i][0], justify=COLUMNS[i][1], overflow="fold")
    for row in cells:
        table.add_row(*(row[i] for i in keep))
    return Group(Text.from_markup(title), table)  # the title as wide as the console, not folded to the table's


def roofline_cell(rec: dict[str, Any]) -> str:
    """The nearest roof as a percentage of its peak, '45.7% BW' or '12.1% FLOP' (the run's measured peaks; 'ds':
    the datasheet's, when none was measured); '-' when the run stored none."""
    from spark_bench.report.model import roofline_pct

    found = roofline_pct(rec, {}) if rec.get("status") == "ok" else None
    if found is None:
        return "-"
    pct, roof = found
    kind, _, source = roof.partition(" ")
    return f"{fmt_pct(pct, 3)} {kind.replace('FLOP/s', 'FLOP')}" + (" ds" if source == "datasheet" else "")


def _point(rec: dict[str, Any]) -> tuple:
    return rec["op"], rec["dtype"], tuple(sorted((k, str(v)) for k, v in rec["params"].items()))


def _median(rec: dict[str, Any]) -> float | None:
    median = (rec.get("timing") or {}).get("median")
    return median if isinstance(median, (int, float)) and median > 0 else None


def fastest_medians(records: Sequence[dict[str, Any]]) -> dict[tuple, float]:
    """The fastest `ok` (checked, then timed) median per (op, dtype, point); the fp32 reference, when timed, is
    context, not a contender (as in the report)."""
    from spark_bench.report.model import NOT_A_CONTENDER

    best: dict[tuple, float] = {}
    for rec in records:  # a median of 0 (below the graph timer's resolution) is the fastest: no ratio is claimed
        median = _median(rec) or (0.0 if below_resolution(rec.get("timing") or {}) else None)
        if rec["status"] == "ok" and median is not None and rec["backend"] not in NOT_A_CONTENDER:
            key = _point(rec)
            best[key] = min(best.get(key, median), median)
    return best


def peak_mb(rec: dict[str, Any], of: str | None = None) -> float | None:
    """The case's peak memory in MB (`memory` of the record): the device peak on a GPU, else the worker's peak RSS
    (a high-water mark that includes the worker's earlier cases); None when not recorded. `of`: that key only."""
    mem = rec.get("memory") if isinstance(rec.get("memory"), dict) else {}
    for key in (of,) if of else ("device_peak_bytes", "rss_peak_bytes"):
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
        table.add_row(status_markup(rec["status"]),
                      escape(f"{rec['op']} {rec['backend']} {fmt_params(rec['params'])} {rec['dtype']}"),
                      escape(first_line(rec.get("error"))))
    for group in skipped:
        cases = f"{group['count']} cases" if group["count"] > 1 else "1 case"
        table.add_row(status_markup("skipped"), escape(f"{group['op']} {group['backend']} ({cases})"),
                      escape(first_line(group["reason"])))
    return table


def weights_note(record: dict[str, Any]) -> str:
    """' · weights <label>' for a case that ran on a weight file or routing trace (its record's `weights`), else ''."""
    label = record.get("weights")
    return f" · weights {label}" if isinstance(label, str) and label else ""


def first_line(error: str | None) -> str:
    return error.splitlines()[0][:300] if error else ""


def summary_line(summary: dict[str, int]) -> str:
    n = summary["cases"]
    parts = [f"{n} case" + ("" if n == 1 else "s")] + [f"{k} {s}" for s, k in summary.items() if s != "cases" and k]
    return ", ".join(parts)


def backend_label(case) -> str:
    """The backend, the forced kernel configs of a `tune` candidate and a re-timing: 'triton[BK=64,num_warps=4]'."""
    from spark_bench.report.model import labelled_backend

    return labelled_backend(case.backend, list((getattr(case, "configs", None) or {}).values()),
                            getattr(case, "repeat", 0))


class SweepProgress:
    """A rich progress bar with the current case, its phase and an ETA on a terminal; one line per finished case
    otherwise (CI logs), the skipped cases (unavailable backends, recorded first) folded into one line.

    The ETA weighs the cases left by `expected` (case_id -> seconds, the estimates `run --dry-run` prints: a
    torch case takes a fraction of a second, an interpreted Triton case seconds) and scales them by how this run
    compares with the estimates so far: elapsed / expected-done, damped towards 1 by PRIOR_SHARE of the sweep's
    estimate so one slow first case (torch.compile's first graph) cannot multiply the whole ETA. Without estimates
    every case that runs weighs the same."""

    PRIOR_SHARE, PRIOR_MAX_S = 0.1, 30.0

    def __init__(self, total: int, out: Console, expected: dict[str, float] | None = None,
                 deadline: float | None = None) -> None:
        self.out, self.total, self.done, self.skipped = out, total, 0, 0
        self.deadline = deadline  # `run --budget`: no new point after it, so the ETA is at most the time left to it
        self.expected = expected or {}
        self.expected_left = sum(self.expected.values())
        self.prior_s = min(self.PRIOR_MAX_S, self.PRIOR_SHARE * self.expected_left)
        self.expected_done = 0.0
        self.folded: list[tuple[Any, dict[str, Any]]] = []  # skipped cases not printed yet (log mode)
        self.folded_at = 0
        self.live = out.is_terminal
        self.started = time.monotonic()
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("eta {task.fields[eta]}"), console=out,
                                 transient=True) if self.live else None
        self.task = self.progress.add_task("starting", total=total, eta="?") if self.progress else None

    def __enter__(self) -> SweepProgress:
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._print_folded()
        if self.progress:
            self.progress.stop()

    def phase(self, case, phase: str) -> None:
        if self.progress:
            params = escape(clip_params(case.params))
            text = f"{escape(case.op)} [bold]{escape(backend_label(case))}[/] {params} {case.dtype}: {phase}"
            self.progress.update(self.task, description=text)

    def eta(self, elapsed: float) -> float:
        """Seconds left, from the estimates of the cases left (see the class), else from the mean case so far."""
        if self.expected_done + self.prior_s > 0:  # estimates, and not all of them 0 (skipped cases)
            return self.expected_left * (elapsed + self.prior_s) / (self.expected_done + self.prior_s)
        measured = self.done - self.skipped
        return elapsed / measured * (self.total - self.done) if measured else 0.0

    def eta_text(self, elapsed: float) -> str:
        """The ETA, capped by the budget's deadline (and then labelled so: the points begun still finish)."""
        eta = self.eta(elapsed)
        if self.deadline is not None and self.deadline - time.monotonic() < eta:
            return f"{max(0.0, self.deadline - time.monotonic()):.0f}s budget"
        return f"{eta:.0f}s"

    def result(self, case, record: dict[str, Any]) -> None:
        self.done += 1
        weight = self.expected.get(case.case_id, 0.0)
        self.expected_left = max(0.0, self.expected_left - weight)
        self.expected_done += weight
        if record["status"] == "skipped":  # costs nothing: it must not speed up the ETA of the cases that run
            self.skipped += 1
        elapsed = time.monotonic() - self.started
        if self.progress:  # the bar counts the cases that run: skipped ones leave its total
            self.progress.update(self.task, completed=self.done - self.skipped, total=self.total - self.skipped,
                                 eta=self.eta_text(elapsed))
            if record["status"] in FAILED:
                detail = (f"{case.op} {backend_label(case)} {fmt_params(case.params)} {case.dtype}"
                          f"{weights_note(record)}: {record.get('error') or ''}")
                self.out.print(f"{status_markup(record['status'])} {escape(detail[:200])}")
            return
        if record["status"] == "skipped":
            self.folded.append((case, record))
            self.folded_at = self.done
            return
        self._print_folded()
        self.out.print(f"[{self.done}/{self.total} {elapsed:.0f}s eta {self.eta_text(elapsed)}] "
                       f"{record['status']:8s} {case.op} {backend_label(case)} {fmt_params(case.params)} "
                       f"{case.dtype} {latency_cell(record)} us{weights_note(record)}",
                       markup=False, soft_wrap=True)  # one line per case in logs, however long

    def _print_folded(self) -> None:
        """The skipped cases so far as one line per reason: '[37/226] skipped 16 cases: fla (fla not installed)'."""
        if not self.folded:
            return
        groups: dict[tuple[str, str], int] = {}
        for case, record in self.folded:
            key = (case.backend, first_line(record.get("error")) or "no reason given")
            groups[key] = groups.get(key, 0) + 1
        self.folded = []
        for (backend, reason), count in groups.items():
            cases = f"{count} cases" if count > 1 else "1 case"
            self.out.print(f"[{self.folded_at}/{self.total}] skipped  {cases} of backend {backend}: {reason}",
                           markup=False, soft_wrap=True)
