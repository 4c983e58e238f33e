"""spark_bench/report/timeline.py edges (found by mutation testing): only power and thermal caps are marked (an idle
GPU's or an application-clock setting's clock events are not throttling) and only timing phases are drawn as timed
cases, with a figure built from a hand-made telemetry dict."""

from spark_bench.report.timeline import figure

IDLE, APP_CLOCKS, SW_POWER_CAP, HW_THERMAL = 0x1, 0x2, 0x4, 0x40


def test_only_power_and_thermal_caps_and_timing_phases_are_marked():
    reasons = [0, IDLE, APP_CLOCKS | IDLE, SW_POWER_CAP | IDLE, HW_THERMAL, None]
    tele = {"header": {"period_s": 0.05, "power_field": "instant", "device_name": "H200"},
            "samples": [{"t": 100.0 + i * 0.05, "power_w": 300.0 + i, "reasons": r} for i, r in enumerate(reasons)],
            "phases": [{"case_id": "a", "phase": "check", "start": 100.0, "end": 100.1},
                       {"case_id": "a", "phase": "timing", "start": 100.1, "end": 100.2}]}
    fig, caption = figure(tele, "run-a")
    (cap,) = [t for t in fig["data"] if t["name"].startswith("power/thermal cap")]
    assert cap["name"] == "power/thermal cap (2 samples)" and cap["y"] == [303.0, 304.0]
    assert cap["text"] == ["sw_power_cap", "hw_thermal_slowdown"]  # the idle bit beside the cap is not named
    (cases,) = [t for t in fig["data"] if t["name"].startswith("timed cases")]
    assert cases["name"] == "timed cases (1)" and cases["x"] == [0.1, 0.2, None]  # the timing phase, not the check
    assert caption == "run-a: 6 samples of H200, one every 50 ms, power from instant; 1 timing phases marked above " \
                      "the power"
