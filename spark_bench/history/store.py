"""The history database: one SQLite file (stdlib sqlite3, WAL mode) holding every ingested run.

Tables (schema version in `meta` and in `PRAGMA user_version`; docs/history.md):

    fingerprints  one row per device fingerprint_id (runs of different fingerprints never share a series)
    runs          run_id (unique), content digest, fingerprint, git commit/dirty, commit time, branch, created,
                  finished, command, spec, summary, the whole run.json (zlib), and every record of the run without
                  its samples (one zlib JSON list: compressed together, the records' repeated keys cost little)
    cases         (op, backend, dtype, params) — how a case is recognised across runs, as `compare` matches them
    results       one row per (run, case): status, error, timer, unit, median/mean/min/max/p10/p90/iqr/CI/n, GB/s,
                  TFLOP/s and the raw samples (little-endian float64)

Ingest (spark_bench.history.ingest) is one IMMEDIATE transaction per run: a killed ingest leaves no half run, and
two writers at once queue on SQLite's lock (busy timeout) instead of failing.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from spark_bench.results import ResultsError

SCHEMA = "spark-bench/history"
SCHEMA_VERSION = 1
DEFAULT_DB = Path("results") / "history.db"
BUSY_TIMEOUT_S = 120.0
STATS = ("median", "mean", "min", "max", "p10", "p90", "iqr", "ci_low", "ci_high", "n")


class HistoryError(ResultsError):
    """A missing, corrupt, foreign or newer history database, or a bad history query; the message is one line.
    (A ResultsError, so the `spark-bench` group prints it as one line and exits 2.)"""


def _v1(con: sqlite3.Connection) -> None:
    for statement in """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE fingerprints (id INTEGER PRIMARY KEY, fingerprint_id TEXT NOT NULL UNIQUE, device_type TEXT,
        device_name TEXT, info TEXT NOT NULL);
    CREATE TABLE runs (id INTEGER PRIMARY KEY, run_id TEXT NOT NULL UNIQUE, digest TEXT NOT NULL,
        fingerprint INTEGER NOT NULL REFERENCES fingerprints(id), git_commit TEXT, dirty INTEGER, commit_time TEXT,
        branch TEXT, created TEXT, finished TEXT, command TEXT, spec TEXT, summary TEXT, run_json BLOB NOT NULL,
        records BLOB NOT NULL, source TEXT, added TEXT NOT NULL);
    CREATE INDEX runs_by_fingerprint ON runs(fingerprint, commit_time, created);
    CREATE TABLE cases (id INTEGER PRIMARY KEY, op TEXT NOT NULL, backend TEXT NOT NULL, dtype TEXT NOT NULL,
        params TEXT NOT NULL, UNIQUE (op, backend, dtype, params));
    CREATE TABLE results (run_ref INTEGER NOT NULL REFERENCES runs(id), case_ref INTEGER NOT NULL REFERENCES cases(id),
        status TEXT NOT NULL, error TEXT, timer TEXT, unit TEXT, median REAL, mean REAL, min REAL, max REAL,
        p10 REAL, p90 REAL, iqr REAL, ci_low REAL, ci_high REAL, n INTEGER, gbps REAL, tflops REAL,
        samples BLOB, PRIMARY KEY (run_ref, case_ref));
    CREATE INDEX results_by_case ON results(case_ref, run_ref);
    """.split(";"):
        if statement.strip():
            con.execute(statement)


# MIGRATIONS[i] takes a database from schema version i to i + 1, inside the transaction that records the new version.
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_v1]


@contextlib.contextmanager
def transaction(con: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on any exception): the write lock is taken up front, so two writers queue
    instead of deadlocking on a lock upgrade."""
    con.execute("BEGIN IMMEDIATE")
    try:
        yield con
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def _version(con: sqlite3.Connection, path: Path) -> int:
    """The schema version of an open database: 0 for an empty one; HistoryError for a foreign one."""
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables:
        return 0
    if "meta" not in tables:
        raise HistoryError(f"{path}: not a spark-bench history database (a SQLite file with tables "
                           f"{', '.join(sorted(tables)[:5])})")
    meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
    if meta.get("schema") != SCHEMA:
        raise HistoryError(f"{path}: not a spark-bench history database (schema {meta.get('schema')!r})")
    try:
        return int(meta.get("schema_version", ""))
    except ValueError:
        raise HistoryError(f"{path}: history database without a valid schema version") from None


def migrate(con: sqlite3.Connection, path: Path) -> int:
    """Bring the database up to SCHEMA_VERSION (each step in its own transaction); returns the version found."""
    with transaction(con):  # re-read under the write lock: another process may have migrated meanwhile
        found = version = _version(con, path)
        if version > len(MIGRATIONS):
            raise HistoryError(f"{path}: history schema version {version} was written by a newer spark-bench; "
                               f"this one reads up to {len(MIGRATIONS)}")
        while version < len(MIGRATIONS):
            MIGRATIONS[version](con)
            version += 1
            con.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?), ('schema_version', ?)",
                        (SCHEMA, str(version)))
            con.execute(f"PRAGMA user_version = {version}")
    return found


SQLITE_HEADER = b"SQLite format 3\x00"


