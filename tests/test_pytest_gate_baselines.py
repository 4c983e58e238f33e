"""The pytest plugin as a CI gate, part 1: bad options and unusable baselines stop the run with one line (exit 4)
instead of a traceback, a silent default, or a pass that compared nothing (spark_bench/pytest_plugin/gate.py)."""

import json

import pytest
import test_pytest_plugin as plugin_tests

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.filterwarnings("ignore::pytest_benchmark.logger.PytestBenchmarkWarning")  # inner sessions'
FAULT = plugin_tests.FAULT
fresh_registry, _loaded_plugins = plugin_tests.fresh_registry, plugin_tests._loaded_plugins  # the shared fixtures
GOOD = [*FAULT, "--spark-backend", "good", "--spark-set", "rows=3", "--spark-max-time", "0.05"]
GATE = ["--benchmark-compare-fail", "median:10%"]


def _one_line_usage_error(result, text):
    err = result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + err
    assert text in err, err
    assert "Traceback" not in err + result.stdout.str() and "INTERNALERROR" not in err
    assert "passed" not in result.stdout.str()  # stopped before any case ran


@pytest.mark.parametrize(("args", "text"), [
    (["--spark-max-time", "-1"], "--spark-max-time must be a finite number of seconds above 0"),
    (["--spark-max-time", "nan"], "--spark-max-time must be a finite number of seconds above 0"),
    (["--spark-min-samples", "0"], "--spark-min-samples must be 1 or more"),
    (["--spark-target-ci", "2"], "--spark-target-ci is a fraction of the median below 1"),
    (["--spark-full"], "--spark-quick and --spark-full contradict each other"),
    (["--spark-backend", ","], "--spark-backend ',' names nothing"),
    (["--spark-dtype", ","], "--spark-dtype ',' names nothing"),
    (["--spark-layer", "3"], "--spark-layer needs --spark-weights"),  # spark-bench's message, our option names
])
def test_bad_options_are_one_line_usage_errors(pytester, fresh_registry, args, text):
    _one_line_usage_error(pytester.runpytest(*GOOD, *args), f"spark-bench: {text}")


def test_a_repeated_set_value_is_one_case_with_its_usual_name(pytester, fresh_registry):
    result = pytester.runpytest(*GOOD, "--spark-set", "rows=3,3", "--co", "-q")  # `run` merges --set the same way
    assert [line for line in result.outlines if line.startswith("spark-bench::")] == [
        "spark-bench::fault.scale[good-fp32-R3-C5]"]


@pytest.fixture
def baseline(pytester, fresh_registry):
    """A real baseline of one case (with its raw samples), to damage."""
    pytester.runpytest(*GOOD, "--benchmark-json", "base.json").assert_outcomes(passed=1)
    return json.loads((pytester.path / "base.json").read_text())


def _damaged(pytester, data, name="damaged.json"):
    (pytester.path / name).write_text(data if isinstance(data, str) else json.dumps(data))
    return name


def test_a_missing_baseline_stops_the_gate_before_it_runs(pytester, fresh_registry):
    for where in ("0007", "nope.json", str(pytester.path / "no" / "such" / "base.json")):
        _one_line_usage_error(pytester.runpytest(*GOOD, f"--benchmark-compare={where}", *GATE),
                              "spark-bench: --benchmark-compare")
    # a path (a .json, or three parts and more: not a run id or a storage-relative name) that is not a file is an
    # error even without a gate; pytest-benchmark alone would match nothing
    for where in ("nope.json", "no/such/base"):
        _one_line_usage_error(pytester.runpytest(*GOOD, f"--benchmark-compare={where}"),
                              f"spark-bench: --benchmark-compare {where}: no such baseline file")


