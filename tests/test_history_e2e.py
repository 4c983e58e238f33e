"""`spark-bench run --history DB` and `spark-bench history ...` on real runs (the sleep-based test backend)."""

import json
import subprocess

from conftest import spark_bench_cmd

SWEEP = ["--op", "fault.scale", "--backend", "slow", "--backend", "good", "--quick", "--min-samples", "5",
         "--max-time", "0.5", "--no-report"]


def cli(env, *args, timeout=600):
    return subprocess.run(spark_bench_cmd(*args), env=env, capture_output=True, text=True, timeout=timeout)


def test_run_with_history_then_query(tmp_path, fault_env):
    db = tmp_path / "history.db"
    env = {**fault_env, "FAULT_SLOW_S": "0.002"}
    for name in ("a", "b"):
        proc = cli(env, "run", *SWEEP, "--out", tmp_path / name, "--history", db)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"history {db}: 1 added" in proc.stdout
    again = cli(env, "history", "add", "--db", db, tmp_path / "a", tmp_path / "b")
    assert again.returncode == 0 and "0 added, 0 replaced, 2 unchanged" in again.stdout, again.stdout + again.stderr
    listed = cli(env, "history", "list", "--db", db, "--runs", "--json")
    runs = json.loads(listed.stdout)
    assert sorted(r["run_id"] for r in runs) == ["a", "b"] and {r["cases"] for r in runs} == {4}
    assert all(r["commit"] for r in runs)  # this checkout's commit, from the run's fingerprint
    trend = cli(env, "history", "trend", "--db", db, "--op", "fault.scale", "--backend", "slow", "--set", "rows=17",
                "--json")
    assert trend.returncode == 0, trend.stderr
    (series,) = json.loads(trend.stdout)
    assert sum(len(p["runs"]) for p in series["points"]) == 2 and series["unit"] == "us"
    assert all(p["median"] > 1500 for p in series["points"])  # a 2 ms sleep per call
    check = cli(env, "history", "check", "--db", db, "--since", "2000-01-01")
    assert check.returncode == 0, check.stdout + check.stderr
    proc = cli(env, "run", *SWEEP, "--out", tmp_path / "again" / "a", "--history", db)  # another run named a
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"history {db}: 1 added (stored as a@" in proc.stdout and "another run of that name" in proc.stdout
    runs = json.loads(cli(env, "history", "list", "--db", db, "--runs", "--json").stdout)
    assert len(runs) == 3 and sum(r["run_id"].startswith("a@") for r in runs) == 1


def test_run_with_a_foreign_history_fails_before_the_sweep(tmp_path, fault_env):
    bad = tmp_path / "not.db"
    bad.write_text("this is not a database, just text\n" * 100)
    proc = cli(fault_env, "run", *SWEEP, "--out", tmp_path / "run", "--history", bad)
    assert proc.returncode == 2 and "not a spark-bench history database" in proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "run").exists()


def test_python_m_history_answers_without_torch(tmp_path):
    """docs/history.md: `python -m spark_bench.history` skips the rest of the CLI, so a query never imports torch
    (seconds here); its one-line errors still work."""
    import sys

    probe = ("import runpy, sys\n"
             "sys.argv = ['spark_bench.history', 'list', '--db', sys.argv[1]]\n"
             "try:\n    runpy.run_module('spark_bench.history', run_name='__main__')\n"
             "except SystemExit as exc:\n    print('exit', exc.code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "none.db")], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "exit 2 False", proc.stdout + proc.stderr
    assert proc.stderr.startswith("spark-bench: error: no history database at") and "Traceback" not in proc.stderr
