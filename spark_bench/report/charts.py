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

from spark_bench.console import fmt_num, fmt_pct
from spark_bench.report.model import (
    NOT_A_CONTENDER,
    RunData,
    combo_key,
    log_scale,
    match_key,
    natural_key,
    number,
    params_text,
    peaks,
    roofline_pct,
    speedups,
    swept_axis,
    timing,
)

# Fixed colours for the backends we know, so a backend looks the same in every report; others take the rest in order.
KNOWN_COLOURS = {"triton": "#1f77b4", "torch": "#ff7f0e", "torch_compile": "#2ca02c", "reference": "#7f7f7f",
                 "fla": "#9467bd", "vllm": "#d62728", "gguf": "#8c564b"}
SPARE_COLOURS = ["#e377c2", "#17becf", "#bcbd22", "#393b79", "#ad494a", "#637939", "#7b4173", "#3182bd", "#e6550d"]
DASHES = ["solid", "dash", "dot", "dashdot", "longdash"]
SYMBOLS = ["circle", "square", "diamond", "triangle-up", "x"]
AXIS = {"gridcolor": "#e5e5e5", "zerolinecolor": "#cccccc", "linecolor": "#999999", "showline": True}


def palette(backends: Sequence[str]) -> dict[str, str]:
    """Backend -> colour: known names fixed, the others in sorted order from the spare list (cycling)."""
    out, spare = {}, 0
    for b in sorted(set(backends)):
        if b in KNOWN_COLOURS:
            out[b] = KNOWN_COLOURS[b]
        else:
            out[b] = SPARE_COLOURS[spare % len(SPARE_COLOURS)]
            spare += 1
    return out


def ptext(x: Any) -> str:
    """Text for plotly, which renders a few HTML tags and decodes &lt; &gt; &amp; (but not &quot;)."""
    return html.escape(str(x), quote=False)


def _layout(title: str, x_title: str, y_title: str, x_log: bool = False, y_log: bool = False,
            categorical: bool = False) -> dict[str, Any]:
    x_type = "log" if x_log else ("category" if categorical else "linear")
    xaxis = {**AXIS, "title": {"text": ptext(x_title)}, "type": x_type}
    yaxis = {**AXIS, "title": {"text": ptext(y_title)}, "type": "log" if y_log else "linear"}
    if y_log:
        yaxis["dtick"] = 1  # one tick per decade; plotly's default 2/5 minor labels read as noise
    return {
        "title": {"text": f"<b>{ptext(title)}</b>", "x": 0.01, "xanchor": "left", "font": {"size": 14}},
        "xaxis": xaxis, "yaxis": yaxis,
        "margin": {"l": 60, "r": 10, "t": 36, "b": 44}, "height": 330, "hovermode": "closest",
        "plot_bgcolor": "white", "paper_bgcolor": "white", "legend": {"font": {"size": 11}},
        "font": {"family": "system-ui, -apple-system, Segoe UI, sans-serif", "size": 12},
    }


