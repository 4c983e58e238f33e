"""The reference check and its repeat after the timing against hostile backends (tests/plugins/hostile_plugin.py):
what values alone pass, slots an in-place op must not touch, a kernel wrong only on later calls."""

import math

import pytest
import torch


@pytest.fixture
def hostile_registry(monkeypatch):
    from conftest import TESTS

    from spark_bench.registry import Registry

    monkeypatch.syspath_prepend(str(TESTS / "plugins"))
    import hostile_plugin

    reg = Registry()
    reg.load_object("hostile_plugin", hostile_plugin)
    return reg


def _run_case(reg, op, backend, params=None, dtype="fp32"):
    from spark_bench.sweep import Case
    from spark_bench.timing import TimingConfig
    from spark_bench.worker import CaseRunner

    case = Case(op, backend, params or {"rows": 3, "cols": 5}, dtype, "cpu", 0)
    return CaseRunner(reg).run(case, TimingConfig.quick(), n_sets=4)


@pytest.mark.parametrize("backend, needle", [
    ("float64_out", "output 0: dtype float64, expected float32"),
    ("overwrites_input", "input x was modified in place"),
    ("empty_out", "shape (0, 5) != reference (3, 5)"),
])
def test_the_check_catches_what_values_alone_pass(hostile_registry, backend, needle):
    rec = _run_case(hostile_registry, "hostile.check", backend)
    assert rec["status"] == "mismatch" and needle in rec["error"], rec["error"]
    assert rec["timing"] is None


def test_slots_an_in_place_op_must_not_touch_are_checked_bitwise(hostile_registry):
    """A pool kernel that nudges another sequence's slot by one ulp passes any error ratio; `untouched=` catches it."""
    bad = _run_case(hostile_registry, "hostile.pool", "scribbles")
    assert bad["status"] == "mismatch" and bad["check"]["err_ratio"] < 1e-6
    assert "pool: 1 of the 6 slots the call must not touch changed" in bad["error"]
    for backend in ("fine", "reference"):
        assert _run_case(hostile_registry, "hostile.pool", backend)["status"] == "ok", backend
    scaled = _run_case(hostile_registry, "hostile.pool", "scales_x")  # pool is declared in place; x is not
    assert scaled["status"] == "mismatch" and "input x was modified in place" in scaled["error"], scaled["error"]
    assert "input pool" not in scaled["error"]
    from spark_bench.check import changed_rows, untouched_slots

    full = {"pool": torch.randn(4, 2, 3), "slots": torch.tensor([3, 0, 2, 1])}  # every slot is the call's
    assert untouched_slots("slots", "pool")(full)["pool"].numel() == 0
    assert changed_rows(untouched_slots("slots", "pool")(full), full, full) == []


def test_the_check_still_passes_good_backends_and_the_fp64_reference(hostile_registry):
    for backend in ("fine", "reference"):
        rec = _run_case(hostile_registry, "hostile.check", backend)
        assert rec["status"] == "ok", (backend, rec["error"])


def _shows_the_failing_numbers(rec, failed):
    """A mismatch that passed input set 0's check shows the failing check's error ratio (console, page, failure
    text), not set 0's passing one."""
    import io

    from rich.console import Console

    from spark_bench.console import fmt_num, results_table
    from spark_bench.report.model import deciding_check, failure_text

    tol = rec["check"]["tolerance"]["err_ratio"]
    assert rec["check"]["err_ratio"] <= tol < failed["err_ratio"]  # set 0 passed; the failing check did not
    assert deciding_check(rec)["err_ratio"] == failed["err_ratio"] and not deciding_check(rec)["ok"]
    assert f"err_ratio={failed['err_ratio']:.3g}" in failure_text(rec)
    assert f"err_ratio={rec['check']['err_ratio']:.3g} " not in failure_text(rec)
    buf = io.StringIO()
    Console(file=buf, width=220).print(results_table([rec]))
    row = next(line for line in buf.getvalue().splitlines() if "mismatch" in line)
    assert f" {fmt_num(failed['err_ratio'], 2)} " in row and f" {fmt_num(rec['check']['err_ratio'], 2)} " not in row


