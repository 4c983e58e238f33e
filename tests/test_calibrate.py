"""Datasheet table, % of peak, the per-fingerprint cache and CPU calibration (tiny sizes)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from spark_bench.telemetry import calibrate as cal
from spark_bench.telemetry import percent_of_peak, roofline_for
from spark_bench.telemetry.cli import calibrate as calibrate_cmd
from spark_bench.telemetry.roofline import datasheet_for, datasheet_key, device_identity, load_cache, store

TINY = {"copy_bytes": 4 * 2**20, "matmul_n": {"fp32": 96, "bf16": 64}, "budget_s": 0.03, "warmup_s": 0.005}
IDLE = {"loadavg_1min": 0.1, "cpus": 2}
BUSY = {"loadavg_1min": 2.6, "cpus": 2}


def _machine(monkeypatch, load, others_share=0.0):
    """The load the calibration sees: the load average before and other processes' CPU share while measuring."""
    monkeypatch.setattr(cal, "machine_load", lambda: load)
    monkeypatch.setattr(cal, "cpu_meter", lambda: (lambda: others_share))


@pytest.mark.parametrize("name,memory,key", [
    ("NVIDIA H200", 150_000_000_000, "H200 SXM"),
    ("NVIDIA H200 NVL", None, "H200 NVL"),
    ("NVIDIA H100 80GB HBM3", None, "H100 SXM"),
    ("NVIDIA H100 PCIe", None, "H100 PCIe"),
    ("NVIDIA H100 NVL", None, "H100 NVL"),
    ("NVIDIA A100-SXM4-80GB", None, "A100 SXM 80GB"),
    ("NVIDIA A100-SXM4-40GB", None, "A100 SXM 40GB"),
    ("NVIDIA A100-PCIE-40GB", None, "A100 PCIe 40GB"),
    ("NVIDIA A100 80GB PCIe", None, "A100 PCIe 80GB"),
    ("NVIDIA GH200 480GB", 102_000_000_000, "GH200 96GB"),
    ("NVIDIA L4", None, "L4"),
    ("NVIDIA L40S", None, "L40S"),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None, None),  # a slice: datasheet numbers would be wrong
    ("NVIDIA H100", None, None),  # ambiguous (SXM or PCIe)
    ("NVIDIA GeForce RTX 4090", None, None),
    ("AMD EPYC", None, None),
    (None, None, None),
])
def test_datasheet_lookup(name, memory, key):
    assert datasheet_key(name, memory) == key
    entry = datasheet_for(name, memory)
    assert (entry is None) == (key is None)


def test_datasheet_numbers():
    h200 = datasheet_for("NVIDIA H200")
    assert h200["bandwidth_gbps"] == 4800 and h200["tflops"]["bf16"] == pytest.approx(989.4)
    assert h200["tflops"]["tf32"] == pytest.approx(h200["tflops"]["bf16"] / 2)
    assert datasheet_for("NVIDIA H100 PCIe")["bandwidth_gbps"] == 2000
    a100 = datasheet_for("NVIDIA A100-SXM4-80GB")
    assert a100["bandwidth_gbps"] == 2039 and a100["tflops"]["fp32"] == 19.5 and a100["tflops"]["fp16"] == 312


def test_percent_of_peak():
    roof = {"measured": {"bandwidth_gbps": 4300.0, "tflops": {"bf16": 780.0}},
            "datasheet": datasheet_for("NVIDIA H200")}
    pct = percent_of_peak(2400.0, 495.0, "bfloat16", roof)
    assert pct == {"pct_bw_measured": pytest.approx(55.81, abs=0.01), "pct_bw_datasheet": 50.0,
                   "pct_flops_measured": pytest.approx(63.46, abs=0.01), "pct_flops_datasheet": pytest.approx(50.03)}
    assert percent_of_peak(2400.0, 1.0, "fp16", roof)["pct_flops_measured"] is None  # fp16 not measured
    assert percent_of_peak(None, 10.0, "fp32", roof)["pct_flops_datasheet"] == pytest.approx(14.95, abs=0.01)
    assert percent_of_peak(100.0, 1.0, "int7", roof)["pct_flops_datasheet"] is None
    tiny = percent_of_peak(2.4e-5, 0.0, "fp32", roof)  # an interpreted kernel of an op without FLOPs
    assert tiny["pct_bw_measured"] == pytest.approx(100 * 2.4e-5 / 4300, rel=1e-3) and tiny["pct_bw_measured"] > 0
    assert tiny["pct_flops_measured"] is None and tiny["pct_flops_datasheet"] is None
    assert set(percent_of_peak(1.0, 1.0, "bf16", None).values()) == {None}
    assert set(percent_of_peak(1.0, 1.0, "bf16", {"measured": None, "datasheet": None}).values()) == {None}


