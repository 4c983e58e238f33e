"""History ingest, store and query edges the other history tests leave open (found by mutation testing): a resumed
case keeps its last record, a non-finite statistic is stored as unknown, a run id is not the prefix of another's, a
copy with as many cases replaces its run, --branch and the repository's commit time win, prune's cut-off and branch,
series in commit order, fingerprint/run prefixes taken literally, case selection by dtype in numeric order, and a
database one schema version newer refused."""

from __future__ import annotations

import datetime as dt
import math
import sqlite3

import numpy as np
import pytest

from spark_bench.history import synthetic
from spark_bench.history.ingest import add_runs

DAY = dt.datetime(2026, 12, 1, 2, 0, tzinfo=dt.timezone.utc)
GATE = synthetic.SynthCase("kda.gate", "triton", {"tokens": 16, "heads": 4}, 50.0)


def _timed(case: synthetic.SynthCase, median: float, seed: int = 0) -> dict:
    return synthetic.record(case, synthetic.draw(np.random.default_rng(seed), median, 20, 0.01))


def _rows(db, sql: str, args=()) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def test_a_resumed_case_is_stored_with_its_last_record(tmp_path):
    first = synthetic.record(GATE, None, status="timeout", error="> 60 s")  # killed, then resumed: timed
    run = synthetic.write_run(tmp_path / "r", [first, _timed(GATE, 50.0)], run_id="r", commit=None, created=DAY)
    add_runs(tmp_path / "h.db", [run])
    ((status, median, error),) = _rows(tmp_path / "h.db", "SELECT status, median, error FROM results")
    assert status == "ok" and median == pytest.approx(50.0, rel=0.05) and error is None


def test_a_non_finite_statistic_is_stored_as_unknown(tmp_path):
    rec = _timed(GATE, 50.0)
    rec["timing"]["n"] = math.nan  # a run written with allow_nan (an interrupted statistic)
    rec["gbps"] = math.nan
    run = synthetic.write_run(tmp_path / "r", [rec], run_id="r", commit=None, created=DAY, fast=True)
    assert add_runs(tmp_path / "h.db", [run])["added"] == 1
    assert _rows(tmp_path / "h.db", "SELECT status, n, gbps FROM results") == [("ok", None, None)]


def test_a_run_whose_id_extends_another_s_is_another_run(tmp_path):
    """`nightly-b` and `nightly`, created in the same second on the same machine: two runs. Only `nightly@...` is a
    copy of `nightly` stored under another id."""
    db = tmp_path / "h.db"
    b = synthetic.write_run(tmp_path / "nightly-b", [_timed(GATE, 70.0)], run_id="nightly-b", commit=None,
                            created=DAY)
    a = synthetic.write_run(tmp_path / "nightly", [_timed(GATE, 50.0)], run_id="nightly", commit=None, created=DAY)
    assert add_runs(db, [b]) == {"added": 1, "replaced": 0, "unchanged": 0}
    assert add_runs(db, [a]) == {"added": 1, "replaced": 0, "unchanged": 0}
    assert add_runs(db, [a, b]) == {"added": 0, "replaced": 0, "unchanged": 2}
    assert sorted(r[0] for r in _rows(db, "SELECT run_id FROM runs")) == ["nightly", "nightly-b"]


def test_a_changed_copy_with_as_many_cases_replaces_the_stored_run(tmp_path):
    """A resumed run that re-did its one case (now a mismatch) holds as many cases as its copy: it replaces it."""
    db = tmp_path / "h.db"
    run = synthetic.write_run(tmp_path / "r", [_timed(GATE, 50.0)], run_id="r", commit=None, created=DAY)
    add_runs(db, [run])
    wrong = synthetic.record(GATE, None, status="mismatch", error="outputs differ")
    synthetic.write_run(tmp_path / "r2", [_timed(GATE, 50.0), wrong], run_id="r", commit=None, created=DAY)
    (tmp_path / "r" / "results.jsonl").write_text((tmp_path / "r2" / "results.jsonl").read_text())
    assert add_runs(db, [run]) == {"added": 0, "replaced": 1, "unchanged": 0}
    assert _rows(db, "SELECT r.run_id, x.status FROM runs r JOIN results x ON x.run_ref = r.id") == [("r", "mismatch")]


