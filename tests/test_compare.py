"""`spark-bench compare`: the robust verdicts on synthetic samples, and the command's exit codes on synthetic runs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import report_fixtures as fx  # noqa: E402

from spark_bench.report.cli import compare  # noqa: E402
from spark_bench.report.compare import (  # noqa: E402
    CompareError,
    case_verdict,
    mann_whitney,
    parse_threshold,
    rel_iqr,
    timing_verdict,
)

SCIPY = "scipy, the Mann-Whitney oracle, is a dev dependency: pip install -e '.[dev]'"


def timing(samples) -> dict:
    return fx.timing_of(np.asarray(samples, dtype=float))


# --- statistics ------------------------------------------------------------------------------------------------------
def test_mann_whitney_by_hand():
    # no ties, 6 samples: exact. U of a = 0 is 1 of the C(6, 3) = 20 orderings, two-sided: p = 2/20
    u, p = mann_whitney([1, 2, 3], [4, 5, 6])
    assert u == 0 and p == pytest.approx(0.1, rel=1e-12)
    assert mann_whitney([4, 5, 6], [1, 2, 3]) == (9, p)  # U of a and U of b sum to n1*n2
    assert mann_whitney(range(5), range(5, 10))[1] == pytest.approx(2 / 252, rel=1e-12)  # 5 vs 5: C(10, 5) = 252
    # U = 1 of 3 vs 3: the orderings with U <= 1 are 2 of 20, so p = 2 * 2/20
    assert mann_whitney([1, 2, 4], [3, 5, 6])[1] == pytest.approx(0.2, rel=1e-12)
    # a tie: the normal approximation. U of a = 0.5; mean 4.5, variance 3*3/12 * (7 - 6/30); z = (4 - 0.5) / sd
    u, p = mann_whitney([1, 2, 3], [3, 5, 6])
    assert u == 0.5 and p == pytest.approx(math.erfc(3.5 / math.sqrt(0.75 * 6.8) / math.sqrt(2)), rel=1e-12)
    assert mann_whitney([2.0] * 5, [2.0] * 7)[1] == 1.0  # all tied: no evidence at all


@pytest.mark.parametrize("n1,n2", [(3, 3), (4, 9), (7, 7), (12, 17), (20, 20)])
def test_exact_mann_whitney_matches_scipy(n1, n2):
    stats = pytest.importorskip("scipy.stats", reason=SCIPY)
    rng = np.random.default_rng(n1 * 100 + n2)
    a, b = rng.normal(10, 1, n1), rng.normal(10.8, 1, n2)
    ref = stats.mannwhitneyu(a, b, alternative="two-sided", method="exact")
    assert mann_whitney(a, b) == (pytest.approx(ref.statistic), pytest.approx(ref.pvalue, rel=1e-9))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mann_whitney_matches_scipy(seed):
    stats = pytest.importorskip("scipy.stats", reason=SCIPY)
    rng = np.random.default_rng(seed)
    a = np.round(rng.normal(10, 1, 37), 1)  # rounded: plenty of ties
    b = np.round(rng.normal(10.4, 1, 23), 1)
    ref = stats.mannwhitneyu(a, b, alternative="two-sided", method="asymptotic", use_continuity=True)
    u, p = mann_whitney(a, b)
    assert u == pytest.approx(ref.statistic)
    assert p == pytest.approx(ref.pvalue, rel=1e-9)


def test_threshold_labels_keep_what_was_given():
    from spark_bench.report.compare import pct

    assert [pct(t) for t in (0.004, 0.05, 0.015, 1.5)] == ["0.4%", "5%", "1.5%", "150%"]  # was 0%, 5%, 2%, 150%


def test_parse_threshold():
    assert parse_threshold("5%") == pytest.approx(0.05)
    assert parse_threshold("0.05") == pytest.approx(0.05)
    assert parse_threshold("12.5") == pytest.approx(0.125)
    for bad in ("five", "0", "-3%"):
        with pytest.raises(CompareError):
            parse_threshold(bad)


# --- verdicts on synthetic samples ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_clear_speedup_and_regression(seed):
    rng = np.random.default_rng(seed)
    base = timing(fx.draw(rng, 100.0, n=50))
    faster = timing_verdict(base, timing(fx.draw(rng, 70.0, n=50)), threshold=0.05)
    slower = timing_verdict(base, timing(fx.draw(rng, 120.0, n=50)), threshold=0.05)
    assert faster.verdict == "faster" and faster.ratio == pytest.approx(0.7, rel=0.05) and faster.p_value < 1e-6
    assert slower.verdict == "slower" and slower.ratio == pytest.approx(1.2, rel=0.05) and slower.p_value < 1e-6


@pytest.mark.parametrize("seed", range(6))
def test_pure_noise_is_same(seed):
    rng = np.random.default_rng(seed)
    v = timing_verdict(timing(fx.draw(rng, 50.0, n=60)), timing(fx.draw(rng, 50.0, n=60)), threshold=0.05)
    assert v.verdict == "same", v
    assert v.ratio_lo < 1.0 < v.ratio_hi or v.p_value < 0.01


@pytest.mark.parametrize("seed", range(3))
def test_significant_shift_below_threshold_is_same(seed):
    rng = np.random.default_rng(seed)
    base = timing(50.0 * np.exp(rng.normal(0, 0.01, 400)))
    new = timing(51.0 * np.exp(rng.normal(0, 0.01, 400)))  # +2%: real, but under the 5% threshold
    v = timing_verdict(base, new, threshold=0.05)
    assert v.p_value < 1e-6 and v.ratio == pytest.approx(1.02, abs=0.005)
    assert v.verdict == "same"
    assert timing_verdict(base, new, threshold=0.01).verdict == "slower"  # the same shift over a 1% threshold


def test_wide_spread_is_noisy_not_slower():
    rng = np.random.default_rng(7)
    base = timing(40.0 * np.exp(rng.normal(0, 0.4, 8)))
    new = timing(44.0 * np.exp(rng.normal(0, 0.4, 8)))
    v = timing_verdict(base, new, threshold=0.05)
    assert rel_iqr(new["samples"]) > 0.2
    assert v.verdict == "noisy" and "reaches past" in v.note


def test_few_samples_decide_only_when_every_sample_agrees():
    """3 vs 3 cannot reach p < 0.01 (exact p >= 0.1); a 2x step with no overlap is still a regression."""
    base = timing([10.0, 10.1, 10.2])
    slower = timing_verdict(base, timing([20.0, 20.1, 20.2]), threshold=0.05)
    assert slower.verdict == "slower" and slower.p_value == pytest.approx(0.1) and "every new sample" in slower.note
    assert timing_verdict(base, timing([5.0, 5.1, 5.2]), threshold=0.05).verdict == "faster"
    # separated, but the gap between the closest samples is under the threshold: the samples cannot tell
    assert timing_verdict(base, timing([10.4, 11.0, 11.5]), threshold=0.05).verdict == "noisy"
    assert timing_verdict(base, timing([9.0, 10.15, 30.0]), threshold=0.05).verdict == "noisy"  # overlapping


@pytest.mark.parametrize("a,b", [([10.0], [10.6]), ([10.0, 10.1], [10.8, 10.9]), ([10.0] * 40, [20.0, 20.5])])
def test_fewer_than_three_samples_are_noisy(a, b):
    """1 or 2 samples carry no spread: their range is no CI (50% at 2), so no verdict, whatever the ratio."""
    v = timing_verdict(timing(a), timing(b), threshold=0.05)
    assert v.verdict == "noisy" and v.p_value is None and "too few samples" in v.note


def test_a_change_of_timer_is_said():
    base, new = fx.case("kda.gate", "triton", {"tokens": 3}, samples=fx.draw(np.random.default_rng(0), 45.0)), \
        fx.case("kda.gate", "triton", {"tokens": 3}, samples=fx.draw(np.random.default_rng(1), 60.0))
    new["timing"]["timer"] = "cuda-graph"
    v = case_verdict(base, new, threshold=0.05)
    assert v.verdict == "slower" and v.note.startswith("timer cuda-event -> cuda-graph; not timed alike")
    assert "not timed alike" not in case_verdict(base, base, threshold=0.05).note


def test_without_raw_samples_the_stored_cis_decide():
    base = {"median": 100.0, "ci_low": 99.0, "ci_high": 101.0}
    assert timing_verdict(base, {"median": 120.0, "ci_low": 119.0, "ci_high": 121.0}, 0.05).verdict == "slower"
    assert timing_verdict(base, {"median": 100.5, "ci_low": 99.5, "ci_high": 101.5}, 0.05).verdict == "same"


@pytest.mark.parametrize("metric,true_value", [("median", math.log(2.0)), ("p90", math.log(10.0)),
                                               ("p10", -math.log(0.9)), ("mean", 1.0)])
def test_each_metrics_ci_covers_its_own_statistic_about_95_percent_of_the_time(metric, true_value):
    """`compare --metric p90` used the medians' CIs for the p90's ratio: a CI of the wrong statistic."""
    from spark_bench.stats import metric_ci

    rng = np.random.default_rng(7)
    draws = [metric_ci(np.sort(rng.exponential(1.0, 120)), metric) for _ in range(600)]
    coverage = np.mean([lo <= true_value <= hi for lo, hi in draws])
    assert 0.92 <= coverage <= 0.985, coverage
    assert metric_ci(np.sort(rng.exponential(1.0, 50)), "min") is None


def test_a_ratio_of_another_metric_gets_that_metrics_verdict_not_the_medians():
    rng = np.random.default_rng(3)
    base = fx.timing_of(rng.normal(100.0, 1.0, 60))
    tail = rng.normal(100.0, 1.0, 60)
    tail[-12:] += 60.0  # the median stays; the p90 jumps
    new = fx.timing_of(tail)
    assert timing_verdict(base, new, 0.05, "median").verdict == "same"
    v = timing_verdict(base, new, 0.05, "p90")
    assert v.ratio == pytest.approx(new["p90"] / base["p90"]) and v.ratio > 1.3
    assert v.ratio_lo <= v.ratio <= v.ratio_hi and v.ratio_lo > 1.05  # the p90's CI, not the median's
    assert timing_verdict(base, new, 0.05, "min").ratio_lo is None  # no CI of a min: said, not invented


def test_correctness_changes():
    ok = fx.case("kda.gate", "triton", {"tokens": 3}, samples=fx.draw(np.random.default_rng(0), 5.0))
    bad = fx.case("kda.gate", "triton", {"tokens": 3}, status="mismatch", error="err_ratio 0.4 > 0.01")
    assert case_verdict(ok, bad, 0.05).verdict == "broken"
    assert "mismatch" in case_verdict(ok, bad, 0.05).note
    assert case_verdict(bad, ok, 0.05).verdict == "fixed"
    assert case_verdict(bad, bad, 0.05).verdict == "failing"
    assert case_verdict(ok, None, 0.05).verdict == "missing"
    assert case_verdict(None, ok, 0.05).verdict == "new"


# --- the command ----------------------------------------------------------------------------------------------------
def invoke(*args: str):
    return CliRunner().invoke(compare, [str(a) for a in args], catch_exceptions=False)


def test_rerun_of_same_build_exits_0(tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b")  # same true latencies, different draws
    res = invoke(a, b)
    assert res.exit_code == 0, res.output
    tally = res.output.strip().splitlines()[-1]
    assert " in both runs: " in tally and "slower" not in tally and "REGRESSED" not in res.output


def test_injected_regression_exits_1_and_lists_it(tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b", scale={"triton": 1.2})
    res = invoke(a, b, "--threshold", "5%")
    assert res.exit_code == 1, res.output
    listed = [line for line in res.output.splitlines() if line.startswith("  ") and "slower" in line]
    assert len(listed) == 16  # triton: 2 ops x 2 head counts x 4 token counts; nothing else moved
    assert all(" triton " in line for line in listed)
    # a threshold above the injected 20% lets it pass
    assert invoke(a, b, "--threshold", "25%").exit_code == 0
    assert "timed on a CPU" not in res.output  # GPU runs: no drift note
    for run in (a, b):  # the same runs, timed on a CPU: the regression stands, with the note on drift
        meta = json.loads((run / "run.json").read_text())
        (run / "run.json").write_text(json.dumps({**meta, "spec": {**meta["spec"], "device": "cpu"}}))
    res = invoke(a, b, "--threshold", "5%")
    assert res.exit_code == 1 and res.output.strip().splitlines()[-1].startswith("note: timed on a CPU")


def test_new_correctness_failure_is_a_regression(tmp_path):
    rng = np.random.default_rng(0)
    params = {"tokens": 17}
    a = fx.write_run(tmp_path / "a", [fx.case("kda.gate", "triton", params, samples=fx.draw(rng, 5.0))])
    b = fx.write_run(tmp_path / "b", [fx.case("kda.gate", "triton", params, status="crash", error="signal 11")],
                     run_id="run-b")
    res = invoke(a, b)
    assert res.exit_code == 1
    assert "broken" in res.output and "signal 11" in res.output


def test_different_device_is_refused_unless_allowed(tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b", fingerprint_id="fp-b200",
                        device={**fx.H200, "name": "NVIDIA B200"})
    res = invoke(a, b)
    assert res.exit_code == 2
    assert len(res.output.strip().splitlines()) == 1 and "--allow-different-device" in res.output
    assert invoke(a, b, "--allow-different-device").exit_code == 0


def test_runs_with_no_case_in_common_are_a_usage_error_naming_their_ops(tmp_path):
    rng = np.random.default_rng(0)
    a = fx.write_run(tmp_path / "a", [fx.case("kda.gate", "triton", {"tokens": t}, samples=fx.draw(rng, 5.0))
                                      for t in (1, 17)])
    b = fx.write_run(tmp_path / "b", [fx.case("moe.router", "triton", {"tokens": 17}, samples=fx.draw(rng, 5.0))],
                     run_id="run-b")
    res = invoke(a, b)
    assert res.exit_code == 2 and "REGRESSED" not in res.output
    (line,) = res.output.strip().splitlines()
    assert "no case in common" in line and "kda.gate" in line and "moe.router" in line
    c = fx.write_run(tmp_path / "c", [fx.case("kda.gate", "triton", {"tokens": 1}, samples=fx.draw(rng, 5.0))],
                     run_id="run-c")  # one case in common: compared, and the other is missing
    res = invoke(a, c)
    assert res.exit_code == 1 and "2 cases, 1 in both runs: 1 missing, 1 same" in res.output


def test_report_across_devices_warns_on_stderr(tmp_path):
    from spark_bench.report.cli import report

    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b", fingerprint_id="fp-b200",
                        device={**fx.H200, "name": "NVIDIA B200"})
    res = CliRunner().invoke(report, [str(a), str(b), "-o", str(tmp_path / "r.html")], catch_exceptions=False)
    assert res.exit_code == 0
    (warning,) = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert f"{b} was measured on another machine than {a}" in warning and "NVIDIA B200" in warning
    same = CliRunner().invoke(report, [str(a), str(a), "-o", str(tmp_path / "s.html")], catch_exceptions=False)
    assert same.exit_code == 0 and "warning" not in same.stderr


@pytest.mark.parametrize("breakage", ["missing", "not_json", "bad_line", "other_schema"])
def test_usage_errors_exit_2_with_one_line(tmp_path, breakage):
    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b")
    if breakage == "missing":
        b = tmp_path / "nope"
    elif breakage == "not_json":
        (b / "run.json").write_text("{not json")
    elif breakage == "bad_line":
        lines = (b / "results.jsonl").read_text().splitlines()
        lines[3] = "{garbage"
        (b / "results.jsonl").write_text("\n".join(lines) + "\n")
    else:
        run = json.loads((b / "run.json").read_text())
        (b / "run.json").write_text(json.dumps({**run, "schema_version": 99}))
    res = invoke(a, b)
    assert res.exit_code == 2
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_bad_threshold_is_a_usage_error(tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0)
    res = invoke(a, a, "--threshold", "lots")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1


def test_html_writes_the_comparison_report(tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b", commit="9b8c7d6e5f", scale={"torch": 0.8})
    out = tmp_path / "cmp.html"
    res = invoke(a, b, "--html", out, "--metric", "min")
    assert res.exit_code == 0, res.output  # torch got faster: not a regression
    assert "faster" in res.output
    text = out.read_text()
    assert 'id="compare"' in text and "9b8c7d6e vs 3f2a1c9d" in text
    assert "verdicts on the min" in text and "±5% minimum effect" in text


def test_html_names_the_compared_metric_and_plots_its_ratio(tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b", commit="9b8c7d6e5f", scale={"torch": 0.8})
    out = tmp_path / "cmp.html"
    assert invoke(a, b, "--html", out, "--metric", "p90").exit_code == 0
    text = out.read_text()
    table = json.loads(text.split('id="sb-data">', 1)[1].split("</script>", 1)[0])["tables"]["comparison"]
    names = [c["name"] if isinstance(c, dict) else c for c in table["columns"]]
    assert "base_p90_us" in str(names) and "median" not in str(names)
    i_base, i_new, i_ratio = (next(i for i, c in enumerate(table["columns"]) if key in json.dumps(c))
                              for key in ("base_p90", "new_p90", '"ratio"'))
    for row in table["rows"]:
        if row[i_base] and row[i_new] and row[i_ratio]:
            assert row[i_ratio] == pytest.approx(row[i_new] / row[i_base], rel=1e-6)
    assert "Ratio to 3f2a1c9d (p90 time, " in text and "(median time, " not in text  # the ratio chart's title


def test_the_console_says_why_a_verdict_is_what_it_is(tmp_path):
    rng = np.random.default_rng(0)
    a = fx.write_run(tmp_path / "a", [fx.case("kda.gate", "triton", {"tokens": 3}, samples=fx.draw(rng, 45.0))])
    slow = fx.case("kda.gate", "triton", {"tokens": 3}, samples=fx.draw(rng, 60.0))
    slow["timing"]["timer"] = "cuda-graph"
    b = fx.write_run(tmp_path / "b", [slow], run_id="run-b")
    res = invoke(a, b)
    assert res.exit_code == 1
    table_row = next(line for line in res.stdout.splitlines() if "kda.gate triton" in line)
    assert "timer cuda-event" in table_row  # the note column
    (listed,) = [line for line in res.stderr.splitlines() if line.startswith("  kda.gate")]
    assert "slower" in listed and "not timed alike" in listed


def test_html_verdicts_use_the_gates_threshold(tmp_path):
    """The page and the exit code give the same verdicts: a 20% speedup is `same` under a 30% threshold."""
    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b", commit="9b8c7d6e5f", scale={"torch": 0.8})
    out = tmp_path / "cmp.html"
    for threshold, faster in (("30%", False), ("5%", True)):
        assert invoke(a, b, "--html", out, "--threshold", threshold).exit_code == 0
        text = out.read_text()
        assert f"±{threshold} minimum effect" in text
        assert ('"faster"' in text.split('"comparison"', 1)[1]) is faster


def test_op_and_backend_select_what_is_gated(tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b", scale={"triton": 1.2}, ops=("kda.gate",))
    res = invoke(a, b, "--op", "moe.*")  # moe.experts is missing from b: a gate of it fails
    assert res.exit_code == 1 and "missing" in res.output
    res = invoke(a, b, "--op", "kda.*", "--backend", "torch*")  # triton's regression is outside the selection
    assert res.exit_code == 0, res.output
    res = invoke(a, b, "--op", "kda.gate", "--backend", "triton")
    listed = [line for line in res.output.splitlines() if line.startswith("  ") and "slower" in line]
    assert res.exit_code == 1 and len(listed) == 8 and all(" kda.gate triton " in line for line in listed)
    res = invoke(a, b, "--op", "quant.*")
    assert res.exit_code == 2 and "no case matches --op quant.*; the run has: kda.gate, moe.experts" in res.output


def test_geomean_per_op_and_backend_summarises_the_change(tmp_path):
    a = fx.standard_run(tmp_path / "a", seed=0)
    b = fx.standard_run(tmp_path / "b", seed=1, run_id="run-b", scale={"triton": 1.2})
    res = invoke(a, b)
    rows = {tuple(c.strip() for c in line.strip("│ ").split("│")[:2]): [c.strip() for c in line.strip("│ ").split("│")]
            for line in res.output.splitlines() if line.startswith("│ kda.gate") or line.startswith("│ moe.experts")}
    for op in ("kda.gate", "moe.experts"):
        _, _, cases, geomean, slower, _ = rows[(op, "triton")]
        assert cases == "8" and float(geomean.rstrip("x")) == pytest.approx(1.2, abs=0.03) and slower == "8"
        assert float(rows[(op, "torch")][3].rstrip("x")) == pytest.approx(1.0, abs=0.03)
    order = [key for key in rows]
    assert order.index(("kda.gate", "triton")) < order.index(("kda.gate", "torch"))  # worst first


def test_stored_cis_without_samples_judge_by_overlap():
    """Without raw samples the verdict is the stored CIs' overlap: overlapping is noisy whatever the ratio (a
    mutation audit turned the test into 'always separated' unseen)."""
    base = {"median": 10.0, "ci_low": 5.0, "ci_high": 20.0}
    assert timing_verdict(base, {"median": 13.0, "ci_low": 6.0, "ci_high": 26.0}, 0.1).verdict == "noisy"
    assert timing_verdict(base, {"median": 40.0, "ci_low": 30.0, "ci_high": 50.0}, 0.1).verdict == "slower"
    assert timing_verdict(base, {"median": 3.0, "ci_low": 2.0, "ci_high": 4.0}, 0.1).verdict == "faster"
