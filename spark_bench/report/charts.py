"""Plotly figures of one op, as plain JSON-able dicts (plotly.js draws them; the page embeds plotly.js once).

Every figure of an op shares its traces' `meta.combo`: the index of the combination of non-swept parameters (and dtype)
the trace belongs to, so one selector per op switches all its charts at once; traces without it always show.
Every text that reaches plotly (names, hovers, titles) is HTML-escaped: plotly renders a subset of HTML tags in them.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from spark_bench.console import below_resolution, ci_is_range, fmt_num, fmt_pct, rate_text
from spark_bench.report.compare import ratio_ci
from spark_bench.report.model import (
    MAX_BOX_SAMPLES,
    NOT_A_CONTENDER,
    RunData,
    baseline_twins,
    combo_key,
    failure_text,
    interpreted_backends,
    log_scale,
    match_key,
    natural_key,
    number,
    order_statistics,
    params_text,
    peaks,
    roofline_pct,
    speedups,
    swept_axis,
    time_unit,
    timed_on,
    timing,
    untimed_status,
)

DASHES = ["solid", "dash", "dot", "dashdot", "longdash"]
SYMBOLS = ["circle", "square", "diamond", "triangle-up", "x"]
AXIS = {"gridcolor": "#e5e5e5", "zerolinecolor": "#cccccc", "linecolor": "#999999", "showline": True}


def ptext(x: Any) -> str:
    """Text for plotly, which renders a few HTML tags and decodes &lt; &gt; &amp; &#37; (but not &quot;). `%` is
    written &#37;: a trace with `meta` reads `%{...}` in its name as a template (a label's `%{y}` vanished)."""
    return html.escape(str(x), quote=False).replace("%", "&#37;")


def _layout(title: str, x_title: str, y_title: str, x_log: bool = False, y_log: bool = False,
            categorical: bool = False, subtitle: str = "") -> dict[str, Any]:
    """Plotly layout; `subtitle` (plain text, escaped here): where and how the numbers were taken, so a chart saved
    on its own (the camera button) still says it."""
    x_type = "log" if x_log else ("category" if categorical else "linear")
    xaxis = {**AXIS, "title": {"text": ptext(x_title)}, "type": x_type}
    yaxis = {**AXIS, "title": {"text": ptext(y_title)}, "type": "log" if y_log else "linear"}
    if y_log:
        yaxis["dtick"] = 1  # one tick per decade; plotly's default 2/5 minor labels read as noise
    head = {"subtitle": {"text": ptext(subtitle), "font": {"size": 11, "color": "#5b6475"}}} if subtitle else {}
    return {
        "title": {"text": f"<b>{ptext(title)}</b>", "x": 0.01, "xanchor": "left", "font": {"size": 14}, **head},
        "xaxis": xaxis, "yaxis": yaxis,
        "margin": {"l": 60, "r": 10, "t": 52 if subtitle else 36, "b": 44}, "height": 346 if subtitle else 330,
        "hovermode": "closest",
        "plot_bgcolor": "white", "paper_bgcolor": "white", "legend": {"font": {"size": 11}},
        "font": {"family": "system-ui, -apple-system, Segoe UI, sans-serif", "size": 12},
    }


