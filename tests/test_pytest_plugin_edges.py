"""The pytest plugin in inner sessions, at its edges: the tests named beside --spark-op, plugin load errors, where a
skipped case points, why a selection has no case, a user's benchmark marker under the fixture, fingerprints of plain
runs (found by a mutation audit of the plugin)."""

import json
import textwrap

import pytest
import test_pytest_plugin as plugin_tests
from test_pytest_gate_baselines import _one_line_usage_error

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.filterwarnings("ignore::pytest_benchmark.logger.PytestBenchmarkWarning")  # inner sessions'
fresh_registry, _loaded_plugins = plugin_tests.fresh_registry, plugin_tests._loaded_plugins  # the shared fixtures
GOOD = [*plugin_tests.FAULT, "--spark-backend", "good", "--spark-set", "rows=3"]


def test_tests_named_beside_spark_op_still_run(pytester, fresh_registry):
    pytester.makepyfile(test_mine="def test_mine():\n    pass\n")
    result = pytester.runpytest(*GOOD, "test_mine.py", "--co", "-q")
    assert result.ret == 0
    assert {"test_mine.py::test_mine", "spark-bench::fault.scale[good-fp32-R3-C5]"} <= set(result.outlines)


def test_the_header_names_a_plugin_that_failed_and_a_skip_points_at_the_op(pytester, fresh_registry, monkeypatch):
    monkeypatch.setenv("SPARK_BENCH_PLUGINS", "fault_plugin,no_such_plugin_module")
    result = pytester.runpytest(*GOOD, "--spark-backend", "unavailable", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    out = result.stdout.str()
    assert "spark-bench: plugin no_such_plugin_module failed to load: ModuleNotFoundError" in out
    skip = next(line for line in result.outlines if line.startswith("SKIPPED"))
    assert "fault_plugin.py" in skip and "unavailable is unavailable on cpu" in skip  # the op's file, not ours


def test_the_fixture_keeps_the_users_benchmark_marker(pytester, fresh_registry):
    pytester.makepyfile(test_grouped=textwrap.dedent("""
        import pytest
        import torch

        @pytest.mark.benchmark(group="mine")
        def test_grouped(spark_bench):
            spark_bench(torch.neg, torch.ones(8))
    """))
    result = pytester.runpytest("--spark-quick", "--benchmark-json", "out.json", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    [bench] = json.loads((pytester.path / "out.json").read_text())["benchmarks"]
    assert bench["group"] == "mine" and bench["options"]["timer"] == "spark_bench.cpu-perf_counter"


def test_a_plain_run_warned_of_another_fingerprint_says_so_first_and_records_its_own(pytester, fresh_registry):
    """A plain benchmark compared with a spark-bench baseline of another device: the warning heads the output, and
    the run's JSON carries this device's fingerprint, so that the next comparison can tell them apart too."""
    pytester.runpytest(*GOOD, "--benchmark-json", "base.json").assert_outcomes(passed=1)
    data = json.loads((pytester.path / "base.json").read_text())
    data["machine_info"]["spark_bench"].update(fingerprint_id="0123456789abcdef")
    (pytester.path / "base.json").write_text(json.dumps(data))
    pytester.makepyfile(test_plain=plugin_tests.PLAIN)
    result = pytester.runpytest("test_plain.py", "--benchmark-compare=base.json", "--benchmark-json", "out.json",
                                "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    header = result.outlines[:result.outlines.index("collected 1 item")]
    assert any(line.startswith("spark-bench: WARNING: the baseline was measured on another device") for line in header)
    out = json.loads((pytester.path / "out.json").read_text())
    assert out["machine_info"]["spark_bench"]["fingerprint_id"] != "0123456789abcdef"


def test_spark_device_alone_switches_the_plugin_on(pytester, fresh_registry):
    """--spark-device is a --spark-* option: plain benchmarks then carry the fingerprint, and a missing baseline file
    is refused as in any spark-bench session."""
    pytester.makepyfile(test_plain=plugin_tests.PLAIN)
    args = ["test_plain.py", "--spark-device", "cpu", "-p", "no:cacheprovider"]
    pytester.runpytest(*args, "--benchmark-json", "out.json").assert_outcomes(passed=1)
    machine = json.loads((pytester.path / "out.json").read_text())["machine_info"]
    assert machine["spark_bench"]["device"]["type"] == "cpu"
    missing = pytester.runpytest(*args, "--benchmark-compare=nope.json")
    assert missing.ret == pytest.ExitCode.USAGE_ERROR
    assert "spark-bench: --benchmark-compare nope.json: no such baseline file" in missing.stderr.str()


def test_a_selection_without_cases_says_why(pytester, fresh_registry):
    """As `spark-bench run`: the values the user set excluded every point, and which constraint did."""
    result = pytester.runpytest("--spark-op", "moe.router", "--spark-backend", "torch", "--spark-quick",
                                "--spark-set", "topk=99", "--co")
    _one_line_usage_error(result, "spark-bench: the selection has no cases (no backend or parameter point matches); "
                                  "moe.router: 12 of 12 parameter points excluded (topk 99 exceeds the 16 experts")
