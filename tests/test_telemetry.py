"""Energy windows, counter handling, throttle flags, preflight and the telemetry timeline, on a scripted fake GPU."""

import json
import time

import pytest

from spark_bench.telemetry import RunTelemetry, Sampler, ThrottleGuard, measure_energy, preflight, read_telemetry
from spark_bench.telemetry.energy import POWER_KEYS, counter_delta, infer_update_period, null_power
from spark_bench.telemetry.fake import FakeSource
from spark_bench.telemetry.nvml import Source, open_source, reason_names
from spark_bench.telemetry.sampler import integrate_power


def net_truth(src: FakeSource, op_s: float) -> float:
    return (src.busy_w - src.idle_w) * op_s


@pytest.mark.parametrize("period,phase", [(0.1, 0.0), (0.05, 0.013), (0.02, 0.007), (0.1, 0.093)])
def test_update_period_inferred(period, phase):
    src = FakeSource(update_period_s=period, update_phase_s=phase)
    assert infer_update_period(src) == pytest.approx(period, abs=2e-3)


def test_counter_never_moving_gives_none():
    src = FakeSource(idle_w=0.0)
    assert infer_update_period(src, max_probe_s=0.3) is None


def test_counter_delta_wraps():
    assert counter_delta(10, 25, 2**32) == 15
    assert counter_delta(2**32 - 5, 7, 2**32) == 12
    assert counter_delta(2**64 - 1, 0, 2**64) == 1


@pytest.mark.parametrize("op_s", [0.0005, 0.002, 0.013])
@pytest.mark.parametrize("idle_w,busy_w,phase", [(60.0, 400.0, 0.0), (95.0, 650.0, 0.031), (30.0, 75.0, 0.077)])
def test_baseline_subtracted_energy_per_call(op_s, idle_w, busy_w, phase):
    src = FakeSource(idle_w=idle_w, busy_w=busy_w, update_period_s=0.05, update_phase_s=phase)
    r = measure_energy(src.op(op_s), source=src)
    assert r["reason"] is None and r["source"] == "nvml-energy-counter"
    assert r["idle_w"] == pytest.approx(idle_w, rel=0.01)
    assert r["net_w"] == pytest.approx(r["avg_w"] - r["idle_w"])
    truth = net_truth(src, op_s)
    assert abs(r["energy_j_per_call"] - truth) <= max(r["energy_j_per_call_uncertainty"], 1e-3 * truth)
    assert r["energy_j_per_call"] == pytest.approx(truth, rel=0.02)
    assert r["energy_j_per_call_gross"] > r["energy_j_per_call"]
    assert r["energy_j_per_call_gross"] == pytest.approx(r["avg_w"] * r["invocation_s"], rel=1e-9)


def test_wrapped_counter_matches_unwrapped():
    plain = FakeSource(update_period_s=0.05)
    wrapped = FakeSource(update_period_s=0.05, energy_start_mj=2**32 - 300, energy_modulus=2**32)
    a = measure_energy(plain.op(0.002), source=plain)
    b = measure_energy(wrapped.op(0.002), source=wrapped)
    assert b["reason"] is None and b["source"] == "nvml-energy-counter"
    assert b["avg_w"] == pytest.approx(a["avg_w"], rel=1e-6)
    assert b["energy_j_per_call"] == pytest.approx(a["energy_j_per_call"], rel=1e-6)


def test_counter_reset_is_not_taken_as_energy():
    src = FakeSource(update_period_s=0.05, energy_start_mj=10**9)
    reset_at = src.t + 0.3  # during the idle baseline: the counter jumps back (a driver reload)
    read = src.energy_mj
    src.energy_mj = lambda: read() - (10**9 - 5) * (src.t > reset_at)
    r = measure_energy(src.op(0.002), source=src, update_period_s=0.05)
    assert r["sources"]["idle_w"] == "nvml-power-instant-integrated"  # not a 2^64 mJ wrap
    assert r["idle_w"] == pytest.approx(60.0, rel=0.01)
    # the subtraction uses one meter: the window's power is the sampled one too (test_telemetry_audit.py)
    assert r["source"] == "nvml-power-instant-integrated" and r["avg_w"] == pytest.approx(400.0, rel=0.01)