def test_cpu_calibration_and_cache(tmp_path, monkeypatch):
    cache = tmp_path / "roofline.json"
    assert roofline_for("cpu", cache=cache) == {"measured": None, "datasheet": None}  # never measures unasked
    assert not cache.exists()
    monkeypatch.setattr(cal, "CPU", TINY)
    _machine(monkeypatch, IDLE)
    roof = roofline_for("cpu", measure=True, cache=cache)
    m = roof["measured"]
    assert roof["datasheet"] is None and m["device"]["type"] == "cpu"
    copy = m["details"]["copy"]
    assert copy["bytes_moved"] == 2 * TINY["copy_bytes"]
    assert m["bandwidth_gbps"] == pytest.approx(copy["bytes_moved"] / copy["seconds"] / 1e9)
    assert 0.05 < m["bandwidth_gbps"] < 2000
    for dtype, n in TINY["matmul_n"].items():
        mm = m["details"]["matmul"][dtype]
        assert mm["n"] == n and m["tflops"][dtype] == pytest.approx(2 * n**3 / mm["seconds"] / 1e12)
        assert 1e-6 < m["tflops"][dtype] < 50
    assert load_cache(cache)[m["fingerprint_id"]] == m
    assert roofline_for("cpu", cache=cache)["measured"] == m  # read back, not remeasured
    assert m["fingerprint_id"] == device_identity("cpu")["fingerprint_id"]


def test_cache_survives_garbage_and_keeps_other_devices(tmp_path):
    cache = tmp_path / "roofline.json"
    cache.write_text("{not json")
    assert load_cache(cache) == {}
    store({"fingerprint_id": "other", "bandwidth_gbps": 1.0}, cache)
    store({"fingerprint_id": "mine", "bandwidth_gbps": 2.0}, cache)
    data = json.loads(cache.read_text())
    assert data["schema"] == "spark-bench/roofline-cache" and set(data["entries"]) == {"other", "mine"}
    cache.write_text(json.dumps({"schema": "something-else", "entries": {"x": {}}}))
    assert load_cache(cache) == {}


def test_calibrate_cli(tmp_path, monkeypatch):
    monkeypatch.setattr(cal, "CPU", TINY)
    _machine(monkeypatch, IDLE)
    cache = tmp_path / "r.json"
    runner = CliRunner()
    first = runner.invoke(calibrate_cmd, ["--device", "cpu", "--json", "--cache", str(cache)])
    assert first.exit_code == 0, first.output
    data = json.loads(first.stdout)
    assert data["measured"]["bandwidth_gbps"] > 0 and data["datasheet"] is None
    again = runner.invoke(calibrate_cmd, ["--device", "cpu", "--json", "--cache", str(cache)])
    assert json.loads(again.stdout) == data  # cached
    monkeypatch.setattr(cal, "CPU", {**TINY, "matmul_n": {"fp32": 32}})
    forced = runner.invoke(calibrate_cmd, ["--device", "cpu", "--json", "--cache", str(cache), "--force"])
    assert set(json.loads(forced.stdout)["measured"]["tflops"]) == {"fp32"}
    assert "measured now in" in runner.invoke(calibrate_cmd, ["--device", "cpu", "--cache", str(tmp_path / "new.json")]
                                              ).stdout
    text = runner.invoke(calibrate_cmd, ["--device", "cpu", "--cache", str(cache)])
    assert text.exit_code == 0 and "bandwidth" in text.stdout and "matmul fp32" in text.stdout
    assert "(cached, 0 min old; --force measures again)" in text.stdout  # read back, not measured
    bad = runner.invoke(calibrate_cmd, ["--device", "tpu"])
    assert bad.exit_code == 2 and "unknown device" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_a_cpu_calibrated_while_busy_is_labelled_and_not_cached_unless_forced(tmp_path, monkeypatch):
    monkeypatch.setattr(cal, "CPU", TINY)
    _machine(monkeypatch, BUSY)
    calls = []
    real = cal.calibrate
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = tmp_path / "r.json"
    first = roofline_for("cpu", measure=True, cache=cache)["measured"]
    assert first["busy"] is True and first["load"] == {**BUSY, "others_cpu_share": 0.0}
    assert load_cache(cache) == {}  # this run uses it, labelled
    second = roofline_for("cpu", measure=True, cache=cache)["measured"]
    assert second["busy"] is True and len(calls) == 2 and load_cache(cache) == {}  # measured again, not served
    assert not cal.was_busy(BUSY, "cuda") and not cal.was_busy(IDLE, "cpu")
    assert not cal.was_busy({"loadavg_1min": None, "cpus": 2}, "cpu")
    text = CliRunner().invoke(calibrate_cmd, ["--device", "cpu", "--cache", str(cache)])
    assert text.exit_code == 0 and "busy (load average 2.6 on 2 CPUs)" in text.stderr
    assert "were not cached" in text.stderr
    assert load_cache(cache) == {}
    forced = CliRunner().invoke(calibrate_cmd, ["--device", "cpu", "--cache", str(cache), "--force"])
    assert forced.exit_code == 0 and "are cached (--force)" in forced.stderr
    again = CliRunner().invoke(calibrate_cmd, ["--device", "cpu", "--cache", str(cache)])
    assert "are cached;" in again.stderr  # served from the cache: said so
    assert list(load_cache(cache).values())[0]["busy"] is True
    _machine(monkeypatch, IDLE)
    idle = roofline_for("cpu", measure=True, cache=cache, force=True)["measured"]
    assert idle["busy"] is False and list(load_cache(cache).values())[0]["busy"] is False