class OpCharts:
    """The charts of one op across the runs given (one line per backend and run; runs differ by dash).

    Hover texts are stored once per case in the page-wide `hovers` list; a trace carries their indices in `meta.h`
    and the page script expands them, so thousands of cases do not repeat their hover in every chart.
    """

    def __init__(self, op: str, runs: Sequence[RunData], colours: dict[str, str], baseline: str = "torch",
                 hovers: list[str] | None = None):
        self.op, self.runs, self.colours, self.baseline = op, runs, colours, baseline
        self.hovers = hovers if hovers is not None else []
        self.per_run = [[r for r in run.results if r.get("op") == op] for run in runs]
        every = [r for rs in self.per_run for r in rs]
        self.swept = swept_axis(every)
        timed = [(ri, r) for ri, rs in enumerate(self.per_run) for r in rs if timing(r)]
        first: dict[str, None] = {}
        for _, r in sorted(timed, key=lambda t: natural_key(t[1])):
            first.setdefault(self.combo(r), None)
        self.combos = list(first) or [""]
        self.backends = sorted({str(r.get("backend")) for r in every})
        # (run index, backend) whose numbers come from the Triton interpreter: every legend says so
        self.interpreted = {(ri, str(r.get("backend"))) for ri, rs in enumerate(self.per_run) for r in rs
                            if "interpreted" in (r.get("labels") or [])}
        self.unit = next((timing(r).get("unit", "us") for _, r in timed), "us")
        self.x_log = bool(self.swept) and log_scale(r["params"][self.swept] for _, r in timed)
        self.speedup = [speedups(rs, baseline) for rs in self.per_run]
        self.hid: dict[int, int] = {}
        self.groups: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
        combo_index = {c: i for i, c in enumerate(self.combos)}
        for ri, r in timed:
            self.hid[id(r)] = len(self.hovers)
            self.hovers.append(self.hover(r, ri))
            self.groups.setdefault((ri, str(r.get("backend")), combo_index[self.combo(r)]), []).append(r)
        for rs in self.groups.values():
            rs.sort(key=lambda r: self.x(r) if self.swept else str(self.x(r)))

    def combo(self, r: dict[str, Any]) -> str:
        return combo_key(r, self.swept) if self.swept else ""

    def x(self, r: dict[str, Any]) -> Any:
        """The swept value, or (no numeric sweep) the case's escaped label on a categorical axis."""
        return r["params"][self.swept] if self.swept else ptext(combo_key(r, None))

    @property
    def x_title(self) -> str:
        return self.swept or "case"

    def name(self, backend: str, run_index: int) -> str:
        text = backend if len(self.runs) == 1 else f"{backend} · {self.runs[run_index].label}"
        return ptext(text + (" (interpreted)" if (run_index, backend) in self.interpreted else ""))

    def hover(self, r: dict[str, Any], run_index: int) -> str:
        """Everything about one timed case: parameters, statistics, timer, throughput, roofline, energy."""
        t = timing(r)
        med, iqr = t["median"], number(t.get("iqr"))
        unit = ptext(self.unit)
        lines = [f"<b>{self.name(str(r.get('backend')), run_index)}</b>  {ptext(params_text(r.get('params') or {}))}"
                 f"  {ptext(r.get('dtype'))}",
                 f"median {med:.4g} {unit}  p10 {t.get('p10', math.nan):.4g}  p90 {t.get('p90', math.nan):.4g}",
                 f"IQR {iqr if iqr is not None else math.nan:.3g}"
                 + (f" ({fmt_pct(100 * iqr / med)})" if iqr is not None and med else "")
                 + f"  n={ptext(t.get('n'))}  timer {ptext(t.get('timer', '?'))}"]
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
        if r.get("labels"):
            lines.append("labels: " + ptext(", ".join(map(str, r["labels"]))))
        return "<br>".join(lines)

    def _lines(self, value, template: str, skip_backends=(), error_bars=False, text=None) -> list[dict[str, Any]]:
        """One trace per (run, backend, combo) of value(result, run_index) -> float|None."""
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
            if text:
                trace["text"] = [text(r, ri) for r, _ in pts]
            if error_bars:
                ts = [timing(r) for r, _ in pts]
                trace["error_y"] = {
                    "type": "data", "symmetric": False, "thickness": 1.2, "width": 3,
                    "array": [max(0.0, (t.get("p90") or t["median"]) - t["median"]) for t in ts],
                    "arrayminus": [max(0.0, t["median"] - (t.get("p10") or t["median"])) for t in ts],
                }
            traces.append(trace)
        return traces

    def _figure(self, title: str, y_title: str, traces: list[dict[str, Any]], y_log: bool | None = None,
                hline: float | None = None) -> dict[str, Any] | None:
        if not traces:
            return None
        ys = [y for t in traces for y in t["y"]]
        if y_log is None:  # one shape per trace (no sweep): bars of backends that differ a lot, a log axis keeps
            single = not self.swept or len({x for t in traces for x in t["x"]}) == 1  # the fast ones off zero
            y_log = log_scale(ys) or (single and len({y for y in ys if y > 0}) > 1 and min(ys) > 0)
        layout = _layout(title, self.x_title, y_title, x_log=self.x_log, categorical=not self.swept, y_log=y_log)
        xs = sorted({x for t in traces for x in t["x"]}) if self.swept else []
        if 1 < len(xs) <= 16:  # tick exactly at the swept values
            layout["xaxis"].update(tickmode="array", tickvals=xs, ticktext=[f"{x:g}" for x in xs])
        if hline is not None:
            layout["shapes"] = [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": hline, "y1": hline,
                                 "line": {"color": "#555", "width": 1, "dash": "dot"}}]
        return {"data": traces, "layout": layout}

    # --- the charts ---------------------------------------------------------------------------------------------
    def latency(self) -> dict[str, Any] | None:
        unit = "µs" if self.unit == "us" else self.unit
        traces = self._lines(lambda r, ri: timing(r)["median"], "", error_bars=True)
        return self._figure(f"Latency: median, bars p10–p90 ({unit})", f"time per call ({unit})", traces)

    def speedup_chart(self) -> dict[str, Any] | None:
        base = ptext(self.baseline)
        traces = self._lines(lambda r, ri: self.speedup[ri].get(id(r)), f"<b>%{{y:.2f}}× faster than {base}</b>",
                             skip_backends=(self.baseline, *NOT_A_CONTENDER))
        return self._figure(f"Speedup over {self.baseline} (higher is better)", f"× faster than {self.baseline}",
                            traces, hline=1.0)

    def throughput(self, key: str, title: str, unit: str) -> dict[str, Any] | None:
        traces = self._lines(lambda r, ri: number(r.get(key)) or None, f"<b>%{{y:.4g}} {unit}</b>")
        return self._figure(title, unit, traces)

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
                        if tf and flops and nbytes:
                            pts.append((r, flops / nbytes, tf))
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
        # each dtype's own compute roof: a bf16 op is drawn under the bf16 peak, not the fp32 one
        dtypes = sorted({str(r.get("dtype")) for rs in self.groups.values() for r in rs})
        roofs = [(run, d, p) for run in self.runs for d in dtypes for p in [peaks(run.run, d, own=True)]]
        ridges = [q["tflops"] * 1000.0 / q["gbps"] for _, _, p in roofs for q in p.values()
                  if q.get("tflops") and q.get("gbps")]
        lo, hi = min(ais + ridges) / 3.0, max(ais + ridges) * 3.0  # the ridge point stays in view
        seen = set()
        for run, d, p in roofs:
            for source, q in sorted(p.items()):
                key = (source, q.get("gbps"), q.get("tflops"))
                if key not in seen:
                    seen.add(key)
                    suffix = f" · {run.label}" if len(self.runs) > 1 else ""
                    what = f"{source} {d} roof" if q.get("tflops") else f"{source} roof"
                    traces.append(_roof_trace(q, lo, hi, f"{what}{suffix}", source))
        fig = {"data": traces, "layout": _layout("Roofline, all shapes (TFLOP/s vs FLOP/byte)",
                                                 "arithmetic intensity (FLOP / byte)", "TFLOP/s",
                                                 x_log=True, y_log=True)}
        if hi / lo >= 100:
            fig["layout"]["xaxis"]["dtick"] = 1
        return fig

    def ratio_chart(self, verdicts: dict[tuple[int, int], Any]) -> dict[str, Any] | None:
        """New/base median per backend (runs 1.. against run 0); `verdicts` maps (run_index, id(result)) to Verdict."""
        base = {match_key(r): timing(r)["median"] for rs in self.groups_of(0) for r in rs}

        def value(r, ri):
            b = base.get(match_key(r))
            return timing(r)["median"] / b if ri > 0 and b else None

        def text(r, ri):
            v = verdicts.get((ri, id(r)))
            return ptext(v.verdict) if v else ""

        traces = self._lines(value, f"<b>%{{y:.3f}}× the time of {ptext(self.runs[0].label)}</b>: %{{text}}",
                             text=text)
        return self._figure(f"Ratio to {self.runs[0].label} (median time, < 1 is faster)", "time ratio", traces,
                            y_log=False, hline=1.0)

    def groups_of(self, run_index: int) -> list[list[dict[str, Any]]]:
        return [rs for (ri, _, _), rs in self.groups.items() if ri == run_index]

    def figures(self, verdicts: dict[tuple[int, int], Any] | None = None) -> list[dict[str, Any]]:
        figs = [self.latency(), self.speedup_chart()]
        if len(self.runs) > 1:
            figs.append(self.ratio_chart(verdicts or {}))
        figs += [self.throughput("gbps", "Achieved bandwidth (GB/s)", "GB/s"),
                 self.throughput("tflops", "Achieved compute (TFLOP/s)", "TFLOP/s"), self.roofline(), self.energy()]
        return [f for f in figs if f is not None]

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


MAX_BOX_SAMPLES = 256


def order_statistics(samples: list[float], most: int) -> list[float]:
    """All the samples when there are at most `most`, else `most` evenly spaced order statistics (min and max kept):
    the same box plot (quartiles, whiskers, outliers) to within one rank in `most`."""
    if len(samples) <= most:
        return samples
    ranked = sorted(samples)
    return [ranked[round(i * (len(ranked) - 1) / (most - 1))] for i in range(most)]


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


def rate_text(per_s: float, unit: str) -> str:
    """A rate with an SI prefix and 3 significant digits: 1.46 GFLOP/s, 22.5 GB/s, 989 TFLOP/s (never '0 TF')."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_s >= scale:
            return f"{fmt_num(per_s / scale)} {prefix}{unit}"
    return f"{fmt_num(per_s)} {unit}"
