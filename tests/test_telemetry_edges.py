"""Energy, sampler and clock behaviour at its edges, on the scripted fake GPU (found by a hand mutation audit of
spark_bench/telemetry): each test names the mutant it kills."""

import json

import pytest
from test_telemetry_audit import one_line, patch_pynvml

from spark_bench.telemetry import RunTelemetry, Sampler, measure_energy, preflight, read_telemetry
from spark_bench.telemetry import calibrate as cal
from spark_bench.telemetry.clocks import throttle_findings
from spark_bench.telemetry.energy import COUNTER, Window, _power_of, infer_update_period, wait_edge
from spark_bench.telemetry.fake import FakeSource
from spark_bench.telemetry.nvml import nvml_index
from spark_bench.telemetry.roofline import datasheet_for, datasheet_key, device_identity, flops_peak, percent_of_peak
from spark_bench.telemetry.sampler import summarize, window_clocks


def test_a_counter_windows_uncertainty_counts_one_mj_at_each_end():
    """Mutant: the counter's +-1 mJ quantization at each end (2 mJ over the window) dropped from uncertainty_w."""
    src = FakeSource()
    window = Window(t0=0.0, t1=2.0, energy_j=200.0, half_gaps_s=0.004, invocations=10)
    avg, unc, meter = _power_of(window, Sampler(src))
    assert (avg, meter) == (100.0, COUNTER)
    assert unc == pytest.approx(100.0 * 0.004 / 2.0 + 2e-3 / 2.0)


def test_sampled_power_uncertainty_is_two_sample_periods_of_the_window():
    """Mutant: sampled power's uncertainty counted one sample period of the window's ends instead of two."""
    src = FakeSource(missing=["energy"])
    r = measure_energy(src.op(0.002), source=src, sample_period_s=0.02)
    assert r["source"] == "nvml-power-instant-integrated"
    assert r["uncertainty_w"] == pytest.approx(r["avg_w"] * 2 * 0.02 / r["window_s"], rel=1e-9)
    assert r["idle_uncertainty_w"] == pytest.approx(r["idle_w"] * 2 * 0.02 / r["baseline_s"], rel=1e-9)


def test_the_idle_baseline_spans_at_least_three_counter_updates():
    """Mutant: the baseline's floor of 3 update periods dropped (a 1% baseline fraction measured idle over one)."""
    src = FakeSource(update_period_s=0.1)
    r = measure_energy(src.op(0.002), source=src, baseline_fraction=0.01)
    assert r["update_period_s"] == pytest.approx(0.1, abs=2e-3)
    assert r["baseline_s"] >= 3 * 0.1 - 2e-3


def test_an_averaged_reading_aliases_a_cycle_longer_than_its_average():
    """Mutant: the ~1 s averaged reading taken to smooth every cycle (it only smooths cycles shorter than 1 s): a
    1 s invocation sampled once a second, always in one phase, was not reported aliased."""
    src = FakeSource(missing=["energy", "power_instant"], average_window_s=1.0, read_latency_s=0.0)
    r = measure_energy(src.op(1.0), source=src, sample_period_s=1.0)
    assert r["source"] == "nvml-power-usage-integrated" and r["invocation_s"] >= 1.0
    assert r["sampling"]["samples"] >= 8 and r["sampling"]["aliased"] is True
    assert any("its average is aliased" in w for w in r["warnings"])


def test_too_few_samples_give_no_aliasing_verdict():
    """Mutant: MIN_PHASE_SAMPLES ignored (a 2 s window sampled 4 times, by chance in one phase, called aliased)."""
    src = FakeSource(missing=["energy"], read_latency_s=0.0)
    r = measure_energy(src.op(0.5), source=src, sample_period_s=0.5, min_window_s=2.0, max_window_s=2.0)
    assert 2 <= r["sampling"]["samples"] < 8 and r["sampling"]["phase_coverage"] < 0.5
    assert r["sampling"]["aliased"] is False and not any("aliased" in w for w in r["warnings"])


def test_gross_per_token_stays_when_there_is_no_net_energy():
    """Mutant: j_per_token_gross dropped with the net J/call (an op at idle power keeps its gross figures)."""
    src = FakeSource(idle_w=60.0, busy_w=60.0)
    r = measure_energy(src.op(0.002), source=src, flops=4e9, tokens=16)
    assert r["energy_j_per_call"] is None and r["j_per_token"] is None
    assert r["j_per_token_gross"] == pytest.approx(r["energy_j_per_call_gross"] / 16)


