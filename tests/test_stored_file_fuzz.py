"""Stored files damaged in the ways a fuzz of every reader found (run.json, results.jsonl, a tune's plan, a tuned
table, the history database): each command either works or says what is wrong in one line naming the file, exit 2,
never a traceback."""

from __future__ import annotations

import json
import shutil
import sqlite3

import numpy as np
import pytest
from conftest import run_cli

from spark_bench.fingerprint import fingerprint
from spark_bench.history import synthetic
from spark_bench.results import RunStore
from spark_bench.timing import TimingConfig

SPEC = {"ops": ["kda.gate"], "backends": ["torch"], "preset": None, "overrides": {"tokens": ["1"], "heads": ["4"]},
        "dtypes": [], "device": "cpu", "quick": True, "seed": 0, "weights": None, "tuned": None, "timers": {},
        "timing": TimingConfig.quick().to_dict(), "timeout_s": 600.0}


def one_error_line(code: int, err: str, *needles: str) -> str:
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith("spark-bench: error: ") and "Traceback" not in err, line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def cpu_run(path, spec=None, **extra):
    """A run directory of this machine's CPU holding no case yet (what `run --resume` and `--like` read)."""
    RunStore(path).create({"run_id": path.name, "created": "2026-12-01T00:00:00+00:00", "finished": None,
                           "fingerprint": fingerprint("cpu"), "command": ["spark-bench", "run"],
                           "spec": spec or SPEC, "roofline": None, "summary": None, **extra})
    return path


def synthetic_run(path, **record_changes):
    case = synthetic.cases(ops=("kda.gate",), backends=("torch",), tokens=(16,))[0]
    rec = synthetic.record(case, synthetic.draw(np.random.default_rng(0), 10.0, 12, 0.02))
    rec.update(record_changes)
    return synthetic.write_run(path, [rec], run_id=path.name, commit=None, created=synthetic.START)


def test_run_dry_run_estimates_past_a_stored_journal_it_cannot_decode(tmp_path, monkeypatch):
    """--dry-run (and a run's ETA) reads every results/*/results.jsonl for durations: a byte that is not UTF-8, an
    op that is a list, a duration beyond a float skip that line, as a torn line is skipped."""
    good = json.dumps({"case_id": "a", "op": "kda.gate", "backend": "torch", "device": "cpu", "duration_s": 2.0})
    for name, line in [("bytes", b'{"duration_s": 1, "op": "\xff"}'),
                       ("list", json.dumps({"case_id": "b", "op": ["x"], "backend": "torch", "device": "cpu",
                                            "duration_s": 1.0}).encode()),
                       ("huge", json.dumps({"case_id": "c", "op": "kda.gate", "backend": "torch", "device": "cpu",
                                            "duration_s": 10 ** 400}).encode())]:
        (tmp_path / "results" / name).mkdir(parents=True)
        (tmp_path / "results" / name / "results.jsonl").write_bytes(line + b"\n" + good.encode() + b"\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("run", "--dry-run", "--device", "cpu", "--op", "kda.gate", "--backend", "torch",
                             "--set", "tokens=1", "--set", "heads=4")
    assert code == 0, err
    assert "estimate" in out


@pytest.mark.parametrize("field, value", [("backends", [[[]]]), ("device", {"a": 1}), ("dtypes", 1.5),
                                          ("overrides", {"tokens": [{"a": 1}]}), ("timeout_s", 10 ** 400),
                                          ("timing", {**TimingConfig.quick().to_dict(), "min_samples": "x"})])
@pytest.mark.parametrize("how", ["--resume", "--like"])
def test_resume_and_like_refuse_a_spec_of_the_wrong_types(tmp_path, field, value, how):
    run = cpu_run(tmp_path / "r", {**SPEC, field: value})
    code, _out, err = run_cli("run", how, run, "--dry-run")
    one_error_line(code, err, str(run / "run.json"), "no usable sweep spec")


def test_like_takes_the_intact_spec(tmp_path):
    code, out, err = run_cli("run", "--like", cpu_run(tmp_path / "r"), "--dry-run")
    assert code == 0, err
    assert "2 cases on cpu" in out  # head_dim 60 and 128 at tokens=1, heads=4


