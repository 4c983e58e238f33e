"""spark_bench/report/charts.py and html.py edges the other report tests leave open (found by mutation testing): the
reference is no contender on the speedup chart, energy in the unit its axis names, the IQR as a percentage of the
median, memory in GiB, a power limit at its default is not a cap, exactly 100% of a roof is not above the peak, and
the skipped count counts cases. Hand-made records, built in memory."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import report_fixtures as fx  # noqa: E402
from test_report_model_edges import _run, _timed  # noqa: E402

from spark_bench.console import fmt_num, fmt_pct  # noqa: E402
from spark_bench.report import html  # noqa: E402
from spark_bench.report.charts import OpCharts  # noqa: E402


def test_the_reference_is_not_drawn_on_the_speedup_chart():
    results = [_timed(b, m, tokens=t) for b, m in (("torch", 10.0), ("triton", 5.0), ("reference", 2.0))
               for t in (1, 2)]
    fig = OpCharts("kda.gate", [_run(results)], {}).speedup_chart()
    assert [t["name"] for t in fig["data"]] == ["triton"]


def test_energy_is_drawn_and_hovered_in_the_unit_it_names():
    rng = np.random.default_rng(0)
    results = [fx.case("kda.gate", "torch", {"tokens": t}, samples=fx.draw(rng, 5.0 * t, n=20), power=True)
               for t in (1, 2)]
    charts = OpCharts("kda.gate", [_run(results)], {})
    fig = charts.energy()
    joules = [r["power"]["energy_j_per_call"] for r in results]  # ~2e-3 J: µJ
    assert fig["layout"]["yaxis"]["title"]["text"] == "µJ / call"
    assert fig["data"][0]["y"] == [j * 1e6 for j in joules]
    assert f"{joules[0] * 1e6:.4g} µJ/call  420 W  (nvml-energy-counter)" in charts.hovers[0]


def test_a_hover_gives_the_iqr_as_a_percentage_of_the_median():
    rec = _timed("torch", 10.0)
    rec["timing"].update(median=10.0, iqr=0.5)
    charts = OpCharts("kda.gate", [_run([rec])], {})
    assert f"IQR {fmt_num(0.5)} ({fmt_pct(5.0)})" in charts.hovers[0] and "(5%)" in charts.hovers[0]


def test_device_memory_is_in_gib():
    text = html.environment([_run([_timed("torch", 10.0)])])
    assert "NVIDIA H200 · sm_9.0 · 132 SMs · 140 GiB · L2 60 MiB" in text  # 150e9 bytes = 139.7 GiB


def test_a_power_limit_at_its_default_is_not_a_cap():
    assert html._power_limit_text({"limit_w": 700, "default_limit_w": 700}) == "700 W (default 700 W)"
    assert html._power_limit_text({"limit_w": 699, "default_limit_w": 700}) == "699 W (default 700 W: capped)"


def test_exactly_the_peak_is_not_marked_above_it():
    def page(pct: float) -> str:
        rec = _timed("torch", 10.0)
        rec["roofline"] = {"pct_bw_measured": pct}
        return html.summary([_run([rec])], "torch", {})

    assert "100% of BW measured<" in page(100.0) and html.OVER_PEAK_MARK not in page(100.0)
    assert f"of BW measured{html.OVER_PEAK_MARK}<" in page(100.5) and "Above 100%" in page(100.5)


def test_the_skipped_line_counts_cases_not_reasons():
    skipped = [fx.case("kda.gate", "fla", {"tokens": t}, status="skipped", error="fla not installed")
               for t in (1, 2, 3)]
    text = html.problems_section([_run([_timed("torch", 10.0), *skipped])])
    assert "3 skipped cases (unavailable backends), by reason" in text


def test_the_box_plot_leaves_out_non_finite_samples():
    rec = _timed("torch", 10.0)
    rec["timing"]["samples"] = [10.0, 10.5, float("nan"), 11.0, float("inf")]  # schema-valid floats, no times
    (entry,) = OpCharts("kda.gate", [_run([rec])], {}).sample_sets()
    assert entry["s"] == [10.0, 10.5, 11.0] and "of" not in entry


def test_two_runs_lines_are_named_by_their_run():
    a, b = _run([_timed("triton", 10.0)]), _run([_timed("triton", 12.0)])
    a.label, b.label = "H200", "B200"
    fig = OpCharts("kda.gate", [a, b], {}).latency()
    assert [t["name"] for t in fig["data"]] == ["triton · H200", "triton · B200"]
    assert [t["line"]["dash"] for t in fig["data"]] == ["solid", "dash"]


def test_skipped_cases_are_not_counted_as_failed_in_the_summary():
    results = [_timed("torch", 10.0), fx.case("kda.gate", "fla", {"tokens": 1}, status="skipped", error="n/a"),
               fx.case("kda.gate", "triton", {"tokens": 1}, status="crash", error="signal 11"),
               fx.case("kda.gate", "triton", {"tokens": 2}, status="mismatch", error="err_ratio 0.4")]
    row = html._summary_row("kda.gate", _run(results), results, "torch", {}, multi=False)
    cases, ok, mismatch, failed, skipped = row[-5:]
    assert (cases, ok, mismatch, failed, skipped) == (4, 1, html._count(1), html._count(1), 1)


def test_a_backend_whose_cases_checked_ok_without_a_timing_is_not_timed_in_the_legend():
    untimed = _timed("triton", 5.0)
    untimed["timing"]["median"] = float("inf")  # checked ok, no usable time
    charts = OpCharts("kda.gate", [_run([_timed("torch", 10.0), untimed])], {})
    section = html.op_section(0, charts, {}, {"figs": [], "samples": {}, "boxLayout": {}})
    assert '<span class="muted"><span class="swatch" style="background:#333"></span>triton (not timed: 1 no timing)' \
        in section