def _with_git(run_dir, **git) -> None:
    """Add facts to the run's git fingerprint (what `run` records in a repository)."""
    import json

    path = run_dir / "run.json"
    run = json.loads(path.read_text())
    run["fingerprint"]["git"].update(git)
    path.write_text(json.dumps(run))


def test_branch_given_at_ingest_overrides_the_run_s_own(tmp_path):
    from spark_bench.history import query
    from spark_bench.history.store import connect

    db = tmp_path / "h.db"
    a = synthetic.write_run(tmp_path / "a", [_timed(GATE, 50.0)], run_id="a", commit="a" * 40, created=DAY)
    b = synthetic.write_run(tmp_path / "b", [_timed(GATE, 50.0)], run_id="b", commit="b" * 40,
                            created=DAY + dt.timedelta(days=1))
    _with_git(a, branch="feature")
    _with_git(b, branch="feature")
    add_runs(db, [a], repo=tmp_path / "no-repo", branch="main")  # --branch main
    add_runs(db, [b], repo=tmp_path / "no-repo")  # no --branch: the run's own
    con = connect(db)
    try:
        assert {r["run_id"]: r["branch"] for r in query.runs(con)} == {"a": "main", "b": "feature"}
    finally:
        con.close()


def test_a_run_without_a_commit_is_neither_clean_nor_dirty(tmp_path):
    from spark_bench.history import query
    from spark_bench.history.store import connect

    db = tmp_path / "h.db"
    made = (("none", None, False), ("clean", "c" * 40, False), ("dirty", "d" * 40, True))
    runs = [synthetic.write_run(tmp_path / name, [_timed(GATE, 50.0)], run_id=name, commit=commit, created=DAY,
                                dirty=dirty) for name, commit, dirty in made]
    add_runs(db, runs, repo=tmp_path / "no-repo")
    con = connect(db)
    try:
        assert {r["run_id"]: r["dirty"] for r in query.runs(con)} == {"none": None, "clean": False, "dirty": True}
    finally:
        con.close()


def test_the_repository_s_commit_time_is_preferred_over_the_run_s_own(tmp_path):
    (sha,) = synthetic.git_repo(tmp_path / "repo", 1)
    run = synthetic.write_run(tmp_path / "r", [_timed(GATE, 50.0)], run_id="r", commit=sha, created=DAY)
    _with_git(run, commit_time="2020-01-01T00:00:00+00:00")  # a stale or hand-edited time
    add_runs(tmp_path / "h.db", [run], repo=tmp_path / "repo")
    ((stored,),) = _rows(tmp_path / "h.db", "SELECT commit_time FROM runs")
    assert stored.startswith((synthetic.START - dt.timedelta(hours=3)).strftime("%Y-%m-%dT%H:%M:%S"))


def test_runs_of_one_id_and_second_on_three_machines_are_told_apart_by_their_fingerprint(tmp_path):
    db = tmp_path / "h.db"
    for fp in ("fp-a", "fp-b", "fp-c"):
        run = synthetic.write_run(tmp_path / fp / "nightly", [_timed(GATE, 50.0)], run_id="nightly", commit=None,
                                  created=DAY, fingerprint_id=fp)
        assert add_runs(db, [run])["added"] == 1
    assert sorted(r[0] for r in _rows(db, "SELECT run_id FROM runs")) == [
        "nightly", "nightly@20261201T020000", "nightly@20261201T020000-fp-c"]


def test_prune_older_than_a_date_keeps_a_run_created_at_that_very_second(tmp_path):
    from spark_bench.history.gate import parse_age
    from spark_bench.history.store import connect, prune

    db = tmp_path / "h.db"
    midnight = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
    runs = [synthetic.write_run(tmp_path / name, [_timed(GATE, 50.0)], run_id=name, commit=None, created=when)
            for name, when in (("before", midnight - dt.timedelta(seconds=1)), ("at", midnight),
                               ("after", midnight + dt.timedelta(days=1)))]
    add_runs(db, runs)
    con = connect(db)
    try:
        assert prune(con, cutoff=parse_age("2026-12-01")) == ["before"]
    finally:
        con.close()
    assert sorted(r[0] for r in _rows(db, "SELECT run_id FROM runs")) == ["after", "at"]


