"""spark_bench/tune/session.py: how a budget cuts the rounds, what the untimed message counts, the exit code, and what
`tune` hands its planning. Runner and clock are fakes (each case takes one fake second), so no timing is real. Found
by a mutation audit of the tuner."""

import contextlib
import json
import subprocess
from types import SimpleNamespace

import pytest
from conftest import run_cli
from test_tune import DEVICE, FAST, SLOW, _first_tune, _plan

from spark_bench.tune.session import TuneSession
from spark_bench.tune.space import config_id

MEDIANS = {None: 10.0, config_id(FAST): 5.0, config_id(SLOW): 12.0}  # µs per config (None: the default)


class Journal:
    """An in-memory run directory: results.jsonl and run.json."""

    def __init__(self, path):
        self.path, self.records, self.run = path, [], {"fingerprint": {"device": DEVICE, "versions": {}}}

    def read_results(self):
        return list(self.records)

    def read_run(self):
        return dict(self.run)

    def write_run(self, run):
        self.run = run


def _session(tmp_path, monkeypatch, *, budget=None, spent=0.0, status=lambda config: "ok"):
    """A tune of test_tune._plan([FAST, SLOW], cases=2) whose cases each take one second of a fake clock."""
    clock, journal = SimpleNamespace(now=0.0), Journal(tmp_path / "tune")

    class Runner:
        def __init__(self, *args, **kwargs):
            pass

        def run(self, cases):
            for case in cases:
                clock.now += 1.0
                config = config_id(case.configs["test._k"]) if case.configs else None
                ok = status(config) == "ok"
                journal.records.append({"case_id": case.case_id, "status": status(config), "labels": [],
                                        "repeat": case.repeat, "duration_s": 1.0,
                                        "timing": {"median": MEDIANS[config], "rel_ci": 0.001} if ok else None})

    class Progress:
        phase = result = None

        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr("spark_bench.runner.Runner", Runner)
    monkeypatch.setattr("spark_bench.console.SweepProgress", Progress)
    monkeypatch.setattr("spark_bench.session.estimates", lambda todo: None)
    monkeypatch.setattr("spark_bench.session.interrupt_says_what_is_kept", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr("spark_bench.tune.session.time", SimpleNamespace(monotonic=lambda: clock.now))
    tune = {"plan": _plan([FAST, SLOW], cases=2), "budget_s": budget, "spent_s": spent, "planning_s": spent,
            "out": str(tmp_path / "t.json")}
    return TuneSession(store=journal, spec=SimpleNamespace(device="cpu"), cfg=None, timeout_s=1.0, tune=tune), journal


def test_a_candidate_round_leaves_time_for_the_closing_one(tmp_path, monkeypatch):
    """5 s for 8 one-second cases: the 2 defaults, then candidates only while the 2 closing re-timings still fit."""
    session, journal = _session(tmp_path, monkeypatch, budget=5.0)
    said = []
    code, path = session.execute(say=said.append)
    assert [r["repeat"] for r in journal.records].count(1) == 2  # the closing round was timed
    assert len(journal.records) == 5 and code == 0 and path is not None
    assert ("left 3 case(s) untimed (0 timings of the declared configs, 3 candidates)" in said[-1]), said


def test_a_budget_spent_before_any_timing_leaves_no_table_and_exits_1(tmp_path, monkeypatch):
    session, journal = _session(tmp_path, monkeypatch, budget=5.0, spent=10.0)
    said = []
    code, path = session.execute(say=said.append)
    assert journal.records == [] and (code, path) == (1, None)
    assert "(5 s; 10 s spent, planning included) left 8 case(s) untimed (4 timings of the declared configs, " \
           "4 candidates)" in said[-1], said


def test_a_failing_candidate_is_recorded_but_fails_nothing_a_failing_default_does(tmp_path, monkeypatch):
    session, _ = _session(tmp_path, monkeypatch, status=lambda c: "mismatch" if c == config_id(FAST) else "ok")
    code, path = session.execute(say=lambda line: None)
    assert code == 0 and json.loads(path.read_text())["kernels"]["test._k"][0]["runner_up"]["config"] == SLOW
    session, _ = _session(tmp_path / "b", monkeypatch, status=lambda c: "mismatch" if c is None else "ok")
    assert session.execute(say=lambda line: None) == (1, None)


def test_no_time_left_and_no_case_duration_yet_fits_no_case(tmp_path, monkeypatch):
    session, _ = _session(tmp_path, monkeypatch)
    assert session._fit(10, 0.0) == 0 and session._fit(10, 0.5) == 10  # nothing to estimate by: all


def _tune(tmp_path, monkeypatch, *args):
    """An in-process `tune --op kda.gate` whose planning (faked) takes 42 s of a fake clock and plans nothing:
    (exit code, stderr, what planning was handed)."""
    seen, clock = {}, SimpleNamespace(now=0.0)

    def build(base, target, **kwargs):
        seen.update(base=base, target=target, **kwargs)
        clock.now += 42.0
        return {"items": [], "untunable": [], "capture_errors": [], "target": target}

    monkeypatch.setattr("spark_bench.tune.plan.build", build)
    monkeypatch.setattr("spark_bench.results.RunStore.lock", lambda self: None)  # in-process: one tune at a time
    monkeypatch.setattr("spark_bench.tune.session.time", SimpleNamespace(monotonic=lambda: clock.now))
    code, _, err = run_cli("tune", "--op", "kda.gate", "--device", "cpu", "--executor", "inprocess", "--out",
                           tmp_path / "t.json", *args)
    return code, err, seen


@pytest.mark.parametrize("budget, deadline", [("600", 200.0), ("60", 30.0), (None, 900.0)])
def test_planning_gets_a_third_of_the_budget_but_at_least_30_s_and_counts_against_it(tmp_path, monkeypatch, budget,
                                                                                     deadline):
    run_dir = tmp_path / "tune"
    code, err, seen = _tune(tmp_path, monkeypatch, "--run-dir", run_dir, *(["--budget", budget] if budget else []))
    assert code == 0 and seen["deadline_s"] == deadline, err
    tune = json.loads((run_dir / "run.json").read_text())["tune"]
    assert tune["planning_s"] == tune["spent_s"] == 42.0


def test_a_named_backend_is_tuned_even_when_it_is_not_triton(tmp_path, monkeypatch):
    code, err, seen = _tune(tmp_path, monkeypatch, "--backend", "torch", "--run-dir", tmp_path / "tune")
    assert code == 0 and {c.backend for c in seen["base"]} == {"torch"}, err


def test_a_run_dir_whose_journal_is_empty_holds_no_results(tmp_path, monkeypatch):
    """A tune killed between planning and its first case leaves an empty results.jsonl: nothing to resume, so a new
    tune may take the directory (as `run` does)."""
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "results.jsonl").write_text("")
    code, err, _ = _tune(tmp_path, monkeypatch, "--run-dir", tmp_path / "tune")
    assert code == 0, err


