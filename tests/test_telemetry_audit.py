"""Findings of the 2026-12-05 telemetry audit, each reproduced on the scripted fake GPU or a patched pynvml:
aliased sampling, the ~1 s averaged power reading, one meter for the idle subtraction, transient NVML errors, MIG,
CUDA_VISIBLE_DEVICES by UUID, the timeline's power field, and the calibrate/profile CLI's bad input."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from spark_bench.telemetry import RunTelemetry, measure_energy, preflight, read_telemetry
from spark_bench.telemetry import calibrate as cal
from spark_bench.telemetry.cli import calibrate as calibrate_cmd
from spark_bench.telemetry.cli import profile as profile_cmd
from spark_bench.telemetry.fake import FakeSource
from spark_bench.telemetry.nvml import nvml_index
from spark_bench.telemetry.roofline import roofline_for


def pulsed(src: FakeSource, busy_s: float = 0.015, idle_s: float = 0.005):
    """An invocation of busy_s at busy_w then a host gap of idle_s: 20 ms per call, the sampler's period."""
    def call() -> None:
        src.run(busy_s)
        src.sleep(idle_s)
    return call


def test_sampled_power_in_step_with_the_invocations_is_reported_aliased():
    """Samples every 20 ms of a 20 ms invocation (15 ms busy, 5 ms idle: 315 W on average) all land in one phase:
    the sampled average read 400 W +- 16 W with no warning. Now `sampling` says so and a warning names it."""
    src = FakeSource(missing=["energy"], read_latency_s=0.0)
    r = measure_energy(pulsed(src), source=src)
    assert r["source"] == "nvml-power-instant-integrated"
    assert r["sampling"]["aliased"] is True and r["sampling"]["phase_coverage"] < 0.5
    assert any("aliased and is avg_w" in w for w in r["warnings"])
    # with the counter, the counter is right; the aliased cross-check is named, not reported as a disagreement
    counted = FakeSource(read_latency_s=0.0)
    r = measure_energy(pulsed(counted), source=counted)
    assert r["source"] == "nvml-energy-counter" and r["avg_w"] == pytest.approx(315.0, rel=0.01)
    assert r["sampling"]["aliased"] is True and not any("disagree" in w for w in r["warnings"])
    assert any("its average is aliased" in w for w in r["warnings"])
    fine = FakeSource()  # 2.3 ms invocations: the 20 ms samples walk through every phase
    r = measure_energy(fine.op(0.0023), source=fine)
    assert r["sampling"]["aliased"] is False and r["sampling"]["phase_coverage"] > 0.8 and r["warnings"] == []


def test_phase_coverage():
    from spark_bench.telemetry.sampler import phase_coverage

    ends = [0.0, 1.0, 2.0, 3.0, 4.0]
    assert phase_coverage([0.5, 1.5, 2.5], ends) == pytest.approx(0.0)  # one phase
    assert phase_coverage([0.1, 1.35, 2.6, 3.85], ends) == pytest.approx(0.75)
    assert phase_coverage([0.5], ends) is None and phase_coverage([9.0, 10.0], ends) is None


@pytest.mark.parametrize("missing", [["energy", "power_instant"], ["power_instant"]])
def test_the_averaged_power_reading_settles_before_the_windows(missing):
    """Without instant power the sampled reading is NVML's ~1 s average: the window opened 20 ms into the work and
    read 250 W of a 400 W op (J/call 45% low, no warning), and the counter's cross-check disagreed by 25%."""
    src = FakeSource(missing=missing, average_window_s=1.0)
    r = measure_energy(src.op(0.002), source=src)
    assert r["avg_w"] == pytest.approx(400.0, rel=0.01) and r["idle_w"] == pytest.approx(60.0, rel=0.01)
    assert r["energy_j_per_call"] == pytest.approx(340.0 * 0.002, rel=0.02)
    if r["cross_check"]:
        assert abs(r["cross_check"]["rel_diff"]) < 0.02
    assert r["warnings"] == [] and r["sampling"]["aliased"] is False


def test_idle_and_window_powers_come_from_one_meter():
    """A counter reset during the baseline left idle_w from sampled power and avg_w from the counter: an offset
    between the two meters (here instant power reads 20 W high) went straight into the net power (319 W for 340)."""
    src = FakeSource(update_period_s=0.05, energy_start_mj=10**9)
    instant, read, reset_at = src.power_instant_w, src.energy_mj, src.t + 0.3
    src.power_instant_w = lambda: None if (w := instant()) is None else w + 20.0
    src.energy_mj = lambda: read() - (10**9 - 5) * (src.t > reset_at)
    r = measure_energy(src.op(0.002), source=src, update_period_s=0.05)
    assert r["sources"]["avg_w"] == r["sources"]["idle_w"] == "nvml-power-instant-integrated"
    assert r["net_w"] == pytest.approx(340.0, rel=0.01)
    assert any("one meter" in w for w in r["warnings"])


