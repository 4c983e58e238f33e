"""`show --set` / `history trend --set` compare by value, the more specific `run --set OP:AXIS` wins, and options that
were silently ignored are one-line usage errors (exit 2)."""

import json

import numpy as np
import pytest
from conftest import run_cli
from report_fixtures import case, draw, write_run

from spark_bench.results import ResultsError
from spark_bench.selection import select_records
from spark_bench.sweep import UsageError, op_overrides


def records():
    rng = np.random.default_rng(0)
    out = [case("kda.chunk_prefill", b, {"seq_len": t, "fused": f, "varlen": "fixed"}, samples=draw(rng, 10.0))
           for b in ("torch", "triton") for t in (64, 1024) for f in (True, False)]
    return out + [case("kda.gate", "torch", {"tokens": t, "heads": 4}, samples=draw(rng, 5.0)) for t in (1, 64)]


def one_line_error(*args):
    code, out, err = run_cli(*args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in out + err, (code, out, err)
    return err


def test_show_set_compares_values_not_text():
    recs = records()
    fused = select_records(recs, sets=("fused=true",))
    assert len(fused) == 4 and all(r["params"]["fused"] is True for r in fused)
    assert len(select_records(recs, sets=("fused=0", "seq_len=064"))) == 2  # false, and 64 as a number
    assert len(select_records(recs, sets=("tokens=1", "tokens=64"))) == 2  # an axis given twice: values add up
    with pytest.raises(ResultsError, match=r"no case has seq_len in \{5\}; the run has seq_len = 64, 1024"):
        select_records(recs, sets=("seq_len=5",))
    with pytest.raises(UsageError, match="axis 'fused' takes true/false, not 'maybe'"):
        select_records(recs, sets=("fused=maybe",))


def test_show_cli_set_true_and_bad_axes_name_the_valid_ones(tmp_path):
    run = write_run(tmp_path / "run", records())
    code, out, _ = run_cli("show", run, "--set", "fused=true")
    assert code == 0 and "4 cases, 4 ok" in out
    have = "the selected cases have: fused, heads, seq_len, tokens, varlen"
    assert have in one_line_error("show", run, "--set", "nosuch=1")
    err = one_line_error("show", run, "--set", "kda.gate:tokens=1")
    assert "unknown axis 'kda.gate:tokens'" in err and "--op kda.gate --set tokens=" in err and have in err


def test_history_trend_set_compares_values(tmp_path):
    from spark_bench.history import add_runs

    recs = [r for r in records() if r["op"] == "kda.chunk_prefill" and r["backend"] == "torch"]
    runs = [write_run(tmp_path / name, recs, run_id=name) for name in ("a", "b")]
    db = tmp_path / "history.db"
    add_runs(db, runs)
    code, out, err = run_cli("history", "trend", "--db", db, "--op", "kda.chunk_prefill", "--set", "fused=true",
                             "--set", "seq_len=64", "--json")
    assert code == 0, err
    (series,) = json.loads(out)
    assert series["params"]["fused"] is True and sum(len(p["runs"]) for p in series["points"]) == 2
    assert "axis 'fused' takes true/false" in one_line_error("history", "trend", "--db", db, "--op", "kda.*",
                                                             "--set", "fused=maybe")


@pytest.mark.parametrize("order", [1, -1])
def test_the_more_specific_op_set_wins_whatever_the_order(order):
    sets = [("kda.gate:tokens", ["64"]), ("kda.*:tokens", ["512"]), ("tokens", ["7"])][::order]
    overrides = dict(sets)
    assert op_overrides(overrides, "kda.gate") == {"tokens": ["64"]}
    assert op_overrides(overrides, "kda.gated_rmsnorm") == {"tokens": ["512"]}
    assert op_overrides(overrides, "moe.experts") == {"tokens": ["7"]}
    two_globs = dict([("kda.*:tokens", ["1"]), ("kda.g*:tokens", ["2"])][::order])
    with pytest.raises(UsageError, match="both set tokens of kda.gate; name the op"):
        op_overrides(two_globs, "kda.gate")
    assert op_overrides({**two_globs, "kda.gate:tokens": ["3"]}, "kda.gate") == {"tokens": ["3"]}


def test_two_globs_on_one_op_axis_are_a_usage_error():
    err = one_line_error("run", "--op", "kda.gate", "--backend", "torch", "--set", "kda.*:tokens=1", "--set",
                         "kda.g*:tokens=2", "--dry-run")
    assert "--set kda.*:tokens and --set kda.g*:tokens both set tokens of kda.gate" in err


@pytest.mark.parametrize("args, needle", [
    (["history", "report", "--last", "-3"], "--last"),
    (["history", "list", "--runs", "--limit", "0"], "--limit"),
    (["history", "list", "--runs", "--limit", "-1"], "--limit"),
    (["history", "check", "--since", "2000-01-01", "--repo", "/nonexistent"], "does not exist"),
    (["run", "--op", "kda.gate", "--dtype", ",", "--dry-run"], "--dtype ',' names nothing; choose from bf16"),
])
def test_ignored_options_are_usage_errors(args, needle):
    assert needle in one_line_error(*args)


def test_history_repo_outside_a_git_work_tree(tmp_path):
    err = one_line_error("history", "check", "--since", "2000-01-01", "--repo", tmp_path)
    assert "is not in a git work tree" in err


def test_an_axis_value_given_besides_the_sweep_is_accepted_but_not_swept():
    """Axis.also: moe.layer's shared_format sweeps `routed` only; --set takes bf16 too, and nothing else."""
    code, out, err = run_cli("run", "--op", "moe.layer", "--backend", "torch", "--quick", "--dry-run")
    assert code == 0, err
    assert "shared_format=routed" in out and "shared_format=bf16" not in out
    code, out, err = run_cli("run", "--op", "moe.layer", "--backend", "torch", "--quick", "--set",
                             "shared_format=bf16", "--dry-run")
    assert code == 0 and "shared_format=bf16" in out and "shared_format=routed" not in out, (out, err)
    err = one_line_error("run", "--op", "moe.layer", "--set", "shared_format=fp8", "--dry-run")
    assert "axis 'shared_format' has no value 'fp8'; choose from routed, bf16" in err
