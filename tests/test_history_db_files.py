"""The commands that only read the history database (list, show, trend, check, report; prune's selection too) never
create or change a file that is not already a history database: an empty file, a text file, an empty or foreign SQLite
database are refused with one line (exit 2) and left byte for byte as they were. `history add` still creates a
database in an empty file."""

from __future__ import annotations

import sqlite3

import pytest
from conftest import run_cli

from spark_bench.history import synthetic

READ_ONLY = (["list"], ["list", "--runs"], ["show", "some-run"], ["trend", "--op", "kda.gate"],
             ["check", "--since", "2026-01-01"], ["report"], ["prune", "--keep", "1"])


def _sqlite(path, *statements) -> None:
    con = sqlite3.connect(path)
    for statement in statements:
        con.execute(statement)
    con.commit()
    con.close()


def _make(kind: str, path) -> str:
    """A file that is not a history database; the words the refusal names it by."""
    if kind == "empty file":
        path.write_bytes(b"")
        return "an empty file"
    if kind == "text file":
        path.write_text("not a database\n")
        return "not a SQLite file"
    if kind == "empty SQLite":
        _sqlite(path, "CREATE TABLE t (a)", "DROP TABLE t")  # a valid SQLite file with no table
        return "an empty SQLite database"
    _sqlite(path, "CREATE TABLE benchmarks (name TEXT)", "INSERT INTO benchmarks VALUES ('x')")
    return "tables benchmarks"


def _snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("kind", ["empty file", "text file", "empty SQLite", "foreign SQLite"])
def test_read_only_commands_refuse_a_file_that_is_no_history_database_and_leave_it_alone(tmp_path, kind):
    folder = tmp_path / "db"
    folder.mkdir()
    db = folder / "afile"
    needle = _make(kind, db)
    before = _snapshot(folder)
    for args in READ_ONLY:
        code, out, err = run_cli("history", *args, "--db", db)
        assert code == 2, (args, out, err)
        (line,) = err.strip().splitlines()
        assert line.startswith("spark-bench: error: ") and "not a spark-bench history database" in line, (args, line)
        assert needle in line and "Traceback" not in out + err, (args, line)
        assert _snapshot(folder) == before, args  # no schema written, no journal mode changed, no -wal/-shm left


def test_add_still_creates_a_database_in_an_empty_file(tmp_path):
    runs = synthetic.write_history(tmp_path / "runs", [f"{i:040x}" for i in range(1, 3)])
    db = tmp_path / "afile"
    db.write_bytes(b"")
    code, out, err = run_cli("history", "add", *runs, "--db", db, "-q")
    assert code == 0 and "2 added" in out, err
    code, out, err = run_cli("history", "list", "--runs", "--json", "--db", db)
    assert code == 0 and out.count('"run_id"') == 2, err