def patch_pynvml(monkeypatch, **extra):
    pynvml = pytest.importorskip("pynvml")
    base = {"nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlDeviceGetHandleByIndex": lambda i: ("h", i),
            "nvmlDeviceIsMigDeviceHandle": lambda h: False, "nvmlDeviceGetMigMode": lambda h: (0, 0)}
    for name, fn in {**base, **extra}.items():
        monkeypatch.setattr(pynvml, name, fn)
    from spark_bench.telemetry.nvml import NvmlSource

    return pynvml, NvmlSource


def test_a_transient_nvml_error_fails_one_reading_only(monkeypatch):
    """NVML_ERROR_UNKNOWN (or a timeout) on one read made the field missing for the process's life: every later case
    lost its energy counter. Only NOT_SUPPORTED, NO_PERMISSION and FUNCTION_NOT_FOUND are asked once."""
    calls = []

    def energy(handle):
        calls.append(1)
        if len(calls) == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return 5000

    def unsupported(handle):
        calls.append(2)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    pynvml, NvmlSource = patch_pynvml(monkeypatch, nvmlDeviceGetTotalEnergyConsumption=energy,
                                      nvmlDeviceGetPowerUsage=unsupported)
    src = NvmlSource(0)
    assert [src.energy_mj() for _ in range(3)] == [None, 5000, 5000] and "Unknown" in src.missing["energy"]
    assert [src.power_average_w() for _ in range(3)] == [None] * 3 and calls.count(2) == 1


def test_mig_is_read_on_the_whole_gpu_and_said(monkeypatch, tmp_path):
    """A MIG instance's handle has no power readings (everything 'missing'), and with MIG on, the GPU's power and
    energy include the other instances' work: that was not said anywhere."""
    pynvml, NvmlSource = patch_pynvml(
        monkeypatch, nvmlDeviceGetHandleByUUID=lambda u: ("mig", u),
        nvmlDeviceIsMigDeviceHandle=lambda h: h[0] == "mig",
        nvmlDeviceGetDeviceHandleFromMigDeviceHandle=lambda h: ("gpu", h[1]))
    src = NvmlSource(0, "MIG-1234")
    assert src.handle == ("gpu", "MIG-1234") and src.mig is True
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigMode", lambda h: (pynvml.NVML_DEVICE_MIG_ENABLE, 1))
    assert NvmlSource(0).mig is True
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigMode", lambda h: (0, 0))
    assert NvmlSource(0).mig is False
    fake = FakeSource(mig=True)
    r = measure_energy(fake.op(0.002), source=fake)
    assert r["energy_j_per_call"] is not None and any("MIG is enabled" in w for w in r["warnings"])
    check = preflight(source=FakeSource(mig=True))
    assert check["records"]["mig"] is True and any("MIG is enabled" in w for w in check["warnings"])
    tele, _ = RunTelemetry.start(tmp_path, 0, source=FakeSource(mig=True))
    tele.stop()
    assert read_telemetry(tmp_path)["header"]["mig"] is True


def test_cuda_visible_devices_by_uuid_maps_through_the_uuid(monkeypatch):
    """CUDA_VISIBLE_DEVICES=GPU-...,GPU-... made cuda:1 NVML's index 1 (another GPU) with no UUID to correct it."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    assert nvml_index("cuda:1") == (1, "GPU-bbbb")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-cccc")
    assert nvml_index("cuda") == (0, "MIG-cccc")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert nvml_index("cuda:1") == (1, None)


@pytest.mark.parametrize("missing,field", [((), "nvml-power-instant"), (("power_instant",), "nvml-power-usage")])
def test_the_timeline_and_preflight_say_which_power_reading(tmp_path, missing, field):
    """telemetry.jsonl's power_w was instant or ~1 s averaged with nothing saying which."""
    tele, _ = RunTelemetry.start(tmp_path, 0, source=FakeSource(missing=missing))
    tele.stop()
    assert read_telemetry(tmp_path)["header"]["power_field"] == field
    assert preflight(source=FakeSource(missing=missing))["records"]["power_field"] == field


@pytest.fixture
def one_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def one_line(result, code: int = 2) -> str:
    assert result.exit_code == code, (result.output, result.exception)
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    return result.stderr


@pytest.mark.parametrize("device,says", [("cudafoo", "unknown device"), ("cuda:x", "unknown device"),
                                         ("cuda:7", "does not exist here: 1 CUDA device(s)")])