def test_no_counter_means_no_update_period_even_when_the_caller_gave_one():
    """Mutant: update_period_s reported for a window measured without an energy counter."""
    src = FakeSource(missing=["energy"])
    r = measure_energy(src.op(0.002), source=src, update_period_s=0.1)
    assert r["source"] == "nvml-power-instant-integrated" and r["update_period_s"] is None


def test_invocation_s_is_per_invocation_not_per_call():
    """Mutant: invocation_s divided by calls_per_invocation (a graph of 8 calls read as 1 ms invocations)."""
    src = FakeSource()
    r = measure_energy(src.op(0.008), source=src, calls_per_invocation=8)
    invocations = r["calls"] // 8
    assert r["invocation_s"] == pytest.approx(r["window_s"] / invocations, rel=1e-9)
    assert 0.008 <= r["invocation_s"] < 0.009


def test_an_edge_is_timed_at_the_midpoint_of_the_polls_around_it():
    """Mutant: the edge timed at the poll that saw it (half a poll gap late): the true update must lie within
    t +- half_gap_s."""
    src = FakeSource(update_period_s=0.1, read_latency_s=1e-4)
    update_at = src.t + 0.1
    edge = wait_edge(src, lambda: src.sleep(0.08), timeout_s=1.0)
    assert edge is not None and edge.half_gap_s == pytest.approx(0.04, abs=1e-3)
    assert edge.t - edge.half_gap_s <= update_at <= edge.t + edge.half_gap_s


def test_a_skipped_counter_update_does_not_stretch_the_inferred_period():
    """Mutant: the inferred update period is the mean of the gaps instead of their median (a skipped update at low
    power read the 0.1 s period as 0.12 s)."""
    src = FakeSource(update_period_s=0.1)
    quiet = (src.t + 0.15, src.t + 0.31)  # no energy from the update at +0.2 to the one at +0.3: it does not move
    src.idle_w = lambda t, busy: 0.0 if quiet[0] <= t < quiet[1] else 60.0
    assert infer_update_period(src) == pytest.approx(0.1, abs=2e-3)


def test_a_sample_at_the_instant_a_window_opens_belongs_to_it():
    """Mutant: Sampler.between excluded its start (the first sample of a window was lost)."""
    src = FakeSource()
    sampler = Sampler(src, period_s=0.1).start()
    src.sleep(0.25)
    sampler.stop()
    times = [r["t"] for r in sampler.samples]
    assert [r["t"] for r in sampler.between(times[0], times[2])] == times[:3]


def test_summarize_takes_the_minimum_clock_the_hottest_reading_and_only_cap_reasons():
    """Mutants: sm_mhz_min a median, temp_c_max the last reading, cap_reason_share counting every reason (gpu_idle
    is no cap), reasons_mask 0 where no reasons were read (None: not read)."""
    rows = [{"sm_mhz": 1980.0, "temp_c": 71.0, "reasons": 0x1}, {"sm_mhz": 1200.0, "temp_c": 80.0, "reasons": 0x4},
            {"sm_mhz": 1900.0, "temp_c": 60.0, "reasons": 0}]
    s = summarize(rows)
    assert s["sm_mhz_min"] == 1200.0 and s["sm_mhz_median"] == 1900.0 and s["temp_c_max"] == 80.0
    assert s["reasons_mask"] == 0x5 and s["cap_reason_share"] == pytest.approx(1 / 3)
    unread = summarize([{"sm_mhz": 1980.0, "reasons": None}])
    assert unread["reasons_mask"] is None and unread["reasons"] == [] and unread["cap_reason_share"] is None


def test_window_clocks_power_is_the_median():
    """Mutant: power_w_median a mean (one 700 W spike moved a 300 W window to 433 W)."""
    rows = [{"t": i, "power_w": w, "sm_mhz": 1980.0, "reasons": 0} for i, w in enumerate((300.0, 300.0, 700.0))]
    assert window_clocks(rows, 1980.0)["power_w_median"] == 300.0