def _refuse_non_sqlite(path: Path) -> None:
    """HistoryError for an existing file that is not SQLite at all (an empty file included), read without writing."""
    try:
        with path.open("rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except OSError as exc:
        raise HistoryError(f"{path}: cannot read the history database ({exc.strerror or exc})") from None
    if head != SQLITE_HEADER:
        what = ("an empty file; `spark-bench history add RUN_DIR... --db FILE` creates one in it" if not head
                else "not a SQLite file")
        raise HistoryError(f"{path}: not a spark-bench history database ({what})")


def connect(path: Path | str, create: bool = False) -> sqlite3.Connection:
    """Open (and migrate) the history database; `create` makes a new one where none exists (or in an empty file).
    Without `create`, nothing is written to a file that is not already a history database.
    HistoryError (one line) for a missing, empty, corrupt, foreign or newer database."""
    path = Path(path)
    if not path.exists() and not create:
        raise HistoryError(f"no history database at {path} (`spark-bench history add RUN_DIR...` creates it)")
    if path.is_dir():
        raise HistoryError(f"{path} is a directory, not a history database")
    if not create:
        _refuse_non_sqlite(path)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        con = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise HistoryError(f"{path}: cannot open the history database ({exc})") from None
    try:
        version = _version(con, path)  # before any write: a foreign SQLite file is refused as it was found
        if version == 0 and not create:
            raise HistoryError(f"{path}: not a spark-bench history database (an empty SQLite database; "
                               "`spark-bench history add RUN_DIR... --db FILE` fills it)")
        if version != len(MIGRATIONS):
            migrate(con, path)
        con.execute("PRAGMA journal_mode = WAL").fetchone()
        con.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: a commit survives a killed process
        con.execute("PRAGMA foreign_keys = ON")
    except HistoryError:
        con.close()
        raise
    except sqlite3.OperationalError as exc:  # locked past the busy timeout, disk full, read-only file...
        con.close()
        raise HistoryError(f"{path}: {' '.join(str(exc).split())}") from None
    except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:  # "file is not a database", "database disk image is
        con.close()  # malformed", a damaged page's text that is no longer UTF-8
        raise HistoryError(f"{path}: not a spark-bench history database ({exc})") from None
    return con


_TYPEOF = {"TEXT": ("text",), "INTEGER": ("integer",), "REAL": ("real", "integer"), "BLOB": ("blob",)}


def mistyped(con: sqlite3.Connection) -> str | None:
    """The first stored value whose type is not its column's (text in a REAL column, a number where a TEXT is:
    SQLite keeps them, only another program writes them), as 'results.median holds text where the schema has REAL
    (row 3)'; None when every value has its column's type. A scan of every table: called after a failure only."""
    for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name != 'meta'").fetchall():
        for _cid, column, declared, *_ in con.execute(f'PRAGMA table_info("{table}")').fetchall():
            allowed = _TYPEOF.get(str(declared).upper())
            if allowed is None:
                continue
            found = con.execute(f'SELECT rowid, typeof("{column}") FROM "{table}" WHERE typeof("{column}") NOT IN '
                                f'({", ".join(repr(t) for t in (*allowed, "null"))}) LIMIT 1').fetchone()
            if found:
                return f"{table}.{column} holds {found[1]} where the schema has {declared} (row {found[0]})"
    return None


def case_key(rec: dict[str, Any]) -> tuple[str, str, str, str]:
    return (str(rec.get("op")), str(rec.get("backend")), str(rec.get("dtype")),
            json.dumps(rec.get("params") or {}, sort_keys=True, separators=(",", ":"), default=str))



def prune(con: sqlite3.Connection, cutoff: str | None = None, keep: int | None = None,
          fingerprint_id: str | None = None, branch: str | None = None, dry_run: bool = False) -> list[str]:
    """Drop runs created before `cutoff` and/or beyond the newest `keep` per (fingerprint, branch), in one transaction,
    with the cases and fingerprints no run uses any more; then VACUUM. Returns the dropped run ids."""
    with transaction(con):
        rows = con.execute("""SELECT r.id, r.run_id, f.fingerprint_id, r.branch, r.created
                              FROM runs r JOIN fingerprints f ON f.id = r.fingerprint
                              ORDER BY COALESCE(r.commit_time, r.created) DESC, r.created DESC,
                                       r.run_id DESC""").fetchall()
        rows = [r for r in rows if (fingerprint_id is None or r[2] == fingerprint_id) and (branch is None
                                                                                         or r[3] == branch)]
        victims: dict[int, str] = {}
        if cutoff is not None:
            victims.update((r[0], r[1]) for r in rows if (r[4] or "") < cutoff)
        if keep is not None:
            seen: dict[tuple[str, str | None], int] = {}
            for r in rows:
                seen[(r[2], r[3])] = seen.get((r[2], r[3]), 0) + 1
                if seen[(r[2], r[3])] > keep:
                    victims[r[0]] = r[1]
        if victims and not dry_run:
            ids = [(i,) for i in victims]
            con.executemany("DELETE FROM results WHERE run_ref = ?", ids)
            con.executemany("DELETE FROM runs WHERE id = ?", ids)
            con.execute("DELETE FROM cases WHERE NOT EXISTS (SELECT 1 FROM results x WHERE x.case_ref = cases.id)")
            con.execute("DELETE FROM fingerprints WHERE NOT EXISTS "
                        "(SELECT 1 FROM runs r WHERE r.fingerprint = fingerprints.id)")
    if victims and not dry_run:
        con.execute("VACUUM")
    return sorted(victims.values())
