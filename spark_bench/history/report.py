"""The trend report: one offline HTML page (plotly.js embedded once, CSP with a nonce, data in one JSON block), built
from the run report's own pieces (spark_bench/report: stylesheet, page script, escaping, backend colours).

From the top: the detected regressions and improvements (a sortable, filterable table, regressions first), the
series overview, then one section per op and device fingerprint with a trend chart: one line per backend (the median
of each commit, its 95% CI as a band), commits and runs on hover, detected steps marked (▲ slower, ▼ faster), and a
selector for the op's other parameters (combinations with a step come first).
"""

from __future__ import annotations

import datetime as dt
import secrets
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import plotly.offline

from spark_bench.console import fmt_pct
from spark_bench.history.detect import Series, Step
from spark_bench.report.assets import CSS, JS, palette
from spark_bench.report.charts import AXIS, ptext
from spark_bench.report.html import esc, script_json

STEP_COLOURS = {"slower": "#cf222e", "faster": "#1a7f37"}
LOG_SPAN = 20.0  # a chart whose medians span more than this ratio gets a logarithmic time axis


def _x(time: str | None) -> str | None:
    """Plotly date axes take 'YYYY-MM-DD HH:MM:SS' (UTC here), not an ISO offset."""
    return time[:19].replace("T", " ") if time else None


def _anchor(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text)


def steps_table(series: Sequence[Series]) -> dict[str, Any]:
    def col(name: str, title: str = "", **kw: Any) -> dict[str, Any]:
        return {"name": name, **({"title": title} if title else {}), **kw}

    columns = [col("verdict", tag="v"), col("op"), col("backend"), col("dtype"), col("params", cls="code"),
               col("device"), col("change_%", "after / before − 1 of the segments' geometric means", digits=1),
               col("before"), col("after"), col("unit"), col("confidence", "1 − Bonferroni-adjusted p", digits=4),
               col("last_good"), col("first_bad"), col("first_bad_time"), col("first_run"),
               col("timer_change", "the timer differs either side of the step: maybe the measurement's step"),
               col("suspects", "git log last_good..first_bad", cls="err")]
    found: list[tuple[Series, Step]] = [(s, st) for s in series for st in s.steps]
    found.sort(key=lambda x: (x[1].direction != "slower", -abs(x[1].ratio - 1)))
    rows = [[st.direction, s.case.op, s.case.backend, s.case.dtype, s.case.params_text,
             f"{s.device} [{s.fingerprint_id}]",
             (st.ratio - 1) * 100, st.before, st.after, s.unit, st.confidence, st.last_good.label,
             st.first_bad.label, st.first_bad.time, st.first_bad.run_ids[0], st.timer_change or "",
             "\n".join(st.suspects) if st.suspects else ("" if st.suspects is not None else "(no repository)")]
            for s, st in found]
    return {"columns": columns, "rows": rows}


def _hover(s: Series, i: int) -> str:
    p = s.points[i]
    runs = ", ".join(p.run_ids[:3]) + (f" +{len(p.run_ids) - 3}" if len(p.run_ids) > 3 else "")
    lines = [f"<b>{ptext(s.case.backend)}</b> {ptext(s.case.params_text)} {ptext(s.case.dtype)}",
             f"commit {ptext(p.label)} · {ptext(p.time or '?')}", f"run {ptext(runs)}"]
    if p.median is not None:
        lines.append(f"median {p.median:.4g} {ptext(s.unit)} (CI {p.ci_low or 0:.4g}–{p.ci_high or 0:.4g}) · n {p.n}"
                     f" · timer {ptext('/'.join(p.timers) or '?')}")
    else:
        lines.append(f"status {ptext(p.status)}" + (f": {ptext((p.error or '')[:160])}" if p.error else ""))
    return "<br>".join(lines)


