"""spark_bench/report/compare.py edges the other compare tests leave open (found by mutation testing): a change of
exactly the threshold is not a change, every way two cases were timed differently is said, '1' is 1%, a case that
stopped running is a regression while one skipped in both is left out, and the CIs of a ratio combine in quadrature."""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
import report_fixtures as fx  # noqa: E402

from spark_bench.report.compare import (  # noqa: E402
    case_verdict,
    compare_runs,
    parse_threshold,
    print_table,
    ratio_ci,
    timing_verdict,
)
from spark_bench.report.model import RunData  # noqa: E402


def _steady(median: float) -> dict:
    """21 samples 0.01 apart around `median`, which is exactly their median."""
    return fx.timing_of(np.array([median + 0.01 * k for k in range(-10, 11)]))


def _case(tokens: int, median: float | None = 10.0, status: str = "ok") -> dict:
    rng = np.random.default_rng(tokens)
    samples = fx.draw(rng, median, n=30, spread=0.01) if median else None
    return fx.case("kda.gate", "triton", {"tokens": tokens}, samples=samples, status=status,
                   error=None if status == "ok" else "n/a")


def _run(results: list[dict]) -> RunData:
    return RunData(Path("r"), {"fingerprint": {"fingerprint_id": "fp"}}, results)


def test_a_change_of_exactly_the_threshold_is_not_a_change():
    v = timing_verdict(_steady(10.0), _steady(15.0), threshold=0.5)  # 1.5x, significant, and exactly +50%
    assert v.ratio == 1.5 and v.p_value < 0.01 and v.verdict == "same"
    assert timing_verdict(_steady(10.0), _steady(15.0), threshold=0.49).verdict == "slower"


def test_a_change_of_l2_flush_is_said():
    base, new = _case(3), _case(3)
    new["timing"]["l2_flush"] = False
    assert case_verdict(base, new, 0.05).note.startswith("l2_flush True -> False; not timed alike (--timer pins it)")


def test_one_is_one_percent():
    assert parse_threshold("1") == pytest.approx(0.01) and parse_threshold("1%") == pytest.approx(0.01)


def test_a_case_skipped_now_is_broken_and_one_skipped_in_both_is_left_out():
    base = _run([_case(1), fx.case("kda.gate", "fla", {"tokens": 1}, status="skipped", error="not installed")])
    new = _run([fx.case("kda.gate", "triton", {"tokens": 1}, status="skipped", error="not installed"),
                fx.case("kda.gate", "fla", {"tokens": 1}, status="skipped", error="not installed")])
    diffs = compare_runs(base, new, 0.05)
    assert [(d.backend, d.verdict.verdict) for d in diffs] == [("triton", "broken")]
    assert diffs[0].verdict.note == "ok -> skipped: not installed"


def test_the_ratio_ci_combines_the_two_cis_in_quadrature_on_a_log_scale():
    a = (math.exp(-0.3), math.exp(0.3))
    b = (2.0 * math.exp(-0.4), 2.0 * math.exp(0.4))
    lo, hi = ratio_ci(2.0, a, b)
    assert (lo, hi) == pytest.approx((2.0 * math.exp(-0.5), 2.0 * math.exp(0.5)))
    assert ratio_ci(2.0, a, (0.0, 3.0)) is None  # a CI reaching zero has no log width


def test_the_count_line_says_how_many_cases_both_runs_have():
    base, new = _run([_case(1), _case(2), _case(3)]), _run([_case(1), _case(4)])
    out = io.StringIO()
    print_table(Console(file=out, width=200), compare_runs(base, new, 0.05), "median", 0.05, "a", "b")
    assert out.getvalue().splitlines()[-1].startswith("4 cases, 1 in both runs: 2 missing, 1 new, 1 same")


def _compare(*args) -> tuple[int, str, str]:
    from click.testing import CliRunner

    from spark_bench.report.cli import compare

    res = CliRunner().invoke(compare, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def test_the_drift_note_when_either_run_was_timed_on_a_cpu(tmp_path):
    """One run on the CPU is enough for the CPU's drift to be in the ratios; a run whose spec says `--device cpu`
    counts as timed on the CPU whatever its fingerprint's device says."""
    import json

    cpu = fx.standard_run(tmp_path / "cpu", seed=0, device={"type": "cpu", "name": "AMD EPYC"}, fingerprint_id="c")
    gpu = fx.standard_run(tmp_path / "gpu", seed=1, run_id="run-b", scale={"triton": 1.2})
    code, _, err = _compare(cpu, gpu, "--allow-different-device")
    assert code == 1 and "note: timed on a CPU" in err
    host = fx.standard_run(tmp_path / "host", seed=2, run_id="run-c", scale={"triton": 1.2})
    run_json = host / "run.json"
    run_json.write_text(json.dumps({**json.loads(run_json.read_text()), "spec": {"device": "cpu"}}))
    code, _, err = _compare(fx.standard_run(tmp_path / "base", seed=3), host)
    assert code == 1 and "note: timed on a CPU" in err


def test_the_geomean_counts_every_case_with_a_ratio_noisy_ones_included():
    from spark_bench.report.compare import CaseDiff, Verdict, geomean_table

    def diff(tokens: int, verdict: str, ratio: float | None) -> CaseDiff:
        return CaseDiff("kda.gate", "triton", {"tokens": tokens}, "bf16", {}, {}, Verdict(verdict, ratio))

    table = geomean_table([diff(1, "noisy", 1.44), diff(2, "same", 1.0), diff(3, "failing", None)])
    out = io.StringIO()
    Console(file=out, width=200).print(table)
    (row,) = [line for line in out.getvalue().splitlines() if "kda.gate" in line]
    assert [c.strip() for c in row.strip("│ ").split("│")] == ["kda.gate", "triton", "2", "1.200x", "0", "0"]


def test_names_are_listed_sorted_with_numbers_by_value():
    from spark_bench.report.compare_checks import _few

    assert _few(["1024", "64", "b", "a", "64"]) == "a, b, 64, 1024"
    assert _few([str(n) for n in range(8)], most=3) == "0, 1, 2 (+5)" and _few([]) == "no cases"
