"""The report in a real browser: headless Chromium, networking off, driven over the DevTools protocol on a pipe
(--remote-debugging-pipe: NUL-separated JSON on fds 3/4, no websocket library needed).

Run `python tests/test_report_browser.py OUT.png` to regenerate docs/report-screenshot.png from the fixture runs.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import report_fixtures as fx  # noqa: E402

from spark_bench.report import write_report  # noqa: E402

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
PAYLOAD = '<script>window.pwned=1;document.title="pwned"</script><img src=x onerror="window.pwned=2">'
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-extensions", "--disable-dev-shm-usage",
         "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9", "--remote-debugging-pipe"]
LOCAL = ("file:", "data:", "blob:", "about:")


class Browser:
    """A headless Chromium with one page; send(method, **params) -> result; events are collected in `events`."""

    def __init__(self, binary: str, width: int = 1400, height: int = 900):
        self.profile = tempfile.mkdtemp(prefix="sb-chromium-")
        to_browser_r, self._w = os.pipe()
        self._r, from_browser_w = os.pipe()

        def wire_fds() -> None:  # the browser reads commands on fd 3 and writes replies on fd 4
            a, b = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     preexec_fn=wire_fds, close_fds=False, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self.replies: queue.Queue = queue.Queue()
        self.events: list[dict[str, Any]] = []
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                return
            buf += chunk
            *messages, buf = buf.split(b"\0")
            for m in messages:
                msg = json.loads(m)
                (self.replies.put(msg) if "id" in msg else self.events.append(msg))

    def send(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if getattr(self, "session", None) and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = self.replies.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"chromium did not answer {method} within {timeout}s "
                                   f"(exit status {self.proc.poll()})") from None
            if reply["id"] == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def eval(self, expression: str) -> Any:
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"evaluation failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Poll a JS expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while not (value := self.eval(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression!r} still false after {timeout}s: {self.problems()}")
            time.sleep(0.1)
        return value

    def open(self, path: Path, timeout: float = 60.0) -> None:
        """Load the page and wait until the report script has drawn every figure."""
        self.events.clear()
        self.send("Page.navigate", url=path.resolve().as_uri())
        self.wait_for("!!(window.sparkBench && window.sparkBench.done)", timeout)

    def problems(self) -> list[str]:
        """Console errors, uncaught exceptions, log errors (CSP violations included) and non-local requests."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails'].get('exception', {}).get('description')}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(f"console.{p['type']}: {[a.get('value', a.get('description')) for a in p['args']]}")
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(f"log: {p['entry']['text']}")
            elif m == "Network.requestWillBeSent" and not p["request"]["url"].startswith(LOCAL):
                out.append(f"network request: {p['request']['url']}")
        return out

    def screenshot(self, out: Path, height: int | None = None) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if height:
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": 1400, "height": height,
                                                            "scale": 1})
        import base64

        out.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", **params)["data"]))
        return out

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._w)
        self._reader.join(timeout=5)  # EOF once the browser is gone
        os.close(self._r)
        shutil.rmtree(self.profile, ignore_errors=True)


PLOTS = """(() => {
  const plots = [...document.querySelectorAll('div.js-plotly-plot')].filter(d => d.querySelector('svg.main-svg'));
  return {plots: plots.length, expected: window.sparkBench.expected, errors: window.sparkBench.errors,
          legends: [...new Set(plots.flatMap(d => [...d.querySelectorAll('.legendtext')].map(t => t.textContent)))],
          title: document.title, pwned: window.pwned === undefined ? null : window.pwned};
})()"""


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium binary found (apt-get install chromium)")
    b = Browser(CHROMIUM)
    yield b
    b.close()