class TrendFigure:
    """The chart of one op on one fingerprint: traces per (combination, backend), switched by `meta.combo`."""

    def __init__(self, op: str, device: str, series: Sequence[Series], colours: dict[str, str], hovers: list[str],
                 last: int | None = None) -> None:
        self.op, self.device, self.colours, self.hovers, self.last = op, device, colours, hovers, last
        by_combo: dict[str, list[Series]] = defaultdict(list)
        for s in series:
            by_combo[f"{s.case.params_text} {s.case.dtype}"].append(s)
        # combinations with a detected step first, then in their natural order
        self.combos = sorted(by_combo, key=lambda c: (not any(s.steps for s in by_combo[c]), c))
        self.by_combo = by_combo
        self.unit = next((s.unit for s in series), "us")

    def label(self, combo: str) -> str:
        n = sum(len(s.steps) for s in self.by_combo[combo])
        return f"{combo}  ({n} step{'s' if n != 1 else ''})" if n else combo

    def traces(self) -> list[dict[str, Any]]:
        out = []
        for ci, combo in enumerate(self.combos):
            for s in sorted(self.by_combo[combo], key=lambda s: s.case.backend):
                out.extend(self._series_traces(s, ci))
        return out

    def _series_traces(self, s: Series, ci: int) -> list[dict[str, Any]]:
        first = max(0, len(s.points) - self.last) if self.last else 0
        idx = list(range(first, len(s.points)))
        colour = self.colours.get(s.case.backend, "#333")
        meta = {"combo": ci}
        visible = ci == 0
        base = len(self.hovers)
        self.hovers.extend(_hover(s, i) for i in idx)
        ok = [(k, i) for k, i in enumerate(idx) if s.points[i].median is not None]
        xs = [_x(s.points[i].time) for _, i in ok]
        band_hi = [s.points[i].ci_high or s.points[i].median for _, i in ok]
        band_lo = [s.points[i].ci_low or s.points[i].median for _, i in ok]
        name = ptext(s.case.backend)
        traces: list[dict[str, Any]] = [
            {"type": "scatter", "mode": "lines", "x": xs + xs[::-1], "y": band_hi + band_lo[::-1], "fill": "toself",
             "fillcolor": colour, "opacity": 0.18, "line": {"width": 0}, "hoverinfo": "skip", "showlegend": False,
             "legendgroup": name, "name": f"{name} 95% CI", "meta": meta, "visible": visible},
            {"type": "scatter", "mode": "lines+markers", "name": name, "legendgroup": name, "x": xs,
             "y": [s.points[i].median for _, i in ok], "line": {"color": colour, "width": 1.6},
             "marker": {"color": colour, "size": 5}, "meta": {**meta, "h": [base + k for k, _ in ok]},
             "hovertemplate": "%{hovertext}<extra></extra>", "visible": visible}]
        bad = [(k, i) for k, i in enumerate(idx) if s.points[i].median is None and s.points[i].status != "skipped"]
        if bad:
            floor = min((v for v in band_lo if v), default=1.0)
            traces.append({"type": "scatter", "mode": "markers", "name": f"{name} failing", "legendgroup": name,
                           "x": [_x(s.points[i].time) for _, i in bad], "y": [floor] * len(bad),
                           "marker": {"symbol": "x", "color": "#cf222e", "size": 9}, "showlegend": False,
                           "meta": {**meta, "h": [base + k for k, _ in bad]},
                           "hovertemplate": "%{hovertext}<extra></extra>", "visible": visible})
        for direction in ("slower", "faster"):
            marks = [st for st in s.steps if st.direction == direction and st.index >= first]
            if not marks:
                continue
            hov = len(self.hovers)
            self.hovers.extend(f"<b>{direction} {(st.ratio - 1) * 100:+.1f}%</b> ({st.before:.4g} → {st.after:.4g} "
                               f"{ptext(s.unit)}), confidence {st.confidence:.4f}<br>between "
                               f"{ptext(st.last_good.label)} and {ptext(st.first_bad.label)}<br>"
                               + "<br>".join(ptext(x) for x in [*st.cautions(), *st.suspects_shown(8)])
                               for st in marks)
            traces.append({"type": "scatter", "mode": "markers", "name": f"{name} {direction}", "legendgroup": name,
                           "x": [_x(st.first_bad.time) for st in marks], "y": [st.first_bad.median for st in marks],
                           "marker": {"symbol": "triangle-up" if direction == "slower" else "triangle-down",
                                      "size": 15, "color": STEP_COLOURS[direction],
                                      "line": {"color": "white", "width": 1}},
                           "meta": {**meta, "h": list(range(hov, hov + len(marks)))}, "showlegend": False,
                           "hovertemplate": "%{hovertext}<extra></extra>", "visible": visible})
        return traces

    def yaxis(self) -> dict[str, Any]:
        """Linear from zero (a step reads as its share of the time), but logarithmic when the medians the chart holds
        span more than LOG_SPAN (an interpreted or a slow backend would flatten every other line at zero)."""
        unit = "µs" if self.unit == "us" else self.unit
        medians = [p.median for ss in self.by_combo.values() for s in ss for p in s.points if p.median]
        title = {"title": {"text": f"time per call ({ptext(unit)})"}}
        if medians and max(medians) > LOG_SPAN * min(medians):
            return {**AXIS, **title, "type": "log"}
        return {**AXIS, **title, "rangemode": "tozero"}

    def figure(self) -> dict[str, Any]:
        return {"data": self.traces(), "layout": {
            "title": {"text": f"<b>{ptext(self.op)}</b> on {ptext(self.device)}: median per commit",
                      "x": 0.01, "xanchor": "left", "font": {"size": 14}},
            "xaxis": {**AXIS, "title": {"text": "commit time (run time without a commit)"}, "type": "date"},
            "yaxis": self.yaxis(),
            "margin": {"l": 60, "r": 10, "t": 36, "b": 44}, "height": 380, "hovermode": "closest",
            "plot_bgcolor": "white", "paper_bgcolor": "white", "legend": {"font": {"size": 11}},
            "font": {"family": "system-ui, -apple-system, Segoe UI, sans-serif", "size": 12}}}