def test_other_processes_using_the_cpus_while_measuring_make_it_busy_though_the_load_average_lags(monkeypatch):
    import multiprocessing

    spinner = multiprocessing.get_context("spawn").Process(target=_spin, args=(3.0,))
    spinner.start()
    try:
        share = cal.cpu_meter()
        import time

        time.sleep(1.0)
        seen = share()
    finally:
        spinner.join()
    assert seen is not None and seen >= cal.BUSY_SHARE  # one core of 2 (or of more: then others' load adds)
    assert cal.was_busy({**IDLE, "others_cpu_share": 0.5}, "cpu") and not cal.was_busy({**IDLE, "others_cpu_share":
                                                                                         0.1}, "cpu")
    assert not cal.was_busy({**IDLE, "others_cpu_share": 0.9}, "cuda")
    _machine(monkeypatch, IDLE, others_share=0.48)
    monkeypatch.setattr(cal, "CPU", TINY)
    entry = cal.calibrate("cpu")
    assert entry["busy"] is True and entry["load"]["others_cpu_share"] == 0.48
    assert cal.busy_text(entry) == "busy (other processes used 48% of the CPUs while measuring)"


def _spin(seconds: float) -> None:
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_cpu_run_measures_its_peaks_before_its_workers_start(tmp_path, fault_env, monkeypatch):
    """Workers importing torch took a core from the calibration of a 2-core VM (peaks about half, unseen)."""
    import sys

    from conftest import run_cli

    from spark_bench.executors.local import LocalExecutor

    for key in ("PYTHONPATH", "SPARK_BENCH_PLUGINS"):
        monkeypatch.setenv(key, fault_env[key])
    monkeypatch.setattr(sys.modules["spark_bench.registry"], "_REGISTRY", None)
    monkeypatch.syspath_prepend(fault_env["PYTHONPATH"].split(":")[0])
    monkeypatch.setenv("SPARK_BENCH_ROOFLINE_CACHE", str(tmp_path / "cache.json"))
    monkeypatch.setattr(cal, "CPU", TINY)
    _machine(monkeypatch, IDLE)
    events = []
    real_calibrate, real_prestart = cal.calibrate, LocalExecutor.prestart
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: events.append("calibrate") or real_calibrate(*a, **k))
    monkeypatch.setattr(LocalExecutor, "prestart", lambda *a, **k: events.append("prestart") or real_prestart(*a, **k))
    code, _, err = run_cli("run", "--op", "fault.scale", "--backend", "good", "--set", "rows=3", "--set", "cols=5",
                           "--no-report", "--out", tmp_path / "run")
    assert code == 0, err
    assert events == ["calibrate", "prestart"]
    measured = json.loads((tmp_path / "run" / "run.json").read_text())["roofline"]["measured"]
    assert measured["busy"] is False and load_cache(tmp_path / "cache.json") == {measured["fingerprint_id"]: measured}


