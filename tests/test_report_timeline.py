"""The report's power timeline (spark_bench/report/timeline.py): a run's telemetry.jsonl, written by the real sampler
from a scripted GPU (telemetry/fake.py), drawn with its timing phases and cap samples, decimated without losing a
spike, and rendered in a real headless browser."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import report_fixtures as fx  # noqa: E402
from test_report_browser import PLOTS, browser  # noqa: E402, F401  (the module's headless Chromium)

from spark_bench.report import write_report  # noqa: E402
from spark_bench.report.timeline import MAX_POINTS, decimate  # noqa: E402
from spark_bench.telemetry.fake import FakeSource  # noqa: E402
from spark_bench.telemetry.sampler import RunTelemetry  # noqa: E402

POWER_CAP = 0x4  # NVML's SW power cap clock-event reason


def _record_timeline(run_dir, cases=("kda.gate|triton|a", "moe.experts|torch|<b>b</b>")):
    """What `spark-bench run` writes on a GPU: 50 ms samples while each case is timed (2 s busy) between idle gaps;
    the board hits its power cap during the second case and warms by 1 °C a second."""
    start = 1_000_000.0
    source = FakeSource(busy_w=lambda t, busy: 650.0 if busy and t > start + 3.5 else (400.0 if busy else 60.0),
                        reasons=lambda t, busy: POWER_CAP if busy and t > start + 3.5 else 0,
                        temp_c=lambda t, busy: 40.0 + (t - start), start_t=start)
    tele, why = RunTelemetry.start(run_dir, source=source)
    assert why is None
    for case in cases:
        source.sleep(0.5)
        with tele.phase(case, "timing"):
            source.run(2.0)
    tele.stop()
    return run_dir / "telemetry.jsonl"


def _figure(page):
    html = page.read_text()
    data = json.loads(html.split('<script type="application/json" id="sb-data">')[1].split("</script>")[0])
    return html, next(f["fig"] for f in data["figs"] if f["id"] == "timeline0")


def test_a_runs_timeline_is_drawn_with_its_timed_cases_and_cap_samples(tmp_path):
    run = fx.standard_run(tmp_path / "a")
    _record_timeline(run)
    html, fig = _figure(write_report([run], tmp_path / "report.html"))
    assert '<section id="timeline"><h2>Power timeline</h2>' in html and 'href="#timeline"' in html
    assert "100 samples of Fake H200, one every 50 ms" in html and "power limit 700 W" in html
    power, sm, temp, cases, cap = fig["data"]
    assert [t["name"] for t in (power, sm, temp)] == ["power (W)", "SM clock (MHz)", "temperature (°C)"]
    assert max(power["y"]) == 650.0 and min(power["y"]) == 60.0 and temp["y"][-1] == pytest.approx(44.95, abs=0.01)
    assert power["x"][0] == 0.0 and power["x"][-1] == pytest.approx(4.95)
    # each timed case is a segment over its timing phase; its hover names the case (escaped for plotly)
    assert cases["name"] == "timed cases (2)" and cases["x"][:2] == [0.5, 2.5] and cases["x"][3:5] == [3.0, 5.0]
    assert cases["text"][0] == "kda.gate|triton|a" and cases["text"][3] == "moe.experts|torch|&lt;b&gt;b&lt;/b&gt;"
    assert cap["name"].startswith("power/thermal cap (") and set(cap["y"]) == {650.0}
    assert all(x >= 3.5 for x in cap["x"]) and "sw_power_cap" in cap["text"][0].lower().replace(" ", "_")
    assert fig["layout"]["shapes"][0]["y0"] == 700.0  # the enforced power limit, dotted


def test_runs_without_a_timeline_have_no_section(tmp_path):
    html = write_report([fx.standard_run(tmp_path / "a")], tmp_path / "report.html").read_text()
    assert 'id="timeline"' not in html and 'href="#timeline"' not in html
    run = fx.standard_run(tmp_path / "b")
    (run / "telemetry.jsonl").write_text('{"type": "header", "schema": "other"}\n')
    html = write_report([run], tmp_path / "report.html").read_text()
    assert "telemetry.jsonl unreadable" in html  # said, and the rest of the report stands


def test_decimation_keeps_the_envelope():
    samples = [{"t": i * 0.05, "power_w": 300.0 + (i % 7)} for i in range(50_000)]
    samples[31_337]["power_w"] = 900.0  # a 50 ms spike
    samples[12_345]["power_w"] = 10.0
    drawn, k = decimate(samples)
    assert len(drawn) <= MAX_POINTS and k == 17
    assert max(s["power_w"] for s in drawn) == 900.0 and min(s["power_w"] for s in drawn) == 10.0
    assert [s["t"] for s in drawn] == sorted(s["t"] for s in drawn)
    assert decimate(samples[:100]) == (samples[:100], 1)


def test_the_timeline_renders_in_the_browser(browser, tmp_path):  # noqa: F811
    run = fx.standard_run(tmp_path / "a")
    _record_timeline(run)
    page = write_report([run], tmp_path / "report.html")
    browser.open(page)
    state = browser.eval(PLOTS)
    assert browser.problems() == [] and state["errors"] == []
    assert state["plots"] == state["expected"] == 13  # the standard run's 12 charts and the timeline
    hover = browser.eval("""(() => { const gd = document.querySelector('#timeline0');
        Plotly.Fx.hover(gd, [{curveNumber: 3, pointNumber: 0}]);
        return [...gd.querySelectorAll('.hovertext')].map(h => h.textContent).join(' '); })()""")
    assert "kda.gate|triton|a" in hover