def _too_short(series: Sequence[Series]) -> str:
    short = sum(s.sigma is None for s in series)
    return (f" <b>{short} of them have fewer than 3 timed points</b>: too short to show a step yet." if short else "")


def render(series: Sequence[Series], db: str = "", threshold: float = 0.05, last: int | None = None) -> str:
    colours = palette([s.case.backend for s in series])
    data: dict[str, Any] = {"figs": [], "hover": [], "samples": {}, "boxLayout": {}, "colours": colours,
                            "tables": {"steps": steps_table(series)}}
    groups: dict[tuple[str, str, str], list[Series]] = defaultdict(list)
    for s in series:
        groups[(s.case.op, s.fingerprint_id, s.device)].append(s)
    n_slow = sum(st.direction == "slower" for s in series for st in s.steps)
    n_fast = sum(st.direction == "faster" for s in series for st in s.steps)
    fps = sorted({(s.fingerprint_id, s.device) for s in series})
    runs = {r for s in series for p in s.points for r in p.run_ids}
    sections = [
        '<section id="steps"><h2>Detected regressions and improvements</h2>'
        f'<p><span class="pill{" bad" if n_slow else ""}">{n_slow} slower</span>'
        f'<span class="pill{" good" if n_fast else ""}">{n_fast} faster</span>'
        f"<span class='muted'>level shifts beyond ±{fmt_pct(100 * threshold)} of a case's median per commit, "
        "confirmed at p &lt; 0.01 (Bonferroni over the series); regressions first. See docs/history.md.</span></p>"
        '<div data-table="steps"></div></section>',
        f'<section id="overview"><h2>Series</h2><p>{len(series)} series (case × device fingerprint) from '
        f"{len(runs)} runs in <span class='code'>{esc(db)}</span>. Fingerprints: "
        + ", ".join(f"<b>{esc(d)}</b> <span class='code'>{esc(f)}</span>" for f, d in fps)
        + ". Runs of different fingerprints never share a series; a run without a git commit is a point of its own, "
          "shown as <i>no commit</i>." + _too_short(series) + "</p></section>"]
    nav = []
    for gi, ((op, fid, device), ss) in enumerate(sorted(groups.items())):
        key = f"op{gi}"
        fig = TrendFigure(op, device, ss, colours, data["hover"], last)
        data["figs"].append({"id": f"{key}-fig0", "fig": fig.figure()})
        controls = ""
        if len(fig.combos) > 1:
            options = "".join(f'<option value="{i}">{esc(fig.label(c))}</option>' for i, c in enumerate(fig.combos))
            controls = (f'<div class="controls"><label>parameters: <select class="sb-combo" data-op="{key}">'
                        f"{options}</select></label></div>")
        else:
            controls = f"<div class='controls muted'>{esc(fig.label(fig.combos[0]))}</div>"
        anchor = f"trend-{_anchor(op)}-{_anchor(fid)}"
        where = f" · {device} {fid[:12]}" if len(fps) > 1 else ""  # two fingerprints: two links per op, told apart
        nav.append(f'<a href="#{anchor}">{esc(op + where)}</a>')
        steps = sum(len(s.steps) for s in ss)
        sections.append(f'<section id="{anchor}" class="trend"><h2>{esc(op)} <span class="muted">on {esc(device)} '
                        f'({esc(fid)}){f" · {steps} step(s)" if steps else ""}</span></h2>{controls}'
                        f'<div data-op-figs="{key}"><div id="{key}-fig0"></div></div></section>')
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    nonce = secrets.token_urlsafe(16)
    title = f"spark-bench trends: {len(series)} series, {n_slow} slower, {n_fast} faster"
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; script-src \'nonce-{nonce}\' '
        "'unsafe-eval'; style-src 'unsafe-inline'; img-src data: blob:; font-src data:\">",
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>",
        f'<header class="top"><b>spark-bench trends</b><a href="#steps">steps</a><a href="#overview">series</a>'
        f'{"".join(nav)}<span class="muted" style="margin-left:auto">generated {when}</span></header><main>',
        *sections, "</main>",
        f'<script type="application/json" id="sb-data">{script_json(data)}</script>',
        f'<script nonce="{nonce}">{plotly.offline.get_plotlyjs()}</script>', f'<script nonce="{nonce}">{JS}</script>',
        "</body></html>"])


def write_trends(series: Sequence[Series], out_path: Path | str, db: Path | str = "", threshold: float = 0.05,
                 last: int | None = None) -> Path:
    """Write the trend page (atomically) and return its path."""
    from spark_bench.results import write_text_atomic

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, render(series, str(db), threshold, last))  # a failed write leaves no .tmp behind
    return out
