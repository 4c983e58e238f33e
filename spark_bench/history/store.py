"""The history database: one SQLite file (stdlib sqlite3, WAL mode) holding every ingested run.

Tables (schema version in `meta` and in `PRAGMA user_version`; docs/history.md):

    fingerprints  one row per device fingerprint_id (runs of different fingerprints never share a series)
    runs          run_id (unique), content digest, fingerprint, git commit/dirty, commit time, branch, created,
                  finished, command, spec, summary, the whole run.json (zlib), and every record of the run without
                  its samples (one zlib JSON list: compressed together, the records' repeated keys cost little)
    cases         (op, backend, dtype, params) — how a case is recognised across runs, as `compare` matches them
    results       one row per (run, case): status, error, timer, unit, median/mean/min/max/p10/p90/iqr/CI/n, GB/s,
                  TFLOP/s and the raw samples (little-endian float64)

Ingest is one IMMEDIATE transaction per run: a killed ingest leaves no half run, and two writers at once queue on
SQLite's lock (busy timeout) instead of failing. A run whose files are unchanged is skipped; a run whose files changed
(resumed, rewritten) replaces its earlier copy.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import itertools
import json
import os
import sqlite3
import zlib
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spark_bench.history import gitinfo
from spark_bench.results import RESULTS_FILE, RUN_FILE, ResultsError, load_run

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


def connect(path: Path | str, create: bool = False) -> sqlite3.Connection:
    """Open (and migrate) the history database; `create` makes a new one where none exists.
    HistoryError (one line) for a missing, corrupt, foreign or newer database."""
    path = Path(path)
    if not path.exists() and not create:
        raise HistoryError(f"no history database at {path} (`spark-bench history add RUN_DIR...` creates it)")
    if path.is_dir():
        raise HistoryError(f"{path} is a directory, not a history database")
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        con = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise HistoryError(f"{path}: cannot open the history database ({exc})") from None
    try:
        con.execute("PRAGMA journal_mode = WAL").fetchone()
        con.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: a commit survives a killed process
        if _version(con, path) != len(MIGRATIONS):
            migrate(con, path)
        con.execute("PRAGMA foreign_keys = ON")
    except HistoryError:
        con.close()
        raise
    except sqlite3.OperationalError as exc:  # locked past the busy timeout, disk full, read-only file...
        con.close()
        raise HistoryError(f"{path}: {' '.join(str(exc).split())}") from None
    except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
        con.close()
        raise HistoryError(f"{path}: not a spark-bench history database ({exc})") from None
    return con


# --- ingest ------------------------------------------------------------------------------------------------------
def digest_of(run_dir: Path) -> str:
    h = hashlib.sha256()
    for name in (RUN_FILE, RESULTS_FILE):
        f = run_dir / name
        h.update(f.read_bytes() if f.is_file() else b"")
        h.update(b"\0")
    return h.hexdigest()


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else None


def case_key(rec: dict[str, Any]) -> tuple[str, str, str, str]:
    return (str(rec.get("op")), str(rec.get("backend")), str(rec.get("dtype")),
            json.dumps(rec.get("params") or {}, sort_keys=True, separators=(",", ":"), default=str))


def _result_row(rec: dict[str, Any]) -> tuple[tuple[str, str, str, str], tuple[Any, ...], dict[str, Any]]:
    """(case key, results row, the record without its samples)."""
    t = rec.get("timing") if isinstance(rec.get("timing"), dict) else None
    samples = t.get("samples") if t else None
    rest = {**rec, "timing": {k: v for k, v in t.items() if k != "samples"}} if t else rec
    blob = np.asarray(samples, dtype="<f8").tobytes() if samples else None
    stats = tuple(_num(t.get(k)) for k in STATS) if t else (None,) * len(STATS)
    n = int(stats[-1]) if stats[-1] is not None else None
    row = (str(rec.get("status")), rec.get("error"), t.get("timer") if t else None, t.get("unit") if t else None,
           *stats[:-1], n, _num(rec.get("gbps")), _num(rec.get("tflops")), blob)
    return case_key(rec), row, rest


def prepare_run(run_dir: Path) -> dict[str, Any]:
    """Read and convert one run, outside any transaction (the write lock is held only to write); picklable, so
    worker processes can do it."""
    digest = digest_of(run_dir)
    run, records = load_run(run_dir)
    latest = {r["case_id"]: r for r in records}  # a resumed case keeps its last record
    fp = run.get("fingerprint") or {}
    git = fp.get("git") or {}
    converted = [_result_row(r) for r in latest.values()]
    blob = json.dumps([rest for _, _, rest in converted], separators=(",", ":"), default=str).encode()
    return {"dir": run_dir, "digest": digest, "run_id": str(run.get("run_id") or run_dir.name),
            "rows": [(key, row) for key, row, _ in converted], "records": zlib.compress(blob, 6),
            "run_json": zlib.compress(json.dumps(run, default=str).encode(), 6),
            "created": gitinfo.utc(run.get("created")), "finished": gitinfo.utc(run.get("finished")),
            "command": json.dumps(run.get("command"), default=str), "spec": json.dumps(run.get("spec"), default=str),
            "summary": json.dumps(run.get("summary"), default=str),
            "fingerprint_id": str(fp.get("fingerprint_id") or "unknown"), "device": fp.get("device") or {},
            "fp_info": json.dumps({k: v for k, v in fp.items() if k != "git"}, sort_keys=True, default=str),
            "commit": git.get("commit") or None, "dirty": git.get("dirty"), "branch": git.get("branch"),
            "commit_time": gitinfo.utc(git.get("commit_time"))}


def _prepared_or_damaged(run_dir: Path) -> dict[str, Any]:
    """prepare_run, or {'dir', 'damaged': why} for a run it cannot read or convert."""
    try:
        return prepare_run(run_dir)
    except ResultsError as exc:
        return {"dir": run_dir, "damaged": str(exc)}
    except (OSError, ValueError, TypeError) as exc:
        return {"dir": run_dir, "damaged": f"{run_dir}: {type(exc).__name__}: {exc}"}


def _worker_init() -> None:
    """Pool workers die with the ingesting process (kill -9 included) instead of lingering."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _prepared(run_dirs: Sequence[Path], jobs: int) -> Iterator[Iterator[dict[str, Any]]]:
    """_prepared_or_damaged over the runs, in order: in this process, or in `jobs` forked workers while this one
    writes."""
    if jobs <= 1 or len(run_dirs) < 8 or not hasattr(os, "fork"):
        yield map(_prepared_or_damaged, run_dirs)
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(jobs, initializer=_worker_init) as pool:
        yield pool.imap(_prepared_or_damaged, run_dirs, chunksize=2)