def test_exactly_the_clock_floor_is_not_throttled():
    """Mutant: `sm < 0.75 * default` -> `<=` (nvbench discards samples below 75% only)."""
    assert throttle_findings(1485.0, 1980.0, 0) == []
    assert throttle_findings(1484.0, 1980.0, 0) == ["SM clock 1484 MHz < 75% of default 1980 MHz"]


def test_a_malformed_line_before_the_last_is_an_error_and_the_version_is_checked(tmp_path):
    """Mutants: every malformed line skipped as if it were a killed run's last line; schema_version not checked."""
    src = FakeSource()
    tele, _ = RunTelemetry.start(tmp_path, 0, period_s=0.05, source=src)
    src.run(0.2)
    tele.stop()
    path = tmp_path / "telemetry.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], '{"type": "sample", "t": 1', *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"telemetry.jsonl:2: malformed telemetry line"):
        read_telemetry(path)
    newer = tmp_path / "v2.jsonl"
    newer.write_text(json.dumps({"type": "header", "schema": "spark-bench/telemetry", "schema_version": 2}) + "\n")
    with pytest.raises(ValueError, match="not a spark-bench/telemetry v1 file"):
        read_telemetry(newer)


def test_timing_clocks_ends_the_watch(tmp_path):
    """Mutant: timing_clocks left the case watched (its samples kept piling up after its timing ended)."""
    src = FakeSource()
    tele, _ = RunTelemetry.start(tmp_path, 0, period_s=0.02, source=src)
    tele.watch("a", "timing")
    src.run(0.2)
    assert tele.timing_clocks("a")["samples"] >= 9
    src.run(0.2)
    tele.stop()
    assert tele.timing_clocks("a") is None


def test_a_power_brake_is_a_cap_reason():
    """Mutant: hw_power_brake_slowdown (0x80) left out of the cap reasons (a braked window was not throttled)."""
    assert throttle_findings(None, None, 0x80) == ["clock-event reasons: hw_power_brake_slowdown"]
    src = FakeSource(reasons=lambda t, busy: 0x80 if busy else 0)
    r = measure_energy(src.op(0.002), source=src)
    assert r["throttled"] is True and r["throttle_reasons"] == ["hw_power_brake_slowdown"]


def test_a_cuda_index_past_the_visible_list_is_not_an_index_error(monkeypatch):
    """Mutant: the `n < len(visible)` guard dropped (cuda:2 with CUDA_VISIBLE_DEVICES=3,1 raised IndexError out of
    nvml_index, which open_source does not catch: it must never raise)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert nvml_index("cuda:2") == (2, None)


def test_no_permission_is_asked_once(monkeypatch):
    """Mutant: NVML_ERROR_NO_PERMISSION treated as transient (asked again on every 20 ms sample)."""
    calls = []

    def refused(handle):
        calls.append(1)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    pynvml, NvmlSource = patch_pynvml(monkeypatch, nvmlDeviceGetTotalEnergyConsumption=refused)
    src = NvmlSource(0)
    assert [src.energy_mj() for _ in range(3)] == [None] * 3 and len(calls) == 1


def test_no_power_reading_names_no_power_field(tmp_path):
    """Mutant: power_w() named 'nvml-power-usage' as its field when neither power reading exists (the timeline
    header and preflight then labelled a reading that was never taken)."""
    src = FakeSource(missing=["power_instant", "power_average"])
    assert src.power_w() == (None, None) and src.power_field is None
    assert preflight(source=src)["records"]["power_field"] is None
    tele, _ = RunTelemetry.start(tmp_path, 0, source=src)
    tele.stop()
    assert read_telemetry(tmp_path)["header"]["power_field"] is None


@pytest.mark.parametrize("name,memory,key", [
    ("NVIDIA GH200 480GB", None, None),  # GH200 96 GB or 144 GB: ambiguous without its memory size
    ("NVIDIA GH200 144G HBM3e", None, "GH200 144GB"),
    ("NVIDIA A100-SXM4", 85_000_000_000, "A100 SXM 80GB"),  # the size is in the memory, not the name
    ("NVIDIA A100 PCIe", 42_000_000_000, "A100 PCIe 40GB"),
])
def test_datasheet_rows_that_need_the_memory_size(name, memory, key):
    """Mutants: a GH200 of unknown memory given the 96 GB row; an A100's size read from its name only."""
    assert datasheet_key(name, memory) == key


