"""Ctrl-C is the parent's: a worker neither dies of it nor prints a traceback, even while it starts up."""

import json
import os
import signal
import subprocess
import time

from conftest import spark_bench_cmd

from spark_bench.executors.worker_process import Worker

# a sitecustomize that holds each spawned worker in its start-up (where it imports torch) and writes its pid there
HOLD_WORKERS = """import os, sys, time
if "--multiprocessing-fork" in sys.argv:
    open(os.path.join(os.environ["HELD_DIR"], str(os.getpid())), "w").close()
    time.sleep(120)
"""


def _wait_for(predicate, timeout=300.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_worker_ignores_sigint_from_its_start(tmp_path):
    worker = Worker("cpu", tmp_path)
    os.kill(worker.process.pid, signal.SIGINT)  # as the terminal's Ctrl-C while the worker imports torch
    worker.wait_ready()
    os.kill(worker.process.pid, signal.SIGINT)
    worker.stop(grace_s=120)  # the default 10 s was too short for torch's teardown on a machine at load 27
    assert worker.process.exitcode == 0  # it left on the stop message, not killed
    assert "KeyboardInterrupt" not in worker.log_path.read_text()


def test_ctrl_c_while_workers_start_aborts_quietly_and_the_run_resumes(tmp_path):
    out, hook, held = tmp_path / "run", tmp_path / "hook", tmp_path / "held"
    hook.mkdir()
    held.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_WORKERS)
    env = {**os.environ, "HELD_DIR": str(held),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH", "")]))}
    sweep = ["--op", "kda.gate", "--backend", "torch", "--quick", "--device", "cpu", "--no-report"]
    proc = subprocess.Popen(spark_bench_cmd("run", *sweep, "--out", out), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(lambda: (out / "run.json").exists() and any(held.iterdir()))
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground process group
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert f"go on with `spark-bench run --resume {out}`" in err
    pids = [int(p.name) for p in held.iterdir()]
    _wait_for(lambda: all(map(_gone, pids)), timeout=60)  # the parent stopped its workers

    done = subprocess.run(spark_bench_cmd("run", "--resume", out, "--no-report"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert records and all(r["status"] == "ok" for r in records)
    assert len({r["case_id"] for r in records}) == len(records)
