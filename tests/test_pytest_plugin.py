"""The pytest plugin: spark-bench cases collected as pytest-benchmark tests, the `spark_bench` fixture, fingerprints.

Inner pytest sessions run in this process (pytester.runpytest) against a fresh registry that also loads the fault
plugin (tests/plugins/fault_plugin.py); only its well-behaved backends (good, slow, wrong, raises, unavailable) run
here, never the segfault/abort/hang ones. torch and the built-in plugins are imported before pytester snapshots
sys.modules, so inner sessions reuse them.
"""

import importlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch  # noqa: F401 - imported before pytester's sys.modules snapshot
from conftest import TESTS

from spark_bench.sweep import SweepSpec, build_cases

pytest_plugins = ["pytester"]
registry_module = importlib.import_module("spark_bench.registry")  # the package's `registry` attribute is the function
PLAIN = "\n\ndef test_plain(benchmark):\n    benchmark.pedantic(sum, args=(range(10),), rounds=3)\n"
FAULT = ["--spark-op", "fault.scale", "--spark-quick", "-p", "no:cacheprovider"]


@pytest.fixture(scope="module", autouse=True)
def _loaded_plugins():
    registry_module.registry()  # the built-in op modules (and triton, fla) stay imported across inner sessions


@pytest.fixture
def fresh_registry(monkeypatch):
    """Every inner session discovers the registry again, with the fault plugin."""
    monkeypatch.setattr(registry_module, "_REGISTRY", None)
    monkeypatch.syspath_prepend(str(TESTS / "plugins"))
    monkeypatch.setenv("SPARK_BENCH_PLUGINS", "fault_plugin")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _json(path):
    return json.loads(path.read_text())


