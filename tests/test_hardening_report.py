"""Issue 15 items 11 and 15: the report does not hide what its numbers are (interpreted Triton, the dtype's own
roof, small values, the calibration's age, per-case memory), without a browser."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import report_fixtures as fx  # noqa: E402

from spark_bench.report import load_runs, write_report  # noqa: E402
from spark_bench.report.assets import palette  # noqa: E402
from spark_bench.report.charts import OpCharts  # noqa: E402

# A CPU's measured peaks, as `spark-bench calibrate` caches them: bf16 matmul is 100x slower than fp32 on this CPU
CPU_ROOF = {"measured": {"fingerprint_id": "cpu-fp", "measured_at": "2026-11-27T07:10:00+0000",
                         "bandwidth_gbps": 22.5, "tflops": {"fp32": 0.1615, "bf16": 0.00146, "fp16": 0.00143}},
            "datasheet": None}
PARAMS = {"tokens": 64, "heads": 4, "head_dim": 128}


def cpu_run(tmp_path: Path, dtype: str = "bf16", tokens=(64,), memory: dict | None = None,
            triton_us: float = 90_000.0) -> Path:
    rng = np.random.default_rng(0)
    results = []
    for t in tokens:
        params = {**PARAMS, "tokens": t}
        for backend, median in (("triton", triton_us), ("torch", 40.0), ("torch_compile", 25.0)):
            rec = fx.case("kda.gate", backend, params, dtype=dtype, samples=fx.draw(rng, median * t / 64),
                          flops=2.0 * t, nbytes=4.0 * t, device="cpu")
            if backend == "triton":
                rec["labels"] = ["interpreted"]
            rec["roofline"] = {"pct_bw_measured": 100.0 * (rec["gbps"] or 0) / 22.5}
            if memory:
                rec["memory"] = memory
            results.append(rec)
    return fx.write_run(tmp_path / "cpu", results, device={"type": "cpu", "name": "AMD EPYC"}, roofline=CPU_ROOF)


def figures(path: Path) -> list[dict]:
    text = path.read_text()
    data = json.loads(re.search(r'<script type="application/json" id="sb-data">(.*?)</script>', text, re.S).group(1))
    return [f["fig"] for f in data["figs"]], data, text


def test_chart_legends_say_which_backend_is_interpreted(tmp_path):
    figs, _, text = figures(write_report([cpu_run(tmp_path, tokens=(16, 64))], tmp_path / "r.html"))
    names = {t["name"] for f in figs for t in f["data"] if not t["name"].startswith(("measured", "datasheet"))}
    assert names == {"triton (interpreted)", "torch", "torch_compile"}
    section = text[text.index('<section id="op-kda-gate">'):]
    assert "</span>triton (interpreted)</span>" in section  # the op's own legend line too


def test_roofline_draws_the_ceiling_its_percentages_divide_by_with_real_figures(tmp_path):
    """On this CPU bf16 matmuls run at 1.46 GFLOP/s and fp32 at 162: a bf16 op's ceiling is the fp32 rate (it may
    compute in fp32), and the chart drew the bf16 peak while its % divided by fp32's (points 100x above the line)."""
    (run,) = load_runs([cpu_run(tmp_path)])
    fig = OpCharts("kda.gate", [run], palette(["triton", "torch", "torch_compile"])).roofline()
    roofs = [t for t in fig["data"] if t["name"].startswith("measured")]
    assert [t["name"] for t in roofs] == ["measured bf16 roof at the fp32 rate: 22.5 GB/s, 162 GFLOP/s"]
    assert max(roofs[0]["y"]) == 0.1615
    from spark_bench.report.model import peaks
    from spark_bench.telemetry.roofline import percent_of_peak

    assert percent_of_peak(None, 0.1615, "bf16", run.run["roofline"])["pct_flops_measured"] == 100.0  # same ceiling
    assert peaks(run.run, "bf16")["measured"]["tflops"] == 0.1615
    (run32,) = load_runs([cpu_run(tmp_path / "fp32", dtype="fp32")])
    fig32 = OpCharts("kda.gate", [run32], palette(["triton"])).roofline()
    assert [t["name"] for t in fig32["data"] if t["name"].startswith("measured")] == \
        ["measured fp32 roof: 22.5 GB/s, 162 GFLOP/s"]
    assert not any(re.search(r"\b0 T", t["name"]) for f in (fig, fig32) for t in f["data"])


def test_small_percentages_keep_their_significant_digits(tmp_path):
    _, data, text = figures(write_report([cpu_run(tmp_path)], tmp_path / "r.html"))
    summary = text[text.index('<section id="summary">'):text.index('<section id="problems">')]
    best = re.search(r"<td>([0-9.e-]+)% of BW measured</td>", summary)
    assert best and float(best.group(1)) > 0.01, summary  # torch_compile at ~0.045% of the BW roof, not 0.0%
    cols = {c["name"]: c for c in data["tables"]["cases"]["columns"]}
    assert "digits" not in cols["roofline_%"] and cols["roofline_%"]["sig"] == 3
    table = data["tables"]["cases"]
    names = [c["name"] for c in table["columns"]]
    roofs = {row[names.index("roof")] for row in table["rows"] if row[names.index("roofline_%")] is not None}
    assert roofs == {"BW measured"}  # which roof each percentage is of
    assert "digits" not in cols["rel_iqr_%"]
    assert "col.sig" in text  # the page script formats them with toPrecision


def test_single_shape_charts_use_a_log_axis(tmp_path):
    # 16x apart: on a linear axis torch and torch_compile would sit on the zero line under triton
    figs, _, _ = figures(write_report([cpu_run(tmp_path, triton_us=400.0)], tmp_path / "r.html"))
    latency = next(f for f in figs if f["layout"]["title"]["text"].startswith("<b>Latency"))
    assert latency["layout"]["xaxis"]["type"] == "category" and latency["layout"]["yaxis"]["type"] == "log"
    swept, _, _ = figures(write_report([cpu_run(tmp_path / "s", tokens=(16, 64), triton_us=400.0)],
                                       tmp_path / "s.html"))
    latency = next(f for f in swept if f["layout"]["title"]["text"].startswith("<b>Latency"))
    assert latency["layout"]["yaxis"]["type"] == "linear"  # a sweep under two decades keeps its linear axis


def test_the_environment_gives_the_age_of_the_roofline_calibration(tmp_path):
    _, _, text = figures(write_report([cpu_run(tmp_path)], tmp_path / "r.html"))
    env = text[text.index('<section id="env">'):]
    assert "<b>roofline peaks</b>" in env
    assert "measured 2026-11-27T07:10:00+0000, 3 d 3 h before this run (cached per device fingerprint" in env


def test_peak_memory_per_case_is_in_the_report_and_show(tmp_path):
    from click.testing import CliRunner

    from spark_bench.cli import main

    mem = {"rss_peak_bytes": 812_000_000, "rss_peak_increase_bytes": 5_000_000, "device_peak_bytes": None}
    path = cpu_run(tmp_path, memory=mem)
    _, data, _ = figures(write_report([path], tmp_path / "r.html"))
    table = data["tables"]["cases"]
    col = [c["name"] for c in table["columns"]].index("peak_MB")
    assert {row[col] for row in table["rows"]} == {812.0}
    res = CliRunner().invoke(main, ["show", str(path)], terminal_width=250)
    assert res.exit_code == 0, res.output
    assert "peak MB" in res.output and "812" in res.output
