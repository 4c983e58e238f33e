"""Bad command-line input found by a grammar-based argv fuzz of every command (2026-12-07): each is one line on
stderr and exit 2 before any work, never a traceback, a second line or a value silently taken for another."""

import json
import os
import stat

import pytest
from conftest import run_cli


def _one_line_usage_error(code, err, *words):
    assert code == 2 and len(err.strip("\n").splitlines()) == 1 and err.startswith("spark-bench: error:"), err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("age", ["999999999d", "99999999999d"])
def test_an_age_before_year_one_is_one_line(tmp_path, age):
    """timedelta overflowed: OverflowError (date value out of range / too large to convert to C int)."""
    code, _, err = run_cli("history", "prune", "--db", tmp_path / "h.db", "--older-than", age)
    _one_line_usage_error(code, err, "--older-than", age)


def test_history_list_refuses_a_limit_sqlite_cannot_hold(tmp_path):
    from spark_bench.history import connect

    connect(tmp_path / "h.db", create=True).close()
    code, _, err = run_cli("history", "list", "--runs", "--db", tmp_path / "h.db", "--limit", str(2**70))
    _one_line_usage_error(code, err, "--limit")


def test_a_budget_too_long_for_a_float_is_refused():
    """400 nines are inf seconds: the dry run's estimate died on int(inf)."""
    code, _, err = run_cli("run", "--dry-run", "--op", "kda.gate", "--budget", "9" * 400)
    _one_line_usage_error(code, err, "--budget", "finite")


@pytest.mark.parametrize("args", [["show", "a\nb"], ["tuned", "show", "a\nb"], ["run", "--resume", "a\nb"],
                                  ["profile", "--op", "kda.gate", "--backend", "torch", "--out", "/proc/a\nb"]])
def test_a_newline_in_a_value_stays_on_the_error_line(args):
    code, _, err = run_cli(*args)
    _one_line_usage_error(code, err, "a\\nb")


def _holds_results(path):
    path.mkdir()
    (path / "results.jsonl").write_text('{"case_id": "x"}\n')
    return path


@pytest.mark.parametrize("extra", [["--out", "RESULTS"], ["--preset", "nope"], ["--ray-address", "x:1"]])
def test_run_refuses_its_input_before_the_tuned_tables_warning(tmp_path, monkeypatch, extra):
    """`--tuned auto` without a table warned first; the error on the --out, preset or executor option came after."""
    monkeypatch.chdir(tmp_path)
    extra = [str(_holds_results(tmp_path / "r")) if a == "RESULTS" else a for a in extra]
    code, _, err = run_cli("run", "--dry-run", "--op", "kda.gate", "--tuned", "auto", *extra)
    _one_line_usage_error(code, err)
    assert "warning" not in err


@pytest.mark.parametrize("option", ["--out", "--run-dir"])
def test_tune_refuses_its_outputs_before_the_memory_warning(tmp_path, monkeypatch, option):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not a table")
    where = tmp_path / "notes.txt" if option == "--out" else _holds_results(tmp_path / "r")
    code, _, err = run_cli("tune", "--op", "kda.gate", "--backend", "triton", "--set", "tokens=1,100000000000",
                           option, where)
    _one_line_usage_error(code, err, str(where))


@pytest.mark.parametrize("args", [["run", "--dry-run", "--op", "kda.gate"], ["list"], ["env"],
                                  ["tune", "--op", "kda.gate"]])
def test_an_empty_device_is_refused_not_taken_for_the_default(args):
    code, _, err = run_cli(*args, "--device", "")
    _one_line_usage_error(code, err, "unknown device ''")


@pytest.mark.parametrize("device", ["cudax", "cuda:", "cuda0", "cuda:01", "cuda:\u0660"])
def test_a_cuda_device_torch_would_refuse_is_refused_here(monkeypatch, device):
    """On a GPU machine these passed the check (they start with cuda) and every case died in torch.device."""
    import torch

    from spark_bench.devices import check_device
    from spark_bench.sweep import UsageError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda:1") == "cuda:1"
    with pytest.raises(UsageError, match="unknown device"):
        check_device(device)


def test_a_dry_run_refuses_an_out_the_run_cannot_create(tmp_path):
    (tmp_path / "afile").write_text("x")
    code, _, err = run_cli("run", "--dry-run", "--op", "kda.gate", "--out", tmp_path / "afile" / "run")
    _one_line_usage_error(code, err, "cannot create the run directory (Not a directory)")


def test_an_output_that_is_not_a_regular_file_is_never_replaced(tmp_path):
    """As root the atomic write renamed a file over /dev/null; a FIFO shows it without root."""
    from test_tune import _store

    _store([("test._k", {"n": 1}, {"B": 8}, "2026-01-01")]).save(tmp_path / "t.json", "now")
    os.mkfifo(tmp_path / "fifo")
    code, _, err = run_cli("tuned", "merge", tmp_path / "t.json", "--out", tmp_path / "fifo")
    _one_line_usage_error(code, err, "not a regular file")
    assert stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode)


@pytest.mark.parametrize("option", ["--cache-dir", "--triton-cache"])
def test_kernels_refuses_an_empty_cache_directory(tmp_path, monkeypatch, option):
    """'' was the current directory: the compile cache was written there."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli("kernels", "--op", "kda.gate", "--set", "tokens=1", "--no-presets", "--select", "cover",
                           option, "")
    _one_line_usage_error(code, err, option, "empty path")
    assert not list(tmp_path.iterdir())


def test_traffic_refuses_a_seed_torch_cannot_take():
    """2**64 reached torch.manual_seed: every case failed late (Overflow when unpacking long long), exit 1."""
    code, _, err = run_cli("traffic", "--op", "kda.gate", "--set", "tokens=1", "--set", "heads=4", "--set",
                           "head_dim=60", "--dtype", "fp32", "--seed", str(2**64))
    _one_line_usage_error(code, err, "--seed")


def test_profile_refuses_an_empty_dtype_not_taken_for_the_default(tmp_path):
    code, out, err = run_cli("profile", "--op", "kda.gate", "--backend", "torch", "--set", "tokens=1", "--set",
                             "heads=4", "--set", "head_dim=60", "--iters", "1", "--out", tmp_path / "p", "--dtype", "")
    _one_line_usage_error(code, err, "unknown dtype ''")
    assert not (tmp_path / "p").exists(), json.dumps(out)
