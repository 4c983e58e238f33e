"""Bad input found by the 2026-12-06 CLI audit: each is one line on stderr and exit 2 (or, for a case that fails,
exit 1 with the other cases kept), never a traceback; and parameter points that vanish say why."""

import json
import subprocess

import pytest
from conftest import run_cli, spark_bench_cmd


@pytest.fixture
def a_run(tmp_path):
    code, _, err = run_cli("run", "--op", "kda.gate", "--quick", "--backend", "torch", "--set", "tokens=1",
                           "--set", "head_dim=60", "--out", tmp_path / "a", "--no-report")
    assert code == 0, err
    return tmp_path / "a"


def _one_line_usage_error(code, err, *words):
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("where", ["", "afile/x.html", "adir", "/proc/x.html"])
def test_an_output_file_that_cannot_be_written_is_refused_before_any_work(a_run, tmp_path, monkeypatch, where):
    """An empty name crashed four writers (a `Path('')` has no name to put a temporary file beside); a file where a
    folder should be, a directory or /proc named the temporary file in their error."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    for args in (["report", a_run, "-o", where], ["compare", a_run, a_run, "--html", where],
                 ["history", "report", "-o", where, "--db", tmp_path / "h.db"],
                 ["tuned", "merge", tmp_path / "t.json", "--out", where],
                 ["kernels", "--op", "kda.gate", "--quick", "--markdown", where]):
        code, out, err = run_cli(*args)
        _one_line_usage_error(code, err)
        assert ".tmp" not in err and ("empty path" in err or where in err), (args, err)
    assert (tmp_path / "afile").read_text() == "x" and not list((tmp_path / "adir").iterdir())


@pytest.mark.parametrize("command", [["run", "--op", "kda.gate", "--dry-run"], ["profile", "--op", "kda.gate"]])
def test_an_empty_output_directory_is_refused(tmp_path, monkeypatch, command):
    """`--out ''` wrote a run (run.json, results.jsonl, logs/, report.html) into the current directory."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(*command, "--out", "")
    _one_line_usage_error(code, err, "an empty path")
    assert not list(tmp_path.iterdir())


def test_kernels_writes_its_markdown_into_a_folder_it_creates(tmp_path):
    code, out, err = run_cli("kernels", "--op", "kda.gate", "--quick", "--set", "tokens=1", "--set", "head_dim=60",
                             "--no-presets", "--markdown", tmp_path / "new" / "k.md")
    assert code == 0, out + err
    assert "_kda_gate_fwd" in (tmp_path / "new" / "k.md").read_text()


def test_resume_of_a_run_whose_results_file_is_a_directory_is_one_line(tmp_path):
    def spark_bench(*args):  # processes of their own: a run directory stays locked by the process that ran it
        return subprocess.run(spark_bench_cmd(*args), capture_output=True, text=True, timeout=300)

    run = tmp_path / "a"
    assert spark_bench("run", "--op", "kda.gate", "--quick", "--backend", "torch", "--set", "tokens=1", "--set",
                       "head_dim=60", "--out", run, "--no-report").returncode == 0
    (run / "results.jsonl").unlink()
    (run / "results.jsonl").mkdir()
    proc = spark_bench("run", "--resume", run)
    _one_line_usage_error(proc.returncode, proc.stderr, "results.jsonl is not a file")


def test_points_a_constraint_rejects_say_why(tmp_path):
    """topk > experts was accepted by moe.align and moe.experts (cases that errored, or a memory estimate of 1e24
    GB); where the user's values leave an op no point, the note or the error says which constraint."""
    for op in ("moe.align", "moe.experts", "moe.experts_gguf"):
        code, out, err = run_cli("run", "--op", op, "--quick", "--backend", "torch", "--set", "experts=2",
                                 "--set", "topk=8", "--dry-run")
        _one_line_usage_error(code, err, f"{op}: ", "parameter points excluded (topk 8 > experts 2")
    code, out, err = run_cli("run", "--op", "moe.experts", "--op", "kda.gate", "--quick", "--backend", "torch",
                             "--set", "experts=2", "--set", "topk=8", "--set", "tokens=1", "--dry-run")
    assert code == 0 and "note: moe.experts: 2 of 2 parameter points excluded (topk 8 > experts 2" in err, err


def test_points_the_op_itself_excludes_are_no_note():
    """moe.router's quick sweep drops a (groups, topk_groups) pair by design: setting tokens says nothing of it."""
    code, out, err = run_cli("run", "--op", "moe.router", "--quick", "--backend", "torch", "--set", "tokens=1",
                             "--dry-run")
    assert code == 0 and "note:" not in err, err


@pytest.mark.parametrize("command", [["memcheck"], ["kernels", "--no-presets"]])
def test_gate_commands_say_which_constraint_left_nothing(command):
    """memcheck said no case without why; kernels compiled nothing and passed (exit 0)."""
    code, _, err = run_cli(*command, "--op", "moe.align", "--set", "topk=16", "--set", "experts=8")
    _one_line_usage_error(code, err, "topk 16 > experts 8")


