"""`history add` of a directory of runs skips a damaged run with a warning and adds the others (exit 1); a damaged run
named itself stays an error (exit 2). Another run reusing a run id (the same `--out` basename) is kept beside the
first, never in its place; the same run resumed replaces its copy, a copy of it with fewer cases only when allowed."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import sqlite3

import pytest
from conftest import run_cli

from spark_bench.history import synthetic
from spark_bench.history.ingest import add_runs
from spark_bench.history.store import HistoryError


def _damage(run_dir) -> None:
    """A malformed middle line in the run's journal."""
    journal = run_dir / "results.jsonl"
    lines = journal.read_text().splitlines()
    lines[1] = lines[1][:20]
    journal.write_text("\n".join(lines) + "\n")


def _run_ids(db) -> list[str]:
    con = sqlite3.connect(db)
    try:
        return sorted(r[0] for r in con.execute("SELECT run_id FROM runs"))
    finally:
        con.close()


@pytest.fixture
def runs(tmp_path):
    """Nine runs under tmp_path/runs (enough for the parallel parsers), the third one damaged."""
    made = synthetic.write_history(tmp_path / "runs", [f"{i:040x}" for i in range(1, 10)])
    _damage(made[2])
    return made


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_damaged_run_below_a_directory_is_skipped_and_the_others_added(tmp_path, runs, jobs):
    db, skipped = tmp_path / "h.db", []
    counts = add_runs(db, [tmp_path / "runs"], jobs=jobs, on_damaged=lambda path, why: skipped.append((path, why)))
    assert counts == {"added": 8, "replaced": 0, "unchanged": 0, "damaged": 1}
    assert [path for path, _ in skipped] == [runs[2]] and "malformed line" in skipped[0][1]
    assert _run_ids(db) == sorted(r.name for i, r in enumerate(runs) if i != 2)
    assert add_runs(db, [tmp_path / "runs"], jobs=jobs) == {"added": 0, "replaced": 0, "unchanged": 8, "damaged": 1}


def test_the_command_warns_adds_the_rest_and_exits_1(tmp_path, runs):
    db = tmp_path / "h.db"
    code, out, err = run_cli("history", "add", tmp_path / "runs", "--db", db, "-q")
    assert code == 1
    (warning,) = err.splitlines()
    assert warning.startswith(f"warning: skipped the damaged run {runs[2]}: ") and "malformed line" in warning
    assert "8 added" in out and "1 damaged" in out
    assert len(_run_ids(db)) == 8


def test_a_damaged_run_named_itself_is_an_error(tmp_path, runs):
    db = tmp_path / "h.db"
    with pytest.raises(HistoryError, match="malformed line"):
        add_runs(db, [runs[2]])
    code, out, err = run_cli("history", "add", runs[0], runs[2], "--db", db)
    assert code == 2 and err.startswith("spark-bench: error: ") and "malformed line" in err
    assert "Traceback" not in err and _run_ids(db) == []


def _one_run(path, created, fingerprint_id="fp-h200", median=50.0):
    case = synthetic.SynthCase("kda.gate", "triton", {"tokens": 4096, "heads": 4}, median)
    rec = synthetic.record(case, synthetic.draw(__import__("numpy").random.default_rng(0), median, 20, 0.01))
    if path.exists():
        shutil.rmtree(path)  # what a nightly job does to its --out before the next run
    return synthetic.write_run(path, [rec], run_id=path.name, commit=None, created=created,
                               fingerprint_id=fingerprint_id)


def _medians(db) -> dict[str, float]:
    con = sqlite3.connect(db)
    try:
        return dict(con.execute("SELECT r.run_id, x.median FROM runs r JOIN results x ON x.run_ref = r.id"))
    finally:
        con.close()


def test_another_run_reusing_an_id_is_kept_beside_the_first(tmp_path):
    db, nightly = tmp_path / "h.db", tmp_path / "nightly"
    day = dt.datetime(2026, 12, 1, 2, 0, tzinfo=dt.timezone.utc)
    _one_run(nightly, day, median=50.0)
    assert add_runs(db, [nightly]) == {"added": 1, "replaced": 0, "unchanged": 0}
    _one_run(nightly, day + dt.timedelta(days=1), median=60.0)  # the next night, same directory
    code, out, err = run_cli("history", "add", nightly, "--db", db)
    assert code == 0, err
    assert out.splitlines()[0].split()[:2] == ["added", "nightly@20261202T020000"]
    _one_run(tmp_path / "other" / "nightly", day, fingerprint_id="fp-a100", median=70.0)  # another machine's
    assert add_runs(db, [tmp_path / "other" / "nightly"])["added"] == 1
    assert _medians(db) == pytest.approx({"nightly": 50.0, "nightly@20261202T020000": 60.0,
                                          "nightly@20261201T020000": 70.0}, rel=0.05)
    seen = []
    assert add_runs(db, [nightly, tmp_path / "other" / "nightly"], on_run=lambda path, run_id, outcome: seen.append(
        run_id)) == {"added": 0, "replaced": 0, "unchanged": 2}
    assert seen == ["nightly@20261202T020000", "nightly@20261201T020000"]  # the ids they are stored under
    code, out, _ = run_cli("history", "show", "nightly@20261202", "--db", db)
    assert code == 0 and out.startswith("nightly@20261202T020000 on NVIDIA H200")  # the id it is stored under
    code, out, _ = run_cli("history", "show", "nightly@20261202", "--db", db, "--json")
    shown = json.loads(out)
    assert shown["stored_id"] == "nightly@20261202T020000" and shown["run"]["run_id"] == "nightly"