def test_the_checked_call_is_repeated_after_the_timing(hostile_registry):
    """A kernel right on its checked call and wrong on later ones (a scratch never reset) is a mismatch, its numbers
    dropped; one whose bits change within tolerance is labelled; a deterministic one (an in-place op too) is not."""
    stale = _run_case(hostile_registry, "hostile.check", "stale_scratch")
    assert stale["check"]["ok"] and stale["status"] == "mismatch", stale["error"]
    assert stale["error"].startswith("right when checked, wrong on the same inputs after its timing: output 0: error")
    assert stale["timing"] is None and stale["gbps"] is None and stale["recheck"]["discarded_median_us"] > 0
    assert stale["recheck"]["differ"] == ["0"] and not stale["recheck"]["identical"]
    _shows_the_failing_numbers(stale, stale["recheck"])

    jitter = _run_case(hostile_registry, "hostile.check", "jitters")
    assert jitter["status"] == "ok" and "nondeterministic" in jitter["labels"], jitter["error"]
    assert jitter["recheck"]["ok"] and jitter["recheck"]["err_ratio"] < 1e-6 and jitter["timing"]["median"] > 0

    for op, backend in (("hostile.check", "fine"), ("hostile.pool", "fine")):
        rec = _run_case(hostile_registry, op, backend)
        assert rec["recheck"] == {"identical": True, "ok": True} and "nondeterministic" not in rec["labels"], op


def test_every_rotated_input_set_is_checked_before_the_timing(hostile_registry):
    """The timing rotates through n input sets (routings); a backend right on set 0 only is a mismatch, untimed."""
    bad = _run_case(hostile_registry, "hostile.rotating", "clips")
    assert bad["status"] == "mismatch" and bad["timing"] is None, bad["error"]
    assert bad["error"].startswith("right on input set 0, wrong on input set 1 of 4 (rotated: x): output 0: error")
    assert bad["check"]["input_sets"]["failed"] == 1
    _shows_the_failing_numbers(bad, bad["check"]["input_sets"])
    good = _run_case(hostile_registry, "hostile.rotating", "fine")
    assert good["status"] == "ok" and good["check"]["input_sets"] == {"checked": 4}, good["error"]
    assert good["timing"]["input_sets"] == 4


def test_the_last_rotated_input_set_is_checked_too(hostile_registry):
    """A check that stopped after set 1 passed every test above (a mutation audit)."""
    import hostile_plugin

    hostile_plugin.SEEN.clear()
    bad = _run_case(hostile_registry, "hostile.rotating", "last_wrong")
    assert bad["status"] == "mismatch" and bad["timing"] is None, bad
    assert bad["error"].startswith("right on input set 0, wrong on input set 3 of 4"), bad["error"]


def test_interpreted_triton_is_not_rechecked():
    """A CPU run's interpreted kernels skip the repeat (no race can show; it would cost a quarter of the sweep)."""
    from spark_bench.registry import registry

    rec = _run_case(registry(), "kda.gate", "triton", {"tokens": 5, "heads": 2, "head_dim": 16}, "bf16")
    assert rec["status"] == "ok" and "interpreted" in rec["labels"], rec["error"]
    assert rec["recheck"] == {"skipped": "interpreted"}


def test_an_empty_output_is_not_a_perfect_match():
    from spark_bench.check import tensor_metrics

    m = tensor_metrics(torch.empty(0, 4), torch.empty(0, 4, dtype=torch.float64))
    assert "empty" in m["error"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 123.0])
def test_where_the_reference_is_not_finite_the_output_must_match_it(value):
    """A poisoned (unwritten) NaN, the wrong infinity or a number where the reference has -inf is wrong; the same
    -inf, and NaN where the reference is NaN, are right."""
    from spark_bench.check import tensor_metrics

    ref = torch.tensor([1.0, 2.0, -math.inf, 4.0, math.nan], dtype=torch.float64)
    out = torch.tensor([1.0, 2.0, value, 4.0, math.nan])
    assert "differ where the reference is NaN/inf" in tensor_metrics(out, ref)["error"]
    good = tensor_metrics(torch.tensor([1.0, 2.0, -math.inf, 4.0, math.nan]), ref)
    assert good["err_ratio"] == 0.0 and "error" not in good
    assert "differ" in tensor_metrics(torch.tensor([1.0, 2.0, -math.inf, 4.0, 5.0]), ref)["error"]


def test_peak_memory_is_recorded_per_case(hostile_registry):
    rec = _run_case(hostile_registry, "hostile.check", "fine")
    mem = rec["memory"]
    assert mem["rss_peak_bytes"] > 0 and mem["rss_peak_increase_bytes"] >= 0 and mem["device_peak_bytes"] is None
