"""Run/tune option checks, the fingerprint's git and core facts, and which probes run isolated (found by a mutation
audit of options.py, fingerprint.py and isolate.py): each test names the mutant it was written against."""

import subprocess

import click
import pytest
from click.testing import CliRunner

from spark_bench import Backend, fingerprint
from spark_bench.isolate import _signal_text, probe_backends, trusted
from spark_bench.options import (
    check_run_options,
    parse_duration,
    positive,
    refuse_sweep_options_with_resume,
    sweep_spec,
)
from spark_bench.sweep import UsageError


# --- options.py -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raised, code, line", [
    (click.Abort(), 130, "aborted"),  # click's Ctrl-C
    (UsageError("bad --set"), 2, "spark-bench: error: bad --set"),
])
def test_the_group_turns_clicks_and_our_exceptions_into_exit_codes(raised, code, line, capsys):
    """click's Abort is an Exception: a broad handler placed before its own (2026-12-07, for WorkersCannotStart) made
    Ctrl-C outside a sweep a traceback."""
    from spark_bench.options import SparkGroup

    group = SparkGroup("g")

    @group.command("c")
    def command():
        raise raised

    with pytest.raises(SystemExit) as exc:
        group.main(["c"], prog_name="g")
    assert exc.value.code == code
    assert capsys.readouterr().err.strip() == line


def test_an_integer_option_must_be_one_or_more():
    """Mutant: `value < 1` -> `value < 0` (--min-samples 0 and tune --jobs 0 passed)."""
    for bad in (0, -2):
        with pytest.raises(UsageError, match=f"--min-samples must be 1 or more, not {bad}"):
            check_run_options(timeout=None, max_time=None, min_samples=bad, target_ci=None, quick=False, full=False)
    positive("--jobs", 1, integer=True)
    positive("--jobs", None, integer=True)


def test_target_ci_is_a_fraction_below_one():
    """Mutant: `target_ci >= 1` -> `> 1` (--target-ci 1, a CI as wide as the median, was accepted)."""
    with pytest.raises(UsageError, match="--target-ci is a fraction of the median below 1"):
        check_run_options(timeout=None, max_time=None, min_samples=None, target_ci=1.0, quick=False, full=False)
    check_run_options(timeout=None, max_time=None, min_samples=None, target_ci=0.99, quick=False, full=False)


def test_durations_in_each_unit():
    """Mutant: an hour of 60 s (and the other unit factors)."""
    assert [parse_duration("--budget", t) for t in ("90", "90s", "30m", "1.5h", " 2H ", ".5m")] == \
        [90.0, 90.0, 1800.0, 5400.0, 7200.0, 30.0]
    assert parse_duration("--budget", None) is None


def test_a_cpu_sweep_is_quick_unless_full():
    """Mutant: `and not full` dropped (`run --full` on CPU swept the quick shapes all the same)."""
    def spec(device, quick=False, full=False):
        return sweep_spec(ops=(), backends=(), preset=None, sets=(), dtypes=(), device=device, quick=quick,
                          full=full, seed=0)

    assert spec("cpu").quick and not spec("cpu", full=True).quick
    assert not spec("cuda").quick and spec("cuda", quick=True).quick


def test_like_allows_its_own_options_and_refuses_the_others():
    """Mutant: `allowed` ignored (`run --like DIR --out NEW`, the way to repeat a run, was refused)."""
    @click.command()
    @click.option("--out")
    @click.option("--seed", type=int)
    def cmd(out, seed):
        refuse_sweep_options_with_resume(click.get_current_context(), "base", "--like", allowed=("out",))

    assert CliRunner().invoke(cmd, ["--out", "new"]).exit_code == 0
    refused = CliRunner().invoke(cmd, ["--out", "new", "--seed", "3"])
    assert isinstance(refused.exception, UsageError)
    assert "--like base runs the sweep stored in its run.json; drop --seed " in str(refused.exception)


# --- fingerprint.py ---------------------------------------------------------------------------------------------
def test_usable_cores_are_the_affinity_not_the_machine(monkeypatch):
    """Mutant: os.cpu_count() in place of the affinity (a taskset/container share hashed as the whole machine)."""
    monkeypatch.setattr(fingerprint.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    monkeypatch.setattr(fingerprint.os, "cpu_count", lambda: 64)
    assert fingerprint.usable_cores() == 1
    assert fingerprint.device_info("cpu")["cores"] == 1


def test_without_git_the_tree_is_not_called_clean(monkeypatch):
    """Mutant: `dirty` = bool(None) = False when git cannot answer (a run outside a checkout claimed a clean tree)."""
    def no_git(*args, **kwargs):
        raise OSError("no git here")

    monkeypatch.setattr(fingerprint.subprocess, "run", no_git)
    assert fingerprint.git_info() == {"commit": None, "dirty": None}
    monkeypatch.setattr(fingerprint.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "abc\n" if "rev-parse" in cmd else ""))
    assert fingerprint.git_info() == {"commit": "abc", "dirty": False}


# --- isolate.py -------------------------------------------------------------------------------------------------
def test_only_spark_bench_modules_are_trusted():
    """Mutant: startswith('spark_bench') (a third-party 'spark_bench_myops' probe ran unisolated in the parent)."""
    def probe(device):
        return None

    for module, ok in (("spark_bench", True), ("spark_bench.probes", True), ("spark_bench_myops", False),
                       ("myops.spark_bench", False)):
        probe.__module__ = module
        assert trusted(probe) is ok, module


def test_a_signal_is_named_and_an_exit_code_is_not_a_signal():
    """Mutant: `code < 0` -> `<= 0` (exit code 0 read 'killed by signal 0')."""
    assert _signal_text(-11) == "killed by SIGSEGV"
    assert _signal_text(0) == "exit code 0" and _signal_text(3) == "exit code 3" and _signal_text(None) == \
        "exit code None"


def test_isolate_false_runs_untrusted_probes_here():
    """Mutant: `or not isolate` dropped (a registry built in this process was probed in a spawned prober that cannot
    rebuild it: every such backend 'probe failed')."""
    answers = probe_backends([("mt3.none", Backend("b", abs, probe=lambda device: "needs a unicorn")),
                              ("mt3.none", Backend("c", abs))], "cpu", isolate=False)
    assert answers == {("mt3.none", "b"): "needs a unicorn", ("mt3.none", "c"): None}
