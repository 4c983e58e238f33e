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

from spark_bench.report.model import (
    RunData,
    combo_key,
    log_scale,
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


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _layout(title: str, x_title: str, y_title: str, x_log: bool = False, y_log: bool = False,
            categorical: bool = False) -> dict[str, Any]:
    x_type = "log" if x_log else ("category" if categorical else "linear")
    xaxis = {**AXIS, "title": {"text": esc(x_title)}, "type": x_type}
    return {
        "title": {"text": f"<b>{esc(title)}</b>", "x": 0.01, "xanchor": "left", "font": {"size": 14}},
        "xaxis": xaxis, "yaxis": {**AXIS, "title": {"text": esc(y_title)}, "type": "log" if y_log else "linear"},
        "margin": {"l": 60, "r": 10, "t": 36, "b": 44}, "height": 330, "hovermode": "closest",
        "plot_bgcolor": "white", "paper_bgcolor": "white", "legend": {"font": {"size": 11}},
        "font": {"family": "system-ui, -apple-system, Segoe UI, sans-serif", "size": 12},
    }


class OpCharts:
    """The charts of one op across the runs given (one line per backend and run; runs differ by dash)."""

    def __init__(self, op: str, runs: Sequence[RunData], colours: dict[str, str], baseline: str = "torch"):
        self.op, self.runs, self.colours, self.baseline = op, runs, colours, baseline
        self.per_run = [[r for r in run.results if r.get("op") == op] for run in runs]
        every = [r for rs in self.per_run for r in rs]
        self.swept = swept_axis(every)
        self.combos = sorted({self.combo(r) for r in every})
        self.backends = sorted({str(r.get("backend")) for r in every})
        self.unit = next((t.get("unit", "us") for r in every for t in [timing(r)] if t), "us")
        self.x_log = bool(self.swept) and log_scale(r["params"][self.swept] for r in every if timing(r))
        self.speedup = [speedups(rs, baseline) for rs in self.per_run]

    def combo(self, r: dict[str, Any]) -> str:
        return combo_key(r, self.swept) if self.swept else ""

    def x(self, r: dict[str, Any]) -> Any:
        """The swept value, or (no numeric sweep) the case's escaped label on a categorical axis."""
        return r["params"][self.swept] if self.swept else esc(combo_key(r, None))

    @property
    def x_title(self) -> str:
        return self.swept or "case"

    def name(self, backend: str, run_index: int) -> str:
        return esc(backend if len(self.runs) == 1 else f"{backend} · {self.runs[run_index].label}")

    def hover(self, r: dict[str, Any], run_index: int, extra: str = "") -> str:
        t = timing(r) or {}
        lines = [f"<b>{self.name(str(r.get('backend')), run_index)}</b>", esc(params_text(r.get("params") or {})),
                 f"dtype {esc(r.get('dtype'))}"]
        if t:
            med = t["median"]
            rel = f" ({100 * t['iqr'] / med:.1f}%)" if number(t.get("iqr")) is not None and med else ""
            lines.append(f"median {med:.4g} {esc(self.unit)}  p10 {t.get('p10', math.nan):.4g}  "
                         f"p90 {t.get('p90', math.nan):.4g}")
            lines.append(f"IQR {t.get('iqr', math.nan):.3g}{rel}  n={t.get('n')}  timer {esc(t.get('timer', '?'))}")
        if r.get("labels"):
            lines.append("labels: " + esc(", ".join(map(str, r["labels"]))))
        if extra:
            lines.append(extra)
        return "<br>".join(lines)

    def series(self, run_index: int, backend: str, combo: str) -> list[dict[str, Any]]:
        rs = [r for r in self.per_run[run_index]
              if r.get("backend") == backend and timing(r) and self.combo(r) == combo]
        return sorted(rs, key=lambda r: (self.x(r) if self.swept else str(self.x(r))))

    def _lines(self, value, hover_extra=None, skip_backends=(), error_bars=False) -> list[dict[str, Any]]:
        """One trace per (run, backend, combo) of value(result, run_index) -> float|None."""
        traces = []
        for ri in range(len(self.runs)):
            for b in self.backends:
                if b in skip_backends:
                    continue
                for ci, combo in enumerate(self.combos):
                    pts = [(r, value(r, ri)) for r in self.series(ri, b, combo)]
                    pts = [(r, v) for r, v in pts if v is not None]
                    if not pts:
                        continue
                    trace = {
                        "type": "scatter", "mode": "lines+markers", "name": self.name(b, ri),
                        "legendgroup": self.name(b, ri), "x": [self.x(r) for r, _ in pts], "y": [v for _, v in pts],
                        "line": {"color": self.colours.get(b, "#333"), "dash": DASHES[ri % len(DASHES)], "width": 2},
                        "marker": {"symbol": SYMBOLS[ri % len(SYMBOLS)], "size": 7},
                        "hovertext": [self.hover(r, ri, hover_extra(r, ri, v) if hover_extra else "") for r, v in pts],
                        "hovertemplate": "%{hovertext}<extra></extra>", "meta": {"combo": ci},
                        "visible": ci == 0,
                    }
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
                hline: float | None = None) -> dict[str, Any]:
        ys = [y for t in traces for y in t["y"]]
        layout = _layout(title, self.x_title, y_title, x_log=self.x_log, categorical=not self.swept,
                         y_log=log_scale(ys) if y_log is None else y_log)
        if hline is not None:
            layout["shapes"] = [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": hline, "y1": hline,
                                 "line": {"color": "#555", "width": 1, "dash": "dot"}}]
        return {"data": traces, "layout": layout}

    # --- the charts -------------------------------------------------------------------------------------------------
    def latency(self) -> dict[str, Any]:
        traces = self._lines(lambda r, ri: timing(r)["median"], error_bars=True)
        return self._figure(f"Latency, median with p10–p90 ({self.unit}, lower is better)", f"time ({self.unit})",
                            traces)

    def speedup_chart(self) -> dict[str, Any] | None:
        def value(r, ri):
            return self.speedup[ri].get(id(r))

        def extra(r, ri, v):
            return f"<b>{v:.2f}× {esc(self.baseline)}</b>"

        traces = self._lines(value, extra, skip_backends=(self.baseline,))
        if not traces:
            return None
        return self._figure(f"Speedup over {self.baseline} (higher is better)", f"× {self.baseline}", traces,
                            hline=1.0)

    def throughput(self, key: str, title: str, unit: str) -> dict[str, Any] | None:
        traces = self._lines(lambda r, ri: number(r.get(key)) or None,
                             lambda r, ri, v: self._pct_text(r, ri) or "")
        return self._figure(title, unit, traces) if traces else None

    def _pct_text(self, r: dict[str, Any], ri: int) -> str:
        pct = roofline_pct(r, self.runs[ri].run)
        return f"<b>{pct[0]:.1f}% of {esc(pct[1])} roof</b>" if pct else ""

    def energy(self) -> dict[str, Any] | None:
        def value(r, ri):
            e = number((r.get("power") or {}).get("energy_j_per_call"))
            return e * 1e6 if e is not None else None

        def extra(r, ri, v):
            p = r.get("power") or {}
            w = number(p.get("avg_w"))
            return (f"<b>{v:.4g} µJ/call</b>" + (f", {w:.0f} W avg" if w is not None else "")
                    + f" ({esc(p.get('source', '?'))})")

        traces = self._lines(value, extra)
        return self._figure("Energy per call (µJ, lower is better)", "µJ / call", traces) if traces else None

    def roofline(self) -> dict[str, Any] | None:
        """Arithmetic intensity vs attained TFLOP/s, every case of the op, with the device's roofs when known."""
        traces, ais = [], []
        for ri in range(len(self.runs)):
            for b in self.backends:
                pts = []
                for r in self.per_run[ri]:
                    cost, tf = r.get("cost") or {}, number(r.get("tflops"))
                    flops, nbytes = number(cost.get("flops")), number(cost.get("bytes"))
                    if r.get("backend") == b and timing(r) and tf and flops and nbytes:
                        pts.append((r, flops / nbytes, tf))
                if not pts:
                    continue
                ais += [p[1] for p in pts]
                traces.append({
                    "type": "scatter", "mode": "markers", "name": self.name(b, ri), "legendgroup": self.name(b, ri),
                    "x": [p[1] for p in pts], "y": [p[2] for p in pts],
                    "marker": {"color": self.colours.get(b, "#333"), "symbol": SYMBOLS[ri % len(SYMBOLS)], "size": 8,
                               "opacity": 0.8, "line": {"width": 0.5, "color": "white"}},
                    "hovertext": [self.hover(r, ri, f"AI {ai:.3g} FLOP/B, {tf:.4g} TFLOP/s " + self._pct_text(r, ri))
                                  for r, ai, tf in pts],
                    "hovertemplate": "%{hovertext}<extra></extra>",
                })
        if not traces:
            return None
        lo, hi = min(ais) / 4.0, max(ais) * 4.0
        dtype = next((r.get("dtype") for rs in self.per_run for r in rs), None)
        seen = set()
        for run in self.runs:
            for source, p in sorted(peaks(run.run, dtype).items()):
                key = (source, p.get("gbps"), p.get("tflops"))
                if key in seen:
                    continue
                seen.add(key)
                traces.append(_roof_trace(p, lo, hi, f"{source} peak" + (f" · {run.label}" if len(self.runs) > 1
                                                                           else ""), source))
        fig = {"data": traces, "layout": _layout("Roofline: attained TFLOP/s vs arithmetic intensity (all shapes)",
                                                 "arithmetic intensity (FLOP / byte)", "TFLOP/s",
                                                 x_log=True, y_log=True)}
        return fig

    def ratio_chart(self, verdicts: dict[tuple[int, int], Any]) -> dict[str, Any] | None:
        """New/base median per backend (runs 1.. against run 0); `verdicts` maps (run_index, id(result)) to Verdict."""
        base_by_key = {(r.get("backend"), r.get("dtype"), str(sorted((r.get("params") or {}).items()))): r
                       for r in self.per_run[0] if timing(r)}

        def base_of(r):
            return base_by_key.get((r.get("backend"), r.get("dtype"), str(sorted((r.get("params") or {}).items()))))

        def value(r, ri):
            b = base_of(r)
            return timing(r)["median"] / timing(b)["median"] if ri > 0 and b and timing(b)["median"] else None

        def extra(r, ri, v):
            verdict = verdicts.get((ri, id(r)))
            return f"<b>{v:.3f}× of {esc(self.runs[0].label)}</b>" + (f": {esc(verdict.verdict)}" if verdict else "")

        traces = self._lines(value, extra)
        if not traces:
            return None
        return self._figure(f"Ratio to {self.runs[0].label} (median time, < 1 is faster)", "time ratio", traces,
                            y_log=False, hline=1.0)

    def figures(self, verdicts: dict[tuple[int, int], Any] | None = None) -> list[dict[str, Any]]:
        figs = [self.latency(), self.speedup_chart()]
        if len(self.runs) > 1:
            figs.append(self.ratio_chart(verdicts or {}))
        figs += [self.throughput("gbps", "Achieved bandwidth (GB/s)", "GB/s"),
                 self.throughput("tflops", "Achieved compute (TFLOP/s)", "TFLOP/s"), self.roofline(), self.energy()]
        return [f for f in figs if f is not None]

    def sample_sets(self) -> list[dict[str, Any]]:
        """Raw samples of every timed case, for the on-demand distribution plot (embedded once per page)."""
        out = []
        for ri in range(len(self.runs)):
            for r in self.per_run[ri]:
                t = timing(r)
                if t and t.get("samples"):
                    out.append({"n": self.name(str(r.get("backend")), ri), "b": r.get("backend"),
                                "c": self.combos.index(self.combo(r)), "x": self.x(r), "run": ri,
                                "s": [float(f"{v:.4g}") for v in t["samples"]]})
        return out


def _roof_trace(p: dict[str, float], lo: float, hi: float, name: str, source: str) -> dict[str, Any]:
    bw, top = p.get("gbps"), p.get("tflops")
    xs = [lo * (hi / lo) ** (i / 48) for i in range(49)]
    if bw and top:
        xs = sorted(set(xs + [top * 1000.0 / bw]))
    ys = [min(v for v in (top, x * bw / 1000.0 if bw else None) if v is not None) for x in xs]
    label = " ".join(x for x in (f"{bw:.0f} GB/s" if bw else "", f"{top:.0f} TFLOP/s" if top else "") if x)
    return {"type": "scatter", "mode": "lines", "name": esc(f"{name} ({label})"), "x": xs, "y": ys,
            "hoverinfo": "name", "line": {"color": "#444", "width": 1.5, "dash": "solid" if source == "measured"
                                          else "dash"}}