def test_the_idle_baselines_meter_is_named_when_the_two_meters_differ():
    """Mutant: sources["idle_w"] named after the window's meter. Here the counter is frozen through the idle baseline
    (sampled instant power) and only power readings are missing under load: no net J/call, and the idle power keeps
    the name of the meter that read it."""
    src = FakeSource(update_period_s=0.05)
    read, instant, average = src.energy_mj, src.power_instant_w, src.power_average_w
    wakes = src.t + 2.6  # after the idle baseline (two 1 s edge timeouts and the 0.5 s baseline)
    src.energy_mj = lambda: read() if src.t > wakes else 7
    src.power_instant_w = lambda: None if src.busy else instant()
    src.power_average_w = lambda: None if src.busy else average()
    r = measure_energy(src.op(0.002), source=src, update_period_s=0.05)
    assert r["sources"]["avg_w"] == "nvml-energy-counter" and r["avg_w"] == pytest.approx(400.0, rel=0.01)
    assert r["sources"]["idle_w"] == "nvml-power-instant-integrated" and r["idle_w"] is None
    assert r["energy_j_per_call"] is None and any("come from different meters" in w for w in r["warnings"])


def test_tf32_and_fp8_have_their_own_flop_roofs():
    """Mutant: tf32 sent through canonical_dtype (which does not know it): a TF32 matmul had no % of peak."""
    roof = {"measured": {"tflops": {"tf32": 400.0}}, "datasheet": datasheet_for("NVIDIA H200")}
    pct = percent_of_peak(None, 247.35, "tf32", roof)
    assert pct["pct_flops_datasheet"] == 50.0 and pct["pct_flops_measured"] == pytest.approx(61.84, abs=0.01)
    assert percent_of_peak(None, 989.45, "fp8", roof)["pct_flops_datasheet"] == 50.0


def test_tf32_is_compared_with_its_own_peak_only():
    """Mutant: tf32 given the 16-bit dtypes' fp32 floor (a measured tf32 below fp32 would read against fp32)."""
    assert flops_peak({"tf32": 10.0, "fp32": 20.0}, "tf32") == 10.0
    assert flops_peak({"bf16": 10.0, "fp32": 20.0}, "bf16") == 20.0


def test_the_load_average_counts_per_cpu():
    """Mutant: the load average compared with BUSY_LOAD without dividing by the CPUs (1.5 on 4 CPUs is not busy)."""
    assert not cal.was_busy({"loadavg_1min": 1.5, "cpus": 4}, "cpu")
    assert cal.was_busy({"loadavg_1min": 2.0, "cpus": 4}, "cpu")


