"""The report says what its numbers are (device, timer, CI, failures) and survives odd data, without a browser."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import plotly.graph_objects as go

sys.path.insert(0, str(Path(__file__).parent))
import report_fixtures as fx  # noqa: E402

from spark_bench.report import write_report  # noqa: E402
from spark_bench.report.charts import ptext  # noqa: E402

CPU = {"type": "cpu", "name": "AMD EPYC"}


def render(tmp_path: Path, results: list[dict], name: str = "r", **kw) -> tuple[list[dict], dict, str]:
    """(figures, page data, page text) of a one-run report."""
    text = write_report([fx.write_run(tmp_path / name, results, **kw)], tmp_path / f"{name}.html").read_text()
    data = json.loads(re.search(r'<script type="application/json" id="sb-data">(.*?)</script>', text, re.S)[1])
    return [f["fig"] for f in data["figs"]], data, text


def titled(figs: list[dict], start: str) -> dict:
    return next(f for f in figs if f["layout"]["title"]["text"].startswith(f"<b>{start}"))


def test_null_percentiles_and_counts_do_not_break_the_report(tmp_path):
    rng = np.random.default_rng(0)
    results = [fx.case("kda.gate", b, {"tokens": t}, samples=fx.draw(rng, 5.0 * t)) for b in ("torch", "triton")
               for t in (1, 10)]
    for k in ("p10", "p90", "iqr", "n", "timer", "ci_low"):  # the schema allows null for each
        results[0]["timing"][k] = None
    figs, data, _ = render(tmp_path, results)  # crashed: "unsupported format string passed to NoneType"
    latency = titled(figs, "Latency")
    torch = next(t for t in latency["data"] if t["name"] == "torch")
    assert torch["error_y"]["array"][0] is None and torch["error_y"]["array"][1] > 0  # no bar, not a 0-wide one
    assert "p10 -  p90 -" in data["hover"][torch["meta"]["h"][0]]


def test_an_axis_some_cases_lack_is_not_swept(tmp_path):
    rng = np.random.default_rng(0)
    results = [fx.case("kda.gate", "torch", {"tokens": t}, samples=fx.draw(rng, 5.0 + t)) for t in (1, 2, 3)]
    results.append(fx.case("kda.gate", "torch", {"rows": 5}, samples=fx.draw(rng, 5.0)))
    figs, _, _ = render(tmp_path, results)  # KeyError 'tokens' before
    latency = titled(figs, "Latency")
    assert latency["layout"]["xaxis"]["type"] == "category" and len(latency["data"][0]["x"]) == 4


def cpu_sweep(rng: np.random.Generator) -> list[dict]:
    """A CPU run as `run --quick` makes one: torch in tens of µs, the interpreted Triton kernel in tens of ms."""
    results = []
    for t in (16, 64):
        for backend, median in (("torch", 60.0), ("triton", 90_000.0)):
            rec = fx.case("kda.gate", backend, {"tokens": t}, samples=fx.draw(rng, median), device="cpu")
            rec["timing"]["timer"] = "cpu-perf_counter"
            rec["labels"] = ["interpreted"] if backend == "triton" else []
            results.append(rec)
    return results


def test_a_cpu_run_is_labelled_as_cpu_everywhere(tmp_path):
    figs, data, text = render(tmp_path, cpu_sweep(np.random.default_rng(0)), device=CPU)
    where = "on CPU (AMD EPYC) · timer cpu-perf_counter"
    assert all(f["layout"]["title"]["subtitle"]["text"] == where for f in figs)  # a chart saved alone says it
    for f in figs:
        go.Figure(f)  # plotly knows title.subtitle
    summary = text[text.index('<section id="summary">'):text.index('<section id="problems">')]
    assert f"Timed {where} (every time is CPU code, torch's included: not a GPU kernel)" in summary
    assert f"timed <b>{where}</b>" in text[text.index('<section id="op-kda-gate">'):]
    assert data["boxLayout"]["op0"]["title"]["subtitle"]["text"] == where
    assert all("timer cpu-perf_counter on CPU (AMD EPYC)" in h for h in data["hover"])
    table = data["tables"]["cases"]
    device = [c["name"] for c in table["columns"]].index("device")
    assert {row[device] for row in table["rows"]} == {"CPU (AMD EPYC)"}  # and in the CSV export


def test_tiny_speedups_keep_three_digits_on_a_log_axis(tmp_path):
    figs, data, text = render(tmp_path, cpu_sweep(np.random.default_rng(0)), device=CPU)
    # the interpreted kernel is ~1500x slower than torch: "0.00x" on a linear axis, its line on the zero line
    assert re.search(r"the baseline is fastest; next triton \(interpreted\) at 0\.000\d\d\d× \(geomean\)", text)
    speedup = titled(figs, "Speedup")
    assert speedup["layout"]["yaxis"]["type"] == "log"  # the 1x line and the 0.0007x points both in view
    assert "%{y:.3g}× faster than torch" in speedup["data"][0]["hovertemplate"]
    cols = {c["name"]: c for c in data["tables"]["cases"]["columns"]}  # the table's cells: toPrecision, not toFixed
    assert cols["x_torch"].get("sig") == 3 and "digits" not in cols["x_torch"]


def test_untimed_cases_are_marked_on_the_latency_chart(tmp_path):
    rng = np.random.default_rng(0)
    results = [fx.case("kda.gate", b, {"tokens": t, "heads": 4}, samples=fx.draw(rng, 5.0 + t))
               for b in ("torch", "triton") for t in (1, 8)]
    results.append(fx.case("kda.gate", "triton", {"tokens": 64, "heads": 4}, status="crash", error="signal 11"))
    results.append(fx.case("kda.gate", "triton", {"tokens": 8, "heads": 32}, status="timeout", error="> 60 s"))
    no_timing = fx.case("kda.gate", "torch", {"tokens": 64, "heads": 4}, samples=fx.draw(rng, 70.0))
    no_timing["timing"]["median"] = float("inf")
    results += [no_timing, fx.case("kda.gate", "fla", {"tokens": 1, "heads": 4}, status="skipped", error="n/a")]
    figs, data, text = render(tmp_path, results)
    marks = {t["name"]: t for t in titled(figs, "Latency")["data"] if t["mode"] == "markers"}
    assert set(marks) == {"triton ✕ crash", "triton ✕ timeout", "torch ✕ no timing"}  # skipped ones aside
    assert marks["triton ✕ crash"]["x"] == [64] and marks["triton ✕ crash"]["meta"]["combo"] == 0
    assert marks["triton ✕ timeout"]["meta"]["combo"] == 1  # a combination where nothing was timed is selectable
    assert min(marks["triton ✕ crash"]["y"]) <= min(min(t["y"]) for t in titled(figs, "Latency")["data"])
    assert "<b>crash</b>: signal 11" in data["hover"][marks["triton ✕ crash"]["meta"]["h"][0]]
    assert '<option value="1">heads=32 bf16</option>' in text
    assert "triton (1 crash, 1 timeout)" in text and "fla (not timed: 1 skipped)" in text
    assert "torch (1 no timing)" in text  # the legend names it as the chart does (it said "1 ok")
    box = data["boxLayout"]["op0"]
    assert (box["xaxis"]["type"], box["yaxis"]["type"], box["boxmode"]) == ("category", "log", "group")
    assert "marked ✕ at the bottom of its op's latency chart" in text


def test_speedup_and_ratio_charts_carry_confidence_intervals(tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b", commit="9b8c7d6e5f", scale={"triton": 1.2})
    text = write_report([a, b], tmp_path / "two.html").read_text()
    data = json.loads(re.search(r'id="sb-data">(.*?)</script>', text, re.S)[1])
    figs = [f["fig"] for f in data["figs"]]
    speedup = titled(figs, "Speedup")["data"][0]
    lows, highs = speedup["error_y"]["arrayminus"], speedup["error_y"]["array"]
    assert all(lo > 0 and hi > 0 for lo, hi in zip(lows, highs, strict=True))
    assert all(re.fullmatch(r"\(CI [0-9.]+–[0-9.]+×\)", t) for t in speedup["text"])
    ratio = next(t for t in titled(figs, "Ratio")["data"] if t["visible"] and t["name"].startswith("triton"))
    assert all(e > 0 for e in ratio["error_y"]["array"]) and all("(CI " in t for t in ratio["text"])
    columns = [c["name"] for c in data["tables"]["comparison"]["columns"]]
    assert "base_median_us" in columns and "new_median_us" in columns
    assert not any("digits" in c for c in data["tables"]["comparison"]["columns"])  # 1e-4 never reads 0.000
    assert "Different machines" not in text  # one device fingerprint


def test_runs_of_different_machines_say_so(tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b", device=CPU, fingerprint_id="fp-cpu")
    text = write_report([a, b], tmp_path / "two.html").read_text()
    assert ("<b>Different machines:</b> CPU (AMD EPYC) [fp-cpu] vs NVIDIA H200 [fp-h200]: these ratios and verdicts "
            "compare hardware as much as code.") in text
    data = json.loads(re.search(r'id="sb-data">(.*?)</script>', text, re.S)[1])
    subtitles = {f["fig"]["layout"]["title"]["subtitle"]["text"] for f in data["figs"]}
    assert subtitles == {"on NVIDIA H200 and CPU (AMD EPYC) (different machines on one axis) · timer cuda-event"}


def test_plotly_template_syntax_in_a_label_is_kept():
    # a trace with `meta` reads %{...} in its name as a template: the text would vanish from the legend
    assert ptext("mode=%{y} <b>") == "mode=&#37;{y} &lt;b&gt;"


def test_the_power_limit_is_in_the_environment(tmp_path):
    rng = np.random.default_rng(0)
    results = [fx.case("kda.gate", "torch", {"tokens": t}, samples=fx.draw(rng, 5.0 + t)) for t in (1, 8)]
    _, _, capped = render(tmp_path, results, name="capped", power={"limit_w": 500, "default_limit_w": 700})
    env = capped[capped.index('<section id="env">'):]
    assert "<b>power limit</b><span>500 W (default 700 W: capped)</span>" in env
    _, _, unread = render(tmp_path, results, name="unread")
    assert "<b>power limit</b><span>not read (no NVML, or a CPU)</span>" in unread


def test_a_case_run_on_a_weight_file_says_so_in_its_hover_and_row(tmp_path):
    rng = np.random.default_rng(0)
    results = [fx.case("moe.router", "torch", {"tokens": t}, samples=fx.draw(rng, 5.0 + t)) for t in (1, 8)]
    results[0]["weights"] = "kimi L1, routed scaling 2.446 (file)"
    _, data, _ = render(tmp_path, results)
    assert "weights: kimi L1, routed scaling 2.446 (file)" in data["hover"][0]
    table = data["tables"]["cases"]
    column = [c["name"] for c in table["columns"]].index("weights")
    assert sorted(row[column] for row in table["rows"]) == ["", "kimi L1, routed scaling 2.446 (file)"]
    assert table["columns"][-1]["name"] == "error"
    _, plain, _ = render(tmp_path, results[1:], name="plain")
    assert "weights" not in [c["name"] for c in plain["tables"]["cases"]["columns"]]  # no file, no column


def test_a_hover_says_what_its_interval_is_and_why_a_median_is_zero(tmp_path):
    rng = np.random.default_rng(0)
    few, many, lost = (fx.case("kda.gate", "torch", {"tokens": t}, samples=fx.draw(rng, 5.0), dtype="bf16")
                       for t in (1, 8, 64))
    few["timing"] = fx.timing_of(np.array([5.0, 5.2, 5.9]))  # 3 samples: the "CI" is their range
    lost["timing"].update(median=0.0, clamped_samples=11, notes=["11 of 20 samples were within the flush's noise "
                                                                 "and stored as 0"])
    _, data, _ = render(tmp_path, [few, many, lost])
    hover = {h.split("tokens=")[1].split("<")[0].split()[0].strip(): h for h in data["hover"]}
    assert "(range of 3 5–5.9)" in hover["1"] and "95% CI" not in hover["1"]
    assert "(95% CI " in hover["8"] and "range of" not in hover["8"]
    assert "median 0 µs (below the timer's resolution)" in hover["64"]
    assert "timing notes: 11 of 20 samples were within the flush's noise and stored as 0" in hover["64"]