def default_jobs() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class Ingest:
    """Adds runs to an open database. Case ids are cached and the cache is dropped whenever another connection has
    committed (PRAGMA data_version), so two writers never use each other's stale ids."""

    def __init__(self, con: sqlite3.Connection, repo: Path | None = None, branch: str | None = None) -> None:
        self.con, self.repo, self.branch = con, repo, branch
        self.cases: dict[tuple[str, str, str, str], int] = {}
        self.data_version: int | None = None

    def _case_ids(self, keys: Sequence[tuple[str, str, str, str]]) -> list[int]:
        version = self.con.execute("PRAGMA data_version").fetchone()[0]
        if version != self.data_version:
            self.cases = {tuple(r[1:]): r[0] for r in self.con.execute(  # type: ignore[misc]
                "SELECT id, op, backend, dtype, params FROM cases")}
            self.data_version = version
        missing = sorted({k for k in keys if k not in self.cases})
        if missing:
            self.con.executemany("INSERT OR IGNORE INTO cases (op, backend, dtype, params) VALUES (?, ?, ?, ?)",
                                 missing)
            for k in missing:
                self.cases[k] = self.con.execute("SELECT id FROM cases WHERE op = ? AND backend = ? AND dtype = ? "
                                                 "AND params = ?", k).fetchone()[0]
        return [self.cases[k] for k in keys]

    @staticmethod
    def _peek_id(run_dir: Path) -> str:
        try:
            return str(json.loads((run_dir / RUN_FILE).read_text()).get("run_id") or run_dir.name)
        except (OSError, ValueError, AttributeError):
            return run_dir.name

    def unchanged(self, run_dir: Path) -> bool:
        row = self.con.execute("SELECT digest FROM runs WHERE run_id = ?", (self._peek_id(run_dir),)).fetchone()
        try:
            return bool(row) and row[0] == digest_of(run_dir)
        except OSError:
            return False  # unreadable: parsing it says so

    def write(self, p: dict[str, Any], commit_time: str | None, branch: str | None) -> str:
        """One run in one transaction: 'added', 'updated' (its files changed since) or 'unchanged'."""
        run_id, con = p["run_id"], self.con
        with transaction(con):
            old = con.execute("SELECT id, digest FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if old and old[1] == p["digest"]:
                return "unchanged"
            if old:
                con.execute("DELETE FROM results WHERE run_ref = ?", (old[0],))
                con.execute("DELETE FROM runs WHERE id = ?", (old[0],))
            con.execute("INSERT OR IGNORE INTO fingerprints (fingerprint_id, device_type, device_name, info) "
                        "VALUES (?, ?, ?, ?)", (p["fingerprint_id"], p["device"].get("type"), p["device"].get("name"),
                                                p["fp_info"]))
            fp_ref = con.execute("SELECT id FROM fingerprints WHERE fingerprint_id = ?",
                                 (p["fingerprint_id"],)).fetchone()[0]
            dirty = None if p["dirty"] is None else int(bool(p["dirty"]))
            cur = con.execute(
                "INSERT INTO runs (run_id, digest, fingerprint, git_commit, dirty, commit_time, branch, created, "
                "finished, command, spec, summary, run_json, records, source, added) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, p["digest"], fp_ref, p["commit"], dirty, commit_time, branch, p["created"], p["finished"],
                 p["command"], p["spec"], p["summary"], p["run_json"], p["records"], str(p["dir"]),
                 dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")))
            ref = cur.lastrowid
            ids = self._case_ids([k for k, _ in p["rows"]])
            con.executemany("INSERT INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            [(ref, cid, *row) for cid, (_, row) in zip(ids, p["rows"], strict=True)])
        return "replaced" if old else "added"

    def add(self, run_dirs: Sequence[Path], on_run: Callable[[Path, str, str], None] | None = None,
            batch: int = 64, jobs: int | None = None, skippable: Collection[Path] = (),
            on_damaged: Callable[[Path, str], None] | None = None) -> dict[str, int]:
        """Ingest the runs (parsed by `jobs` worker processes, default: one per core up to 4, while this process
        writes; git facts looked up for a batch of runs at once); counts per outcome. A run that cannot be read is a
        HistoryError, or, when in `skippable`, left out: counted as 'damaged' and passed to `on_damaged` with why."""
        counts = {"added": 0, "replaced": 0, "unchanged": 0}
        todo = []
        for d in run_dirs:
            if self.unchanged(d):  # checked again under the write lock; this only skips the parsing
                counts["unchanged"] += 1
                if on_run is not None:
                    on_run(d, self._peek_id(d), "unchanged")
            else:
                todo.append(d)
        with _prepared(todo, default_jobs() if jobs is None else jobs) as stream:
            while chunk := list(itertools.islice(stream, batch)):
                for p in (p for p in chunk if "damaged" in p):
                    if p["dir"] not in skippable:
                        raise HistoryError(p["damaged"])
                    counts["damaged"] = counts.get("damaged", 0) + 1
                    if on_damaged is not None:
                        on_damaged(p["dir"], p["damaged"])
                chunk = [p for p in chunk if "damaged" not in p]
                commits = [p["commit"] for p in chunk if p["commit"]]
                times = gitinfo.commit_times(self.repo, commits)
                branches = {} if self.branch else gitinfo.branch_of(self.repo, commits)
                for p in chunk:
                    branch = self.branch or p["branch"] or branches.get(p["commit"])
                    outcome = self.write(p, times.get(p["commit"]) or p["commit_time"], branch)
                    counts[outcome] += 1
                    if on_run is not None:
                        on_run(p["dir"], p["run_id"], outcome)
        return counts


def add_runs(db: Path | str, run_dirs: Sequence[Path | str], repo: Path | str | None = None,
             branch: str | None = None, on_run: Callable[[Path, str, str], None] | None = None,
             jobs: int | None = None, on_damaged: Callable[[Path, str], None] | None = None) -> dict[str, int]:
    """Ingest run directories (or directories of runs) into the database at `db`, creating it if needed.
    `repo`: the git repository to read commit times and the branch from (default: the one around the current
    directory, if any). A damaged run found below a directory given is skipped (counted as 'damaged', passed to
    `on_damaged` with why); one named is a HistoryError."""
    from spark_bench.history.rundirs import expand_run_dirs  # it raises HistoryError

    dirs, below = expand_run_dirs(run_dirs)
    con = connect(db, create=True)
    try:
        con.execute("PRAGMA cache_size = -65536")  # 64 MiB: the case index stays in memory while runs stream in
        return Ingest(con, gitinfo.find_repo(repo), branch).add(dirs, on_run, jobs=jobs, skippable=below,
                                                                 on_damaged=on_damaged)
    finally:
        con.close()


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