def test_report_renders_offline(browser, tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0)
    page = write_report([a], tmp_path / "report.html")
    browser.open(page)
    state = browser.eval(PLOTS)
    assert browser.problems() == []
    assert state["errors"] == []
    # 2 ops x (latency, speedup, GB/s, TFLOP/s, roofline, energy)
    assert state["plots"] == state["expected"] == 12
    for backend in ("triton", "torch", "torch_compile", "reference"):
        assert backend in state["legends"]
    hover = browser.eval("""(() => { const gd = document.querySelector('#op0-fig0');
        Plotly.Fx.hover(gd, [{curveNumber: 0, pointNumber: 1}]);
        return [...gd.querySelectorAll('.hovertext')].map(h => h.textContent).join(' '); })()""")
    assert "tokens=16" in hover and "timer cuda-event" in hover and "median" in hover
    browser.screenshot(tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 10_000

    # the combination selector switches every chart of the op; the raw-sample box plot draws on demand
    shown = """(sel) => [...document.querySelectorAll('[data-op-figs="op0"] .js-plotly-plot')][0].data
                 .filter(t => t.visible === true).map(t => t.meta.combo)"""
    assert set(browser.eval(f"({shown})()")) == {0}
    browser.eval("""(() => { const s = document.querySelector('select.sb-combo[data-op="op0"]');
                   s.value = '1'; s.dispatchEvent(new Event('change')); })()""")
    assert set(browser.eval(f"({shown})()")) == {1}
    browser.eval("""document.querySelector('details.sb-box[data-op="op0"]').open = true""")
    boxes = """document.querySelectorAll('details.sb-box[data-op="op0"] g.trace.boxes').length"""
    assert browser.wait_for(boxes) == 4  # one per timed backend of the selected combination

    # the table filters and sorts
    rows = """document.querySelectorAll('[data-table="cases"] tbody tr')"""
    browser.eval("""(() => { const i = document.querySelector('[data-table="cases"] input');
                   i.value = 'status:mismatch'; i.dispatchEvent(new Event('input')); })()""")
    assert browser.eval(f"{rows}.length") == 1
    browser.eval("""(() => { const i = document.querySelector('[data-table="cases"] input');
                   i.value = 'backend=triton tokens=4096'; i.dispatchEvent(new Event('input')); })()""")
    # 'backend=' is an exact column match; 'tokens=4096' names no column, so it is text found in params:
    # 2 ops x 2 head counts, plus the mismatching triton case at tokens=4096
    assert browser.eval(f"{rows}.length") == 5
    assert browser.problems() == []


def test_hostile_names_run_no_script(browser, tmp_path):
    rng = fx.np.random.default_rng(3)
    results = []
    for backend in ("triton", PAYLOAD):
        for t in (8, 64, 512):
            results.append(fx.case(f"kda.{PAYLOAD}", backend, {"tokens": t, "format": PAYLOAD},
                                   samples=fx.draw(rng, 10.0 + t / 50), flops=1e6 * t, nbytes=1e5 * t))
    results.append(fx.case(f"kda.{PAYLOAD}", PAYLOAD, {"tokens": 1, "format": PAYLOAD}, status="error",
                           error=f"</script>{PAYLOAD}<!--"))
    run = fx.write_run(tmp_path / "evil", results, run_id=PAYLOAD, commit=PAYLOAD)
    page = write_report([run], tmp_path / "evil.html", baseline=PAYLOAD)
    text = page.read_text()
    assert "<script>window.pwned" not in text and "<img src=x" not in text
    browser.open(page)
    state = browser.eval(PLOTS)
    assert state["pwned"] is None and state["title"] != "pwned"
    assert browser.problems() == []
    assert state["plots"] == state["expected"] >= 3
    assert PAYLOAD in state["legends"]  # shown as text, not markup
    assert browser.eval("document.querySelectorAll('main img').length") == 0


def test_report_of_a_real_quick_run(browser, tmp_path):
    """What `spark-bench run --quick` writes at its end opens offline, draws every chart, and names its backends."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "spark_bench", "run", "--op", "kda.gate", "--quick", "--out",
                           str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    page = out / "report.html"
    assert f"report: {page}" in proc.stdout
    browser.open(page)
    state = browser.eval(PLOTS)
    assert browser.problems() == [] and state["errors"] == []
    assert state["plots"] == state["expected"] >= 5
    for backend in ("triton (interpreted)", "torch", "torch_compile"):  # the Triton numbers say what they are
        assert backend in state["legends"]
    assert "interpreted" in page.read_text()


ODD = 'é—µ𝛼 %{y} ${x} & "q" ' + PAYLOAD  # unicode, a plotly template, HTML specials, a script


def odd_results() -> list[dict[str, Any]]:
    """One case alone, an op where everything failed, null statistics, 1e-6 and 1e12 µs, and hostile labels."""
    rng = fx.np.random.default_rng(7)
    out = [fx.case("odd.one", "torch", {"tokens": 16}, samples=fx.draw(rng, 50.0), flops=1e6, nbytes=1e6)]
    out += [fx.case("odd.failed", "triton", {"tokens": t}, status=s, error=f"{s}: {ODD}")
            for t, s in ((1, "crash"), (2, "mismatch"), (4, "timeout"))]
    out.append(fx.case("odd.failed", "fla", {"tokens": 1}, status="skipped", error=ODD))
    for b, median in (("torch", 1e-6), ("triton", 1e12)):
        out += [fx.case("odd.extreme", b, {"tokens": t}, samples=fx.draw(rng, median * t)) for t in (1, 1000)]
    nulls = [fx.case("odd.nulls", b, {"tokens": t}, samples=fx.draw(rng, 10.0 * t)) for b in ("torch", "triton")
             for t in (1, 10)]
    nulls[0]["timing"].update(p10=None, p90=None, iqr=None, n=None, timer=None)
    nulls[1]["timing"]["median"] = float("inf")  # ok, but no usable timing
    for b in ("torch", ODD):
        out += [fx.case(f"odd.{ODD}", b, {"tokens": t, "mode": ODD}, dtype=ODD, samples=fx.draw(rng, 5.0 + t),
                        flops=1e6, nbytes=1e6) for t in (1, 10)]
    out.append(fx.case(f"odd.{ODD}", ODD, {"tokens": 100, "mode": ODD}, dtype=ODD, status="mismatch", error=ODD))
    return out + nulls


FAILURE_HOVER = """((name) => {  // the hover of the first visible ✕ trace whose name has `name`
  for (const gd of document.querySelectorAll('[data-op-figs] .js-plotly-plot')) {
    const k = gd.data.findIndex(t => t.visible === true && t.name.includes('✕') && t.name.includes(name));
    if (k < 0) continue;
    Plotly.Fx.hover(gd, [{curveNumber: k, pointNumber: 0}]);
    return [...gd.querySelectorAll('.hovertext')].map(h => h.textContent).join(' ');
  }
})"""


def test_odd_data_renders_without_errors(browser, tmp_path):
    run = fx.write_run(tmp_path / "odd", odd_results(), run_id=ODD)
    page = write_report([run], tmp_path / "odd.html")
    browser.open(page)
    state = browser.eval(PLOTS)
    assert browser.problems() == [] and state["errors"] == []
    assert state["pwned"] is None and browser.eval("document.querySelectorAll('main img').length") == 0
    assert state["plots"] == state["expected"] >= 12  # odd.failed has none: nothing was timed
    assert f"{ODD} ✕ mismatch" in state["legends"]  # the template and the markup kept as text
    hover = browser.eval(f"{FAILURE_HOVER}('mismatch')")  # a ✕ gives the case's error, as text
    assert "mismatch: " + ODD in hover and "not timed" in hover
    assert "no usable timing" in browser.eval(f"{FAILURE_HOVER}('torch')")  # status ok, median inf
    subtitles = browser.eval("[...document.querySelectorAll('.gtitle-subtitle')].map(t => t.textContent)")
    assert "on NVIDIA H200 · timer ?, cuda-event (mixed: see each point)" in subtitles
    assert set(subtitles) <= {"on NVIDIA H200 · timer cuda-event",
                              "on NVIDIA H200 · timer ?, cuda-event (mixed: see each point)"}
    assert "No timed case of this op" in browser.eval("document.getElementById('op-odd-failed').textContent")
    browser.eval("""(() => { const i = document.querySelector('[data-table="cases"] input');
                   i.value = 'op=odd.extreme backend=triton'; i.dispatchEvent(new Event('input')); })()""")
    speedups = browser.eval("""(() => { const t = document.querySelector('[data-table="cases"] table');
        const k = [...t.querySelectorAll('th')].findIndex(th => th.textContent === 'x_torch');
        return [...t.querySelectorAll('tbody tr')].map(tr => tr.children[k].textContent); })()""")
    assert len(speedups) == 2 and all(float(x) > 0 for x in speedups)  # ~1e-18, not "0.00"


def test_runs_of_two_machines_say_so_in_the_browser(browser, tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b", device={"type": "cpu", "name": "AMD EPYC"},
                        fingerprint_id="fp-cpu")
    browser.open(write_report([a, b], tmp_path / "two.html"))
    state = browser.eval(PLOTS)
    assert browser.problems() == [] and state["plots"] == state["expected"] == 14
    subtitles = set(browser.eval("[...document.querySelectorAll('.gtitle-subtitle')].map(t => t.textContent)"))
    assert subtitles == {"on NVIDIA H200 and CPU (AMD EPYC) (different machines on one axis) · timer cuda-event"}
    assert "Different machines: CPU (AMD EPYC) [fp-cpu] vs NVIDIA H200" in browser.eval(
        "document.getElementById('compare').textContent")
    bars = "document.querySelectorAll('#op0-fig1 g.errorbar path').length"  # the speedups' CIs are drawn
    assert browser.eval(bars) == browser.eval(
        "document.getElementById('op0-fig1').data.filter(t => t.visible === true).reduce((n, t) => n + t.y.length, 0)")


AT_LOAD = """window.addEventListener('load', () => {
  const shown = [...document.querySelectorAll('[data-op-figs] > div')].filter(d => {
    const r = d.getBoundingClientRect(); return r.bottom > 0 && r.top < window.innerHeight; });
  window.atLoad = {inView: shown.length, drawn: shown.filter(d => d.querySelector('svg.main-svg')).length};
});"""


def test_charts_in_view_are_drawn_by_the_load_event(tmp_path):
    """A headless screenshot (chromium --screenshot takes it at load) shows the charts in view: no wait needed."""
    if CHROMIUM is None:
        pytest.skip("no chromium binary found (apt-get install chromium)")
    page = write_report([fx.standard_run(tmp_path / "a", seed=0)], tmp_path / "report.html")
    b = Browser(CHROMIUM, height=2400)  # summary, failures, environment and the first op's charts
    try:
        b.send("Page.addScriptToEvaluateOnNewDocument", source=AT_LOAD)
        b.open(page)
        at_load = b.eval("window.atLoad")
        assert at_load["inView"] >= 3 and at_load["drawn"] == at_load["inView"], at_load
        assert b.problems() == []
    finally:
        b.close()


if __name__ == "__main__":  # the docs screenshot, of a real run: python tests/test_report_browser.py RUN_DIR [OUT.png]
    if CHROMIUM is None:
        sys.exit("no chromium binary found")
    if len(sys.argv) < 2:
        sys.exit("usage: python tests/test_report_browser.py RUN_DIR [OUT.png [HEIGHT]] (a real run: the screenshot "
                 "goes into the docs, so no fixture data)")
    out = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/report-screenshot.png")
    with tempfile.TemporaryDirectory() as tmp:
        page = write_report([sys.argv[1]], Path(tmp) / "report.html")
        b = Browser(CHROMIUM, height=int(sys.argv[3]) if len(sys.argv) > 3 else 1500)
        try:
            b.open(page)
            print(b.problems())
            b.screenshot(out)
        finally:
            b.close()
    print(out)
