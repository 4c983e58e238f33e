"""The pytest plugin as a CI gate, part 2: --benchmark-compare-fail judges spark-bench cases with `spark-bench
compare`'s statistics (noise is not a regression, a 2x slowdown is, the timer is named), and a case that breaks fails
the gate with its recorded error. Timings come from sleeps far apart; only verdicts are asserted."""

import json
import statistics
import textwrap
from types import SimpleNamespace

import pytest
import test_pytest_plugin as plugin_tests
from pytest_benchmark.utils import PercentageRegressionCheck

from spark_bench.pytest_plugin.gate import SparkCheck
from spark_bench.pytest_plugin.replay import ReplayTimer

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.filterwarnings("ignore::pytest_benchmark.logger.PytestBenchmarkWarning")  # inner sessions'
FAULT = plugin_tests.FAULT
fresh_registry, _loaded_plugins = plugin_tests.fresh_registry, plugin_tests._loaded_plugins  # the shared fixtures
GATE = ["--benchmark-compare-fail", "median:10%"]
NAME = "spark-bench::op.x[triton-bf16-T1]"


class _Bench(SimpleNamespace):
    """What pytest-benchmark hands a compare-fail check: stats fields by item, the raw samples in stats.data."""

    def __getitem__(self, key):
        return getattr(self.stats, key)


def _stats(samples_s):
    return {"median": statistics.median(samples_s), "mean": statistics.fmean(samples_s), "min": min(samples_s),
            "data": list(samples_s)}


