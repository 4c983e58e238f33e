"""The history database: idempotent, transactional ingest (kill -9 included), two concurrent writers, schema versions
and migrations, one-line errors for corrupt or foreign files, fingerprints kept apart, runs without a commit, prune."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import zlib

import pytest
from conftest import run_cli

from spark_bench.history import ingest, store, synthetic
from spark_bench.history.ingest import add_runs
from spark_bench.history.store import HistoryError, connect


def history_cmd(*args):
    return [sys.executable, "-m", "spark_bench.history", *map(str, args)]


def dump(db) -> dict:
    """The logical content of a database: every table keyed by natural keys (no row ids, no ingest timestamps)."""
    con = sqlite3.connect(db)
    try:
        out = {
            "meta": sorted(con.execute("SELECT key, value FROM meta")),
            "fingerprints": sorted(con.execute("SELECT fingerprint_id, device_type, device_name, info "
                                               "FROM fingerprints")),
            "runs": sorted(con.execute("""SELECT r.run_id, r.digest, f.fingerprint_id, r.git_commit, r.dirty,
                                          r.commit_time, r.branch, r.created, r.finished, r.command, r.spec, r.summary,
                                          r.run_json, r.records, r.source
                                          FROM runs r JOIN fingerprints f ON f.id = r.fingerprint""")),
            "cases": sorted(con.execute("SELECT op, backend, dtype, params FROM cases")),
            "results": sorted(con.execute("""SELECT r.run_id, c.op, c.backend, c.dtype, c.params, x.status, x.error,
                                             x.timer, x.unit, x.median, x.mean, x.min, x.max, x.p10, x.p90, x.iqr,
                                             x.ci_low, x.ci_high, x.n, x.gbps, x.tflops, x.samples
                                             FROM results x JOIN runs r ON r.id = x.run_ref
                                             JOIN cases c ON c.id = x.case_ref""")),
        }
    finally:
        con.close()
    return out


def counts_per_run(db) -> dict[str, int]:
    con = sqlite3.connect(db)
    try:
        return dict(con.execute("SELECT r.run_id, COUNT(x.case_ref) FROM runs r LEFT JOIN results x "
                                "ON x.run_ref = r.id GROUP BY r.id"))
    finally:
        con.close()


def children(pid: int) -> list[int]:
    out = []
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(stat))
    return out


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def small_history(tmp_path):
    return synthetic.write_history(tmp_path / "runs", [f"{i:040x}" for i in range(1, 7)])


def test_a_tune_directory_is_not_a_sweep_to_add(tmp_path, small_history):
    import shutil

    tune = tmp_path / "runs" / "tune-1"  # one point timed under two configs: the same case key twice
    shutil.copytree(small_history[0], tune)
    run = json.loads((tune / "run.json").read_text())
    (tune / "run.json").write_text(json.dumps({**run, "run_id": "tune-1", "kind": "tune"}))
    lines = [json.loads(line) for line in (tune / "results.jsonl").read_text().splitlines()]
    twice = lines + [{**r, "case_id": r["case_id"] + "|k:BT=32"} for r in lines]
    (tune / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in twice))
    db = tmp_path / "h.db"
    assert add_runs(db, [tmp_path / "runs"]) == {"added": 6, "replaced": 0, "unchanged": 0}  # left out below
    with pytest.raises(HistoryError, match="tune-1 is a tune directory"):  # refused when named
        add_runs(db, [tune])


def test_ingest_stores_everything_and_twice_is_a_no_op(tmp_path, small_history):
    db = tmp_path / "h.db"
    assert add_runs(db, small_history) == {"added": 6, "replaced": 0, "unchanged": 0}
    first = dump(db)
    assert add_runs(db, small_history) == {"added": 0, "replaced": 0, "unchanged": 6}
    assert add_runs(db, [tmp_path / "runs"]) == {"added": 0, "replaced": 0, "unchanged": 6}  # a directory of runs
    assert dump(db) == first
    con = connect(db)
    try:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert con.execute("PRAGMA user_version").fetchone()[0] == store.SCHEMA_VERSION
        assert con.execute("SELECT COUNT(*) FROM cases").fetchone()[0] == 8
        blob, run_ref = con.execute("SELECT records, id FROM runs LIMIT 1").fetchone()
        stored = json.loads(zlib.decompress(blob))[0]
        samples, median, n = con.execute(
            "SELECT samples, median, n FROM results x JOIN cases c ON c.id = x.case_ref WHERE x.run_ref = ? AND "
            "c.op = ? AND c.backend = ? AND c.params = ?", (run_ref, stored["op"], stored["backend"],
                                                           json.dumps(stored["params"], sort_keys=True,
                                                                      separators=(",", ":")))).fetchone()
    finally:
        con.close()
    # the records keep everything but their samples, which are stored once per case as float64 (exactly)
    from spark_bench.results import load_run

    _, records = load_run(small_history[0])
    original = next(r for r in records if r["case_id"] == stored["case_id"])
    assert "samples" not in stored["timing"] and stored["check"] == original["check"]
    import numpy as np

    assert np.frombuffer(samples, "<f8").tolist() == original["timing"]["samples"]
    assert median == original["timing"]["median"] and n == original["timing"]["n"]


def test_a_changed_run_replaces_its_earlier_copy(tmp_path, small_history):
    db = tmp_path / "h.db"
    add_runs(db, small_history)
    run = small_history[2]
    from spark_bench.results import RunStore

    rec = synthetic.record(synthetic.SynthCase("kda.gate", "triton", {"tokens": 4096, "heads": 4}, 50.0), None,
                           status="mismatch", error="outputs differ")
    RunStore(run).append(rec)  # as a resumed run would
    assert add_runs(db, [run]) == {"added": 0, "replaced": 1, "unchanged": 0}
    assert counts_per_run(db)[run.name] == 9 and len(counts_per_run(db)) == 6


def test_failed_ingest_rolls_back_the_whole_run(tmp_path, small_history, monkeypatch):
    db = tmp_path / "h.db"
    add_runs(db, small_history[:2])
    before = dump(db)
    calls = {"n": 0}
    real = ingest.Ingest._case_ids

    def dies_midway(self, keys):
        real(self, keys)  # the run row and new cases are written by now
        calls["n"] += 1
        raise RuntimeError("killed")

    monkeypatch.setattr(ingest.Ingest, "_case_ids", dies_midway)
    with pytest.raises(RuntimeError):
        add_runs(db, small_history[2:3])
    assert calls["n"] == 1 and dump(db) == before


def test_kill_9_during_ingest_then_reingest_equals_one_clean_ingest(tmp_path):
    big = synthetic.cases(tokens=tuple(range(1, 376)))  # 1,500 cases per run: each run takes a while to write
    runs = synthetic.write_history(tmp_path / "runs", [f"{i:040x}" for i in range(1, 9)], case_list=big,
                                   samples=30, fast=True)  # 8 runs: parsed by worker processes
    db = tmp_path / "killed.db"
    proc = subprocess.Popen(history_cmd("add", "--db", db, "-q", *runs), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:  # kill it right after its first committed run
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
            try:
                if con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] >= 1:
                    break
            finally:
                con.close()
        except sqlite3.Error:
            pass
        time.sleep(0.01)
    workers = children(proc.pid)
    assert workers, "the runs should be parsed by worker processes"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if alive(w)], "parsing workers outlived the killed ingest"
    stored = counts_per_run(db)
    assert 1 <= len(stored) < len(runs), "the ingest should have been killed midway"
    assert set(stored.values()) == {len(big)}  # no half run
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()

    counts = add_runs(db, runs)
    assert counts["unchanged"] == len(stored) and counts["added"] == len(runs) - len(stored)
    clean = tmp_path / "clean.db"
    add_runs(clean, runs)
    assert dump(db) == dump(clean)


def test_two_concurrent_writers_lose_nothing(tmp_path):
    cases = synthetic.cases(tokens=tuple(range(1, 51)))  # 200 cases
    runs = synthetic.write_history(tmp_path / "runs", [f"{i:040x}" for i in range(1, 25)], case_list=cases,
                                   samples=20, fast=True)
    db = tmp_path / "h.db"
    a = subprocess.Popen(history_cmd("add", "--db", db, "-q", *runs[:16]), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    b = subprocess.Popen(history_cmd("add", "--db", db, "-q", *runs[8:][::-1]), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    for p in (a, b):
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, out + err
    stored = counts_per_run(db)
    assert sorted(stored) == sorted(r.name for r in runs)
    assert set(stored.values()) == {len(cases)}
    clean = tmp_path / "clean.db"
    add_runs(clean, runs)
    assert dump(db) == dump(clean)


@pytest.mark.parametrize("content, needle", [
    (b"\x00garbage" * 1000, "not a spark-bench history database"),
    (b'{"schema": "spark-bench/run"}\n', "not a spark-bench history database"),
])
def test_corrupt_database_is_a_one_line_error(tmp_path, content, needle):
    db = tmp_path / "h.db"
    db.write_bytes(content)
    for args in (["list"], ["trend", "--op", "kda.gate"], ["check", "--since", "2026-01-01"], ["report"]):
        code, out, err = run_cli("history", *args, "--db", db)
        assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, (args, err)
        assert err.startswith("spark-bench: error:") and "Traceback" not in out + err
    code, _, err = run_cli("history", "add", "--db", db, tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_foreign_and_newer_databases_are_refused(tmp_path, small_history):
    foreign = tmp_path / "foreign.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE benchmarks (name TEXT)")
    con.commit()
    con.close()
    with pytest.raises(HistoryError, match="not a spark-bench history database"):
        add_runs(foreign, small_history)
    code, _, err = run_cli("history", "list", "--db", foreign)
    assert code == 2 and "tables benchmarks" in err and len(err.strip().splitlines()) == 1

    newer = tmp_path / "newer.db"
    add_runs(newer, small_history[:1])
    con = sqlite3.connect(newer)
    con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    con.commit()
    con.close()
    code, _, err = run_cli("history", "list", "--db", newer)
    assert code == 2 and "newer spark-bench" in err
    code, _, err = run_cli("history", "list", "--db", tmp_path / "missing.db")
    assert code == 2 and "no history database" in err
    proc = subprocess.run(history_cmd("list", "--db", newer), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "newer spark-bench" in proc.stderr


def test_migrations_run_in_order_and_transactionally(tmp_path, small_history, monkeypatch):
    db = tmp_path / "h.db"
    add_runs(db, small_history[:2])
    before = dump(db)

    def broken_v2(con):
        con.execute("ALTER TABLE runs ADD COLUMN note TEXT")
        raise sqlite3.OperationalError("disk full, say")

    monkeypatch.setattr(store, "MIGRATIONS", [*store.MIGRATIONS, broken_v2])
    with pytest.raises(HistoryError, match="disk full, say"):
        connect(db)
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA user_version").fetchone()[0] == 1
    assert "note" not in [r[1] for r in con.execute("PRAGMA table_info(runs)")]
    con.close()
    assert dump(db) == before

    def v2(con):
        con.execute("ALTER TABLE runs ADD COLUMN note TEXT")
        con.execute("UPDATE runs SET note = 'migrated'")

    monkeypatch.setattr(store, "MIGRATIONS", [store._v1, v2])
    con = connect(db)
    try:
        assert con.execute("PRAGMA user_version").fetchone()[0] == 2
        assert dict(con.execute("SELECT key, value FROM meta"))["schema_version"] == "2"
        assert {r[0] for r in con.execute("SELECT note FROM runs")} == {"migrated"}
    finally:
        con.close()
    assert add_runs(db, small_history[:3])["added"] == 1  # the migrated database keeps working


def test_fingerprints_never_share_a_series_and_runs_without_a_commit_are_kept(tmp_path):
    a = synthetic.write_history(tmp_path / "a", [f"{i:040x}" for i in range(1, 9)], seed=1)
    slow_gpu = {**synthetic.H200, "name": "NVIDIA L4"}
    b = synthetic.write_history(tmp_path / "b", [f"{i:040x}" for i in range(1, 9)], seed=2, device=slow_gpu,
                                fingerprint_id="fp-l4", case_list=[
                                    synthetic.SynthCase(c.op, c.backend, c.params, c.base_us * 3)
                                    for c in synthetic.cases()])
    for i, path in enumerate(b):  # give the L4 runs their own ids
        path.rename(path.with_name(path.name + "-l4"))
        run = json.loads((path.with_name(path.name + "-l4") / "run.json").read_text())
        run["run_id"] += "-l4"
        (path.with_name(path.name + "-l4") / "run.json").write_text(json.dumps(run))
        b[i] = path.with_name(path.name + "-l4")
    none = synthetic.write_history(tmp_path / "c", [None, None], seed=3)
    for i, path in enumerate(none):
        run = json.loads((path / "run.json").read_text())
        run["run_id"] += "-nocommit"
        run["created"] = f"2026-09-{20 + i}T02:00:00+00:00"
        (path / "run.json").write_text(json.dumps(run))
    db = tmp_path / "h.db"
    add_runs(db, [*a, *b, *none])
    code, out, err = run_cli("history", "trend", "--db", db, "--op", "kda.gate", "--backend", "torch", "--set",
                             "tokens=256", "--json")
    assert code == 0, err
    series = json.loads(out)
    assert sorted(s["fingerprint_id"] for s in series) == ["fp-h200", "fp-l4"]
    for s in series:
        assert s["steps"] == []  # 3x apart, yet no step: the devices are never mixed
    h200 = next(s for s in series if s["fingerprint_id"] == "fp-h200")
    assert len(h200["points"]) == 10 and [p["commit"] for p in h200["points"][-2:]] == [None, None]
    code, out, _ = run_cli("history", "list", "--db", db)
    assert code == 0 and "NVIDIA L4" in out and "NVIDIA H200" in out
    code, out, _ = run_cli("history", "list", "--db", db, "--runs", "--fingerprint", "H200")
    assert code == 0 and out.count("no commit") == 2 and "-l4" not in out


def test_show_prune_and_selection_errors(tmp_path, small_history):
    db = tmp_path / "h.db"
    add_runs(db, small_history)
    code, out, err = run_cli("history", "show", "--db", db, small_history[0].name[:8], "--json")
    assert code == 0, err
    shown = json.loads(out)
    from spark_bench.results import load_run

    run, records = load_run(small_history[0])
    assert shown["run"] == run and sorted(r["case_id"] for r in shown["results"]) == sorted(
        r["case_id"] for r in records)
    assert next(r for r in shown["results"] if r["case_id"] == records[0]["case_id"]) == records[0]
    code, _, err = run_cli("history", "show", "--db", db, "2026")
    assert code == 2 and "matches 6 stored runs" in err
    code, _, err = run_cli("history", "trend", "--db", db, "--op", "kda.gate")
    assert code == 2 and "matches 4 cases" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli("history", "trend", "--db", db, "--op", "kda.gate", "--set", "tokens")
    assert code == 2 and "malformed --set" in err

    code, out, _ = run_cli("history", "prune", "--db", db, "--keep", "4", "--dry-run")
    assert code == 0 and out.count("would drop") == 2 and len(counts_per_run(db)) == 6
    code, out, _ = run_cli("history", "prune", "--db", db, "--keep", "4")
    assert code == 0 and sorted(counts_per_run(db)) == sorted(p.name for p in small_history[2:])
    code, out, _ = run_cli("history", "prune", "--db", db, "--older-than", "2026-09-05")
    assert code == 0 and sorted(counts_per_run(db)) == sorted(p.name for p in small_history[4:])
    code, _, err = run_cli("history", "prune", "--db", db, "--older-than", "soon")
    assert code == 2 and "expected an age" in err
    code, out, _ = run_cli("history", "prune", "--db", db, "--older-than", "0d")
    con = sqlite3.connect(db)
    assert [con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("runs", "results", "cases",
                                                                           "fingerprints")] == [0, 0, 0, 0]
    con.close()


def test_list_names_the_newest_commit_and_limit_keeps_the_newest_runs(tmp_path, small_history):
    from spark_bench.history import query

    db = tmp_path / "h.db"
    add_runs(db, list(reversed(small_history)))  # ingest order must not matter
    con = connect(db)
    try:
        assert query.fingerprints(con)[0]["latest_commit"] == f"{6:040x}"
        assert [r["run_id"] for r in query.runs(con, limit=2)] == [p.name for p in small_history[:-3:-1]]
    finally:
        con.close()
    code, out, _ = run_cli("history", "list", "--db", db, "--runs", "--limit", "1")
    assert code == 0 and small_history[-1].name[:12] in out and small_history[0].name[:12] not in out