@pytest.mark.parametrize("period,min_window,op_s,expect", [
    (0.05, 1.0, 0.001, 1.0),     # min_window_s rules
    (0.2, 1.0, 0.001, 2.0),      # 10 update periods rule
    (0.05, 1.0, 0.25, 2.5),      # 10 invocations rule
    (0.05, 0.2, 0.001, 0.5),     # short window asked: still 10 periods
])
def test_window_amplified(period, min_window, op_s, expect):
    src = FakeSource(update_period_s=period)
    r = measure_energy(src.op(op_s), source=src, min_window_s=min_window)
    assert 0.97 * expect <= r["window_s"] <= expect + 2 * period + 3 * op_s  # edges: a period is inferred ~1%
    assert r["calls"] == pytest.approx(r["window_s"] / op_s, rel=0.05)
    assert r["baseline_s"] >= 0.48 * expect


def test_window_capped():
    src = FakeSource(update_period_s=0.05)
    r = measure_energy(src.op(1.0), source=src, max_window_s=3.0)
    assert r["window_s"] < 5.0


def test_calls_per_invocation_divides_energy():
    one, graph = FakeSource(), FakeSource()
    a = measure_energy(one.op(0.001), source=one)
    b = measure_energy(graph.op(0.008), source=graph, calls_per_invocation=8)
    assert b["calls"] % 8 == 0
    assert b["energy_j_per_call"] == pytest.approx(a["energy_j_per_call"], rel=0.02)
    assert b["energy_j_per_call"] == pytest.approx(net_truth(graph, 0.001), rel=0.02)


def test_uncertainty_grows_with_coarse_edges():
    fine, coarse = FakeSource(update_period_s=0.05), FakeSource(update_period_s=0.05)
    a = measure_energy(fine.op(0.0005), source=fine)
    b = measure_energy(coarse.op(0.04), source=coarse)
    assert 0 < a["uncertainty_w"] < b["uncertainty_w"]
    assert 0 < a["rel_uncertainty"] < b["rel_uncertainty"] < 0.5


def test_efficiency_numbers():
    src = FakeSource()
    r = measure_energy(src.op(0.002), source=src, flops=4e9, tokens=16)
    assert r["gflop_per_j"] == pytest.approx(4.0 / r["energy_j_per_call"])
    assert r["gflop_per_j_gross"] == pytest.approx(4.0 / r["energy_j_per_call_gross"])
    assert r["j_per_token"] == pytest.approx(r["energy_j_per_call"] / 16)
    assert r["j_per_token_gross"] == pytest.approx(r["energy_j_per_call_gross"] / 16)


@pytest.mark.parametrize("busy_w", [60.0, 50.0])
def test_no_power_above_idle_gives_no_net_energy(busy_w):
    """An op that draws no more than idle (tiny kernels, a drifting baseline) has no net J/call, never a negative or
    noise-sized one (and no GFLOP/J from it); the gross figure stays."""
    src = FakeSource(idle_w=60.0, busy_w=busy_w)
    r = measure_energy(src.op(0.002), source=src, flops=4e9, tokens=16)
    assert r["net_w"] < 0.5 and r["energy_j_per_call_gross"] > 0 and r["gflop_per_j_gross"] > 0
    assert r["energy_j_per_call"] is None and r["gflop_per_j"] is None and r["j_per_token"] is None
    assert any("of the idle baseline: no net energy per call" in w for w in r["warnings"])
    above = FakeSource(idle_w=60.0, busy_w=61.0)  # 1 W above idle is measurable: +-0.23 W
    assert measure_energy(above.op(0.002), source=above)["energy_j_per_call"] > 0


def test_cross_check_reports_disagreement():
    src = FakeSource(instant_scale=1.3)
    r = measure_energy(src.op(0.002), source=src)
    assert r["cross_check"]["source"] == "nvml-power-instant-integrated"
    assert r["cross_check"]["rel_diff"] == pytest.approx(0.3, abs=0.02)
    assert any("disagree" in w for w in r["warnings"])
    agree = FakeSource()
    r = measure_energy(agree.op(0.002), source=agree)
    assert abs(r["cross_check"]["rel_diff"]) < 0.02 and r["warnings"] == []