def _verdict(base_s, new_s, base_timer="cuda-event", new_timer="cuda-event", keep_data=True, flush=("2x-L2",) * 2,
             base_median=True):
    """(pytest-benchmark's own median:10% check, the plugin's) on these samples (seconds); `flush`: the two sides'
    l2_flush; `base_median=False`: a baseline entry without a median (a hand-edited or foreign saved run)."""
    base_stats = _stats(base_s) if keep_data else {k: v for k, v in _stats(base_s).items() if k != "data"}
    if not base_median:
        base_stats["median"] = None
    lo, hi = sorted(base_s)[len(base_s) // 4], sorted(base_s)[-len(base_s) // 4]
    base = {"stats": base_stats, "extra_info": {"timer": base_timer, "ci_low": lo * 1e6, "ci_high": hi * 1e6,
                                                "l2_flush": flush[0]}}
    config = SimpleNamespace(_benchmarksession=SimpleNamespace(compared_mapping={"base.json": {NAME: base}}))
    new = sorted(new_s)
    current = _Bench(name=NAME.split("::")[1], fullname=NAME, options={"timer": ReplayTimer()},
                     stats=SimpleNamespace(**_stats(new_s)),
                     extra_info={"timer": new_timer, "ci_low": new[len(new) // 4] * 1e6,
                                 "ci_high": new[-len(new) // 4] * 1e6, "l2_flush": flush[1]})
    compared = {"path": "base.json", "source": "base", **base_stats}
    naive = PercentageRegressionCheck("median", 10)
    return naive.fails(current, compared), SparkCheck(naive, config).judge(current, compared)[1]


def test_noise_is_not_a_regression_but_a_real_slowdown_is():
    us = 1e-6
    bimodal = [10 * us, 30 * us] * 6  # a busy device: every run is a mix of fast and slow calls
    base, new = [*bimodal, 10 * us], [*bimodal, 30 * us]  # medians 10 vs 30 us, the same distribution
    naive, honest = _verdict(base, new)
    assert naive and "PercentageRegressionCheck" in naive  # pytest-benchmark alone would fail the job on this
    assert honest is None

    steady = [(10 + 0.01 * i) * us for i in range(6)]  # quick timing: a handful of samples a side
    naive, honest = _verdict(steady, [2 * s for s in steady])
    assert naive and honest and honest.startswith("median 2.000x the baseline's, slower by more than 10%")
    assert "timer cuda-event" in honest

    _, changed = _verdict(steady, [2 * s for s in steady], new_timer="cuda-graph")
    assert "timer cuda-event -> cuda-graph" in changed and "not timed alike" in changed
    _, flushed = _verdict(steady, [2 * s for s in steady], flush=("2x-L2", "none"))  # a slowdown timed unlike
    assert "l2_flush 2x-L2 -> none" in flushed and "not timed alike" in flushed
    assert "l2_flush" not in _verdict(steady, [2 * s for s in steady])[1]
    _, no_data = _verdict(steady, [2 * s for s in steady], keep_data=False)  # --benchmark-save without its data
    assert no_data and "stored CIs compared" in no_data
    assert _verdict(steady, steady)[1] is None


def test_a_baseline_entry_without_the_field_fails_the_gate_instead_of_passing():
    steady = [(10 + 0.01 * i) * 1e-6 for i in range(6)]
    _, failure = _verdict(steady, steady, base_median=False)
    assert failure == "the baseline has no number for 'median': nothing to compare"


def test_plain_benchmarks_keep_pytest_benchmarks_check():
    current = _Bench(name="test_x", fullname="t.py::test_x", options={"timer": "perf_counter"},
                     stats=SimpleNamespace(median=2.0), extra_info={})
    check = SparkCheck(PercentageRegressionCheck("median", 10), SimpleNamespace())
    assert "PercentageRegressionCheck" in check.fails(current, {"median": 1.0})


def test_a_2x_slowdown_at_quick_timing_fails_the_gate(pytester, fresh_registry, monkeypatch):
    slow = [*FAULT, "--spark-backend", "slow", "--spark-set", "rows=3"]  # --spark-quick timing: a few samples
    monkeypatch.setenv("FAULT_SLOW_S", "0.020")
    pytester.runpytest(*slow, "--benchmark-json", "base.json").assert_outcomes(passed=1)
    info = json.loads((pytester.path / "base.json").read_text())["benchmarks"][0]["extra_info"]
    assert info["ci_low"] <= info["median_us"] <= info["ci_high"]  # the CI a baseline without raw samples needs

    monkeypatch.setenv("FAULT_SLOW_S", "0.005")  # 4x faster, not the same sleep: noise under load never fails it
    faster = pytester.runpytest(*slow, "--benchmark-compare=base.json", *GATE)
    assert faster.ret == 0, faster.stdout.str()
    assert "as `spark-bench compare`" in faster.stdout.str()

    monkeypatch.setenv("FAULT_SLOW_S", "0.040")
    slower = pytester.runpytest(*slow, "--benchmark-compare=base.json", *GATE)
    out = slower.stdout.str()
    assert slower.ret == pytest.ExitCode.TESTS_FAILED, out  # not pytest-benchmark's exception and its traceback
    assert "Traceback" not in out + slower.stderr.str()
    assert "Performance has regressed (1 case(s))" in out and "1 slower" in out
    assert "fault.scale[slow-fp32-R3-C5] vs base: median " in out
    assert "the baseline's, slower by more than 10%" in out and "timer cpu-perf_counter" in out


PLUGIN = textwrap.dedent("""
    import os
    from spark_bench import Axis, Cost, Op, Tolerance
    from spark_bench.inputs import generator, randn

    op = Op(name="gate.scale", reference=lambda x: 2 * x.double(), dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)},
            make_inputs_fn=lambda p, *, device, dtype, seed: {
                "x": randn((p["rows"], 5), generator(device, seed), dtype=dtype, device=device)},
            axes=[Axis("rows", [64], quick=[3])], cost=lambda p, dtype: Cost(flops=5 * p["rows"], bytes=40 * p["rows"]))

    @op.backend("kernel")
    def kernel(x):
        mode = os.environ.get("GATE_MODE", "ok")
        if mode == "raises":
            raise RuntimeError("the kernel broke in this change")
        return (2.5 if mode == "wrong" else 2) * x
""")


def test_a_case_that_breaks_fails_the_gate_with_its_error(pytester, fresh_registry, monkeypatch):
    pytester.makepyfile(gate_plugin=PLUGIN)
    monkeypatch.syspath_prepend(str(pytester.path))
    monkeypatch.setenv("SPARK_BENCH_PLUGINS", "gate_plugin")
    case = ["--spark-op", "gate.scale", "--spark-quick", "--spark-max-time", "0.05", "-p", "no:cacheprovider"]
    pytester.runpytest(*case, "--benchmark-json", "base.json").assert_outcomes(passed=1)
    for mode, error in (("wrong", "does not match the reference: output 0: error ratio 0.25"),
                        ("raises", "the kernel broke in this change")):
        monkeypatch.setenv("GATE_MODE", mode)
        result = pytester.runpytest(*case, "--benchmark-compare=base.json", *GATE)
        result.assert_outcomes(failed=1)
        assert "gate.scale[kernel-fp32-R3]" in result.stdout.str() and error in result.stdout.str()


def test_a_clear_speedup_passes_the_gate():
    """A gate that failed on `faster` as well as `slower` passed every test above (found by a mutation audit)."""
    steady = [(10 + 0.01 * i) * 1e-6 for i in range(12)]
    naive, honest = _verdict(steady, [s / 2 for s in steady])
    assert not naive  # pytest-benchmark's own check passes a speedup too
    assert honest is None