def test_plugin_import_is_cheap():
    code = ("import sys, spark_bench.pytest_plugin; heavy = [m for m in ('torch', 'triton', 'numpy') "
            "if m in sys.modules]; assert not heavy, heavy; assert registry_module._REGISTRY is None")
    code = code.replace("registry_module", "sys.modules['spark_bench.registry']")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_inert_without_its_options(pytester, fresh_registry):
    pytester.makepyfile(test_plain=PLAIN)
    result = pytester.runpytest("--benchmark-json", "plain.json", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "spark-bench:" not in result.stdout.str()
    data = _json(pytester.path / "plain.json")
    assert "spark_bench" not in data["machine_info"]
    assert data["benchmarks"][0]["options"]["timer"] == "perf_counter"
    assert registry_module._REGISTRY is None  # the registry was never loaded


def test_collects_registry_cases_with_readable_ids(pytester, fresh_registry):
    pytester.makepyfile(test_other="def test_not_collected():\n    assert False\n")
    result = pytester.runpytest("--spark-op", "*", "--spark-quick", "--co", "-q")  # every op, every backend
    assert result.ret == 0
    ids = [line for line in result.outlines if line.startswith("spark-bench::")]
    assert "spark-bench::kda.gate[torch-bf16-T67-H4-Dh128]" in ids
    assert "spark-bench::fault.scale[good-fp32-R17-C5]" in ids
    expected = build_cases(registry_module.registry(), SweepSpec(ops=["*"], quick=True))
    assert len(ids) == len(set(ids)) == len(expected)
    assert "test_not_collected" not in result.stdout.str()  # --spark-op alone runs the cases only

    selected = pytester.runpytest(*FAULT, "--spark-backend", "good,wrong", "-k", "good and R3", "--co", "-q")
    assert [line for line in selected.outlines if line.startswith("spark-bench::")] == [
        "spark-bench::fault.scale[good-fp32-R3-C5]"]

    bad = pytester.runpytest("--spark-op", "no.such_op", "-q")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    assert "no op matches 'no.such_op'" in bad.stderr.str()


def test_mismatch_fails_and_json_carries_metrics_and_fingerprint(pytester, fresh_registry):
    result = pytester.runpytest(*FAULT, "--spark-backend", "good,wrong,raises,unavailable", "--spark-device", "cpu",
                                "--benchmark-json", "out.json", "-rs")
    result.assert_outcomes(passed=2, failed=4, skipped=2)
    out = result.stdout.str()
    assert "fault.scale[wrong-fp32-R3-C5]" in out and "does not match the reference" in out
    assert "error ratio 0.25 > 1e-06" in out and "err_ratio=0.25" in out
    assert "deliberate failure in the backend" in out
    assert "unavailable is unavailable on cpu: needs a device nobody has" in out
    assert "fixture was not used" not in out

    data = _json(pytester.path / "out.json")
    fp = data["machine_info"]["spark_bench"]
    assert fp["fingerprint_id"] and fp["device"]["type"] == "cpu" and fp["versions"]["torch"] == torch.__version__
    benches = {b["name"]: b for b in data["benchmarks"]}
    assert sorted(benches) == ["fault.scale[good-fp32-R17-C5]", "fault.scale[good-fp32-R3-C5]"]  # failures left out
    bench = benches["fault.scale[good-fp32-R3-C5]"]
    info, stats = bench["extra_info"], bench["stats"]
    assert bench["fullname"] == "spark-bench::fault.scale[good-fp32-R3-C5]"
    assert bench["group"] == "fault.scale[fp32-R3-C5]"
    assert bench["options"]["timer"] == "spark_bench.cpu-perf_counter"
    assert info["op"] == "fault.scale" and info["backend"] == "good" and info["dtype"] == "fp32"
    assert info["params"] == {"rows": 3, "cols": 5} and info["timer"] == "cpu-perf_counter"
    assert info["fingerprint_id"] == fp["fingerprint_id"]
    assert info["check"]["ok"] and info["check"]["err_ratio"] == 0.0
    assert info["cost"] == {"flops": 15, "bytes": 120, "tokens": None}
    assert info["gbps"] == pytest.approx(120 / (info["median_us"] * 1e-6) / 1e9)
    assert info["tflops"] == pytest.approx(15 / (info["median_us"] * 1e-6) / 1e12)
    assert stats["rounds"] == info["samples"] == len(stats["data"]) >= 3  # our samples, in seconds
    assert stats["median"] == pytest.approx(info["median_us"] * 1e-6, rel=1e-4)


@pytest.mark.filterwarnings("ignore:Benchmark machine_info is different")  # the doctored baseline, on purpose
def test_compare_fail_catches_a_slowdown(pytester, fresh_registry, monkeypatch):
    slow = [*FAULT, "--spark-backend", "slow", "--spark-set", "rows=3", "--spark-min-samples", "12",
            "--spark-max-time", "2"]
    monkeypatch.setenv("FAULT_SLOW_S", "0.050")  # sleeps far apart (5x, 2x): only verdicts, never close timings
    pytester.runpytest(*slow, "--benchmark-save", "base").assert_outcomes(passed=1)
    compare = ["--benchmark-compare", "0001", "--benchmark-compare-fail", "median:10%"]

    monkeypatch.setenv("FAULT_SLOW_S", "0.010")  # faster, not the same sleep: a loaded machine's oversleeping is
    faster = pytester.runpytest(*slow, *compare)  # a few ms per call, which a same-vs-same check cannot absorb at 10%
    assert faster.ret == 0, faster.stdout.str() + faster.stderr.str()

    monkeypatch.setenv("FAULT_SLOW_S", "0.100")  # a 2x slowdown
    slower = pytester.runpytest(*slow, *compare)
    assert slower.ret == pytest.ExitCode.TESTS_FAILED, slower.stdout.str()
    assert "Performance has regressed" in slower.stdout.str() and "Traceback" not in slower.stderr.str()
    assert "fault.scale[slow-fp32-R3-C5] vs 0001_base: median " in slower.stdout.str()

    # A baseline from another device fingerprint: a loud warning by default, an error on request.
    saved = next((pytester.path / ".benchmarks").glob("*/0001_base.json"))
    data = _json(saved)
    data["machine_info"]["spark_bench"].update(fingerprint_id="0123456789abcdef")
    data["machine_info"]["spark_bench"]["device"].update(type="cuda", name="NVIDIA H200")
    saved.write_text(json.dumps(data))
    monkeypatch.setenv("FAULT_SLOW_S", "0.050")
    warned = pytester.runpytest(*slow, "--benchmark-compare", "0001")
    assert warned.ret == 0
    assert "fingerprint mismatch" in warned.stdout.str()
    assert "name 'NVIDIA H200' -> " in warned.stdout.str()
    failed = pytester.runpytest(*slow, "--benchmark-compare", "0001", "--spark-fingerprint-mismatch", "fail")
    assert failed.ret == pytest.ExitCode.USAGE_ERROR
    assert "another device fingerprint" in failed.stderr.str()
    # a gate refuses another fingerprint by default, as `spark-bench compare` does; =warn compares anyway
    gate = pytester.runpytest(*slow, *compare)
    assert gate.ret == pytest.ExitCode.USAGE_ERROR and "another device fingerprint" in gate.stderr.str()
    assert pytester.runpytest(*slow, *compare, "--spark-fingerprint-mismatch", "warn").ret == 0


def test_fixture_times_a_custom_callable(pytester, fresh_registry):
    pytester.makepyfile(test_custom=textwrap.dedent("""
        import torch

        def double(x):
            return 2 * x

        def test_ok(spark_bench):
            x = torch.randn(64, 48)
            out = spark_bench(double, x, reference=lambda x: 2 * x.double(), nbytes=2 * x.nbytes, flops=x.numel())
            assert torch.equal(out, 2 * x)

        def test_wrong(spark_bench):
            x = torch.randn(64, 48)
            spark_bench(lambda x: 2.5 * x, x, reference=lambda x: 2 * x.double())

    """) + PLAIN)
    result = pytester.runpytest("--spark-quick", "--benchmark-json", "out.json", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    assert "does not match the reference" in out and "error ratio 0.25" in out
    assert "fixture was not used" not in out
    data = _json(pytester.path / "out.json")
    assert data["machine_info"]["spark_bench"]["fingerprint_id"]
    benches = {b["name"]: b for b in data["benchmarks"]}
    assert sorted(benches) == ["test_ok", "test_plain"]
    ok = benches["test_ok"]
    assert ok["options"]["timer"] == "spark_bench.cpu-perf_counter"
    assert ok["extra_info"]["check"]["ok"] and ok["extra_info"]["device"] == "cpu"
    assert ok["extra_info"]["gbps"] == pytest.approx(2 * 64 * 48 * 4 / (ok["extra_info"]["median_us"] * 1e-6) / 1e9)
    assert ok["stats"]["rounds"] == ok["extra_info"]["samples"]
    assert benches["test_plain"]["options"]["timer"] == "perf_counter"  # plain benchmarks keep their own timer
