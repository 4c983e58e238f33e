"""spark_bench/report/model.py edges the other report tests leave open (found by mutation testing): failed cases are
never timed, however much timing they carry; the chart's unit is the records' own and mixed timers are said; ties
between swept axes; log axes from two decades; roofline peaks in decimal units, the measured one preferred; the check
a mismatch shows. Hand-made records, built in memory."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import report_fixtures as fx  # noqa: E402

from spark_bench.report.charts import OpCharts  # noqa: E402
from spark_bench.report.model import (  # noqa: E402
    RunData,
    op_summary,
    speedups,
    time_unit,
    timed_on,
    timing,
)

FAILED_STATUSES = ("mismatch", "error", "crash", "timeout", "oom")


def _run(results: list[dict], device: dict | None = None, fingerprint_id: str = "fp-h200") -> RunData:
    """A loaded run without touching disk: RunData as load_runs makes it."""
    run = {"run_id": "r", "fingerprint": {"device": device or fx.H200, "fingerprint_id": fingerprint_id}}
    return RunData(Path("r"), run, results, label="r")


def _timed(backend: str, median: float, tokens: int = 1, status: str = "ok", **kw) -> dict:
    rng = np.random.default_rng(tokens)
    rec = fx.case("kda.gate", backend, {"tokens": tokens}, samples=fx.draw(rng, median, n=20, spread=0.01), **kw)
    rec["status"] = status  # a failed case that still carries the timing of its (discarded) measurement
    return rec


@pytest.mark.parametrize("status", FAILED_STATUSES)
def test_a_failed_case_with_a_stored_timing_is_never_timed_nor_fastest(status):
    fast_but_wrong = _timed("triton", 1.0, status=status)
    results = [_timed("torch", 10.0), fast_but_wrong]
    assert timing(fast_but_wrong) is None
    assert id(fast_but_wrong) not in speedups(results, "torch")
    s = op_summary("kda.gate", results, {}, "torch")
    assert (s["fastest"], s["speedup"], s["compared"]) == ("torch", 1.0, 1)  # the baseline against itself only
    charts = OpCharts("kda.gate", [_run(results)], {})
    latency = charts.latency()
    lines = [t for t in latency["data"] if t["mode"] == "lines+markers"]
    assert [t["name"] for t in lines] == ["torch"]  # the wrong kernel has no latency point, only its ✕
    assert [t["name"] for t in latency["data"] if t["mode"] == "markers"] == [f"triton ✕ {status}"]
    assert charts.speedup_chart() is None  # nothing correct to compare with torch


def test_mixed_timers_are_said_and_a_single_timer_is_not_called_mixed():
    one = [_timed("torch", 10.0)]
    both = [_timed("torch", 10.0), _timed("triton", 5.0)]
    both[1]["timing"]["timer"] = "cuda-graph"
    assert timed_on([_run(one)], one) == "on NVIDIA H200 · timer cuda-event"
    assert timed_on([_run(both)], both) == "on NVIDIA H200 · timer cuda-event, cuda-graph (mixed: see each point)"


def test_the_time_unit_is_the_records_own():
    rec = _timed("torch", 10.0)
    rec["timing"]["unit"] = "ms"
    assert time_unit([None, {"status": "error"}, rec]) == "ms"
    assert time_unit([{"status": "ok", "timing": {"median": 1.0}}]) == "us"  # no unit stated: µs, the schema's
    charts = OpCharts("kda.gate", [_run([rec, _timed("torch", 20.0, tokens=2)])], {})
    assert charts.unit == "ms" and charts.latency()["layout"]["yaxis"]["title"]["text"] == "time per call (ms)"


def _params(**axes) -> list[dict]:
    """One case per combination of the axes' values."""
    import itertools

    names = sorted(axes)
    return [{"params": dict(zip(names, combo, strict=True))} for combo in itertools.product(*(axes[n] for n in names))]


def test_a_tie_between_axes_goes_to_the_preferred_sweep_axis():
    from spark_bench.report.model import swept_axis

    assert swept_axis(_params(tokens=(1, 2, 3), heads=(4, 8, 16))) == "tokens"  # as many values: tokens first
    assert swept_axis(_params(zeta=(1, 2), batch=(1, 2))) == "batch"  # a known sweep axis before an unknown one
    assert swept_axis(_params(tokens=(1, 2), heads=(4, 8, 16))) == "heads"  # more values win over the preference


def test_a_log_axis_from_two_decades_on():
    from spark_bench.report.model import log_scale

    assert log_scale([1.0, 100.0]) and log_scale([0.0, 2.0, 200.0])  # zeros are not on a log axis
    assert not log_scale([1.0, 99.0]) and not log_scale([]) and not log_scale([0.0, -5.0])


def test_peaks_in_bytes_and_flops_per_second_are_decimal_gb_and_tflop():
    from spark_bench.report.model import peaks

    run = {"roofline": {"measured": {"bytes_per_s": 4.3e12, "flops_per_s": 7.8e14}}}
    assert peaks(run, "bf16") == {"measured": {"gbps": 4300.0, "tflops": 780.0}}  # GB/s as the cases' gbps, not GiB/s


def test_a_16_bit_dtype_ceiling_is_said_to_be_the_fp32_rate_only_when_it_is():
    from spark_bench.report.model import peaks

    cpu = {"roofline": {"measured": {"gbps": 20.0, "tflops": {"bf16": 0.0015, "fp32": 0.16}}}}
    gpu = {"roofline": {"measured": {"gbps": 4300.0, "tflops": {"bf16": 989.0, "fp32": 67.0}}}}
    assert peaks(cpu, "bf16")["measured"] == {"gbps": 20.0, "tflops": 0.16, "rate_of": "fp32"}
    assert peaks(gpu, "bf16")["measured"] == {"gbps": 4300.0, "tflops": 989.0}  # its own rate: nothing to say


def test_a_stored_percentage_of_the_measured_peak_is_preferred_over_the_datasheet_s():
    from spark_bench.report.model import roofline_pct

    r = {"roofline": {"pct_bw_measured": 40.0, "pct_bw_datasheet": 45.0, "pct_flops_datasheet": 12.0}}
    assert roofline_pct(r, {}) == (40.0, "BW measured")  # the measured roof is the honest one, though lower


def test_a_skip_without_a_reason_says_so():
    from spark_bench.report.model import problems

    skipped = fx.case("kda.gate", "fla", {"tokens": 1}, status="skipped")
    assert problems([skipped])[1] == [{"op": "kda.gate", "backend": "fla", "reason": "no reason given", "count": 1}]


def test_a_mismatch_shows_its_own_check_when_no_input_set_or_recheck_failed():
    from spark_bench.report.model import deciding_check

    r = {"status": "mismatch", "check": {"ok": True, "err_ratio": 0.4, "message": "set 0"},
         "recheck": {"ok": True, "identical": False, "err_ratio": 1e-7}}
    assert deciding_check(r) is r["check"]
    r["recheck"]["ok"] = False  # the call after the timing failed: its numbers are the ones shown
    assert deciding_check(r) == {"ok": False, "err_ratio": 1e-7, "max_abs": None, "cosine": None, "message": ""}