def test_prune_of_one_branch_leaves_the_other_branches_runs(tmp_path):
    from spark_bench.history.store import connect, prune

    db = tmp_path / "h.db"
    for i, branch in enumerate(("main", "main", "feature", "feature")):
        name = f"{branch}-{i}"
        run = synthetic.write_run(tmp_path / name, [_timed(GATE, 50.0)], run_id=name, commit=None,
                                  created=DAY + dt.timedelta(days=i))
        add_runs(db, [run], branch=branch)
    con = connect(db)
    try:
        assert prune(con, keep=1, branch="main") == ["main-0"]  # the newest main run kept; feature untouched
    finally:
        con.close()
    assert sorted(r[0] for r in _rows(db, "SELECT run_id FROM runs")) == ["feature-2", "feature-3", "main-1"]


def test_a_series_is_in_commit_order_even_when_runs_were_made_out_of_order(tmp_path):
    """A backfill: the older commit measured a day after the newer one. Its point comes first."""
    from spark_bench.history import query
    from spark_bench.history.store import connect

    old, new = synthetic.git_repo(tmp_path / "repo", 2)
    db = tmp_path / "h.db"
    runs = [synthetic.write_run(tmp_path / name, [_timed(GATE, 50.0)], run_id=name, commit=sha, created=when)
            for name, sha, when in (("of-new", new, DAY), ("of-old", old, DAY + dt.timedelta(days=1)))]
    add_runs(db, runs, repo=tmp_path / "repo")
    con = connect(db)
    try:
        (case,) = query.select_cases(con)
        assert [r["run_id"] for r in query.series_rows(con, [case.id])] == ["of-old", "of-new"]
    finally:
        con.close()


def _db_of(tmp_path, runs: list[tuple[str, str, list[dict]]]):
    """A database of runs (run id, fingerprint id, records), all created DAY; returns an open connection."""
    from spark_bench.history.store import connect

    db = tmp_path / "h.db"
    add_runs(db, [synthetic.write_run(tmp_path / run_id, records, run_id=run_id, commit=None, created=DAY,
                                      fingerprint_id=fp) for run_id, fp, records in runs])
    return connect(db)


def test_a_fingerprint_is_found_by_a_prefix_not_by_a_piece_of_its_middle(tmp_path):
    from spark_bench.history import query

    con = _db_of(tmp_path, [("a", "abc123", [_timed(GATE, 50.0)]), ("b", "zabc99", [_timed(GATE, 50.0)])])
    try:
        assert query.resolve_fingerprint(con, "abc") == "abc123"
    finally:
        con.close()


def test_a_run_prefix_with_an_underscore_matches_it_literally(tmp_path):
    from spark_bench.history import query

    con = _db_of(tmp_path, [("a_b-1", "fp", [_timed(GATE, 50.0)]), ("axb-2", "fp", [_timed(GATE, 50.0)])])
    try:
        assert query.run(con, "a_b")["stored_id"] == "a_b-1"  # `_` is no LIKE wildcard here
    finally:
        con.close()


def test_select_cases_by_dtype_and_in_numeric_order(tmp_path):
    from spark_bench.history import query

    cases = [synthetic.SynthCase("kda.gate", "triton", {"tokens": t}, 50.0, dtype=d)
             for t in (256, 4, 16) for d in ("bf16", "fp32")]
    con = _db_of(tmp_path, [("a", "fp", [_timed(c, 50.0) for c in cases])])
    try:
        picked = query.select_cases(con, dtypes=["bf16"])
        assert [(c.dtype, c.params["tokens"]) for c in picked] == [("bf16", 4), ("bf16", 16), ("bf16", 256)]
    finally:
        con.close()


def test_a_run_named_in_full_is_that_run_though_it_is_the_prefix_of_another(tmp_path):
    from spark_bench.history import query

    con = _db_of(tmp_path, [("nightly", "fp", [_timed(GATE, 50.0)]), ("nightly-2", "fp", [_timed(GATE, 60.0)])])
    try:
        assert query.run(con, "nightly")["stored_id"] == "nightly"
    finally:
        con.close()


def test_a_database_one_schema_version_newer_is_refused(tmp_path):
    from spark_bench.history.store import SCHEMA_VERSION, HistoryError, connect

    db = tmp_path / "h.db"
    add_runs(db, [synthetic.write_run(tmp_path / "r", [_timed(GATE, 50.0)], run_id="r", commit=None, created=DAY)])
    con = sqlite3.connect(db)
    con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    con.commit()
    con.close()
    with pytest.raises(HistoryError, match="newer spark-bench"):
        connect(db)
