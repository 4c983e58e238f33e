"""`history add` of a directory of runs skips a damaged run with a warning and adds the others (exit 1); a damaged run
named itself stays an error (exit 2)."""

from __future__ import annotations

import sqlite3

import pytest
from conftest import run_cli

from spark_bench.history import synthetic
from spark_bench.history.store import HistoryError, add_runs


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