def tune_dir(tmp_path, change=None):
    case = {"op": "kda.gate", "backend": "triton", "params": {"tokens": 7, "heads": 4, "head_dim": 60},
            "dtype": "bf16", "device": "cpu", "seed": 0}
    item = {"case": case, "kernel": "kda.gate._kda_gate_fwd",
            "keys": [{"key": {"T": 7, "K": 60, "dtype": "torch.bfloat16"},
                      "config": {"BT": 64, "HEADS_FASTEST": 1, "num_warps": 4}}],
            "candidates": [{"config": {"BT": 32, "HEADS_FASTEST": 1, "num_warps": 4},
                            "id": "BT=32,HEADS_FASTEST=1,num_warps=4", "status": "ok", "reason": None}]}
    if change:
        change(item)
    tune = {"plan": {"items": [item], "untunable": [], "capture_errors": [], "target": None}, "budget_s": None,
            "spent_s": 1.0, "planning_s": 1.0, "out": str(tmp_path / "tuned.json")}
    return cpu_run(tmp_path / "tune", {**SPEC, "backends": ["triton"]}, kind="tune", tune=tune)


@pytest.mark.parametrize("change", [
    lambda i: i["candidates"].__setitem__(0, float("nan")),
    lambda i: i["candidates"][0].__setitem__("id", {}),
    lambda i: i.__setitem__("kernel", [1, "a"]),
    lambda i: i["keys"][0].__setitem__("key", [1, "a"]),
    lambda i: i["candidates"][0].pop("config"),
    lambda i: i["candidates"][0].__setitem__("config", [1]),
    lambda i: i["case"].__setitem__("colour", "red"),
], ids=["candidate-number", "id-object", "kernel-list", "key-list", "no-config", "config-list", "case-extra-key"])
def test_tune_resume_refuses_a_damaged_plan(tmp_path, change):
    run = tune_dir(tmp_path, change)
    code, _out, err = run_cli("tune", "--resume", run)
    one_error_line(code, err, str(run / "run.json"), "the tune's")


@pytest.mark.parametrize("key", ["plan", "out"])
def test_tune_resume_refuses_a_tune_without_its_plan_or_table(tmp_path, key):
    run = tune_dir(tmp_path)
    doc = json.loads((run / "run.json").read_text())
    del doc["tune"][key]
    (run / "run.json").write_text(json.dumps(doc))
    one_error_line(*run_cli("tune", "--resume", run)[::2], str(run / "run.json"), "the tune's")


def test_tune_resume_of_a_damaged_journal_is_one_line(tmp_path):
    run = tune_dir(tmp_path)
    (run / "results.jsonl").write_text('{"schema_version": 1, "case_id": "x", "op": "kda.gate"}\n')
    code, _out, err = run_cli("tune", "--resume", run)
    one_error_line(code, err, str(run / "results.jsonl"), "missing required field")


def _history(tmp_path):
    db = tmp_path / "history.db"
    run = synthetic_run(tmp_path / "r1")
    assert run_cli("history", "add", run, "--db", db)[0] == 0
    return db


@pytest.mark.parametrize("damage, args", [
    ("UPDATE runs SET records = X'789c0bce4f4d'", ["show", "r1"]),  # zlib's header, then garbage
    ("UPDATE runs SET run_json = X'789cffffffff'", ["show", "r1"]),
    ("UPDATE runs SET summary = 'not json'", ["list", "--runs"]),
    ("schema", ["list"]),
    ("UPDATE cases SET params = CAST(X'7bff7d' AS TEXT)", ["trend", "--op", "kda.gate"]),
    # valid SQLite, values of another type than their column's (only another program writes them)
    ("UPDATE results SET median = 'abc'", ["trend", "--op", "kda.gate"]),
    ("UPDATE results SET median = 'abc'", ["check", "--since", "2000-01-01"]),
    ("UPDATE results SET n = 'many'", ["report", "-o", "trends.html"]),
    ("UPDATE results SET samples = 'xyz'", ["show", "r1"]),
    ("UPDATE results SET status = X'6f6b'", ["trend", "--op", "kda.gate"]),
    ("UPDATE runs SET commit_time = X'00'", ["report", "-o", "trends.html"]),
])
def test_history_names_a_damaged_database(tmp_path, damage, args):
    db = _history(tmp_path)
    if damage == "schema":
        _flip_schema_byte(db)
    else:
        con = sqlite3.connect(db)
        con.execute(damage)
        con.commit()
        con.close()
    args = [str(tmp_path / a) if a.endswith(".html") else a for a in args]
    code, _out, err = run_cli("history", *args, "--db", db)
    one_error_line(code, err, str(db))


