import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU-only CI: Triton kernels run interpreted
# The tests' runs read and write their own roofline cache (this process and the `spark-bench` subprocesses it
# starts), never the user's: peaks calibrated while the suite loads every core are low, and a shared cache would serve
# them to the user's later runs.
ROOFLINE_CACHE = Path(tempfile.mkdtemp(prefix="spark-bench-tests-")) / "roofline.json"
os.environ["SPARK_BENCH_ROOFLINE_CACHE"] = str(ROOFLINE_CACHE)


@pytest.fixture(scope="session", autouse=True)
def _seeded_roofline_cache():
    """This CPU's entry in the tests' cache, from a tiny calibration (not a peak): a run then never calibrates."""
    from spark_bench.telemetry.calibrate import calibrate
    from spark_bench.telemetry.roofline import store

    tiny = {"copy_bytes": 4 * 2**20, "matmul_n": {"fp32": 96, "bf16": 64, "fp16": 64}, "budget_s": 0.02,
            "warmup_s": 0.005}
    store({**calibrate("cpu", sizes=tiny), "busy": False}, ROOFLINE_CACHE)
    yield
    shutil.rmtree(ROOFLINE_CACHE.parent, ignore_errors=True)


@pytest.fixture
def fault_env(monkeypatch):
    """Environment in which `spark-bench` subprocesses load the fault-injection test plugin."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS / "plugins"), env.get("PYTHONPATH", "")]))
    env["SPARK_BENCH_PLUGINS"] = "fault_plugin"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def spark_bench_cmd(*args):
    return [sys.executable, "-m", "spark_bench", *map(str, args)]


def run_cli(*args):
    """`spark-bench ARGS` in this process (click's runner): (exit code, stdout, stderr)."""
    from click.testing import CliRunner

    from spark_bench.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def hostile_env(fault_env, tmp_path):
    """Like fault_env, with the hostile test plugin (tests/plugins/hostile_plugin.py) loaded too; the pids of the
    processes its backends start are written under tmp_path/hostile."""
    (tmp_path / "hostile").mkdir()
    return {**fault_env, "SPARK_BENCH_PLUGINS": "fault_plugin,hostile_plugin", "HOSTILE_DIR": str(tmp_path / "hostile")}


@pytest.fixture(autouse=True)
def _inner_pytest_is_not_an_xdist_worker(request, monkeypatch):
    """Under `-n 2` this process is an xdist worker: the pytest sessions a test runs with `pytester` inherit its
    PYTEST_XDIST_* variables, and pytest-benchmark then believes *they* are distributed and disables itself."""
    if "pytester" in request.fixturenames:
        for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
            monkeypatch.delenv(name, raising=False)