class OpCharts:
    """The charts of one op across the runs given (one line per backend and run; runs differ by dash).

    Hover texts are stored once per case in the page-wide `hovers` list; a trace carries their indices in `meta.h`
    and the page script expands them, so thousands of cases do not repeat their hover in every chart. Cases that were
    not timed (mismatch, error, crash, ...; skipped ones aside) are marked ✕ on the latency chart with their error.
    """

    def __init__(self, op: str, runs: Sequence[RunData], colours: dict[str, str], baseline: str = "torch",
                 hovers: list[str] | None = None, metric: str = "median"):
        self.op, self.runs, self.colours, self.baseline, self.metric = op, runs, colours, baseline, metric
        self.hovers = hovers if hovers is not None else []
        self.per_run = [[r for r in run.results if r.get("op") == op] for run in runs]
        every = [r for rs in self.per_run for r in rs]
        self.swept = swept_axis(every)
        timed = [(ri, r) for ri, rs in enumerate(self.per_run) for r in rs if timing(r)]
        untimed = [(ri, r) for ri, rs in enumerate(self.per_run) for r in rs
                   if not timing(r) and r.get("status") != "skipped"]
        first: dict[str, None] = {}
        for _, r in sorted(timed + untimed, key=lambda t: natural_key(t[1])):
            first.setdefault(self.combo(r), None)
        self.combos = list(first) or [""]
        self.backends = sorted({str(r.get("backend")) for r in every})
        # (run index, backend) whose numbers come from the Triton interpreter: every legend says so
        self.interpreted = {(ri, b) for ri, rs in enumerate(self.per_run) for b in interpreted_backends(rs)}
        self.unit = "µs" if (unit := time_unit(r for _, r in timed)) == "us" else unit  # as the axes name it
        self.x_log = bool(self.swept) and log_scale(r["params"][self.swept] for _, r in timed)
        self.context = timed_on(self.runs, every)  # every chart's subtitle: device(s) and timer(s)
        self.twins = [baseline_twins(rs, baseline) for rs in self.per_run]
        self.speedups = [speedups(rs, baseline, twins) for rs, twins in zip(self.per_run, self.twins, strict=True)]
        self.hid: dict[int, int] = {}
        self.groups: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
        self.failed: dict[tuple[int, str, int], list[dict[str, Any]]] = {}  # not timed: ✕ on the latency chart
        combo_index = {c: i for i, c in enumerate(self.combos)}
        for ri, r in timed + untimed:
            self.hid[id(r)] = len(self.hovers)
            self.hovers.append(self.hover(r, ri) if timing(r) else self.failure_hover(r, ri))
            into = self.groups if timing(r) else self.failed
            into.setdefault((ri, str(r.get("backend")), combo_index[self.combo(r)]), []).append(r)
        for rs in (*self.groups.values(), *self.failed.values()):
            rs.sort(key=lambda r: self.x(r) if self.swept else str(self.x(r)))

    def combo(self, r: dict[str, Any]) -> str:
        return combo_key(r, self.swept) if self.swept else ""

    def x(self, r: dict[str, Any]) -> Any:
        """The swept value, or (no numeric sweep) the case's escaped label on a categorical axis."""
        return r["params"][self.swept] if self.swept else ptext(combo_key(r, None))

    @property
    def x_title(self) -> str:
        return self.swept or "case"

    def speedup_ci(self, r: dict[str, Any], ri: int) -> tuple[float, float] | None:
        """The speedup's CI: the two medians' stored CIs combined on a log scale, as `compare` does for its ratio."""
        if (v := self.speedups[ri].get(id(r))) is None:
            return None
        cis = [(number(timing(x).get("ci_low")) or 0.0, number(timing(x).get("ci_high")) or 0.0)
               for x in (r, self.twins[ri][id(r)])]
        return ratio_ci(v, *cis)  # None (no bar) when a CI is missing

    def name(self, backend: str, run_index: int) -> str:
        text = backend if len(self.runs) == 1 else f"{backend} · {self.runs[run_index].label}"
        return ptext(text + (" (interpreted)" if (run_index, backend) in self.interpreted else ""))

    def hover(self, r: dict[str, Any], run_index: int) -> str:
        """Everything about one timed case: parameters, statistics, timer, throughput, roofline, energy."""
        t = timing(r)
        med, iqr = t["median"], number(t.get("iqr"))
        unit = ptext(self.unit)
        g = {k: fmt_num(number(t.get(k)), 4) for k in ("p10", "p90", "ci_low", "ci_high")}  # '-': stored as null
        what = f"range of {fmt_num(number(t.get('n')))}" if ci_is_range(t) else "95% CI"
        ci = f" ({what} {g['ci_low']}–{g['ci_high']})" if number(t.get("ci_low")) is not None else ""
        lost = " (below the timer's resolution)" if below_resolution(t) else ""
        lines = [self._who(r, run_index),
                 f"median {med:.4g} {unit}{lost}{ci}  p10 {g['p10']}  p90 {g['p90']}",
                 f"IQR {fmt_num(iqr)}" + (f" ({fmt_pct(100 * iqr / med)})" if iqr is not None and med else "")
                 + f"  n={fmt_num(number(t.get('n')))}  timer {ptext(t.get('timer') or '?')}"
                 + f" on {ptext(self.runs[run_index].device_text)}"]
        rates = [f"{v:.4g} {u}" for v, u in ((number(r.get("gbps")), "GB/s"), (number(r.get("tflops")), "TFLOP/s"))
                 if v is not None]
        pct = roofline_pct(r, self.runs[run_index].run)
        if rates or pct:
            lines.append("  ".join(rates) + (f"  ({fmt_pct(pct[0])} of {ptext(pct[1])} roof)" if pct else ""))
        power = r.get("power") or {}
        if number(power.get("energy_j_per_call")) is not None:
            w = number(power.get("avg_w"))
            lines.append(f"{power['energy_j_per_call'] * 1e6:.4g} µJ/call" + (f"  {w:.0f} W" if w is not None else "")
                         + f"  ({ptext(power.get('source', '?'))})")
        extras = (("labels", ", ".join(map(str, r.get("labels") or []))), ("weights", r.get("weights")),
                  ("timing notes", "; ".join(map(str, t.get("notes") or []))))
        lines += [f"{k}: {ptext(v)}" for k, v in extras if v]
        return "<br>".join(lines)

    def _who(self, r: dict[str, Any], run_index: int) -> str:
        return (f"<b>{self.name(str(r.get('backend')), run_index)}</b>  {ptext(params_text(r.get('params') or {}))}"
                f"  {ptext(r.get('dtype'))}")

    def failure_hover(self, r: dict[str, Any], run_index: int) -> str:
        """A case that was not timed: its status and error (the first 400 characters; the tables hold all of it)."""
        why = failure_text(r) if r.get("status") != "ok" else "checked ok, but no usable timing was stored"
        why = why if len(why) <= 400 else why[:400] + " …"
        return f"{self._who(r, run_index)}<br><b>{ptext(r.get('status'))}</b>: " + "<br>".join(
            ptext(line) for line in why.splitlines())

    def _lines(self, value, template: str, skip_backends=(), errors=None, text=None) -> list[dict[str, Any]]:
        """One trace per (run, backend, combo) of value(result, run_index) -> float|None; errors(result, run_index)
        -> (low, high) or None draws error bars (a point without them gets none); text(result, run_index, bounds)
        -> the point's %{text}, given the bounds errors() returned for it (each computed once)."""
        traces = []
        for (ri, b, ci), rs in sorted(self.groups.items()):
            if b in skip_backends:
                continue
            pts = [(r, v) for r in rs for v in [value(r, ri)] if v is not None]
            if not pts:
                continue
            trace = {
                "type": "scatter", "mode": "lines+markers", "name": self.name(b, ri), "legendgroup": self.name(b, ri),
                "x": [self.x(r) for r, _ in pts], "y": [v for _, v in pts],
                "line": {"color": self.colours.get(b, "#333"), "dash": DASHES[ri % len(DASHES)], "width": 2},
                "marker": {"symbol": SYMBOLS[ri % len(SYMBOLS)], "size": 7},
                "hovertemplate": f"%{{hovertext}}<br>{template}<extra></extra>",
                "meta": {"combo": ci, "h": [self.hid[id(r)] for r, _ in pts]}, "visible": ci == 0,
            }
            bounds = [errors(r, ri) if errors else None for r, _ in pts]
            if text:
                trace["text"] = [text(r, ri, e) for (r, _), e in zip(pts, bounds, strict=True)]
            if errors:
                trace["error_y"] = {"type": "data", "symmetric": False, "thickness": 1.2, "width": 3,
                                    "array": [_gap(e and e[1], v) for (_, v), e in zip(pts, bounds, strict=True)],
                                    "arrayminus": [_gap(v, e and e[0]) for (_, v), e in zip(pts, bounds, strict=True)]}
            traces.append(trace)
        return traces

    def _figure(self, title: str, y_title: str, traces: list[dict[str, Any]], y_log: bool | None = None,
                hline: float | None = None) -> dict[str, Any] | None:
        if not traces:
            return None
        ys = [y for t in traces for y in t["y"]]
        if y_log is None:  # one shape per trace (no sweep): bars of backends that differ a lot, a log axis keeps
            single = not self.swept or len({x for t in traces for x in t["x"]}) == 1  # the fast ones off zero
            y_log = log_scale(ys + ([hline] if hline else [])) or (  # 0.001x drawn against 1x: not on zero
                single and len({y for y in ys if y > 0}) > 1 and min(ys) > 0)
        layout = _layout(title, self.x_title, y_title, x_log=self.x_log, categorical=not self.swept, y_log=y_log,
                         subtitle=self.context)
        xs = sorted({x for t in traces for x in t["x"]}) if self.swept else []
        if 1 < len(xs) <= 16:  # tick exactly at the swept values
            layout["xaxis"].update(tickmode="array", tickvals=xs, ticktext=[f"{x:g}" for x in xs])
        if hline is not None:
            layout["shapes"] = [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": hline, "y1": hline,
                                 "line": {"color": "#555", "width": 1, "dash": "dot"}}]
        return {"data": traces, "layout": layout}

    # --- the charts ---------------------------------------------------------------------------------------------
    def latency(self) -> dict[str, Any] | None:
        traces = self._lines(lambda r, ri: timing(r)["median"], "",
                             errors=lambda r, ri: (number(timing(r).get("p10")), number(timing(r).get("p90"))))
        fig = self._figure(f"Latency: median, bars p10–p90 ({self.unit})", f"time per call ({self.unit})", traces)
        if fig and self.failed:  # at the chart's floor, so a failing backend or shape is seen, not just missing
            lows = [number(timing(r).get("p10")) or timing(r)["median"] for rs in self.groups.values() for r in rs]
            floor = min((y for y in lows if y > 0), default=1.0)
            fig["data"] += [self._failure_trace(key, rs, floor) for key, rs in sorted(self.failed.items())]
        return fig

    def _failure_trace(self, key: tuple[int, str, int], rs: list[dict[str, Any]], floor: float) -> dict[str, Any]:
        ri, b, ci = key
        statuses = ", ".join(sorted({untimed_status(r) for r in rs}))
        return {"type": "scatter", "mode": "markers", "name": f"{self.name(b, ri)} ✕ {ptext(statuses)}",
                "legendgroup": self.name(b, ri), "x": [self.x(r) for r in rs], "y": [floor] * len(rs),
                "marker": {"symbol": "x", "size": 10, "color": self.colours.get(b, "#333"),
                           "line": {"width": 1, "color": "#cf222e"}},
                "meta": {"combo": ci, "h": [self.hid[id(r)] for r in rs]}, "visible": ci == 0,
                "hovertemplate": "%{hovertext}<extra>not timed</extra>"}

    def speedup_chart(self) -> dict[str, Any] | None:
        base = ptext(self.baseline)

        def ci_text(r, ri, ci):
            return f"(CI {ci[0]:.3g}–{ci[1]:.3g}×)" if ci else ""

        traces = self._lines(lambda r, ri: self.speedups[ri].get(id(r)),
                             f"<b>%{{y:.3g}}× faster than {base}</b> %{{text}}", errors=self.speedup_ci, text=ci_text,
                             skip_backends=(self.baseline, *NOT_A_CONTENDER))
        return self._figure(f"Speedup over {self.baseline} (higher is better, bars: CI)",
                            f"× faster than {self.baseline}", traces, hline=1.0)

    def throughput(self, key: str, what: str, unit: str, counted: str) -> dict[str, Any] | None:
        traces = self._lines(lambda r, ri: number(r.get(key)) or None, f"<b>%{{y:.4g}} {unit}</b>")  # derived
        return self._figure(f"{what} ({unit}): the cost model's {counted} / median time", unit, traces)

    def energy(self) -> dict[str, Any] | None:
        joules = [number((r.get("power") or {}).get("energy_j_per_call")) for rs in self.groups.values() for r in rs]
        top = max((j for j in joules if j is not None), default=None)
        if top is None:
            return None
        unit, scale = ("mJ", 1e3) if top >= 1e-2 else ("µJ", 1e6)

        def value(r, ri):
            e = number((r.get("power") or {}).get("energy_j_per_call"))
            return e * scale if e is not None else None

        traces = self._lines(value, f"<b>%{{y:.4g}} {unit}/call</b>")
        return self._figure(f"Energy per call ({unit}, calls back to back, warm L2; lower is better)",
                            f"{unit} / call", traces)

    def roofline(self) -> dict[str, Any] | None:
        """Arithmetic intensity vs attained TFLOP/s, every case of the op, with the device's roofs when known."""
        traces, ais = [], []
        for ri in range(len(self.runs)):
            for b in self.backends:
                pts = []
                for ci in range(len(self.combos)):
                    for r in self.groups.get((ri, b, ci), []):
                        cost, tf = r.get("cost") or {}, number(r.get("tflops"))
                        flops, nbytes = number(cost.get("flops")), number(cost.get("bytes"))
                        if tf and flops and nbytes and tf > 0 and 0 < flops / nbytes < math.inf:  # log-log: a
                            pts.append((r, flops / nbytes, tf))  # zero or negative (damaged) figure has no place
                if not pts:
                    continue
                ais += [p[1] for p in pts]
                traces.append({
                    "type": "scatter", "mode": "markers", "name": self.name(b, ri), "legendgroup": self.name(b, ri),
                    "x": [p[1] for p in pts], "y": [p[2] for p in pts],
                    "marker": {"color": self.colours.get(b, "#333"), "symbol": SYMBOLS[ri % len(SYMBOLS)], "size": 8,
                               "opacity": 0.8, "line": {"width": 0.5, "color": "white"}},
                    "meta": {"h": [self.hid[id(r)] for r, _, _ in pts]},
                    "hovertemplate": "%{hovertext}<br>AI %{x:.3g} FLOP/byte<extra></extra>",
                })
        if not traces:
            return None
        # each dtype's compute ceiling, the one its % of roofline divides by (bf16's on a GPU, fp32's on most CPUs)
        dtypes = sorted({str(r.get("dtype")) for rs in self.groups.values() for r in rs})
        roofs = [(run, d, p) for run in self.runs for d in dtypes for p in [peaks(run.run, d)]]
        ridges = [q["tflops"] * 1000.0 / q["gbps"] for _, _, p in roofs for q in p.values()
                  if q.get("tflops") and q.get("gbps") and q["tflops"] > 0 and q["gbps"] > 0]
        lo, hi = min(ais + ridges) / 3.0, max(ais + ridges) * 3.0  # the ridge point stays in view
        seen = set()
        for run, d, p in roofs:
            for source, q in sorted(p.items()):
                key = (source, q.get("gbps"), q.get("tflops"))
                if key not in seen:
                    seen.add(key)
                    suffix = f" · {run.label}" if len(self.runs) > 1 else ""
                    what = f"{source} {d} roof" + (f" at the {q['rate_of']} rate" if "rate_of" in q else "") \
                        if q.get("tflops") else f"{source} roof"
                    traces.append(_roof_trace(q, lo, hi, f"{what}{suffix}", source))
        fig = {"data": traces, "layout": _layout("Roofline, all shapes (TFLOP/s vs FLOP/byte)",
                                                 "arithmetic intensity (FLOP / byte)", "TFLOP/s",
                                                 x_log=True, y_log=True, subtitle=self.context)}
        if hi / lo >= 100:
            fig["layout"]["xaxis"]["dtick"] = 1
        return fig

    def ratio_chart(self, verdicts: dict[tuple[int, int], Any]) -> dict[str, Any] | None:
        """New/base of the compared metric per backend (runs 1.. against run 0) with the verdict's CI; `verdicts`
        maps (run_index, id(result)) to Verdict."""
        m = self.metric
        base = {match_key(r): number(timing(r).get(m)) for rs in self.groups_of(0) for r in rs}

        def value(r, ri):
            b, v = base.get(match_key(r)), number(timing(r).get(m))
            return v / b if ri > 0 and b and v is not None else None

        def text(r, ri, bounds):
            v = verdicts.get((ri, id(r)))
            return ptext(v.verdict + (f" (CI {v.ratio_lo:.3f}–{v.ratio_hi:.3f})" if bounds else "")) if v else ""

        def ci(r, ri):
            v = verdicts.get((ri, id(r)))
            return (v.ratio_lo, v.ratio_hi) if v and None not in (number(v.ratio_lo), number(v.ratio_hi)) else None

        traces = self._lines(value, f"<b>%{{y:.3f}}× the time of {ptext(self.runs[0].label)}</b>: %{{text}}",
                             text=text, errors=ci)
        return self._figure(f"Ratio to {self.runs[0].label} ({m} time, < 1 is faster, bars: CI)", "time ratio",
                            traces, y_log=False, hline=1.0)

    def groups_of(self, run_index: int) -> list[list[dict[str, Any]]]:
        return [rs for (ri, _, _), rs in self.groups.items() if ri == run_index]

    def figures(self, verdicts: dict[tuple[int, int], Any] | None = None) -> list[dict[str, Any]]:
        figs = [self.latency(), self.speedup_chart()]
        if len(self.runs) > 1:
            figs.append(self.ratio_chart(verdicts or {}))
        figs += [self.throughput("gbps", "Bandwidth", "GB/s", "bytes"),
                 self.throughput("tflops", "Compute", "TFLOP/s", "FLOPs"), self.roofline(), self.energy()]
        return [f for f in figs if f is not None]

    def box_layout(self) -> dict[str, Any]:
        """The layout of the raw-samples box plot, which the page draws on demand from sample_sets()."""
        layout = _layout(f"Raw samples per {self.x_title}", self.x_title, f"time per call ({self.unit})",
                         categorical=True, y_log=True, subtitle=self.context)
        return layout | {"boxmode": "group", "height": 396}

    def sample_sets(self) -> list[dict[str, Any]]:
        """Raw samples of every timed case, for the on-demand distribution plot (embedded once per page); a case
        with more than MAX_BOX_SAMPLES keeps that many evenly spaced order statistics (`of`: how many it had), so a
        sweep of thousands of converged GPU cases does not make a report of hundreds of MB."""
        out = []
        for (ri, b, ci), rs in sorted(self.groups.items()):
            for r in rs:
                samples = [v for v in timing(r).get("samples") or () if math.isfinite(v)]
                if samples:
                    kept = order_statistics(samples, MAX_BOX_SAMPLES)
                    out.append({"n": self.name(b, ri), "b": b, "c": ci, "x": self.x(r), "run": ri,
                                "s": [float(f"{v:.4g}") for v in kept]}
                               | ({"of": len(samples)} if len(kept) < len(samples) else {}))
        return out


def _gap(hi: float | None, lo: float | None) -> float | None:
    """An error bar's length, None (no bar) when a bound is unknown."""
    return max(0.0, hi - lo) if hi is not None and lo is not None else None


def _roof_trace(p: dict[str, float], lo: float, hi: float, name: str, source: str) -> dict[str, Any]:
    bw, top = p.get("gbps"), p.get("tflops")
    xs = [lo * (hi / lo) ** (i / 48) for i in range(49)]
    if bw and top:
        xs = sorted(set(xs + [top * 1000.0 / bw]))
    ys = [min(v for v in (top, x * bw / 1000.0 if bw else None) if v is not None) for x in xs]
    label = ", ".join(x for x in (rate_text(bw * 1e9, "B/s") if bw else "", rate_text(top * 1e12, "FLOP/s") if top
                                  else "") if x)
    return {"type": "scatter", "mode": "lines", "name": ptext(f"{name}: {label}"), "x": xs, "y": ys,
            "hoverinfo": "name", "line": {"color": "#444", "width": 1.5, "dash": "solid" if source == "measured"
                                          else "dash"}}
