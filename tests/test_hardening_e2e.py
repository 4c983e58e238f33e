"""Issue 15 end to end: `spark-bench` subprocesses against hostile plugins (tests/plugins/)."""

import json
import os
import subprocess
import time

import pytest
from conftest import spark_bench_cmd


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _one_error_line(proc):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("spark-bench: error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


def test_a_second_run_of_a_live_run_directory_is_refused(tmp_path, hostile_env):
    out, gate = tmp_path / "run", tmp_path / "gate"
    gate.write_text("")  # the first run's backend blocks while this file exists
    env = {**hostile_env, "HOSTILE_GATE": str(gate)}
    sweep = ["--op", "hostile.gate", "--quick", "--no-report"]
    first = subprocess.Popen(spark_bench_cmd("run", *sweep, "--out", out), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and not (out / "run.json").exists() and first.poll() is None:
            time.sleep(0.05)
        assert first.poll() is None, "the first run must still be going"
        both = [subprocess.Popen(spark_bench_cmd("run", *args), env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
                for args in (["--resume", out, "--no-report"], [*sweep, "--out", out])]
        resume, again = (subprocess.CompletedProcess(p.args, p.wait(timeout=600), *p.communicate()) for p in both)
        assert first.poll() is None, "the first run is held at its gate until both were refused"
    finally:
        gate.unlink(missing_ok=True)
        stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stdout + stderr
    for proc in (resume, again):
        line = _one_error_line(proc)
        assert f"in use by pid {first.pid} " in line, line
    records = _lines(out / "results.jsonl")
    assert len(records) == len({r["case_id"] for r in records}) == 2  # journalled once each
    assert json.loads((out / "run.json").read_text())["summary"]["cases"] == 2


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_forking_backend_crash_is_a_crash_and_its_processes_end(tmp_path, hostile_env):
    out = tmp_path / "run"
    proc = subprocess.run(spark_bench_cmd("run", "--op", "hostile.forks", "--quick", "--timeout", "60",
                                          "--out", out, "--no-report"), env=hostile_env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    by = {(r["backend"], r["params"]["rows"]): r for r in _lines(out / "results.jsonl")}
    for rows in (3, 17):
        crash = by[("fork_then_segfault", rows)]
        assert crash["status"] == "crash" and "SIGSEGV" in crash["error"], crash["error"]
        assert by[("leaves_a_sleeper", rows)]["status"] == "ok"
    pids = [int(p.read_text()) for p in (tmp_path / "hostile").iterdir()]
    assert len(pids) >= 4  # two forked children and two sleepers (at least)
    deadline = time.time() + 30  # SIGKILLed at once; give init time to reap them
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "processes started by backends outlived the sweep"


def test_a_crash_is_charged_to_the_case_that_caused_it(tmp_path, hostile_env):
    """`poisoner` passes, then the next case of its worker segfaults (an asynchronous fault surfacing at the next
    sync). Every crash is re-run in a fresh worker before it is recorded: the innocent cases pass, the first error is
    kept, and the poisoner is marked suspect."""
    from spark_bench.results import load_run

    out = tmp_path / "run"
    proc = subprocess.run(spark_bench_cmd("run", "--op", "hostile.asyncfault", "--quick", "--timeout", "120",
                                          "--out", out, "--no-report"), env=hostile_env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # nothing is charged a crash it did not cause
    _, records = load_run(out)
    assert len(records) == 8 and all(r["status"] == "ok" for r in records), [(r["backend"], r["status"])
                                                                              for r in records]
    moved = [r for r in records if r.get("crash_not_reproduced")]
    assert moved, "some case ran right after a poisoner in the same worker"
    by_id = {r["case_id"]: r for r in records}
    for rec in moved:
        assert "SIGSEGV" in rec["crash_not_reproduced"]["error"] and "SIGSEGV" in rec["earlier_errors"][0]
        suspect = by_id[rec["suspect_previous"]]
        assert suspect["backend"] == "poisoner" and "suspect" in suspect["labels"], suspect
        assert "asynchronous fault" in suspect["suspect"]
    assert not [r for r in records if r["backend"] == "innocent" and "suspect" in r["labels"]]


def test_a_reproducible_crash_is_confirmed(tmp_path, fault_env):
    out = tmp_path / "run"
    proc = subprocess.run(spark_bench_cmd("run", "--op", "fault.scale", "--backend", "segfault", "--quick",
                                          "--set", "rows=3", "--out", out, "--no-report"), env=fault_env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (rec,) = _lines(out / "results.jsonl")
    assert rec["status"] == "crash" and rec["crash_confirmed"] is True and "SIGSEGV" in rec["earlier_errors"][0]


def test_a_full_disk_is_one_line_keeps_whole_records_and_resumes(tmp_path, fault_env):
    """A file size limit (RLIMIT_FSIZE; Python ignores SIGXFSZ) makes writes fail like a full disk (EFBIG)."""
    import resource

    out = tmp_path / "run"
    sweep = ["--op", "fault.scale", "--backend", "good", "--quick", "--set", "rows=3,5,7,9,11,13", "--set",
             "cols=5,6", "--out", out]

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (24_000, 24_000))

    proc = subprocess.run(spark_bench_cmd("run", *sweep), env=fault_env, capture_output=True, text=True,
                          timeout=900, preexec_fn=small_disk)
    line = _one_error_line(proc)
    assert "no space left writing" in line and "cases are kept in" in line and f"--resume {out}" in line, line
    journal = (out / "results.jsonl").read_text()
    assert journal.endswith("\n") and all(json.loads(x) for x in journal.splitlines())  # whole records only
    kept = len(journal.splitlines())
    assert 0 < kept < 12 and f"{kept} of 12 cases are kept" in line
    assert not list(out.rglob("*.tmp")), "partial files are removed"
    done = subprocess.run(spark_bench_cmd("run", "--resume", out), env=fault_env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(_lines(out / "results.jsonl")) == 12 and (out / "report.html").exists()


def test_a_bad_plugin_probe_or_constraint_costs_only_its_own_backend(tmp_path, hostile_env):
    env = {**hostile_env, "SPARK_BENCH_PROBE_TIMEOUT": "5"}
    out = tmp_path / "run"
    proc = subprocess.run(spark_bench_cmd("run", "--op", "hostile.probes", "--quick", "--out", out, "--no-report"),
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stdout) < 100_000  # the chatty probe's 10 MB went nowhere
    by = {r["backend"]: r for r in _lines(out / "results.jsonl")}
    assert set(by) == {"probe_hangs", "probe_segfaults", "probe_chatty", "plain"}  # rows=17: its constraint raised
    assert by["probe_hangs"]["status"] == "skipped" and by["probe_hangs"]["error"] == "probe timed out after 5 s"
    assert by["probe_segfaults"]["status"] == "skipped" and "SIGSEGV" in by["probe_segfaults"]["error"]
    assert by["probe_chatty"]["status"] == by["plain"]["status"] == "ok"

    listed = subprocess.run(spark_bench_cmd("list", "--json", "--device", "cpu"), env=env, capture_output=True,
                            text=True, timeout=900)
    assert listed.returncode == 0, listed.stderr
    backends = json.loads(listed.stdout)["ops"]["hostile.probes"]["backends"]
    assert backends["probe_hangs"]["reason"] == "probe timed out after 5 s"
    assert "SIGSEGV" in backends["probe_segfaults"]["reason"] and backends["plain"]["available"]


def test_a_worker_killed_during_start_up_costs_no_sweep_and_load_errors_are_shown(tmp_path, hostile_env):
    marker = tmp_path / "die-once"
    marker.write_text("")
    env = {**hostile_env, "HOSTILE_DIE_AT_STARTUP": str(marker),
           "SPARK_BENCH_PLUGINS": hostile_env["SPARK_BENCH_PLUGINS"] + ",no_such_plugin_xyz"}
    out = tmp_path / "run"
    proc = subprocess.run(spark_bench_cmd("run", "--op", "fault.scale", "--backend", "good", "--quick", "--out", out,
                                          "--no-report"), env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and not marker.exists()
    assert "warning: plugin no_such_plugin_xyz failed to load: ModuleNotFoundError" in proc.stderr
    records = _lines(out / "results.jsonl")
    assert len(records) == 2 and all(r["status"] == "ok" for r in records)
    assert not any(r.get("crash_not_reproduced") for r in records)  # a start-up failure is no case's: none charged
    (first,) = [r for r in records if r.get("worker_start_failures")]  # said with the case it delayed
    assert first["worker_start_failures"] == ["worker died during start-up (killed by SIGKILL)"]


def test_backend_output_goes_to_the_case_log_not_the_terminal(tmp_path, hostile_env):
    out = tmp_path / "run"
    proc = subprocess.run(spark_bench_cmd("run", "--op", "hostile.logs", "--quick", "--out", out, "--no-report",
                                          "--no-confirm-crashes"), env=hostile_env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 1, proc.stderr
    assert "stdout-noise" not in proc.stdout + proc.stderr and len(proc.stdout) < 200_000
    records = _lines(out / "results.jsonl")
    assert {r["backend"]: r["status"] for r in records} == {"noisy": "ok", "quiet_segfault": "crash"}
    for rec in records:
        if rec["backend"] == "quiet_segfault":
            assert "Segmentation fault" in rec["worker_log_tail"] and "NOISE" not in rec["worker_log_tail"]
    assert any("stdout-noise" in p.read_text(errors="replace") for p in (out / "logs").iterdir())


def test_report_path_is_printed_last_and_a_finished_run_keeps_its_end(tmp_path, fault_env):
    out = tmp_path / "run"
    first = subprocess.run(spark_bench_cmd("run", "--op", "fault.scale", "--backend", "good", "--quick", "--out",
                                           out), env=fault_env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip().splitlines()[-1] == f"report: {out / 'report.html'}"
    finished = json.loads((out / "run.json").read_text())["finished"]
    time.sleep(1.1)  # run.json stores seconds
    again = subprocess.run(spark_bench_cmd("run", "--resume", out, "--no-report"), env=fault_env,
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "0 to run" in again.stdout
    assert json.loads((out / "run.json").read_text())["finished"] == finished


def test_a_report_that_cannot_be_written_is_one_line_and_the_results_stand(tmp_path, fault_env):
    out = tmp_path / "run"
    first = subprocess.run(spark_bench_cmd("run", "--op", "fault.scale", "--backend", "good", "--quick", "--out",
                                           out, "--no-report"), env=fault_env, capture_output=True, text=True,
                           timeout=900)
    assert first.returncode == 0, first.stderr
    (out / "report.html").mkdir()  # the report cannot be written there
    again = subprocess.run(spark_bench_cmd("run", "--resume", out), env=fault_env, capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    line = again.stderr.strip().splitlines()[-1]
    assert line.startswith("report: not written (IsADirectoryError") and f"kept in {out}" in line
    assert f"spark-bench report {out} -o {out / 'report.html'}" in line


_HOOK = """import os, sys
if '--multiprocessing-fork' in sys.argv and os.environ.get('FAIL_LOG_TAG'):
    import spark_bench.worker as worker
    real_main = worker.main
    def main(conn, device, log_path):
        if os.environ['FAIL_LOG_TAG'] in os.path.basename(log_path or ''):
            raise ValueError('simulated start-up failure of slot ' + os.environ['FAIL_LOG_TAG'])
        return real_main(conn, device, log_path)
    worker.main = main
elif '--multiprocessing-fork' in sys.argv:
    counter = os.environ['START_COUNTER']
    with open(counter, 'a') as f:
        f.write('x')
    if os.path.getsize(counter) > int(os.environ['STARTS_THAT_WORK']):
        import spark_bench.devices as devices
        def use_device(device):
            if os.environ.get('HANG_AT_START'):
                import time
                time.sleep(3600)
            raise ValueError('simulated start-up failure on ' + device)
        devices.use_device = use_device
"""


def _run_with_failing_starts(tmp_path, fault_env, starts_that_work: int, *args, **env_extra):
    """`spark-bench run` whose spawned workers die (or, with HANG_AT_START=1, hang) at start-up after the first
    `starts_that_work` started."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_HOOK)
    env = {**fault_env, "PYTHONPATH": os.pathsep.join([str(hook), fault_env["PYTHONPATH"]]),
           "START_COUNTER": str(tmp_path / "starts"), "STARTS_THAT_WORK": str(starts_that_work), **env_extra}
    out = tmp_path / "run"
    proc = subprocess.run(spark_bench_cmd("run", "--op", "fault.scale", "--quick", "--out", out, "--no-report", *args),
                          env=env, capture_output=True, text=True, timeout=900)
    return proc, out


@pytest.mark.parametrize("confirm", [True, False])
def test_workers_that_cannot_start_stop_the_run_in_one_line(tmp_path, fault_env, confirm):
    """The first H200 run (2026-12-05): every worker died at start-up (a ValueError in torch.cuda.set_device), and the
    sweep charged each of its 9508 cases a 'crash' ~7 s apart. A start-up failure is no case's: the worker is started
    again at once, and after two failures in a row the run stops, saying why in one line (the log's last line) with
    what is kept, exit code 1; no case is recorded, so `--resume` runs them once the environment is fixed."""
    proc, out = _run_with_failing_starts(tmp_path, fault_env, 0, "--backend", "good",
                                         *([] if confirm else ["--no-confirm-crashes"]))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("spark-bench: error: workers cannot start on cpu: died during start-up (exit code 1); "
                           "its log ends: ValueError: simulated start-up failure on cpu (log: "), line
    assert f"0 of 2 cases are kept in {out}" in line and f"spark-bench run --resume {out}" in line
    assert _lines(out / "results.jsonl") == []
    log = line.split("(log: ")[1].split(")")[0]
    assert "ValueError: simulated start-up failure on cpu" in open(log).read()  # the traceback, kept with the run


def test_a_hung_start_up_is_announced_and_bounded_by_its_timeout(tmp_path, fault_env):
    """A worker that never answers at start-up: the wait is said on stderr while it lasts (CI logs showed nothing
    for 2 x 300 s), SPARK_BENCH_STARTUP_TIMEOUT bounds it, and the run stops naming the slot and the timeout."""
    proc, out = _run_with_failing_starts(tmp_path, fault_env, 0, "--backend", "good", HANG_AT_START="1",
                                         SPARK_BENCH_STARTUP_TIMEOUT="6")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    waits = [line for line in lines if line.startswith("spark-bench: waiting for the worker on cpu to start (")]
    assert len(waits) == 2 and all(" s of 6 s; its log: " in line for line in waits), lines  # once per start-up
    assert lines[-1].startswith("spark-bench: error: workers cannot start on cpu: died during start-up (hung: no "
                                "answer within 6 s)"), lines[-1]
    assert _lines(out / "results.jsonl") == []


@pytest.mark.parametrize("name,value", [("SPARK_BENCH_STARTUP_TIMEOUT", "soon"), ("SPARK_BENCH_TIMEOUT", "-1"),
                                        ("SPARK_BENCH_TIMEOUT", "inf")])
def test_a_bad_timeout_variable_is_one_line(tmp_path, fault_env, name, value):
    proc = subprocess.run(spark_bench_cmd("run", "--op", "fault.scale", "--backend", "good", "--quick", "--out",
                                          tmp_path / "run", "--no-report"), env={**fault_env, name: value},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"spark-bench: error: {name}={value!r} is not a positive number of seconds"), proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_slot_whose_workers_cannot_start_leaves_its_cases_to_the_others(tmp_path, fault_env):
    """Two slots, one broken (its workers die at start-up): a warning names it, the other slot runs every case,
    exit 0. Before, the broken slot stopped the whole run."""
    proc, out = _run_with_failing_starts(tmp_path, fault_env, 10**6, "--backend", "good", "--set", "rows=3,5,7",
                                         "--devices", "cpu0,cpu1", FAIL_LOG_TAG="cpu1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: workers cannot start on cpu1")]
    assert len(warnings) == 1 and warnings[0].endswith("its cases go to the other slots"), proc.stderr
    records = _lines(out / "results.jsonl")
    assert len(records) == 3 and {r["status"] for r in records} == {"ok"} and {r["worker"] for r in records} == {"cpu0"}


def test_workers_that_stop_starting_mid_run_stop_it_too(tmp_path, fault_env):
    """The first worker starts and dies in a case (a segfault); every start after it fails. The run stops there
    instead of charging each remaining case a start-up 'crash' (and 'confirming' it without a re-run)."""
    proc, out = _run_with_failing_starts(tmp_path, fault_env, 1, "--backend", "segfault", "--backend", "good",
                                         "--set", "rows=3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "workers cannot start on cpu" in proc.stderr and "Traceback" not in proc.stderr
    assert not [r for r in _lines(out / "results.jsonl") if r.get("phase") == "startup" or r.get("crash_confirmed")]