def test_a_resume_with_a_budget_keeps_the_new_budget(tmp_path, monkeypatch):
    run_dir = _first_tune(tmp_path, monkeypatch)
    code, _, err = run_cli("tune", "--resume", run_dir, "--executor", "inprocess", "--budget", "90m")
    assert code == 0, err
    assert json.loads((run_dir / "run.json").read_text())["tune"]["budget_s"] == 5400.0


def test_a_resume_refuses_the_planning_options_it_would_ignore(tmp_path, monkeypatch):
    """The plan (its offline pruning included) was made by the first run: --target or --jobs beside --resume changed
    nothing and exited 0."""
    run_dir = _first_tune(tmp_path, monkeypatch)
    for extra, needle in ((["--target", "sm_80"], "drop --target sm_80"), (["--jobs", "3"], "drop --jobs 3")):
        code, _, err = run_cli("tune", "--resume", run_dir, "--executor", "inprocess", *extra)
        assert code == 2 and err.strip().count("\n") == 0 and needle in err, err


def test_zero_compile_jobs_are_one_line_before_any_planning(tmp_path, monkeypatch):
    code, err, seen = _tune(tmp_path, monkeypatch, "--jobs", "0", "--run-dir", tmp_path / "tune")
    assert code == 2 and err.strip().count("\n") == 0 and "--jobs must be 1 or more, not 0" in err, err
    assert seen == {} and not (tmp_path / "tune").exists()


def test_a_planning_capture_that_fails_is_one_line(tmp_path, monkeypatch):
    """The capture process dying (here: exit 1 with a traceback on stderr) ended `tune` in a RuntimeError traceback."""
    def dies(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback (most recent call last):\nImportError: no triton")

    monkeypatch.setattr("spark_bench.kernelgate.capture.subprocess.run", dies)
    monkeypatch.setattr("spark_bench.results.RunStore.lock", lambda self: None)
    code, _, err = run_cli("tune", "--op", "kda.gate", "--device", "cpu", "--executor", "inprocess", "--quick",
                           "--out", tmp_path / "t.json", "--run-dir", tmp_path / "tune")
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == ("spark-bench: error: launch capture failed (exit 1): ImportError: no "
                                            "triton"), err


@pytest.mark.parametrize("exists", [False, True])
@pytest.mark.parametrize("signal_name, code_wanted", [("interrupted", 130), ("terminated", 143)])
def test_an_interrupt_while_planning_says_there_is_nothing_to_resume(tmp_path, monkeypatch, exists, signal_name,
                                                                     code_wanted):
    """Ctrl-C (or SIGTERM) during the offline compiles printed only 'aborted' and left an empty directory that
    `tune --resume` then refused (no run.json). One line now, and the directory this tune made is removed."""
    from spark_bench.session import Terminated

    run_dir = tmp_path / "tune"
    if exists:  # the user's own --run-dir is kept
        run_dir.mkdir()

    def build(*args, **kwargs):
        raise Terminated() if signal_name == "terminated" else KeyboardInterrupt()

    monkeypatch.setattr("spark_bench.tune.plan.build", build)
    code, _, err = run_cli("tune", "--op", "kda.gate", "--device", "cpu", "--executor", "inprocess", "--quick",
                           "--out", tmp_path / "t.json", "--run-dir", run_dir)
    assert code == code_wanted and "Traceback" not in err and "aborted" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"{signal_name} while planning: nothing was timed, so there is nothing to resume"
        + ("" if exists else f" ({run_dir} removed)") + "; run the command again"), err
    assert run_dir.exists() == exists and not (tmp_path / "t.json").exists()