def test_throttle_flags_low_clock_and_cap_reasons():
    slow = FakeSource(sm_mhz=1200.0)
    r = measure_energy(slow.op(0.002), source=slow)
    assert r["throttled"] and "SM clock 1200" in r["throttle"][0]
    capped = FakeSource(reasons=lambda t, busy: 0x4 if busy else 0)
    r = measure_energy(capped.op(0.002), source=capped)
    assert r["throttled"] and r["throttle_reasons"] == ["sw_power_cap"]
    fine = FakeSource(reasons=0x1 | 0x10)  # idle and sync boost are not throttling
    r = measure_energy(fine.op(0.002), source=fine)
    assert not r["throttled"] and r["throttle_reasons"] == ["gpu_idle", "sync_boost"]
    assert r["sm_mhz_median"] == 1980.0 and r["mem_mhz_median"] == 3201.0 and r["temp_c_max"] == 45.0


def test_throttled_window_is_retried_after_backoff():
    src = FakeSource()
    recover_at = src.t + 3.0  # hot for the first window, fine after one back-off
    src.sm_mhz = lambda t, busy: 1000.0 if t < recover_at else 1980.0
    r = measure_energy(src.op(0.002), source=src, retries=3)
    assert r["attempts"] >= 2 and not r["throttled"]
    stuck = FakeSource(sm_mhz=1000.0)
    r = measure_energy(stuck.op(0.002), source=stuck, retries=2)
    assert r["attempts"] == 3 and r["throttled"]


def test_throttle_guard_backs_off():
    src = FakeSource(sm_mhz=1000.0, idle_sm_mhz=1000.0)
    guard = ThrottleGuard(src, max_backoff_s=0.3)
    assert guard.check()
    t0 = src.now()
    assert [guard.wait() for _ in range(4)] == [0.05, 0.1, 0.2, 0.3]
    assert src.now() - t0 == pytest.approx(0.65, abs=0.01)
    guard.reset()
    assert guard.wait() == 0.05
    assert ThrottleGuard(FakeSource()).check() == []


@pytest.mark.parametrize("missing,source", [
    (["energy"], "nvml-power-instant-integrated"),
    (["energy", "power_instant"], "nvml-power-usage-integrated"),
])
def test_missing_energy_counter_falls_back_to_sampled_power(missing, source):
    src = FakeSource(missing=missing)
    r = measure_energy(src.op(0.002), source=src)
    assert r["source"] == source and r["cross_check"] is None
    assert r["avg_w"] == pytest.approx(400.0, rel=0.01) and r["idle_w"] == pytest.approx(60.0, rel=0.01)
    assert r["energy_j_per_call"] == pytest.approx(net_truth(src, 0.002), rel=0.03)
    assert "energy" in r["missing"]


def test_missing_everything_is_a_reason_not_a_crash():
    src = FakeSource(missing=["energy", "power_instant", "power_average", "sm_clock", "mem_clock", "temperature",
                              "clock_event_reasons", "power_limit", "default_power_limit", "default_sm_clock"])
    r = measure_energy(src.op(0.002), source=src)
    assert r["avg_w"] is None and "no power reading" in r["reason"]
    clocks_only = FakeSource(missing=["sm_clock", "mem_clock", "temperature", "clock_event_reasons"])
    r = measure_energy(clocks_only.op(0.002), source=clocks_only)
    assert r["avg_w"] is not None and r["sm_mhz_median"] is None and r["throttled"] is False


def test_failing_call_is_recorded():
    src = FakeSource()
    r = measure_energy(lambda: 1 / 0, source=src)
    assert r["avg_w"] is None and "ZeroDivisionError" in r["reason"]


def test_nvml_absent_path():
    source, reason = open_source(0)
    if source is not None:
        pytest.skip("NVML works on this machine")
    assert "NVML" in reason
    ran = []
    r = measure_energy(lambda: ran.append(1), 0)
    assert ran == [] and set(r) == set(POWER_KEYS) and r["avg_w"] is None and r["reason"] == reason
    assert preflight(0) == {"ok": None, "warnings": [], "records": {}, "reason": reason}
    assert RunTelemetry.start("/nonexistent-dir", 0) == (None, reason)
    assert null_power("x")["energy_j_per_call"] is None


