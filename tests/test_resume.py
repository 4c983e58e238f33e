"""kill -9 during a sweep, then --resume: every case exactly once, nothing lost."""

import json
import os
import signal
import subprocess
import time

from conftest import spark_bench_cmd

SWEEP = ["--op", "fault.scale", "--backend", "good", "--backend", "slow", "--quick",
         "--set", "rows=3,5,7,9,11,13", "--set", "cols=5,6"]


def _case_ids(path):
    return [json.loads(line)["case_id"] for line in path.read_text().splitlines() if line.strip()]


def test_kill_9_then_resume(tmp_path, fault_env):
    out = tmp_path / "run"
    env = {**fault_env, "FAULT_SLOW_S": "0.05"}
    proc = subprocess.Popen(spark_bench_cmd("run", *SWEEP, "--out", out, "--no-report"), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = out / "results.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (journal.exists() and len(_case_ids(journal)) >= 5):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = _case_ids(journal)
    assert 5 <= len(before) < 24, "the kill must land mid-sweep"

    done = subprocess.run(spark_bench_cmd("run", "--resume", out, "--no-report"), env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    after = _case_ids(journal)
    assert len(after) == len(set(after)) == 24  # 2 backends x 6 rows x 2 cols, no duplicate, none lost
    assert after[: len(before)] == before  # what was measured before the kill is kept as it was
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert all(r["status"] == "ok" for r in records)
    assert json.loads((out / "run.json").read_text())["summary"]["ok"] == 24

    again = subprocess.run(spark_bench_cmd("run", "--resume", out, "--no-report"), env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0 and "0 to run" in again.stdout
    assert len(_case_ids(journal)) == 24


def test_resume_repairs_a_torn_last_line(tmp_path, fault_env):
    out = tmp_path / "run"
    args = ["--op", "fault.scale", "--backend", "good", "--quick", "--out", out, "--no-report"]
    first = subprocess.run(spark_bench_cmd("run", *args), env=fault_env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    journal = out / "results.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # as if killed mid-write
    done = subprocess.run(spark_bench_cmd("run", "--resume", out, "--no-report"), env=fault_env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert len(_case_ids(journal)) == 2


def test_sigterm_stops_the_sweep_says_what_is_kept_and_resume_finishes_it(tmp_path, fault_env):
    out = tmp_path / "run"
    env = {**fault_env, "FAULT_SLOW_S": "0.5", "FAULT_SEMAPHORE": "1"}  # the killed worker leaves a semaphore
    proc = subprocess.Popen(spark_bench_cmd("run", *SWEEP, "--out", out, "--no-report"), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    journal = out / "results.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (journal.exists() and len(_case_ids(journal)) >= 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # as `kill PID` or a CI job's timeout: the parent only
    _, err = proc.communicate(timeout=300)
    kept = _case_ids(journal)
    assert proc.returncode == 143, err
    assert f"terminated: {len(kept)} of 24 cases are kept in {out}" in err
    assert f"go on with `spark-bench run --resume {out}`" in err
    assert err.strip().splitlines()[-1].startswith("terminated: "), err  # no resource-tracker warning after it
    assert 2 <= len(kept) < 24 and all(json.loads(line)["status"] == "ok" for line in journal.read_text().splitlines())
    # the case its worker was killed in is neither recorded as a crash nor re-run in a fresh worker to confirm one
    assert len(list((out / "logs").glob("worker-*.log"))) == 1
    done = subprocess.run(spark_bench_cmd("run", "--resume", out, "--no-report"), env={**env, "FAULT_SLOW_S": "0.01"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(set(_case_ids(journal))) == 24 and _case_ids(journal)[: len(kept)] == kept


def test_like_runs_the_base_sweep_again_in_a_new_directory(tmp_path, fault_env):
    base, new = tmp_path / "base", tmp_path / "new"
    args = ["--op", "fault.scale", "--backend", "good", "--quick", "--set", "rows=3,5", "--max-time", "0.02"]
    first = subprocess.run(spark_bench_cmd("run", *args, "--out", base, "--no-report"), env=fault_env,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    again = subprocess.run(spark_bench_cmd("run", "--like", base, "--out", new, "--no-report"), env=fault_env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert sorted(_case_ids(new / "results.jsonl")) == sorted(_case_ids(base / "results.jsonl"))
    spec = {d: json.loads((d / "run.json").read_text())["spec"] for d in (base, new)}
    assert spec[new] == spec[base] and spec[new]["timing"]["max_time_s"] == 0.02  # its cases and its timing
    assert again.stdout.strip().splitlines()[-1] == f"compare: spark-bench compare {base} {new}"
    refused = subprocess.run(spark_bench_cmd("run", "--like", base, "--set", "rows=7"), env=fault_env,
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "drop --set" in refused.stderr and len(refused.stderr.splitlines()) == 1


def test_resume_on_another_device_is_refused(tmp_path, fault_env):
    """One run holds one device's timings: a resume on another machine (or after a torch upgrade) says what
    differs, one line, exit 2, and times nothing."""
    out = tmp_path / "run"
    args = ["--op", "fault.scale", "--backend", "good", "--quick", "--out", out, "--no-report"]
    first = subprocess.run(spark_bench_cmd("run", *args), env=fault_env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    journal = out / "results.jsonl"
    journal.write_text(journal.read_text().splitlines()[0] + "\n")  # as if killed after the first case
    run = json.loads((out / "run.json").read_text())
    run["fingerprint"]["versions"]["torch"] = "2.11.0"
    run["fingerprint"]["fingerprint_id"] = "0123456789abcdef"
    (out / "run.json").write_text(json.dumps(run))
    done = subprocess.run(spark_bench_cmd("run", "--resume", out, "--no-report"), env=fault_env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "versions.torch '2.11.0' -> " in done.stderr and "would mix two devices' timings" in done.stderr
    assert len(_case_ids(journal)) == 1


def test_like_keeps_each_cases_timer_from_the_base(tmp_path, monkeypatch):
    """`--timer auto` picks graph or events from a 5-sample probe at 50 us: a case near that line could change timer
    between the base and its `--like` run, and compare would set a graph time against an event time. The new run
    keeps each case's timer from the base (a GPU base's timers, simulated on this CPU's records)."""
    from conftest import run_cli

    import spark_bench.timing as timing

    base, new = tmp_path / "base", tmp_path / "new"
    args = ["--op", "kda.gate", "--backend", "torch", "--quick", "--dtype", "bf16", "--set", "tokens=1,7",
            "--set", "head_dim=60", "--max-time", "0.02"]
    code, _, err = run_cli("run", *args, "--out", base, "--no-report", "--executor", "inprocess")
    assert code == 0, err
    records = [json.loads(line) for line in (base / "results.jsonl").read_text().splitlines() if line.strip()]
    for record, timer, calls in zip(records, ["cuda-graph", "cuda-event"], [37, 1], strict=True):
        record["timing"]["timer"], record["timing"]["calls_per_sample"] = timer, calls
    (base / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    modes, real = {}, timing.measure

    def measure(calls, device, cfg):
        modes[len(modes)] = (cfg.mode, cfg.graph_calls)
        return real(calls, device, cfg)

    monkeypatch.setattr(timing, "measure", measure)
    code, _, err = run_cli("run", "--like", base, "--out", new, "--no-report", "--executor", "inprocess")
    assert code == 0, err
    kept = json.loads((new / "run.json").read_text())["spec"]["timers"]
    assert kept == {records[0]["case_id"]: "graph:37", records[1]["case_id"]: "events"}
    assert sorted(modes.values()) == [("events", None), ("graph", 37)]  # each case timed with its base's timer


def test_budget_stops_new_points_reports_what_ran_and_resume_finishes(tmp_path, fault_env):
    """`run --budget`: no parameter point starts after it (the one begun finishes, its backends together), the run
    ends as usual (tables, report, exit 0) with a line naming the cases left and the --resume that runs them;
    run.json and the report say how many were left, until a later invocation runs them."""
    out = tmp_path / "run"
    env = {**fault_env, "FAULT_SLOW_S": "0.3"}  # >= 0.6 s per slow case: 12 points cannot all run in 3 s
    first = subprocess.run(spark_bench_cmd("run", *SWEEP, "--out", out, "--budget", "3s"), env=env,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    points: dict = {}
    for r in records:
        points.setdefault(json.dumps(r["params"], sort_keys=True), set()).add(r["backend"])
    assert all(backends == {"good", "slow"} for backends in points.values())  # no point left half-measured
    left = 24 - len(records)
    assert left > 0 and json.loads((out / "run.json").read_text())["stopped_by_budget"] == {
        "budget_s": 3.0, "cases_left": left}
    assert (f"budget of 3 s reached: {len(records)} of 24 cases are in {out} (the points begun were finished); "
            f"`spark-bench run --resume {out}` runs the other {left}") in " ".join(first.stdout.split())
    assert f"budget left {left}" in (out / "report.html").read_text()

    done = subprocess.run(spark_bench_cmd("run", "--resume", out, "--budget", "1h", "--no-report"), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "budget of" not in done.stdout, done.stdout + done.stderr
    assert len(set(_case_ids(out / "results.jsonl"))) == 24
    assert "stopped_by_budget" not in json.loads((out / "run.json").read_text())


def test_resume_of_a_finished_run_reruns_nothing_not_even_its_failures(tmp_path, fault_env):
    """A case is measured once: a finished case that failed (a mismatch, an error) is in the journal and stays as
    recorded; resume runs only the cases not journaled yet (a mutation audit: re-running every non-ok case passed)."""
    out = tmp_path / "run"
    sweep = ["--op", "fault.scale", "--backend", "good", "--backend", "wrong", "--backend", "raises", "--quick",
             "--set", "rows=3", "--set", "cols=5", "--out", out, "--no-report"]
    first = subprocess.run(spark_bench_cmd("run", *sweep), env=fault_env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 1, first.stdout + first.stderr
    journal = (out / "results.jsonl").read_text()
    assert sorted(json.loads(line)["status"] for line in journal.splitlines()) == ["error", "mismatch", "ok"]
    again = subprocess.run(spark_bench_cmd("run", "--resume", out, "--no-report"), env=fault_env,
                           capture_output=True, text=True, timeout=600)
    assert "Traceback" not in again.stderr and (out / "results.jsonl").read_text() == journal