def test_a_malformed_baseline_is_one_line(pytester, baseline):
    text = json.dumps(baseline)

    def bench(**changes):
        data = json.loads(text)
        data["benchmarks"][0].update(changes)
        return data

    null_median = json.loads(text)
    null_median["benchmarks"][0]["stats"]["median"] = None
    no_machine = json.loads(text)
    del no_machine["machine_info"]
    cases = {
        "not a readable JSON file": text[: len(text) // 2],
        "no 'benchmarks' list": "[1, 2]",
        "median not a number": null_median,
        "no 'machine_info' object": no_machine,
        "a benchmark without a 'fullname'": bench(fullname=None),
        "no 'stats' object": bench(stats="fast"),
    }
    for message, data in cases.items():
        _one_line_usage_error(pytester.runpytest(*GOOD, f"--benchmark-compare={_damaged(pytester, data)}", *GATE),
                              message)


def test_a_baseline_without_a_usable_fingerprint_is_not_compared_silently(pytester, baseline):
    text = json.dumps(baseline)
    unreadable, missing = json.loads(text), json.loads(text)
    unreadable["machine_info"]["spark_bench"] = "an H200"
    del missing["machine_info"]["spark_bench"]
    for data, message in ((unreadable, "fingerprint (machine_info.spark_bench) is malformed"),
                          (missing, "holds spark-bench cases but no device fingerprint")):
        name = _damaged(pytester, data)
        warned = pytester.runpytest(*GOOD, f"--benchmark-compare={name}")
        assert warned.ret == 0 and "fingerprint mismatch" in warned.stdout.str() and message in warned.stdout.str()
        failed = pytester.runpytest(*GOOD, f"--benchmark-compare={name}", "--spark-fingerprint-mismatch", "fail")
        _one_line_usage_error(failed, message)


def test_a_gate_that_compared_nothing_fails(pytester, baseline):
    empty = dict(baseline, benchmarks=[])
    renamed = json.loads(json.dumps(baseline))
    renamed["benchmarks"][0]["fullname"] = "spark-bench::fault.scale[good-fp32-R4-C5]"
    for data in (empty, renamed):
        result = pytester.runpytest(*GOOD, f"--benchmark-compare={_damaged(pytester, data)}", *GATE)
        assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
        assert "the baseline holds none of the 1 timed spark-bench case(s)" in result.stdout.str()
    looked = pytester.runpytest(*GOOD, f"--benchmark-compare={_damaged(pytester, empty)}")  # no gate: a look only
    assert looked.ret == 0


def test_a_case_timed_in_the_baseline_and_skipped_now_fails_the_gate(pytester, baseline):
    """A backend that became unavailable (fla-core uninstalled) is not a pass: `spark-bench compare`'s `missing`."""
    gone = json.loads(json.dumps(baseline["benchmarks"][0]))
    gone["fullname"] = "spark-bench::fault.scale[unavailable-fp32-R3-C5]"
    name = _damaged(pytester, dict(baseline, benchmarks=[*baseline["benchmarks"], gone]))
    both = [*GOOD, "--spark-backend", "unavailable", f"--benchmark-compare={name}"]
    result = pytester.runpytest(*both, *GATE)
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "1 case(s) timed in the baseline were skipped in this run" in result.stdout.str()
    assert "fault.scale[unavailable-fp32-R3-C5]: unavailable is unavailable on cpu" in result.stdout.str()
    assert pytester.runpytest(*both).ret == 0  # no gate: a look only
    # a case skipped now that the baseline never timed is no loss: the gate judges the one it holds and passes
    # (against a baseline 1000x slower, so that this machine's load cannot make the case a regression)
    slow = json.loads(json.dumps(baseline))
    stats, info = slow["benchmarks"][0]["stats"], slow["benchmarks"][0]["extra_info"]
    stats.update({k: 1000 * stats[k] for k in ("median", "mean", "min")}, data=[1000 * t for t in stats["data"]])
    info.update(ci_low=1000 * info["ci_low"], ci_high=1000 * info["ci_high"])
    new_only = pytester.runpytest(*GOOD, "--spark-backend", "unavailable",
                                  f"--benchmark-compare={_damaged(pytester, slow, 'base_only.json')}", *GATE)
    new_only.assert_outcomes(passed=1, skipped=1)
    assert new_only.ret == 0, new_only.stdout.str()


def test_a_gate_with_benchmarks_disabled_fails(pytester, baseline):
    """--benchmark-disable (or xdist's -n) times nothing, so pytest-benchmark compares nothing: not a pass."""
    name = _damaged(pytester, baseline, "base_copy.json")
    result = pytester.runpytest(*GOOD, f"--benchmark-compare={name}", *GATE, "--benchmark-disable")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    assert "--benchmark-compare-fail compared nothing: pytest-benchmark is disabled" in result.stdout.str()
    assert pytester.runpytest(*GOOD, f"--benchmark-compare={name}", "--benchmark-disable").ret == 0  # a look only


def test_a_saved_run_keeps_its_raw_samples(pytester, fresh_registry):
    """A later gate on a saved run compares raw samples (Mann-Whitney), not only the stored CIs."""
    pytester.runpytest(*GOOD, "--benchmark-save=base").assert_outcomes(passed=1)
    saved = [json.loads(p.read_text()) for p in pytester.path.glob(".benchmarks/*/0001_base.json")]
    assert len(saved) == 1
    case = saved[0]["benchmarks"][0]
    assert len(case["stats"]["data"]) == case["stats"]["rounds"] >= 3


def test_each_case_keeps_the_baselines_timer(pytester, baseline):
    """`--spark-timer auto` picks graph or events from a probe at 50 us: a case near the line could be timed one way
    in the baseline and the other now, and the gate would set a graph time against an event time. Each case keeps
    the baseline's timer (a GPU baseline's, simulated on this CPU's), and says so (extra_info.timer_kept)."""
    baseline["benchmarks"][0]["extra_info"].update(timer="cuda-graph", calls_per_sample=24)
    name = _damaged(pytester, baseline, "gpu-base.json")
    pytester.runpytest(*GOOD, f"--benchmark-compare={name}", "--benchmark-json", "new.json").assert_outcomes(passed=1)
    [bench] = json.loads((pytester.path / "new.json").read_text())["benchmarks"]
    assert bench["extra_info"]["timer_kept"] == "graph:24"  # the graph at the baseline's calls per replay
    pytester.runpytest(*GOOD, f"--benchmark-compare={name}", "--spark-timer", "events", "--benchmark-json",
                       "pinned.json").assert_outcomes(passed=1)
    [bench] = json.loads((pytester.path / "pinned.json").read_text())["benchmarks"]
    assert "timer_kept" not in bench["extra_info"]  # a timer given on the command line wins
    pytester.runpytest(*GOOD, "--benchmark-json", "alone.json").assert_outcomes(passed=1)
    assert "timer_kept" not in json.loads((pytester.path / "alone.json").read_text())["benchmarks"][0]["extra_info"]
