"""The Ray executor on a local Ray instance (CPU only, loopback): the same cases and statuses as the local executor,
crashing workers and a lost actor become `crash` records, and an interrupted sweep resumes."""

import os
import signal
import sys

import pytest
from conftest import TESTS

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'spark-bench[ray]')")

from spark_bench import results  # noqa: E402
from spark_bench.executors.local import LocalExecutor  # noqa: E402
from spark_bench.executors.ray import RayExecutor  # noqa: E402
from spark_bench.runner import Runner  # noqa: E402
from spark_bench.sweep import Case  # noqa: E402
from spark_bench.timing import TimingConfig  # noqa: E402

FAST = TimingConfig(warmup_s=0.0, min_samples=2, max_samples=2, min_time_s=0.0, max_time_s=0.0, target_rel_ci=0.5)
EXPECTED = {"good": "ok", "raises": "error", "wrong": "mismatch", "segfault": "crash", "slow": "ok"}
CASES = ([Case("fault.scale", b, {"rows": 3, "cols": 5}, "fp32", "cpu", 0) for b in EXPECTED]
         + [Case("fault.scale", b, {"rows": 5, "cols": 5}, "fp32", "cpu", 0) for b in ("good", "raises", "slow")])


class Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module (start-up is slow), whose workers load the fault plugin."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS / "plugins"), os.environ.get("PYTHONPATH")])),
           "SPARK_BENCH_PLUGINS": "fault_plugin", "FAULT_SLOW_S": "2", "RAY_USAGE_STATS_ENABLED": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.path.insert(0, str(TESTS / "plugins"))  # for the local executor's workers, which get this sys.path
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray
    ray.shutdown()
    sys.path.remove(str(TESTS / "plugins"))
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _runner(store, executor, on_result=None):
    return Runner(store, FAST, timeout_s=60, device="cpu", executor=executor, on_result=on_result)


def test_ray_sweep_survives_crashes_a_lost_actor_and_resumes(tmp_path, local_ray):
    store = results.RunStore(tmp_path / "ray")
    store.create({"run_id": "ray"})
    executor, killed = RayExecutor(), []

    def kill_then_interrupt(case, record):
        if not killed:
            # only an actor holding the slow case (FAULT_SLOW_S): one holding only fast cases can have finished
            # them all before the signal lands on a loaded machine, and then no case is lost with it. Each actor
            # takes a point's cases in order (slow last, depth 2), so this kills after a few results.
            holding = [n for n, calls in executor.calls.items() if any(c.backend == "slow" for _ref, c in calls)]
            if not holding:
                return
            holding.sort(key=lambda n: executor.calls[n][0][1].backend != "slow")  # running it first
            os.kill(executor.actor_info()[holding[0]]["pid"], signal.SIGKILL)  # as if its node were lost
            killed.append(f"ray-{holding[0]}")
        elif record.get("phase") == "ray-actor":  # the lost case is journaled: stop there
            raise Interrupted  # as a Ctrl-C of the driver would

    with pytest.raises(Interrupted):
        _runner(store, executor, kill_then_interrupt).run(CASES)
    first = [r["case_id"] for r in store.read_results()]
    assert 0 < len(first) < len(CASES), first  # the resume has work left (the other actor's slow case at least)
    _runner(store, RayExecutor(max_actors=1)).run(CASES)  # --resume
    records = store.read_results()
    assert [r["case_id"] for r in records][:len(first)] == first  # what was journaled stays, nothing runs twice
    assert sorted(r["case_id"] for r in records) == sorted(c.case_id for c in CASES)

    lost = [r for r in records if r.get("phase") == "ray-actor"]
    assert len(lost) == 1 and lost[0]["status"] == "crash" and lost[0]["worker"] == killed[0], lost
    assert lost[0]["error"].startswith(f"Ray actor {killed[0]} died")
    ray_status = {r["case_id"]: r["status"] for r in records if r is not lost[0]}
    for rec in records:
        assert rec["executor"] == "ray" and rec["host"] and rec["worker"].startswith("ray-")
        if rec is not lost[0]:
            assert rec["status"] == EXPECTED[rec["backend"]], rec
            if rec["backend"] == "segfault":
                assert "SIG" in rec["error"] and rec["worker_log_tail"]  # the worker died, the actor lived on

    # the local executor on the cases that do not kill their worker (test_runner_faults pins segfault -> crash)
    calm = [c for c in CASES if c.backend != "segfault" and c.case_id != lost[0]["case_id"]]
    local = results.RunStore(tmp_path / "local")
    local.create({"run_id": "local"})
    _runner(local, LocalExecutor()).run(calm)
    assert {r["case_id"]: r["status"] for r in local.read_results()} == {c.case_id: ray_status[c.case_id] for c in calm}
