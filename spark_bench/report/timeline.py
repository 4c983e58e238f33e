"""The report's power timeline: a run's NVML samples (`telemetry.jsonl`, one every 50 ms: power, SM clock,
temperature, clock-event reasons) against time, with each case's timing phase marked, so a power cap, a throttle or
a hot spell is seen beside the cases it touched. Runs without NVML (every CPU run) have no timeline and no section.

Long runs are decimated for the page: beyond MAX_POINTS samples, each bucket of k keeps its lowest- and
highest-power samples (the envelope: a spike stays), and the caption says so. Sampled power is what NVML reported
(`power_field`: the instant field, or the ~1 s average where only that exists), not the energy counter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spark_bench.report.charts import AXIS, ptext
from spark_bench.report.charts import _layout as chart_layout
from spark_bench.report.model import RunData
from spark_bench.telemetry.nvml import CAP_REASONS_MASK, reason_names
from spark_bench.telemetry.sampler import FILENAME, read_telemetry

MAX_POINTS = 6000  # samples drawn per run; beyond, min/max decimation
COLOURS = {"power": "#1f77b4", "sm": "#2ca02c", "temp": "#d62728", "cases": "#7f7f7f", "cap": "#d62728"}


def decimate(samples: Sequence[dict[str, Any]], max_points: int = MAX_POINTS) -> tuple[list[dict[str, Any]], int]:
    """(the samples to draw, in time order; the bucket size k: 1 when all are drawn). Beyond max_points, each
    bucket of k samples keeps its lowest- and highest-power sample."""
    if len(samples) <= max_points:
        return list(samples), 1
    k = math.ceil(len(samples) / (max_points // 2))
    out = []
    for start in range(0, len(samples), k):
        bucket = samples[start:start + k]
        powered = [i for i, s in enumerate(bucket) if s.get("power_w") is not None] or [0]
        watts = [bucket[i].get("power_w") or 0.0 for i in powered]
        lo, hi = powered[watts.index(min(watts))], powered[watts.index(max(watts))]
        out.extend(bucket[i] for i in sorted({lo, hi}))
    return out, k


def _capped(sample: dict[str, Any]) -> list[str]:
    """The power/thermal cap reasons a sample's clock-event mask holds (nvbench's throttle rule's reasons)."""
    mask = sample.get("reasons")
    return reason_names(mask & CAP_REASONS_MASK) if isinstance(mask, int) else []


def figure(tele: dict[str, Any], label: str) -> tuple[dict[str, Any] | None, str]:
    """(the plotly figure of one run's timeline, or None when it has no sample; its caption: what was drawn)."""
    header, samples = tele.get("header") or {}, [s for s in tele.get("samples") or [] if s.get("t") is not None]
    if not samples:
        return None, ""
    t0 = samples[0]["t"]
    drawn, k = decimate(samples)
    xs = [round(s["t"] - t0, 3) for s in drawn]

    def series(key: str, name: str, axis: str, colour: str, unit: str) -> dict[str, Any]:
        return {"type": "scatter", "mode": "lines", "name": name, "x": xs, "y": [s.get(key) for s in drawn],
                "yaxis": axis, "line": {"color": colour, "width": 1},
                "hovertemplate": f"%{{x:.2f}} s: %{{y:.4g}} {unit}<extra>{ptext(name)}</extra>"}

    traces = [series("power_w", "power (W)", "y", COLOURS["power"], "W"),
              series("sm_mhz", "SM clock (MHz)", "y2", COLOURS["sm"], "MHz"),
              series("temp_c", "temperature (°C)", "y3", COLOURS["temp"], "°C")]
    top = max((s["power_w"] for s in samples if s.get("power_w") is not None), default=0.0)
    timed = [p for p in tele.get("phases") or [] if p.get("phase") == "timing" and p.get("start") is not None]
    if timed:  # one segment per timed case just above the power curve; its hover names the case
        x, y, text = [], [], []
        for p in timed:
            x += [round(p["start"] - t0, 3), round(p["end"] - t0, 3), None]
            y += [top * 1.04] * 2 + [None]
            text += [ptext(p.get("case_id"))] * 2 + [None]
        traces.append({"type": "scatter", "mode": "lines", "name": f"timed cases ({len(timed)})", "x": x, "y": y,
                       "yaxis": "y", "text": text, "line": {"color": COLOURS["cases"], "width": 4},
                       "hovertemplate": "%{text}<extra>timing</extra>"})
    capped = [s for s in samples if _capped(s)]
    if capped:
        traces.append({"type": "scatter", "mode": "markers", "name": f"power/thermal cap ({len(capped)} samples)",
                       "x": [round(s["t"] - t0, 3) for s in capped], "y": [s.get("power_w") for s in capped],
                       "yaxis": "y", "text": [ptext(", ".join(_capped(s))) for s in capped],
                       "marker": {"color": COLOURS["cap"], "symbol": "x", "size": 6},
                       "hovertemplate": "%{x:.2f} s: %{text}<extra>cap</extra>"})
    layout = _layout(label)
    limit = header.get("power_limit_w")
    if limit:
        layout["shapes"] = [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": limit,
                             "y1": limit, "line": {"color": "#555", "width": 1, "dash": "dot"}}]
    caption = (f"{label}: {len(samples)} samples of {header.get('device_name') or 'the GPU'}, one every "
               f"{1e3 * float(header.get('period_s') or 0):.0f} ms, power from {header.get('power_field') or '?'}"
               + (f", power limit {limit:.0f} W (dotted)" if limit else "")
               + (f"; drawn: the lowest and highest power of every {k} samples" if k > 1 else "")
               + (f"; {len(timed)} timing phases marked above the power" if timed else ""))
    return {"data": traces, "layout": layout}, caption


def _layout(label: str) -> dict[str, Any]:
    """The op charts' layout (charts._layout) with three stacked value axes over one time axis at the bottom."""
    layout = chart_layout(f"{label}: power, SM clock and temperature over the run", "seconds since the first sample",
                          "W")
    layout["xaxis"]["anchor"] = "y3"
    for name, title, domain in (("yaxis", "W", [0.56, 1.0]), ("yaxis2", "MHz", [0.29, 0.52]),
                                ("yaxis3", "°C", [0.0, 0.25])):
        layout[name] = {**AXIS, "title": {"text": ptext(title)}, "domain": domain, "anchor": "x"}
    layout.update(height=540, margin={"l": 60, "r": 10, "t": 60, "b": 44},
                  legend={"font": {"size": 11}, "orientation": "h", "x": 1, "xanchor": "right", "y": 1.02,
                          "yanchor": "bottom"})
    return layout


def timeline_section(runs: Sequence[RunData], data: dict[str, Any], esc: Callable[[Any], str]) -> str:
    """HTML of the section (empty when no run has a timeline); its figures are appended to data["figs"]."""
    parts = []
    for ri, run in enumerate(runs):
        path = Path(run.path) / FILENAME if run.path is not None else None
        if path is None or not path.is_file():
            continue
        try:
            tele = read_telemetry(path)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            parts.append(f"<p class='muted'>{esc(run.label)}: {esc(FILENAME)} unreadable ({esc(exc)})</p>")
            continue
        fig, caption = figure(tele, run.label)
        if fig is None:
            continue
        fid = f"timeline{ri}"
        data["figs"].append({"id": fid, "fig": fig})
        parts.append(f"<p class='muted'>{esc(caption)}</p><div id=\"{fid}\"></div>")
    if not parts:
        return ""
    return f'<section id="timeline"><h2>Power timeline</h2>{"".join(parts)}</section>'
