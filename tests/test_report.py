"""The HTML report without a browser: self-containment, escaping, the figures plotly accepts, the summaries."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import plotly.offline
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import report_fixtures as fx  # noqa: E402

from spark_bench.report import ResultsError, load_runs, write_report  # noqa: E402
from spark_bench.report.assets import palette  # noqa: E402
from spark_bench.report.charts import OpCharts  # noqa: E402
from spark_bench.report.cli import report  # noqa: E402
from spark_bench.report.html import script_json  # noqa: E402
from spark_bench.report.model import op_summary, peaks, problems, roofline_pct, swept_axis  # noqa: E402

PAYLOAD = '</script><script>alert(1)</script><img src=x onerror=alert(2)>&amp;'


def page_data(text: str) -> dict:
    m = re.search(r'<script type="application/json" id="sb-data">(.*?)</script>', text, re.S)
    assert m, "no data block"
    return json.loads(m.group(1))


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    return fx.standard_run(d / "a", seed=0)


@pytest.fixture(scope="module")
def page(one_run, tmp_path_factory):
    out = write_report([one_run], tmp_path_factory.mktemp("html") / "r.html")
    return out.read_text()


def test_self_contained_and_offline(page):
    assert page.count(plotly.offline.get_plotlyjs()) == 1
    assert len(re.findall(r"<script\b", page)) == 3  # data, plotly.js, the page script
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)\s*=", page, re.I)
    own = page.split(plotly.offline.get_plotlyjs())
    for part in own:  # plotly.js mentions URLs in its source; our own markup must not load anything
        assert "cdn.plot.ly" not in part and "fonts.googleapis" not in part
    assert "default-src 'none'" in page


def test_figures_are_valid_plotly_and_count(page):
    data = page_data(page)
    assert len(data["figs"]) == 12  # 2 ops x (latency, speedup, GB/s, TFLOP/s, roofline, energy)
    for f in data["figs"]:
        go.Figure(f["fig"])  # raises on any attribute plotly does not know
        assert f'id="{f["id"]}"' in page
    latency = data["figs"][0]["fig"]
    assert latency["layout"]["xaxis"]["type"] == "log"  # tokens 1..4096 span > 2 decades
    assert latency["layout"]["xaxis"]["tickvals"] == [1, 16, 256, 4096]
    names = {t["name"] for t in latency["data"] if t["mode"] == "lines+markers"}
    assert names == {"triton", "torch", "torch_compile", "reference"}
    (failed,) = [t for t in latency["data"] if t["mode"] == "markers"]  # the mismatch is marked, not missing
    assert failed["name"] == "triton ✕ mismatch" and failed["x"] == [4096] and failed["marker"]["symbol"] == "x"
    assert "outputs differ: err_ratio 0.4 &gt; 0.01" in data["hover"][failed["meta"]["h"][0]]
    colours = {t["name"]: t["line"]["color"] for f in data["figs"] for t in f["fig"]["data"] if "line" in t
               and t["name"] in names}
    assert colours["triton"] == "#1f77b4" and colours["torch"] == "#ff7f0e"
    # error bars are the p10/p90 spread around the median
    t = latency["data"][0]
    assert all(a >= 0 for a in t["error_y"]["array"]) and any(a > 0 for a in t["error_y"]["arrayminus"])
    hover = data["hover"][t["meta"]["h"][0]]  # stored once per case, expanded by the page script
    assert "timer cuda-event" in hover and "tokens=" in hover and "% of BW measured roof" in hover
    assert len(data["hover"]) == 66  # timed cases, and the 2 that failed (not the skipped ones)


def test_raw_samples_embedded_once(page, one_run):
    data = page_data(page)
    timed = [r for r in load_runs([one_run])[0].results if r["status"] == "ok"]
    assert sum(len(v) for v in data["samples"].values()) == len(timed)
    assert all(len(s["s"]) == 60 for v in data["samples"].values() for s in v)
    assert not any("samples" in json.dumps(f["fig"]) for f in data["figs"])


def test_a_case_of_many_samples_embeds_evenly_spaced_order_statistics(tmp_path):
    rng = np.random.default_rng(5)
    many = np.concatenate([rng.lognormal(np.log(10.0), 0.05, 1995), [50.0, 60.0, 70.0, 80.0, 90.0]])
    run = fx.write_run(tmp_path / "a", [fx.case("kda.gate", "triton", {"tokens": 1}, samples=many),
                                        fx.case("kda.gate", "torch", {"tokens": 1}, samples=fx.draw(rng, 9.0))])
    page = write_report([run], tmp_path / "r.html").read_text()
    sets = {s["b"]: s for s in page_data(page)["samples"]["op0"]}
    kept = sets["triton"]["s"]
    assert len(kept) == 256 and sets["triton"]["of"] == 2000 and "of" not in sets["torch"]
    assert min(kept) == pytest.approx(many.min(), rel=1e-3) and max(kept) == 90.0  # whiskers and outliers kept
    for q in (25, 50, 75):  # the box to within one rank in 256
        assert np.percentile(kept, q) == pytest.approx(np.percentile(many, q), rel=0.01)
    assert "1 case(s) with more than 256 drawn from 256 evenly spaced order statistics" in page


def test_failures_are_listed_with_their_error(page):
    assert "outputs differ: err_ratio 0.4 &gt; 0.01" in page
    assert "RuntimeError: CUDA out of resources" in page
    assert "16 skipped cases" in page and "fla-core not installed" in page


def test_summary_numbers(one_run):
    run = load_runs([one_run])[0]
    gate = [r for r in run.results if r["op"] == "kda.gate"]
    s = op_summary("kda.gate", gate, run.run, "torch")
    assert s["fastest"] == "triton" and s["compared"] == 8
    assert 1.9 < s["speedup"] < 2.8 and s["speedup_min"] <= s["speedup"] <= s["speedup_max"]
    assert s["counts"] == {"ok": 32, "skipped": 8, "mismatch": 1}
    pct, label = s["roofline"]
    assert label == "BW measured" and 0 < pct < 100
    failed, skipped = problems(gate)
    assert [r["status"] for r in failed] == ["mismatch"] and skipped[0]["count"] == 8


def test_baseline_fastest_names_the_runner_up(tmp_path):
    rng = np.random.default_rng(0)
    results = [fx.case("kda.gate", b, {"tokens": t}, samples=fx.draw(rng, m * t))
               for t in (4, 40) for b, m in (("torch", 1.0), ("triton", 2.0), ("torch_compile", 4.0))]
    text = write_report([fx.write_run(tmp_path / "r", results)], tmp_path / "r.html").read_text()
    assert re.search(r"the baseline is fastest; next triton at 0\.5\d\d× \(geomean\)", text)  # 3 digits


def test_roofline_percent_sources():
    r = {"gbps": 2150.0, "tflops": 39.0, "dtype": "bf16", "roofline": None}
    run = {"roofline": {"measured": {"bw_gbps": 4300.0}, "datasheet": {"gbps": 4800.0, "tflops": {"bf16": 989.0}}}}
    assert roofline_pct(r, run) == pytest.approx((50.0, "BW measured"))
    assert peaks(run, "bf16")["datasheet"] == {"gbps": 4800.0, "tflops": 989.0}
    stored = {**r, "roofline": {"pct_bw_measured": 12.0, "pct_flops_datasheet": 61.0}}
    assert roofline_pct(stored, run) == (61.0, "FLOP/s datasheet")
    assert roofline_pct(r, {"roofline": {"measured": None, "datasheet": None}}) is None


def test_peaks_taken_while_busy_and_rates_above_the_peak_are_explained(tmp_path):
    rng = np.random.default_rng(0)
    results = [fx.case("kda.gate", b, {"tokens": t}, samples=fx.draw(rng, m * t), nbytes=4e6)
               for t in (4, 40) for b, m in (("torch", 1.0), ("triton", 2.0))]
    busy = {"measured": {"bandwidth_gbps": 1.0, "measured_at": "2026-11-30T10:00:00+00:00", "busy": True,
                         "load": {"loadavg_1min": 3.9, "cpus": 2}}, "datasheet": None}
    text = write_report([fx.write_run(tmp_path / "b", results, roofline=busy)], tmp_path / "b.html").read_text()
    assert "busy (load average 3.9 on 2 CPUs)" in text and "Above 100%" in text and "% of BW measured †" in text
    idle = {"measured": {"bandwidth_gbps": 1e6, "measured_at": "2026-11-30T10:00:00+00:00", "busy": False,
                         "load": {"loadavg_1min": 0.1, "cpus": 2}}, "datasheet": None}
    text = write_report([fx.write_run(tmp_path / "i", results, roofline=idle)], tmp_path / "i.html").read_text()
    assert "load average" not in text and "Above 100%" not in text and "†" not in text


def test_swept_axis_and_palette():
    rs = [{"params": {"tokens": t, "heads": h}} for t in (1, 7, 300) for h in (2, 4)]
    assert swept_axis(rs) == "tokens"
    assert swept_axis([{"params": {"tokens": 5}}]) is None
    p = palette(["zeta", "triton", "alpha"])
    assert p["triton"] == "#1f77b4" and p["alpha"] != p["zeta"]
    assert palette(["alpha", "zeta"]) == {k: v for k, v in p.items() if k != "triton"}


def test_hostile_strings_are_escaped(tmp_path):
    rng = np.random.default_rng(0)
    results = [fx.case(f"op.{PAYLOAD}", PAYLOAD, {"tokens": t, "format": PAYLOAD}, samples=fx.draw(rng, 5.0 + t),
                       flops=1e6, nbytes=1e6) for t in (3, 30, 300)]
    results.append(fx.case(f"op.{PAYLOAD}", "triton", {"tokens": 3, "format": PAYLOAD}, status="error",
                           error=PAYLOAD))
    run = fx.write_run(tmp_path / "evil", results, run_id=PAYLOAD, commit=PAYLOAD)
    text = write_report([run], tmp_path / "evil.html", baseline=PAYLOAD).read_text()
    assert "<script>alert" not in text and "<img" not in text and "</script><script>" not in text
    assert "&lt;/script&gt;&lt;script&gt;alert(1)" in text  # shown, as text
    data = page_data(text)
    assert any(PAYLOAD in row for row in data["tables"]["cases"]["rows"][0])  # round-trips exactly through JSON


def test_script_json_cannot_close_its_element():
    text = script_json({"a": "</script><!-- & \u2028", "b": float("nan")})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"a": "</script><!-- & \u2028", "b": None}


def test_two_runs_side_by_side(tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b", commit="9b8c7d6e5f", scale={"triton": 1.2})
    runs = load_runs([a, b])
    assert [r.label for r in runs] == ["3f2a1c9d", "9b8c7d6e"]
    text = write_report([a, b], tmp_path / "two.html").read_text()
    data = page_data(text)
    assert len(data["figs"]) == 14  # a ratio chart per op on top of the 6
    verdicts = [row[-2] for row in data["tables"]["comparison"]["rows"]]
    assert verdicts.count("slower") == 16 and verdicts[0] == "slower"  # regressions sorted first
    ratio = next(f["fig"] for f in data["figs"] if f["fig"]["layout"]["title"]["text"].startswith("<b>Ratio"))
    triton = [t for t in ratio["data"] if t["name"].startswith("triton") and t["visible"]]
    assert triton and all(1.1 < y < 1.3 for y in triton[0]["y"])


def test_single_shape_op_uses_a_categorical_axis(tmp_path):
    rng = np.random.default_rng(0)
    results = [fx.case("moe.router", b, {"tokens": 64, "experts": 256}, dtype=dt, samples=fx.draw(rng, 9.0))
               for b in ("triton", "torch") for dt in ("bf16", "fp32")]
    run = fx.write_run(tmp_path / "r", results)
    (rs,) = load_runs([run])
    charts = OpCharts("moe.router", [rs], palette(["triton", "torch"]))
    assert charts.swept is None and charts.combos == [""]
    lat = charts.latency()
    assert lat["layout"]["xaxis"]["type"] == "category"
    assert sorted(lat["data"][0]["x"]) == ["experts=256 tokens=64 bf16", "experts=256 tokens=64 fp32"]


def test_nothing_timed_still_reports(tmp_path):
    results = [fx.case("kda.gate", "triton", {"tokens": t}, status="crash", error=f"signal 11 at {t}")
               for t in (1, 2)]
    run = fx.write_run(tmp_path / "r", results)
    text = write_report([run], tmp_path / "r.html").read_text()
    assert page_data(text)["figs"] == []
    assert "signal 11 at 1" in text and "signal 11 at 2" in text and "No timed case" in text


def test_thousands_of_cases_stay_small(tmp_path):
    rng = np.random.default_rng(0)
    tokens = tuple(int(x) for x in np.unique(np.geomspace(1, 65536, 40).astype(int)))
    results = fx.sweep(rng, ops=tuple(f"kda.op{i}" for i in range(8)), tokens=tokens, n=30)
    assert len(results) > 3000
    run = fx.write_run(tmp_path / "big", results)
    out = write_report([run], tmp_path / "big.html")  # about 1 s on an idle core (not asserted: CI is shared)
    extra = out.stat().st_size - len(plotly.offline.get_plotlyjs())
    assert extra < 1200 * len(results), extra  # per case: hovers, table row, 30 samples


def test_report_command(tmp_path, one_run):
    out = tmp_path / "sub" / "r.html"
    res = CliRunner().invoke(report, [str(one_run), "-o", str(out), "--baseline", "torch_compile"])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == str(out) and "speedup over torch_compile" in out.read_text()
    res = CliRunner().invoke(report, [str(tmp_path / "missing"), "-o", str(out)])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1


def test_report_of_selected_ops_and_backends(tmp_path, one_run):
    out = tmp_path / "r.html"
    res = CliRunner().invoke(report, [str(one_run), "-o", str(out), "--op", "moe.*", "--backend", "triton"])
    assert res.exit_code == 0, res.output
    rows = page_data(out.read_text())["tables"]["cases"]["rows"]
    assert rows and {(row[0], row[1]) for row in rows} == {("moe.experts", "triton")}
    res = CliRunner().invoke(report, [str(one_run), "-o", str(out), "--op", "quant.*"])
    assert res.exit_code == 2 and "no case matches --op quant.*; the run has: kda.gate, moe.experts" in res.output


def test_load_errors_are_one_line(tmp_path):
    with pytest.raises(ResultsError, match="no such run directory"):
        load_runs([tmp_path / "nothing"])