def test_preflight_warnings(caplog):
    busy = FakeSource(processes=[{"pid": 1, "used_memory_bytes": 2**30}], sm_mhz=345.0, power_limit_w=500.0,
                      reasons=0x20)  # pid 1: a process of this namespace that is not this run's
    r = preflight(source=busy)
    assert r["ok"] is False and len(r["warnings"]) == 4
    assert not caplog.records  # the caller prints them (logged too, each was printed twice on the first H200 run)
    text = " ".join(r["warnings"])
    for needle in ("(pid 1)", "idle", "500 W is below the default 700 W", "sw_thermal_slowdown"):
        assert needle in text
    assert r["records"]["other_processes"][0]["pid"] == 1
    clean = preflight(source=FakeSource())
    assert clean["ok"] is True and clean["warnings"] == [] and clean["records"]["power_limit_w"] == 700.0


def test_reason_names():
    assert reason_names(0) == [] and reason_names(None) == []
    assert reason_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert reason_names(0x10000) == ["0x10000"]


def test_run_timeline_written_and_read(tmp_path):
    src = FakeSource(busy_w=300.0, idle_w=lambda t, busy: 50.0)
    tele, reason = RunTelemetry.start(tmp_path, 0, period_s=0.02, source=src)
    assert reason is None
    with tele.phase("kda.gate|torch|{}|bf16|cuda", "timing", backend="torch"):
        src.run(0.5)
    src.sleep(0.2)
    tele.mark("other", "energy", src.now() - 0.1, src.now())
    tele.stop()
    data = read_telemetry(tmp_path)
    assert data["header"]["period_s"] == 0.02 and data["header"]["device_name"] == "Fake H200"
    timing = data["phases"][0]
    assert timing["phase"] == "timing" and timing["backend"] == "torch"
    assert timing["end"] - timing["start"] == pytest.approx(0.5, abs=1e-3)
    inside = [s for s in data["samples"] if timing["start"] < s["t"] < timing["end"]]
    assert 23 <= len(inside) <= 26 and {s["power_w"] for s in inside} == {300.0}
    assert set(inside[0]) == {"t", "power_w", "sm_mhz", "mem_mhz", "temp_c", "reasons"}
    after = [s for s in data["samples"] if s["t"] > timing["end"]]
    assert after and {s["power_w"] for s in after} == {50.0}
    # a killed run leaves a truncated last line: ignored
    with (tmp_path / "telemetry.jsonl").open("a") as fh:
        fh.write('{"type": "sample", "t": 1')
    assert len(read_telemetry(tmp_path)["samples"]) == len(data["samples"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"type": "header", "schema": "other", "schema_version": 1}) + "\n")
    with pytest.raises(ValueError):
        read_telemetry(bad)


@pytest.mark.parametrize("one_device", [True, False])
def test_a_case_timed_on_throttled_clocks_is_labelled(tmp_path, one_device):
    """The run's timeline sees the clocks while each case is timed: a case timed below 75% of the default SM clock
    gets `timing.clocks` and the label `throttled-timing`; one timed at full clock gets the clocks only. With several
    GPUs (or Ray) the timeline's GPU is not the case's: nothing is claimed."""
    from spark_bench.session import PhaseTimeline
    from spark_bench.sweep import Case

    state = {"mhz": 1980.0}
    src = FakeSource(sm_mhz=lambda t, busy: state["mhz"])
    tele, _ = RunTelemetry.start(tmp_path, 0, period_s=0.02, source=src)
    records = []
    with PhaseTimeline(tele, one_device=one_device) as timeline:
        phase = timeline.wrap(lambda case, phase: None)
        for n, mhz in ((1, 1200.0), (2, 1980.0)):
            case = Case("kda.gate", "triton", {"tokens": n}, "bf16", "cuda:0", 0)
            phase(case, "check")
            src.run(0.1)
            state["mhz"] = mhz
            phase(case, "timing")
            src.run(0.3)
            state["mhz"] = 1980.0
            phase(case, "energy")
            src.run(0.3)
            records.append({"case_id": case.case_id, "labels": [], "timing": {"median": 1.0}})
            timeline.annotate(records[-1])
    slow, fast = records
    if not one_device:
        assert "clocks" not in slow["timing"] and slow["labels"] == []
        return
    assert slow["labels"] == ["throttled-timing"] and slow["timing"]["clocks"]["sm_mhz_min"] == 1200.0
    assert 13 <= slow["timing"]["clocks"]["throttled_samples"] <= slow["timing"]["clocks"]["samples"] <= 16
    assert slow["timing"]["clocks"]["throttle"] == ["SM clock 1200 MHz < 75% of default 1980 MHz"]
    assert fast["labels"] == [] and fast["timing"]["clocks"]["throttled_samples"] == 0
    assert fast["timing"]["clocks"]["sm_mhz_min"] == 1980.0