def test_set_values_are_points_once_and_never_empty():
    code, out, err = run_cli("run", "--op", "kda.gate", "--quick", "--backend", "torch", "--set", "tokens=1,01",
                             "--set", "head_dim=60", "--dry-run")
    assert code == 0 and out.count("kda.gate torch tokens=1 ") == 1, out  # 1 and 01 are one point
    for bad in ("tokens=1,,2", "tokens=1,"):
        code, out, err = run_cli("run", "--op", "kda.gate", "--set", bad, "--dry-run")
        _one_line_usage_error(code, err, "no empty value")


@pytest.mark.parametrize("command", ["traffic", "memcheck"])
def test_a_selection_with_no_backend_that_can_run_is_one_line(command):
    code, out, err = run_cli(command, "--op", "kda.gate", "--backend", "fla", "--set", "tokens=1")
    _one_line_usage_error(code, err, "kda.gate fla: ")


def test_traffic_keeps_counting_after_a_case_fails(fault_env):
    """A backend that raises was a traceback that lost every other case's figures."""
    proc = subprocess.run(spark_bench_cmd("traffic", "--op", "fault.scale", "--backend", "raises",
                                          "--backend", "good", "--json"),
                          env=fault_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    rows = json.loads(proc.stdout)
    failed = [r for r in rows if "error" in r]
    assert {r["backend"] for r in failed} == {"raises"} and len(rows) == 2 * len(failed)
    assert all(r["error"] == "ValueError: deliberate failure in the backend" for r in failed)


def test_a_suggested_resume_command_can_be_pasted(tmp_path, monkeypatch):
    """The resume hints printed the path bare: `--resume sp ace/x y` runs something else in a shell."""
    import shlex

    monkeypatch.setattr("spark_bench.results.RunStore.lock", lambda self: None)  # in-process: the run's lock is ours

    out = tmp_path / "sp ace" / "x y"
    args = ("run", "--op", "kda.gate", "--quick", "--backend", "torch", "--set", "tokens=1", "--set", "head_dim=60",
            "--no-report", "--out", out)
    assert run_cli(*args)[0] == 0
    code, _, err = run_cli(*args)
    _one_line_usage_error(code, err, f"use --resume {shlex.quote(str(out))} or another --out")


def test_show_says_what_it_selected_and_when_a_run_is_unfinished(a_run):
    """`show --failed` on a run without failures printed "0 cases", as for an empty run; a run stopped before its
    end read as complete."""
    code, out, _ = run_cli("show", a_run, "--failed")
    assert code == 0 and "0 cases (selected of the run's 1)" in out and "unfinished" not in out, out
    run = json.loads((a_run / "run.json").read_text())
    (a_run / "run.json").write_text(json.dumps({**run, "finished": None}))
    code, out, _ = run_cli("show", a_run)
    assert code == 0 and "1 case, 1 ok\n" in out and "unfinished: no end recorded" in out, out
    (a_run / "run.json").write_text(json.dumps({**run, "stopped_by_budget": {"budget_s": 1, "cases_left": 7}}))
    code, out, _ = run_cli("show", a_run)
    assert "stopped by its budget: 7 more cases" in " ".join(out.split()), out
    odd = a_run.rename(a_run.parent / "my [b] run")  # a path is no markup; a tune goes on with `tune --resume`
    (odd / "run.json").write_text(json.dumps({**run, "finished": None, "kind": "tune"}))
    code, out, _ = run_cli("show", odd)
    assert f"`spark-bench tune --resume '{odd}'` runs what is left" in " ".join(out.split()), out


def test_contradicting_options_are_refused(tmp_path):
    """Each was accepted with one of the two silently ignored."""
    code, _, err = run_cli("kernels", "--op", "kda.gate", "--preset", "kimi-linear", "--no-presets")
    _one_line_usage_error(code, err, "contradict")
    code, _, err = run_cli("tune", "--resume", tmp_path, "--run-dir", tmp_path / "x")
    _one_line_usage_error(code, err, "drop --run-dir")
    (tmp_path / "afile").write_text("")
    code, _, err = run_cli("tune", "--op", "kda.gate", "--device", "cpu", "--run-dir", tmp_path / "afile",
                           "--out", tmp_path / "t.json")
    _one_line_usage_error(code, err, "not a run directory; choose another --run-dir")


def test_a_dry_run_refuses_what_the_run_would_refuse(a_run, tmp_path):
    """An --out holding results and a --history that is no history database (or cannot be created) passed the dry
    run and failed the run; a dry run still creates nothing."""
    code, _, err = run_cli("run", "--like", a_run, "--out", a_run, "--dry-run")
    _one_line_usage_error(code, err, "already holds results")
    (tmp_path / "junk.db").write_text("junk")
    for db, words in ((tmp_path / "junk.db", "not a spark-bench history database"),
                      (tmp_path / "junk.db" / "h.db", "is a file, not a folder")):
        code, _, err = run_cli("run", "--op", "kda.gate", "--backend", "torch", "--dry-run", "--history", db)
        _one_line_usage_error(code, err, words)
    (tmp_path / "empty.db").write_text("")  # the run fills an empty file: the dry run accepts it, unwritten
    for db in (tmp_path / "n.db", tmp_path / "empty.db"):
        code, _, err = run_cli("run", "--op", "kda.gate", "--backend", "torch", "--dry-run", "--history", db)
        assert code == 0, err
    assert not (tmp_path / "n.db").exists() and (tmp_path / "empty.db").read_text() == ""
