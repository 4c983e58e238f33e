import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU-only CI: Triton kernels run interpreted


@pytest.fixture(scope="session", autouse=True)
def _own_roofline_cache(tmp_path_factory):
    """The tests' runs read and write a roofline cache of their own (this process and the `spark-bench` subprocesses
    it starts), never the user's: peaks calibrated while the suite loads every core are low, and a shared cache
    would serve them to the user's later runs. Seeded with this CPU's entry from a tiny calibration (not a peak), so
    a run never calibrates. Only for the tests of this directory: `pytest --spark-op ...` alone (the regression
    gate, docs/ci.md) does not use this fixture and keeps the user's cache."""
    from spark_bench.telemetry.calibrate import calibrate
    from spark_bench.telemetry.roofline import CACHE_ENV, store

    cache = tmp_path_factory.mktemp("roofline") / "roofline.json"
    tiny = {"copy_bytes": 4 * 2**20, "matmul_n": {"fp32": 96, "bf16": 64, "fp16": 64}, "budget_s": 0.02,
            "warmup_s": 0.005}
    store({**calibrate("cpu", sizes=tiny), "busy": False}, cache)  # under -n 2 it reads busy: not the tests' topic
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(cache)
    yield cache
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before


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


@pytest.fixture
def record_grids(monkeypatch):
    """record_grids(module, "_kernel") -> the list that receives every grid `_kernel` is launched with from then
    on (the launches still run): for tests of a wrapper's grid order."""
    def record(module, name):
        grids, real = [], getattr(module, name)

        class Recorder:
            def __getitem__(self, grid):
                grids.append(grid)
                return real[grid]

        monkeypatch.setattr(module, name, Recorder())
        return grids

    return record