def test_a_bad_cuda_device_is_one_line_exit_2(one_gpu, tmp_path, monkeypatch, device, says):
    """With a GPU present these passed the check and printed a table of Nones (calibrate, exit 0)."""
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: pytest.fail("measured on a bad device"))
    assert says in one_line(CliRunner().invoke(calibrate_cmd, ["--device", device, "--cache", str(tmp_path / "c")]))
    got = CliRunner().invoke(profile_cmd, ["--op", "kda.gate", "--backend", "torch", "--device", device])
    assert says in one_line(got)


def test_a_failed_calibration_is_one_line_and_a_run_keeps_going(tmp_path, monkeypatch, capsys):
    """An out-of-memory copy (or any error) while measuring the peaks was a traceback (calibrate) and failed a run
    at its start, though roofline_for says it never raises."""
    def oom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text")

    monkeypatch.setattr(cal, "measure_bandwidth", oom)
    got = CliRunner().invoke(calibrate_cmd, ["--device", "cpu", "--cache", str(tmp_path / "c.json")])
    assert got.exit_code == 1 and "Traceback" not in got.output
    assert got.stderr.strip().splitlines()[-1] == ("spark-bench: error: no peaks measured on cpu: measuring the "
                                                   "peaks failed (RuntimeError: CUDA out of memory. Tried to "
                                                   "allocate 2.00 GiB)")
    roof = roofline_for("cpu", measure=True, cache=tmp_path / "c.json")
    assert roof["measured"] is None and "out of memory" in roof["reason"]
    assert "% of measured peak is left out" in capsys.readouterr().err


def test_profile_into_an_unwritable_out_is_one_line_before_profiling(tmp_path, monkeypatch):
    """--out /proc/x profiled the case, then died writing the trace with a traceback."""
    import spark_bench.telemetry.profile as prof

    monkeypatch.setattr(prof, "profile_case", lambda *a, **k: pytest.fail("profiled into an unwritable --out"))
    (tmp_path / "a-file").write_text("")
    for out in [tmp_path / "a-file" / "sub"] + ([Path("/proc/spark-bench-x")] if Path("/proc/self").is_dir() else []):
        got = CliRunner().invoke(profile_cmd, ["--op", "kda.gate", "--backend", "torch", "--device", "cpu",
                                               "--out", str(out)])
        why = "cannot write there" if out.parent.name != "a-file" else "a-file is a file, not a folder"
        line = one_line(got)
        assert f"--out {out}: " in line and why in line, line


def test_a_sampler_thread_that_fails_says_so(caplog):
    """A reading that raised (a full disk under the timeline, a pynvml bug) ended the sampling thread silently: the
    rest of the run had no clocks, so no case could be labelled throttled, and nothing said why."""
    from spark_bench.telemetry import Sampler
    from spark_bench.telemetry.nvml import Source

    class Failing(Source):
        def power_instant_w(self):
            raise OSError("No space left on device")

    sampler = Sampler(Failing(), period_s=0.01).start()
    handle = sampler._handle
    handle._thread.join(timeout=5.0)
    sampler.stop()
    assert isinstance(handle.error, OSError)
    assert "stopped sampling: OSError: No space left on device" in caplog.text


def test_the_runs_own_workers_are_not_other_processes_on_the_gpu():
    """The local executor prestarts its workers before the preflight, and each may hold a CUDA context by then
    (torch.cuda.set_device creates one on CUDA 12): listed by NVML, they were warned of as other processes
    disturbing the run. Inside a container NVML gives host PIDs this process cannot see: as many of those as the
    run has processes may be its own, so only a surplus is warned of."""
    import os

    from spark_bench.telemetry.fake import FakeSource

    worker, stranger = os.getpid() + 100_000, 1  # a (simulated) worker pid; pid 1 is not this run's
    own = preflight(source=FakeSource(processes=[{"pid": worker}, {"pid": os.getpid()}]), own_pids={worker})
    assert own["ok"] is True and own["records"]["other_processes"] == []
    other = preflight(source=FakeSource(processes=[{"pid": worker}, {"pid": stranger}]), own_pids={worker})
    assert other["ok"] is False and "1 other process(es) use this GPU (pid 1)" in other["warnings"][0]
    hidden = [{"pid": 4_000_000 + i} for i in range(3)]  # no such PIDs here: another namespace's
    check = preflight(source=FakeSource(processes=hidden), own_pids={worker})  # this run: 2 processes
    assert len(check["records"]["unidentified_processes"]) == 3
    assert check["warnings"] == ["3 process(es) use this GPU under PIDs of another namespace (a container's host "
                                 "PIDs), at least 1 of them not this run's: timings and energy will be disturbed"]
    assert preflight(source=FakeSource(processes=hidden[:2]), own_pids={worker})["ok"] is True
