"""The trend page in headless Chromium (the run report's harness, networking off): offline, every chart drawn, the
steps table first and filterable, the parameter selector, hovers with commits and the step, and hostile names inert."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import run_cli
from test_report_browser import PAYLOAD, PLOTS, browser  # noqa: E402, F401  (the module's Chromium fixture)

from spark_bench.history import synthetic  # noqa: E402
from spark_bench.history.ingest import add_runs  # noqa: E402


@pytest.fixture(scope="module")
def trends(tmp_path_factory):
    root = tmp_path_factory.mktemp("trends")
    shas = synthetic.git_repo(root / "repo", 30)
    runs = synthetic.write_history(root / "h200", shas, steps={3: (17, 1.15)}, seed=7)
    l4 = synthetic.write_history(root / "l4", shas[-10:], seed=8, device={**synthetic.H200, "name": "NVIDIA L4"},
                                 fingerprint_id="fp-l4")
    for path in l4:  # distinct run ids for the second device
        run = json.loads((path / "run.json").read_text())
        run["run_id"] += "-l4"
        (path / "run.json").write_text(json.dumps(run))
    db = root / "history.db"
    add_runs(db, [*runs, *l4], repo=root / "repo")
    out = root / "trends.html"
    code, stdout, err = run_cli("history", "report", "--db", db, "-o", out, "--repo", root / "repo")
    assert code == 0, err
    assert stdout.strip() == str(out)
    return {"page": out, "shas": shas}


def test_trend_page_is_self_contained(trends):
    text = trends["page"].read_text()
    assert "Content-Security-Policy" in text and "default-src 'none'" in text
    assert "<script src" not in text and "<link" not in text
    head = text[:text.index('id="sb-data"')]
    assert head.index('id="steps"') < head.index('id="overview"') < head.index('class="trend"')  # regressions first


def test_trend_page_renders_offline(browser, trends):  # noqa: F811
    browser.open(trends["page"])
    state = browser.eval(PLOTS)
    assert browser.problems() == [] and state["errors"] == []
    assert state["plots"] == state["expected"] == 4  # 2 ops x 2 device fingerprints
    assert {"triton", "torch"} <= set(state["legends"])
    assert state["title"] == "spark-bench trends: 16 series, 1 slower, 0 faster"

    rows = """document.querySelectorAll('[data-table="steps"] tbody tr')"""
    assert browser.eval(f"{rows}.length") == 1
    cells = browser.eval(f"[...{rows}[0].querySelectorAll('td')].map(td => td.textContent)")
    assert cells[:5] == ["slower", "kda.gate", "torch", "bf16", "heads=4 tokens=256"]
    assert trends["shas"][17][:10] in cells and any("change 17" in c for c in cells)
    browser.eval("""(() => { const i = document.querySelector('[data-table="steps"] input');
                   i.value = 'verdict=faster'; i.dispatchEvent(new Event('input')); })()""")
    assert browser.eval(f"{rows}.length") == 0

    # the H200 kda.gate chart: the combination with the step comes first; the selector switches the traces
    gd = """[...document.querySelectorAll('section.trend')].find(s => s.textContent.includes('kda.gate')
             && s.textContent.includes('H200')).querySelector('.js-plotly-plot')"""
    assert "1 step" in browser.eval(f"({gd}).closest('section').querySelector('select').options[0].text")
    visible = f"[...new Set(({gd}).data.filter(t => t.visible === true).map(t => t.meta.combo))]"
    assert browser.eval(visible) == [0]
    browser.eval(f"""(() => {{ const s = ({gd}).closest('section').querySelector('select');
                   s.value = '1'; s.dispatchEvent(new Event('change')); }})()""")
    assert browser.eval(visible) == [1]
    browser.eval(f"""(() => {{ const s = ({gd}).closest('section').querySelector('select');
                   s.value = '0'; s.dispatchEvent(new Event('change')); }})()""")

    def hover(trace_test: str, point: int) -> str:
        return browser.eval(f"""(() => {{ const gd = {gd};
            const k = gd.data.findIndex(t => {trace_test});
            Plotly.Fx.unhover(gd);
            Plotly.Fx.hover(gd, [{{curveNumber: k, pointNumber: {point}}}]);
            return [...gd.querySelectorAll('.hovertext')].map(h => h.textContent).join(' '); }})()""")

    step = hover("t.visible === true && t.name === 'torch slower'", 0)
    assert "slower +1" in step and "change 17" in step and "confidence" in step
    point = hover("t.visible === true && t.name === 'torch'", 10)
    assert f"commit {trends['shas'][10][:10]}" in point and "median" in point and "cuda-0010" in point
    assert browser.problems() == []


def test_hostile_names_run_no_script(browser, tmp_path):  # noqa: F811
    evil = [synthetic.SynthCase(f"kda.{PAYLOAD}", PAYLOAD, {"tokens": 16, "format": PAYLOAD}, 10.0, dtype=PAYLOAD)]
    runs = synthetic.write_history(tmp_path / "runs", [PAYLOAD, None, None, PAYLOAD], case_list=evil,
                                   steps={0: (2, 1.5)}, seed=1, device={**synthetic.H200, "name": PAYLOAD},
                                   fingerprint_id=PAYLOAD)
    db = tmp_path / "h.db"
    add_runs(db, runs, branch=PAYLOAD)
    out = tmp_path / "evil.html"
    code, _, err = run_cli("history", "report", "--db", db, "-o", out)
    assert code == 0, err
    text = out.read_text()
    assert "<script>window.pwned" not in text and "<img src=x" not in text
    browser.open(out)
    state = browser.eval(PLOTS)
    assert state["pwned"] is None and state["title"] != "pwned"
    assert browser.problems() == [] and state["plots"] == state["expected"] == 1
    assert PAYLOAD in state["legends"]
    assert browser.eval("document.querySelectorAll('main img').length") == 0


def _layouts(page: Path) -> list[dict]:
    blob = page.read_text().split('id="sb-data">', 1)[1].split("</script>", 1)[0]
    return [f["fig"]["layout"] for f in json.loads(blob)["figs"]]


def test_time_axis_turns_logarithmic_when_a_chart_spans_20x_and_short_series_are_said(tmp_path, trends):
    assert all(lay["yaxis"].get("rangemode") == "tozero" and "type" not in lay["yaxis"]
               for lay in _layouts(trends["page"]))  # synthetic backends 1.5-3x apart: linear from zero
    assert "fewer than 3 timed points" not in trends["page"].read_text()
    wide = [synthetic.SynthCase("kda.gate", b, {"tokens": 16}, us) for b, us in (("torch", 10.0), ("triton", 2.5e4))]
    runs = synthetic.write_history(tmp_path / "runs", [f"{i:040x}" for i in (1, 2)], case_list=wide)
    add_runs(tmp_path / "h.db", runs)
    code, _, err = run_cli("history", "report", "--db", tmp_path / "h.db", "-o", tmp_path / "t.html")
    assert code == 0, err
    (layout,) = _layouts(tmp_path / "t.html")
    assert layout["yaxis"]["type"] == "log" and "rangemode" not in layout["yaxis"]
    assert "2 of them have fewer than 3 timed points" in (tmp_path / "t.html").read_text()
    (tmp_path / "adir").mkdir()
    code, _, err = run_cli("history", "report", "--db", tmp_path / "h.db", "-o", tmp_path / "adir")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "'-o'" in err and "is a directory" in err, err
    assert not list(tmp_path.glob("adir*.tmp"))  # it left a .tmp page behind