class ConstSource(Source):
    def power_instant_w(self):
        return 100.0

    def sm_clock_mhz(self):
        return 1500.0


def test_real_thread_sampler():
    sampler = Sampler(ConstSource(), period_s=0.01)
    with sampler:
        time.sleep(0.15)
    n = len(sampler.samples)
    assert n >= 3 and sampler.power_source == "nvml-power-instant"
    time.sleep(0.05)
    assert len(sampler.samples) == n  # stopped
    avg, energy = integrate_power(sampler.samples)
    assert avg == pytest.approx(100.0)
    assert energy == pytest.approx(100.0 * (sampler.samples[-1]["t"] - sampler.samples[0]["t"]))
    assert sampler.samples[0]["sm_mhz"] == 1500.0 and sampler.samples[0]["temp_c"] is None
    with pytest.raises(ValueError):
        Sampler(ConstSource(), period_s=0)


def test_nvml_source_adapter_against_pynvml(monkeypatch):
    """NvmlSource's calls, units and error handling, with pynvml's driver entry points replaced."""
    pynvml = pytest.importorskip("pynvml")

    def field_values(handle, ids):
        assert ids == [pynvml.NVML_FI_DEV_POWER_INSTANT]
        values = (pynvml.c_nvmlFieldValue_t * 1)()
        values[0].nvmlReturn, values[0].valueType, values[0].value.uiVal = pynvml.NVML_SUCCESS, 1, 412_345
        return values

    def unsupported(*args):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    clocks = {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 3201}
    procs = [type("P", (), {"pid": 77, "usedGpuMemory": 1 << 30})()]
    for name, fn in {
        "nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlDeviceGetHandleByIndex": lambda i: ("h", i),
        "nvmlDeviceGetTotalEnergyConsumption": lambda h: 123_456_789, "nvmlDeviceGetFieldValues": field_values,
        "nvmlDeviceGetPowerUsage": lambda h: 400_000, "nvmlDeviceGetClockInfo": lambda h, c: clocks[c],
        "nvmlDeviceGetDefaultApplicationsClock": unsupported, "nvmlDeviceGetMaxClockInfo": lambda h, c: 1980,
        "nvmlDeviceGetTemperature": lambda h, s: 51, "nvmlDeviceGetEnforcedPowerLimit": lambda h: 700_000,
        "nvmlDeviceGetPowerManagementDefaultLimit": lambda h: 700_000,
        "nvmlDeviceGetCurrentClocksEventReasons": lambda h: 0x4,
        "nvmlDeviceGetComputeRunningProcesses": lambda h: procs,
        "nvmlDeviceGetGraphicsRunningProcesses": lambda h: procs, "nvmlDeviceGetName": lambda h: "NVIDIA H200",
        "nvmlSystemGetDriverVersion": lambda: "570.86",
    }.items():
        monkeypatch.setattr(pynvml, name, fn)
    from spark_bench.telemetry.nvml import NvmlSource

    src = NvmlSource(3)
    assert src.handle == ("h", 3)
    assert src.energy_mj() == 123_456_789 and src.power_instant_w() == pytest.approx(412.345)
    assert src.power_average_w() == 400.0 and src.power_w() == (pytest.approx(412.345), "nvml-power-instant")
    assert (src.sm_clock_mhz(), src.mem_clock_mhz(), src.temperature_c()) == (1980, 3201, 51)
    assert src.default_sm_clock_mhz() == 1980 and "default_sm_clock" in src.missing  # fell back to the max clock
    assert (src.power_limit_w(), src.default_power_limit_w(), src.clock_event_reasons()) == (700.0, 700.0, 4)
    assert src.processes() == [{"pid": 77, "used_memory_bytes": 1 << 30}]
    assert (src.device_name(), src.driver_version()) == ("NVIDIA H200", "570.86")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTotalEnergyConsumption", unsupported)
    src.missing.pop("energy", None)
    assert src.energy_mj() is None and "Not Supported" in src.missing["energy"]
    row = src.snapshot()
    assert row["power_w"] == pytest.approx(412.345) and row["reasons"] == 4