def test_a_wrong_typed_value_is_named_by_its_column(tmp_path):
    db = _history(tmp_path)
    con = sqlite3.connect(db)
    con.execute("UPDATE results SET median = 'abc'")
    con.commit()
    con.close()
    code, _out, err = run_cli("history", "trend", "--op", "kda.gate", "--db", db)
    assert err.strip().endswith("damaged history database (results.median holds text where the schema has REAL "
                                "(row 1))"), err


def test_a_type_error_of_ours_keeps_its_traceback(tmp_path, monkeypatch):
    """Only a database that holds a wrong-typed value turns a TypeError into one line: a bug is not hidden."""
    from spark_bench.history import cli as history_cli

    def broken(*args, **kwargs):
        raise TypeError("a bug of ours")

    monkeypatch.setattr(history_cli, "_series", broken)
    with pytest.raises(TypeError, match="a bug of ours"):
        run_cli("history", "check", "--since", "2000-01-01", "--db", _history(tmp_path))


def _flip_schema_byte(db) -> None:
    """A byte of the schema's SQL (page 1) no longer UTF-8: SQLite's error quotes it, Python cannot decode it."""
    data = bytearray(db.read_bytes())
    data[data.index(b"CREATE TABLE runs") + 6] = 0x9A
    db.write_bytes(bytes(data))


def test_run_history_names_a_database_whose_schema_does_not_decode(tmp_path):
    db = _history(tmp_path)
    _flip_schema_byte(db)
    code, _out, err = run_cli("run", "--history", db, "--device", "cpu", "--op", "kda.gate", "--backend", "torch",
                              "--set", "tokens=1", "--set", "heads=4", "--dry-run")
    one_error_line(code, err, str(db))


def test_report_of_a_run_whose_intensity_underflows_is_written(tmp_path):
    run = synthetic_run(tmp_path / "r1", cost={"flops": 1e-320, "bytes": 5000.0})  # FLOP/byte: 0.0
    code, _out, err = run_cli("report", run, "-o", tmp_path / "r.html")
    assert code == 0, err
    assert (tmp_path / "r.html").stat().st_size > 0


def _text_with(record_line: str, key: str, raw: str) -> str:
    """The JSON text of a record with `key` set to the raw JSON token `raw` (as a file can hold it)."""
    rec = json.loads(record_line)
    rec[key] = "@@"
    return json.dumps(rec).replace('"@@"', raw)


@pytest.mark.parametrize("raw", ['"bad \\ud800 x"', "1" * 5000], ids=["lone-surrogate", "5000-digit-integer"])
def test_a_string_or_number_python_cannot_take_is_one_line(tmp_path, raw):
    run = synthetic_run(tmp_path / "r1")
    results = run / "results.jsonl"
    results.write_text(_text_with(results.read_text().splitlines()[0], "error", raw) + "\n")
    one_error_line(*run_cli("show", run)[::2], f"{results}:1: malformed line")
    other = shutil.copytree(synthetic_run(tmp_path / "r2"), tmp_path / "r3")
    run_json = other / "run.json"
    run_json.write_text(_text_with(run_json.read_text(), "finished", raw))
    one_error_line(*run_cli("show", other)[::2], str(run_json), "not valid JSON")


@pytest.mark.parametrize("raw", ['["\\udc80"]', "1" * 5000], ids=["lone-surrogate", "5000-digit-integer"])
def test_a_tuned_table_python_cannot_take_is_one_line(tmp_path, raw):
    table = {"schema": "spark-bench.tuned", "schema_version": 1, "device": {"type": "cpu", "name": "cpu"},
             "device_id": "x", "updated": None, "versions": {}, "kernels": {"k": [
                 {"key": {"N": 1}, "config": {"B": 1}, "time_us": 1.0, "default": {"config": {"B": 2}, "time_us": 2.0},
                  "runner_up": None, "speedup": 2.0, "cases": 1, "labels": "@@"}]}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table).replace('"@@"', raw))
    one_error_line(*run_cli("tuned", "show", path)[::2], str(path), "not valid JSON")


@pytest.mark.parametrize("value", ["x", [1], {"cases_left": {"a": 1}}])
@pytest.mark.parametrize("command", ["show", "report"])
def test_a_run_json_budget_note_of_another_type_is_one_line(tmp_path, value, command):
    run = synthetic_run(tmp_path / "r1")
    run_json = run / "run.json"
    run_json.write_text(json.dumps({**json.loads(run_json.read_text()), "stopped_by_budget": value}))
    args = [command, run] + (["-o", tmp_path / "r.html"] if command == "report" else [])
    one_error_line(*run_cli(*args)[::2], str(run_json), "stopped_by_budget")