def test_flops_peak_of_16_bit_dtypes_is_at_least_the_fp32_peak():
    from spark_bench.telemetry.roofline import flops_peak, percent_of_peak

    cpu = {"fp32": 0.072, "bf16": 0.0014}  # no native bf16: ops upcast, so fp32 is the ceiling
    gpu = {"fp32": 60.0, "tf32": 400.0, "bf16": 790.0}
    assert flops_peak(cpu, "bf16") == 0.072 and flops_peak(gpu, "bf16") == 790.0
    assert flops_peak(gpu, "fp32") == 60.0 and flops_peak(gpu, "fp16") is None
    pct = percent_of_peak(None, 0.036, "bf16", {"measured": {"tflops": cpu}})
    assert pct["pct_flops_measured"] == 50.0


def test_a_run_that_calibrates_a_busy_cpu_says_so_and_leaves_the_cache_empty(tmp_path, fault_env, monkeypatch):
    import sys

    from conftest import run_cli

    for key in ("PYTHONPATH", "SPARK_BENCH_PLUGINS"):
        monkeypatch.setenv(key, fault_env[key])
    monkeypatch.setattr(sys.modules["spark_bench.registry"], "_REGISTRY", None)  # the fault plugin's registry
    monkeypatch.syspath_prepend(fault_env["PYTHONPATH"].split(":")[0])
    monkeypatch.setenv("SPARK_BENCH_ROOFLINE_CACHE", str(tmp_path / "cache.json"))
    monkeypatch.setattr(cal, "CPU", TINY)
    _machine(monkeypatch, BUSY)
    code, _, err = run_cli("run", "--op", "fault.scale", "--backend", "good", "--set", "rows=3", "--set", "cols=5",
                           "--executor", "inprocess", "--no-report", "--out", tmp_path / "run")
    assert code == 0, err
    assert "measured while the machine was busy (load average 2.6 on 2 CPUs)" in err
    assert json.loads((tmp_path / "run" / "run.json").read_text())["roofline"]["measured"]["busy"] is True
    assert load_cache(tmp_path / "cache.json") == {}


def _unwritable(tmp_path):
    """Cache paths that cannot be written: under a file, and (where there is one) /proc."""
    (tmp_path / "a-file").write_text("")
    paths = [tmp_path / "a-file" / "r.json"]
    return paths + ([Path("/proc/spark-bench-x.json")] if Path("/proc/self").is_dir() else [])


def test_calibrate_with_an_unwritable_cache_is_one_line_before_measuring(tmp_path, monkeypatch):
    def measure(*args, **kwargs):
        raise AssertionError("measured although the peaks could not be cached")

    monkeypatch.setattr(cal, "calibrate", measure)
    for cache in _unwritable(tmp_path):
        got = CliRunner().invoke(calibrate_cmd, ["--device", "cpu", "--cache", str(cache)])
        assert got.exit_code == 2 and got.stderr.strip().count("\n") == 0, (got.output, got.exception)
        why = "cannot write there" if cache.parent.name != "a-file" else "a-file is a file, not a folder"
        assert f"--cache {cache}: " in got.stderr and why in got.stderr and "Traceback" not in got.stderr