def test_a_cpus_peaks_are_cached_per_torch_thread_count():
    """Mutant: the fingerprint key of a CPU without its torch thread count (peaks at 1 thread served to 2)."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = device_identity("cpu")
        torch.set_num_threads(2)
        two = device_identity("cpu")
    finally:
        torch.set_num_threads(before)
    assert one["key_source"] == "spark_bench.fingerprint" and one["device"]["threads"] == 1
    assert one["fingerprint_id"].endswith("-t1") and two["fingerprint_id"].endswith("-t2")


def test_a_peak_is_the_best_timed_batch(monkeypatch):
    """Mutant: per_call_seconds returned the median batch, not the best (other load only ever slows a batch down,
    so the peak is the fastest). On a virtual clock each call takes 1 ms longer than the one before."""
    from types import SimpleNamespace

    clock, durations = [0.0], []

    def call():
        durations.append(0.001 * (len(durations) + 1))
        clock[0] += durations[-1]

    monkeypatch.setattr(cal, "time", SimpleNamespace(perf_counter=lambda: clock[0], time=lambda: clock[0]))
    seconds, calls = cal.per_call_seconds(call, "cpu", budget_s=0.0, warmup_s=0.003)
    batch = calls // 3
    timed = durations[-calls:]
    assert seconds == pytest.approx(sum(timed[:batch]) / batch)  # the first batch: the fastest
    assert seconds < sum(timed[batch:2 * batch]) / batch


def test_kernel_rows_per_call_is_per_profiled_call(monkeypatch):
    """Mutants: a kernel's per_call_us divided by its own launches (not the profiled calls); profiler_time not
    divided by the calls (two matmuls per call: per_call_us is two launches' time)."""
    import torch

    from spark_bench.telemetry import profile as prof_mod

    a = torch.randn(64, 64)
    rows = {r["name"]: r for r in prof_mod.kernel_rows(prof_mod.record(lambda: a @ a @ a, "cpu", 4, 1), "cpu", 4)}
    mm = rows["aten::mm"]
    assert mm["calls"] == 8 and mm["per_call_us"] == pytest.approx(mm["total_us"] / 4)
    monkeypatch.setattr(prof_mod, "record", lambda fn, device, iters, warmup: None)
    monkeypatch.setattr(prof_mod, "kernel_rows", lambda prof, device, iters: [{"total_us": 300.0},
                                                                              {"total_us": 100.0}])
    assert prof_mod.profiler_time(lambda: None, "cpu", iters=4) == pytest.approx(1e-4)


def test_this_processs_own_cpu_time_is_not_others_load(monkeypatch):
    """Mutant: cpu_meter counted all busy CPU time as other processes' (the calibration's own matmuls on 2 cores
    made every CPU calibration 'busy')."""
    from types import SimpleNamespace

    stat, clock = iter([(100.0, 2), (103.0, 2)]), iter([0.0, 2.0])
    own = iter([SimpleNamespace(user=10.0, system=1.0), SimpleNamespace(user=11.5, system=1.5)])
    monkeypatch.setattr(cal, "_proc_stat", lambda: next(stat))
    monkeypatch.setattr(cal.os, "times", lambda: next(own))
    monkeypatch.setattr(cal, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    others_share = cal.cpu_meter()
    assert others_share() == 0.25  # 3 CPU-s busy, 2 of them this process's, over 2 s of 2 CPUs


def test_a_gpus_copy_is_at_most_an_eighth_of_its_memory(monkeypatch):
    """Mutant: the copy size not capped by the GPU's memory (a 2 GiB copy, 4 GiB with its destination, on an 8 GiB
    card). The GPU is scripted: only the sizes calibrate asks for are checked."""
    import contextlib
    from types import SimpleNamespace

    import torch

    import spark_bench.timing

    asked = {}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=8 * 2**30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(spark_bench.timing, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cal, "measure_bandwidth", lambda device, nbytes, *a, **k: asked.update(copy=nbytes) or
                        {"gbps": 1.0})
    monkeypatch.setattr(cal, "measure_matmul", lambda device, dtype, n, *a, **k: {"tflops": 1.0, "n": n})
    ident = {"fingerprint_id": "x", "key_source": "test", "device": {"type": "cuda"}}
    entry = cal.calibrate("cuda", identity=ident, dtypes=["bf16"], source=FakeSource())
    assert asked["copy"] == 2**30 and entry["busy"] is False


def test_an_undeclared_interpreted_backend_is_labelled_by_profile(tmp_path, monkeypatch):
    """Mutant: profile trusted the backend's own labels (a Triton backend that does not declare 'interpreted' had
    the interpreter's host time shown as its kernels' time)."""
    from spark_bench.registry import registry
    from spark_bench.telemetry.profile import profile_case

    backend = registry().get("kda.gate").backends["triton"]
    monkeypatch.setattr(backend, "labels_for", lambda device: [])
    summary = profile_case("kda.gate", "triton", sets=["tokens=3"], device="cpu", out_dir=tmp_path, iters=1,
                           warmup=1)
    assert "interpreted" in summary["labels"] and "not an aten op" in summary["what"]


def test_cuda_n_of_a_one_gpu_host_is_one_line_exit_2(tmp_path, monkeypatch):
    """Mutant: `N >= count` -> `N > count` (cuda:1 on a host of one GPU passed the check)."""
    import torch
    from click.testing import CliRunner

    from spark_bench.telemetry.cli import calibrate as calibrate_cmd

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: pytest.fail("measured on a bad device"))
    got = CliRunner().invoke(calibrate_cmd, ["--device", "cuda:1", "--cache", str(tmp_path / "c")])
    assert "device 'cuda:1' does not exist here: 1 CUDA device(s), cuda:0 to cuda:0" in one_line(got)
