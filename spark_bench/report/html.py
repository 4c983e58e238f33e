"""Assembly of the self-contained report page: static sections escaped with html.escape, and one JSON block (every
`<`, `>`, `&` written as \\u003c etc.) that the page script reads for the figures, raw samples and tables."""

from __future__ import annotations

import datetime as dt
import html
import json
import secrets
from collections import Counter
from collections.abc import Sequence
from typing import Any

import plotly.offline

from spark_bench.console import fmt_num, fmt_pct
from spark_bench.report import tables
from spark_bench.report.assets import CSS, JS, palette
from spark_bench.report.charts import OpCharts
from spark_bench.report.compare import CaseDiff, compare_runs, pct, tally
from spark_bench.report.model import (
    MAX_BOX_SAMPLES,
    RunData,
    by_op,
    failure_text,
    interpreted_backends,
    op_summary,
    params_text,
    problems,
    timed_on,
    timing,
    untimed_status,
)
from spark_bench.report.timeline import timeline_section
from spark_bench.report.tuned import tuned_section
from spark_bench.telemetry.calibrate import busy_text, clock_notes

COMPARE_THRESHOLD = 0.05


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def script_json(obj: Any) -> str:
    """JSON that cannot end its <script> element or open a comment: <, >, & escaped, non-ASCII as \\uXXXX.
    Non-finite numbers become null (JSON.parse rejects NaN); the round trip runs at the json module's C speed."""
    text = json.dumps(obj, separators=(",", ":"), default=str)
    if "NaN" in text or "Infinity" in text:
        text = json.dumps(json.loads(text, parse_constant=lambda _: None), separators=(",", ":"))
    for ch, rep in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):  # ASCII output: no U+2028 left
        text = text.replace(ch, rep)
    return text


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "static") -> str:
    """A static table; every cell is escaped unless given as a Markup (pre-escaped) string."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


class Markup(str):
    """HTML built here from escaped parts."""


def _inner(c: Any) -> str:
    return c if isinstance(c, Markup) else esc("" if c is None else c)


def _cell(c: Any) -> str:
    numeric = isinstance(c, (int, float)) and not isinstance(c, bool)
    return f'<td class="num">{esc(c)}</td>' if numeric else f"<td>{_inner(c)}</td>"


# --- sections --------------------------------------------------------------------------------------------------------
def environment(runs: Sequence[RunData]) -> str:
    def row(name: str, f) -> tuple[str, list[Any]]:
        return name, [f(r) for r in runs]

    def dev(r: RunData) -> str:
        d = r.fingerprint.get("device") or {}
        bits = [d.get("name") or "?", f"sm_{d['capability']}" if d.get("capability") else "",
                f"{d['sm_count']} SMs" if d.get("sm_count") else "",
                f"{d['memory_bytes'] / 2**30:.0f} GiB" if d.get("memory_bytes") else "",
                f"L2 {d['l2_bytes'] / 2**20:.0f} MiB" if d.get("l2_bytes") else ""]
        return " · ".join(b for b in bits if b)

    def versions(r: RunData) -> str:
        v = r.fingerprint.get("versions") or {}
        return "  ".join(f"{k} {x}" for k, x in v.items() if x)

    def git(r: RunData) -> str:
        g = r.fingerprint.get("git") or {}
        return f"{g.get('commit') or 'unknown'}{' (dirty)' if g.get('dirty') else ''}"

    def sweep(r: RunData) -> str:
        s = r.run.get("spec") or {}
        parts = [f"ops {', '.join(map(str, s.get('ops') or []))}" if s.get("ops") else "",
                 "quick" if s.get("quick") else "", f"preset {s['preset']}" if s.get("preset") else "",
                 f"seed {s['seed']}" if s.get("seed") is not None else ""]
        return "; ".join(p for p in parts if p)

    def summary(r: RunData) -> Markup:
        s = {**(r.run.get("summary") or {}), "budget left": (r.run.get("stopped_by_budget") or {}).get("cases_left")}
        bad = ("mismatch", "error", "crash", "timeout", "oom")
        return Markup(" ".join(f'<span class="pill{" bad" if k in bad else ""}">{esc(k)} {esc(n)}</span>'
                               for k, n in s.items() if n))

    fp = lambda r: r.fingerprint  # noqa: E731

    def weights_text(w):  # --weights / --routing (docs/weights.md)
        if not w:
            return "random (seeded factories)"
        parts = []
        if w.get("path"):
            parts.append(f"{w['path']} layer {w.get('layer')} ({w.get('format')}, {w.get('family')}, "
                         f"{w.get('size_bytes', 0) / 1e6:.1f} MB, layer sha256 {str(w.get('sha256'))[:16]})")
        if w.get("routing"):
            parts.append(f"routing {w['routing']['path']} (sha256 {str(w['routing'].get('sha256'))[:16]})")
        return "; ".join(parts)

    rows = [
        row("run", lambda r: f"{r.run.get('run_id', r.path.name)}  ({r.path})"),
        row("when", lambda r: f"{r.run.get('created', '?')} → {r.run.get('finished') or 'unfinished'}"),
        row("device", dev),
        row("driver / CUDA", lambda r: " / ".join(str((fp(r).get("device") or {}).get(k) or "-")
                                                  for k in ("driver", "cuda"))),
        row("CPU / host", lambda r: f"{(fp(r).get('cpu') or {}).get('model', '?')} · {fp(r).get('host', '?')} · "
                                    f"{fp(r).get('os', '?')}"),
        row("versions", lambda r: f"python {fp(r).get('python', '?')}  {versions(r)}"),
        row("git commit", git),
        row("command", lambda r: Markup(f'<span class="code">{esc(" ".join(map(str, r.run.get("command") or [])))}'
                                        "</span>")),
        row("sweep", sweep),
        row("fingerprint", lambda r: fp(r).get("fingerprint_id") or "?"),
        row("power limit", lambda r: _power_limit_text(fp(r).get("power"))),
        row("weights", lambda r: weights_text(fp(r).get("weights"))),
        row("cases", summary),
        row("roofline peaks", calibration),
        row("Triton", lambda r: f"interpreted (TRITON_INTERPRET=1): {_interpreted_text(r)} ran in the Triton "
                                "interpreter, numbers measure Python, not a kernel" if _interpreted_text(r)
                                else "compiled"),
    ]
    if len(runs) == 1:  # one run: key/value pairs flow in columns across the page
        pairs = "".join(f"<div><b>{esc(k)}</b><span>{_inner(v[0])}</span></div>" for k, v in rows)
        return f'<section id="env"><h2>Environment</h2><div class="envgrid">{pairs}</div></section>'
    table = _table([""] + [r.label for r in runs], [[Markup(f"<b>{esc(k)}</b>"), *v] for k, v in rows], "static env")
    return f'<section id="env"><h2>Environment</h2>{table}</section>'


def _power_limit_text(power: Any) -> str:
    """The GPU's power limit at the run's start (NVML) against its default (capped: slower), and whether MIG was on."""
    if not isinstance(power, dict) or power.get("limit_w") is None:
        return "not read (no NVML, or a CPU)"
    default, mig = power.get("default_limit_w"), "; MIG enabled: the whole GPU's" if power.get("mig") else ""
    capped = default is not None and power["limit_w"] < default
    return f"{power['limit_w']} W" + (f" (default {default} W{': capped' if capped else ''})" if default else "") + mig


def calibration(run: RunData) -> str:
    """Where the measured roofline peaks come from and how old they were when the run began: they are measured once
    per device fingerprint and cached (~/.cache/spark-bench/roofline.json), shared by every later run."""
    roof = run.run.get("roofline") or {}
    measured, sheet = roof.get("measured") or {}, roof.get("datasheet") or {}
    parts = []
    if measured:
        when, age = measured.get("measured_at"), _age(measured.get("measured_at"), run.run.get("created"))
        parts.append(f"measured {when or 'at an unknown time'}" + (f", {age} before this run" if age else "")
                     + " (cached per device fingerprint, shared by later runs; `spark-bench calibrate --force` "
                       "re-measures)")
        if measured.get("busy"):
            parts.append(f"taken while the machine was {busy_text(measured)}: the peaks are likely low, so % of "
                         "roofline reads high")
        parts += [f"measured slowed, {note}: that peak is likely low" for note in clock_notes(measured)]
    else:
        parts.append("not measured")
    if sheet:
        parts.append(f"datasheet {sheet.get('name') or ''}".strip())
    return "; ".join(parts)


def _age(then: Any, now: Any) -> str | None:
    """'3 d 4 h', '2 h 5 min', '40 s' from two ISO-8601 times (with offsets), None when either is unreadable."""
    try:
        seconds = (dt.datetime.fromisoformat(str(now)) - dt.datetime.fromisoformat(str(then))).total_seconds()
    except (TypeError, ValueError):
        return None
    seconds = max(0.0, seconds)
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    if days:
        return f"{days} d {hours} h"
    return f"{hours} h {rest // 60} min" if hours else (f"{rest // 60} min" if rest >= 60 else f"{rest} s")


def _interpreted_text(run: RunData) -> str:
    return ", ".join(sorted(interpreted_backends(run.results)))


OVER_PEAK_MARK = " †"  # a best % of roofline above 100: explained under the summary


def summary(runs: Sequence[RunData], baseline: str, colours: dict[str, str]) -> str:
    multi = len(runs) > 1
    per_op = sorted((op, ri, results) for ri, run in enumerate(runs) for op, results in by_op(run.results).items())
    rows = [_summary_row(op, runs[ri], results, baseline, colours, multi) for op, ri, results in per_op]
    headers = ["op"] + (["run"] if multi else []) + ["fastest correct backend", f"speedup over {baseline}",
                                                    "best % of roofline", "cases", "ok", "mismatch", "failed",
                                                    "skipped"]
    interp = sorted(interpreted_backends(r for run in runs for r in run.results))
    note = (f'<p class="sb-interpreted"><b>Interpreted:</b> {esc(", ".join(interp))} ran in the Triton interpreter '
            "(CPU, TRITON_INTERPRET=1): their times measure the interpreter, not a GPU kernel.</p>") if interp else ""
    where = "<br>".join(f"{esc(r.label) + ': t' if multi else 'T'}imed {esc(timed_on([r], r.results))}"
                        + (" (every time is CPU code, torch's included: not a GPU kernel)" if r.on_cpu else "")
                        for r in runs)
    note = f'<p class="sb-device">{where}</p>{note}'
    over = any(isinstance(cell, str) and cell.endswith(OVER_PEAK_MARK) for row in rows for cell in row)
    return (f'<section id="summary"><h2>Summary</h2>{note}{_table(headers, rows)}'
            f'<p class="muted">Fastest = highest geometric-mean speedup over <b>{esc(baseline)}</b> across the shapes '
            "both ran correctly (the fp32 reference is not a contender). Roofline % uses the stored per-case values, "
            "else GB/s and TFLOP/s against the run's measured (preferred) or datasheet peaks."
            + (f"{OVER_PEAK_MARK} Above 100%: the case's data fit in a cache (small shapes), an fp32 op ran on TF32, "
               "or the peak was measured low (Environment, roofline peaks)." if over else "") + "</p></section>")


def _summary_row(op: str, run: RunData, results: list, baseline: str, colours: dict[str, str],
                 multi: bool) -> list[Any]:
    s = op_summary(op, results, run.run, baseline)
    c = s["counts"]

    interpreted = interpreted_backends(results)

    def interp(backend: str) -> str:  # an interpreted backend's name says so wherever the summary gives it
        return " (interpreted)" if backend in interpreted else ""

    fastest = Markup("<span class='muted'>none timed</span>")
    if s.get("fastest"):
        fastest = Markup(f'<span class="swatch" style="background:{colours.get(s["fastest"], "#333")}">'
                         f'</span><b>{esc(s["fastest"])}</b>{interp(s["fastest"])}')
    if s.get("fastest") == baseline:  # 3 significant digits: an interpreted 0.00146x never reads 0.00x
        nxt = s.get("runner_up")
        speed = Markup("<span class='muted'>the baseline is fastest" + (
            f"; next {esc(nxt[0])}{interp(nxt[0])} at {fmt_num(nxt[1])}× (geomean)" if nxt else "") + "</span>")
    elif "speedup" in s:
        speed = Markup(f"<b>{fmt_num(s['speedup'])}×</b> <span class='muted'>geomean over {s['compared']} shapes, "
                       f"{fmt_num(s['speedup_min'])}–{fmt_num(s['speedup_max'])}×</span>")
    elif "wins" in s:
        speed = Markup(f"<span class='muted'>no {esc(baseline)} baseline; fastest on {s['wins']}/"
                       f"{s['shapes']} shapes</span>")
    else:
        speed = Markup("<span class='muted'>n/a</span>")
    roof = f"{fmt_pct(s['roofline'][0])} of {s['roofline'][1]}" if s.get("roofline") else "n/a"
    if s.get("roofline") and s["roofline"][0] > 100:
        roof += OVER_PEAK_MARK
    failed = sum(n for k, n in c.items() if k not in ("ok", "mismatch", "skipped"))
    link = Markup(f'<a href="#op-{_op_anchor(op)}">{esc(op)}</a>')
    return [link] + ([run.label] if multi else []) + [fastest, speed, roof, s["cases"], c.get("ok", 0),
                                                      _count(c.get("mismatch", 0)), _count(failed),
                                                      c.get("skipped", 0)]


def _count(n: int) -> Markup:
    return Markup(f'<span class="pill bad">{n}</span>' if n else "0")


def _op_anchor(op: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in op)


def problems_section(runs: Sequence[RunData]) -> str:
    failed_rows, skipped_rows = [], []
    for run in runs:
        failed, skipped = problems(run.results)
        for r in failed:
            failed_rows.append(([run.label] if len(runs) > 1 else []) + [
                r.get("op"), r.get("backend"), r.get("dtype"), params_text(r.get("params") or {}),
                Markup(f'<span class="st-{esc(r.get("status"))}">{esc(r.get("status"))}</span>'),
                Markup(f'<div class="err">{esc(failure_text(r))}</div>')])
        for s in skipped:
            skipped_rows.append(([run.label] if len(runs) > 1 else []) + [s["op"], s["backend"], s["count"],
                                                                          s["reason"]])
    lead = ["run"] if len(runs) > 1 else []
    parts = ['<section id="problems"><h2>Mismatches and failures</h2>']
    if failed_rows:
        parts.append(f'<p><span class="pill bad">{len(failed_rows)} cases did not pass</span> every one is listed '
                     "with its error, and marked ✕ at the bottom of its op's latency chart.</p>")
        parts.append(_table(lead + ["op", "backend", "dtype", "params", "status", "error"], failed_rows))
    else:
        parts.append('<p><span class="pill good">no mismatches or failures</span></p>')
    if skipped_rows:
        n = sum(r[-2] for r in skipped_rows)
        parts.append(f"<details><summary>{n} skipped cases (unavailable backends), by reason</summary>"
                     f"{_table(lead + ['op', 'backend', 'cases', 'reason'], skipped_rows)}</details>")
    parts.append("</section>")
    return "".join(parts)


def comparison(runs: Sequence[RunData], diffs: dict[int, list[CaseDiff]], data: dict[str, Any],
               threshold: float = COMPARE_THRESHOLD, metric: str = "median") -> str:
    parts = ['<section id="compare"><h2>Run comparison</h2>',
             f"<p class='muted'>Each run against <b>{esc(runs[0].label)}</b>, cases matched by (op, backend, params, "
             f"dtype); verdicts on the {esc(metric)} from the raw samples (Mann-Whitney U, p &lt; 0.01) and a "
             f"±{pct(threshold)} minimum effect; see docs/report.md.</p>"]
    for ri, ds in diffs.items():
        pills = " ".join(f'<span class="pill v-{esc(k)}">{esc(k)} {n}</span>' for k, n in sorted(tally(ds).items()))
        parts.append(f"<h3>{esc(runs[ri].label)} vs {esc(runs[0].label)}</h3><p>{pills}</p>")
        a, b = (r.fingerprint.get("fingerprint_id") for r in (runs[0], runs[ri]))
        if a != b:  # `compare` refuses this without --allow-different-device; the page says it instead
            parts.append(f'<p class="sb-warn"><b>Different machines:</b> {esc(runs[ri].device_text)} [{esc(b)}] vs '
                         f"{esc(runs[0].device_text)} [{esc(a)}]: these ratios and verdicts compare hardware as much "
                         "as code.</p>")
    data["tables"]["comparison"] = tables.comparison_table(runs, diffs, metric)
    parts.append('<div data-table="comparison"></div></section>')
    return "".join(parts)


def op_section(index: int, charts: OpCharts, verdicts: dict, data: dict[str, Any]) -> str:
    key = f"op{index}"
    figs = charts.figures(verdicts)
    divs = []
    for j, fig in enumerate(figs):
        fid = f"{key}-fig{j}"
        data["figs"].append({"id": fid, "fig": fig})
        divs.append(f'<div id="{fid}"></div>')
    data["samples"][key] = charts.sample_sets()
    data["boxLayout"][key] = charts.box_layout()
    controls = [f"<span class='muted'>timed <b>{esc(charts.context)}</b></span>",
                f"<span class='muted'>swept: <b>{esc(charts.swept or 'none')}</b></span>"]
    if charts.swept and len(charts.combos) > 1:
        options = "".join(f'<option value="{i}">{esc(c)}</option>' for i, c in enumerate(charts.combos))
        controls.append(f'<label>other parameters: <select class="sb-combo" data-op="{key}">{options}</select></label>')
    elif charts.swept:
        controls.append(f"<span class='muted'>at {esc(charts.combos[0])}</span>")
    interp = {b for _, b in charts.interpreted}
    legend = []
    for b in charts.backends:  # each backend with how many of its cases were not timed, and why
        timed = any(timing(r) for rs in charts.per_run for r in rs if r.get("backend") == b)
        untimed = Counter(untimed_status(r) for rs in charts.per_run for r in rs
                          if r.get("backend") == b and not timing(r))
        why = ", ".join(f"{n} {k}" for k, n in sorted(untimed.items()))
        why = f" ({why})" if timed and why else f" (not timed: {why or 'no case'})" if not timed else ""
        legend.append(f'<span class="{"" if timed else "muted"}"><span class="swatch" style="background:'
                      f'{charts.colours.get(b, "#333")}"></span>{esc(b)}{" (interpreted)" if b in interp else ""}'
                      f"{esc(why)}</span>")
    controls.append(f"<span>{' '.join(legend)}</span>")
    body = (f'<div class="grid" data-op-figs="{key}">{"".join(divs)}</div>' if divs
            else "<p class='muted'>No timed case of this op: see the failures above.</p>")
    boxes = ""
    if data["samples"][key]:
        thinned = sum("of" in entry for entry in data["samples"][key])
        which = (f"every stored sample; {thinned} case(s) with more than {MAX_BOX_SAMPLES} drawn from "
                 f"{MAX_BOX_SAMPLES} evenly spaced order statistics" if thinned else "every stored sample")
        boxes = (f'<details class="sb-box" data-op="{key}"><summary>Raw-sample distributions (box plots of '
                 f'{which}, drawn when opened)</summary><div class="sb-boxplot"></div></details>')
    return (f'<section id="op-{_op_anchor(charts.op)}"><h2>{esc(charts.op)}</h2>'
            f'<div class="controls">{"".join(controls)}</div>{body}{boxes}</section>')


# --- the page --------------------------------------------------------------------------------------------------------
def render(runs: Sequence[RunData], baseline: str = "torch", threshold: float = COMPARE_THRESHOLD,
           metric: str = "median") -> str:
    """The report page; `threshold` and `metric` make its comparison's verdicts (`compare --html` passes its own)."""
    everything = [r for run in runs for r in run.results]
    colours = palette([str(r.get("backend")) for r in everything])
    ops = sorted({str(r.get("op")) for r in everything})
    data: dict[str, Any] = {"figs": [], "hover": [], "samples": {}, "boxLayout": {}, "colours": colours, "tables": {}}
    diffs = {ri: compare_runs(runs[0], runs[ri], threshold, metric) for ri in range(1, len(runs))}
    verdicts = {(ri, id(d.new)): d.verdict for ri, ds in diffs.items() for d in ds if d.new is not None}
    sections = [summary(runs, baseline, colours), problems_section(runs), environment(runs)]
    sections.append(tuned_section(runs, _table, esc))  # `run --tuned`: the tuned config each kernel ran
    timeline = timeline_section(runs, data, esc)  # a GPU run's NVML power/clock samples over time
    sections.append(timeline)
    if diffs:
        sections.append(comparison(runs, diffs, data, threshold, metric))
    for i, op in enumerate(ops):
        charts = OpCharts(op, runs, colours, baseline, hovers=data["hover"], metric=metric)
        sections.append(op_section(i, charts, verdicts, data))
    data["tables"]["cases"] = tables.cases_table(runs, baseline)
    sections.append('<section id="cases"><h2>All cases</h2><div data-table="cases"></div></section>')
    nav = "".join(f'<a href="#op-{_op_anchor(op)}">{esc(op)}</a>' for op in ops)
    title = f"spark-bench report: {', '.join(r.label for r in runs)}"
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    nonce = secrets.token_urlsafe(16)  # only our own scripts run, even if some markup slipped through unescaped
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; script-src \'nonce-{nonce}\' '
        "'unsafe-eval'; style-src 'unsafe-inline'; img-src data: blob:; font-src data:\">",
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>",
        f'<header class="top"><b>spark-bench</b><span>{esc(", ".join(r.label for r in runs))}</span>'
        f'<a href="#summary">summary</a><a href="#problems">failures</a><a href="#env">environment</a>'
        + ('<a href="#compare">comparison</a>' if diffs else "")
        + ('<a href="#timeline">power timeline</a>' if timeline else "")
        + f'<a href="#cases">all cases</a>{nav}'
        f'<span class="muted" style="margin-left:auto">generated {when}</span></header><main>',
        *sections, "</main>",
        f'<script type="application/json" id="sb-data">{script_json(data)}</script>',
        f'<script nonce="{nonce}">{plotly.offline.get_plotlyjs()}</script>', f'<script nonce="{nonce}">{JS}</script>',
        "</body></html>",
    ])