def test_list_counts_a_killed_runs_failures_from_its_results(tmp_path):
    """A run killed before its end has no summary in run.json: its failures were listed as 0."""
    db = tmp_path / "h.db"
    case = synthetic.SynthCase("kda.gate", "triton", {"tokens": 4096, "heads": 4}, 50.0)
    killed = synthetic.write_run(tmp_path / "killed", [synthetic.record(case, None, status="mismatch", error="x")],
                                 run_id="killed", commit=None, created=dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc))
    run = json.loads((killed / "run.json").read_text())
    (killed / "run.json").write_text(json.dumps({**run, "summary": None, "finished": None}))
    add_runs(db, [killed])
    code, out, _ = run_cli("history", "list", "--runs", "--db", db, "--json")
    (row,) = json.loads(out)
    assert code == 0 and row["failed"] == 1 and row["cases"] == 1
    code, out, _ = run_cli("history", "list", "--runs", "--db", db)
    assert "run at" in out and "2026-12-01T00:00:00+00:00" in out


def test_the_same_run_resumed_replaces_its_copy_under_its_stored_id(tmp_path):
    from spark_bench.results import RunStore

    db, nightly = tmp_path / "h.db", tmp_path / "nightly"
    day = dt.datetime(2026, 12, 1, 2, 0, tzinfo=dt.timezone.utc)
    _one_run(nightly, day)
    add_runs(db, [nightly])
    _one_run(nightly, day + dt.timedelta(days=1))
    add_runs(db, [nightly])
    extra = synthetic.record(synthetic.SynthCase("moe.router", "triton", {"tokens": 64}, 9.0), None,
                             status="mismatch", error="outputs differ")
    RunStore(nightly).append(extra)  # the second night's run, resumed
    seen = []
    assert add_runs(db, [nightly], on_run=lambda path, run_id, outcome: seen.append((run_id, outcome))) == \
        {"added": 0, "replaced": 1, "unchanged": 0}
    assert seen == [("nightly@20261202T020000", "replaced")]
    con = sqlite3.connect(db)
    try:
        per_run = dict(con.execute("SELECT r.run_id, COUNT(*) FROM runs r JOIN results x ON x.run_ref = r.id "
                                   "GROUP BY r.id"))
    finally:
        con.close()
    assert per_run == {"nightly": 1, "nightly@20261202T020000": 2}


def _two_case_run(path):
    cases = [synthetic.SynthCase("kda.gate", "triton", {"tokens": t, "heads": 4}, 50.0) for t in (16, 256)]
    rng = __import__("numpy").random.default_rng(0)
    return synthetic.write_run(path, [synthetic.record(c, synthetic.draw(rng, 50.0, 20, 0.01)) for c in cases],
                               run_id="a", commit=None, created=dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc))


@pytest.mark.parametrize("keep_lines", [0, 1])  # no results at all; a truncated results.jsonl
def test_a_changed_copy_with_fewer_cases_does_not_replace_the_stored_run(tmp_path, keep_lines):
    db, run = tmp_path / "h.db", _two_case_run(tmp_path / "a")
    assert add_runs(db, [run])["added"] == 1
    short = tmp_path / "below" / "short"
    shutil.copytree(run, short)  # the same run id, creation time and fingerprint: a copy of run `a`
    journal = short / "results.jsonl"
    journal.write_text("".join(journal.read_text().splitlines(keepends=True)[:keep_lines]))
    code, out, err = run_cli("history", "add", short, "--db", db)
    assert code == 2 and "Traceback" not in out + err
    (line,) = err.strip().splitlines()
    assert f"now holds {keep_lines} case(s) where its stored copy a holds 2" in line and "--allow-fewer-cases" in line
    code, out, err = run_cli("history", "add", tmp_path / "below", "--db", db)  # found below a directory: skipped
    assert code == 1 and "1 damaged" in out and err.startswith(f"warning: skipped the damaged run {short}: "), err
    con = sqlite3.connect(db)
    try:
        assert con.execute("SELECT COUNT(*) FROM results").fetchone()[0] == 2  # the stored copy is intact
    finally:
        con.close()
    code, out, err = run_cli("history", "add", short, "--db", db, "--allow-fewer-cases")
    assert code == 0 and out.startswith("replaced  a "), err
    code, out, _ = run_cli("history", "list", "--runs", "--json", "--db", db)
    assert [r["cases"] for r in json.loads(out)] == [keep_lines]