def test_an_unwritable_cache_keeps_the_measured_peaks_with_a_warning(tmp_path, monkeypatch, capsys):
    entry = {"fingerprint_id": device_identity("cpu")["fingerprint_id"], "bandwidth_gbps": 1.0, "busy": False}
    monkeypatch.setattr(cal, "calibrate", lambda *args, **kwargs: dict(entry))
    for cache in _unwritable(tmp_path):  # roofline_for never raises: a run keeps its peaks
        assert roofline_for("cpu", measure=True, cache=cache)["measured"] == entry
        assert f"warning: roofline cache {cache} not written" in capsys.readouterr().err
    with pytest.raises(OSError):
        store(entry, tmp_path / "a-file" / "r.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no temporary file left behind


class _ScriptedGpu:
    """A telemetry source on the real clock that runs at 1980 MHz and 400 W, and while `capped` at 700 W against
    the power cap (sw_power_cap) at 1980 MHz, or with `hot` also thermally slowed to 1400 MHz."""

    def __new__(cls):
        from spark_bench.telemetry.nvml import Source

        class Scripted(Source):
            capped = False
            hot = False

            def sm_clock_mhz(self):
                return 1400.0 if self.capped and self.hot else 1980.0

            def default_sm_clock_mhz(self):
                return 1980.0

            def power_instant_w(self):
                return 700.0 if self.capped else 400.0

            def clock_event_reasons(self):
                return (0x4 | (0x40 if self.hot else 0)) if self.capped else 0  # sw_power_cap, hw_thermal_slowdown

        return Scripted()


def test_each_peak_keeps_the_clocks_it_was_measured_at_and_a_slowed_one_is_labelled(tmp_path, monkeypatch):
    """The first H200 run's bf16 matmul peak was 13% under what such machines gave, and nothing said at what clock.
    A peak at the power cap is what a healthy card reaches (recorded, no note); a thermally slowed one is named."""
    from types import SimpleNamespace

    from spark_bench.report.html import calibration

    gpu = _ScriptedGpu()
    real = cal.measure_matmul

    def capped_matmul(*args, **kwargs):  # the matmuls run into the power cap, the copy does not
        gpu.capped = True
        try:
            return real(*args, **kwargs)
        finally:
            gpu.capped = False

    monkeypatch.setattr(cal, "measure_matmul", capped_matmul)
    _machine(monkeypatch, IDLE)
    entry = cal.calibrate("cpu", sizes={**TINY, "budget_s": 0.2}, source=gpu)
    copy = entry["details"]["copy"]["clocks"]
    assert copy["samples"] >= 2 and copy["throttled_samples"] == 0 and copy["sm_mhz_median"] == 1980.0
    assert copy["power_w_median"] == 400.0 and copy["reasons"] == [] and copy["slowed_samples"] == 0
    for dtype in ("fp32", "bf16"):
        clocks = entry["details"]["matmul"][dtype]["clocks"]
        assert clocks["samples"] >= 2 and clocks["throttled_samples"] == clocks["samples"]  # nvbench's rule
        assert clocks["power_w_median"] == 700.0 and clocks["reasons"] == ["sw_power_cap"]
        assert clocks["slowed_samples"] == 0
    assert cal.clock_notes(entry) == []  # at the power cap: a peak as a healthy card reaches it
    gpu.hot = True
    entry = cal.calibrate("cpu", sizes={**TINY, "budget_s": 0.2}, source=gpu)
    for dtype in ("fp32", "bf16"):
        clocks = entry["details"]["matmul"][dtype]["clocks"]
        assert clocks["slowed_samples"] == clocks["samples"] and clocks["sm_mhz_median"] == 1400.0
    notes = cal.clock_notes(entry)
    assert [n.split(":")[0] for n in notes] == ["matmul fp32", "matmul bf16"]
    assert "slowed (SM clock 1400 MHz < 75% of default 1980 MHz; clock-event reasons: hw_thermal_slowdown); " \
           "SM 1400 MHz median, 700 W" in notes[0], notes[0]
    # where the peaks are shown: `spark-bench calibrate` (from the cache here) and the report's roofline row
    cache = tmp_path / "roof.json"
    store(entry, cache)
    text = CliRunner().invoke(calibrate_cmd, ["--device", "cpu", "--cache", str(cache)])
    assert text.exit_code == 0, text.output
    assert "warning: measured slowed, matmul fp32: " in text.output and "bandwidth:" not in text.output
    row = calibration(SimpleNamespace(run={"roofline": {"measured": entry}, "created": entry["measured_at"]}))
    assert "measured slowed, matmul bf16: " in row and "that peak is likely low" in row
    # without a source (a CPU) nothing is sampled and nothing is said; a foreign entry's odd clocks do not crash
    plain = cal.calibrate("cpu", sizes=TINY)
    assert "clocks" not in plain["details"]["copy"] and cal.clock_notes(plain) == []
    odd = {"details": {"copy": {"clocks": {"slowed_samples": 2}}, "matmul": {"bf16": None, "fp16": {"clocks": 3}}}}
    assert cal.clock_notes(odd) == ["bandwidth: 2 of ? samples slowed (); SM ? MHz median, ? W"]
    assert cal.clock_notes({"details": "junk"}) == []
