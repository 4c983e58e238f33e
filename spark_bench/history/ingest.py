"""Ingest: run directories into the history database (spark_bench.history.store holds the schema).

A run is the same run when its id, creation time and device fingerprint match: unchanged files are skipped before
they are parsed, changed ones (resumed, rewritten) replace the earlier copy in one transaction. Another run that
reuses an id (`--out results/nightly` every night, or another machine's) is kept beside it as `ID@<created>`. A changed
copy with fewer cases than the stored one (a truncated results.jsonl) replaces it only when allowed (FewerCasesError).
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
from spark_bench.history.store import STATS, HistoryError, case_key, connect, transaction
from spark_bench.results import RESULTS_FILE, RUN_FILE, ResultsError, load_run


class FewerCasesError(HistoryError):
    """A changed run holds fewer cases than its stored copy: not replaced unless allowed (--allow-fewer-cases)."""


def digest_of(run_dir: Path) -> str:
    h = hashlib.sha256()
    for name in (RUN_FILE, RESULTS_FILE):
        f = run_dir / name
        h.update(f.read_bytes() if f.is_file() else b"")
        h.update(b"\0")
    return h.hexdigest()


def _family(column: str, run_id: str) -> tuple[str, tuple[str, str, str]]:
    """SQL (and its arguments) matching a run id and the ids `ID@...` another run of it is stored under: "A" follows
    "@", so the range is every id starting "ID@" (the unique index serves it)."""
    return f"({column} = ? OR ({column} > ? AND {column} < ?))", (run_id, run_id + "@", run_id + "A")


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else None


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

    def __init__(self, con: sqlite3.Connection, repo: Path | None = None, branch: str | None = None,
                 allow_fewer_cases: bool = False) -> None:
        self.con, self.repo, self.branch, self.allow_fewer_cases = con, repo, branch, allow_fewer_cases
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

    def stored_unchanged(self, run_dir: Path) -> str | None:
        """The id this run is stored under when its files are unchanged since (same digest), else None."""
        try:
            digest = digest_of(run_dir)
        except OSError:
            return None  # unreadable: parsing it says so
        family, args = _family("run_id", self._peek_id(run_dir))
        row = self.con.execute(f"SELECT run_id FROM runs WHERE {family} AND digest = ?", (*args, digest)).fetchone()
        return row[0] if row else None

    def _stored_copy(self, p: dict[str, Any]) -> tuple[int, str, str] | None:
        """(row id, digest, stored id) of this very run's earlier copy: the same run id, creation time and device
        fingerprint. A run resumed or rewritten keeps all three; another run into a reused `--out` does not."""
        family, args = _family("r.run_id", p["run_id"])
        return self.con.execute(
            f"SELECT r.id, r.digest, r.run_id FROM runs r JOIN fingerprints f ON f.id = r.fingerprint WHERE "
            f"{family} AND r.created IS ? AND f.fingerprint_id = ?",
            (*args, p["created"], p["fingerprint_id"])).fetchone()

    def _free_id(self, p: dict[str, Any]) -> str:
        """The run id, or, where another run already holds it, `ID@<created>` (then `-<fingerprint>`, then `~N`):
        two runs written to the same `--out` (a nightly directory) are both kept."""
        run_id, stamp = p["run_id"], (p["created"] or "undated")[:19].replace("-", "").replace(":", "")
        first = (run_id, f"{run_id}@{stamp}", f"{run_id}@{stamp}-{p['fingerprint_id'][:12]}")
        for candidate in itertools.chain(first, (f"{first[-1]}~{i}" for i in itertools.count(2))):
            if self.con.execute("SELECT 1 FROM runs WHERE run_id = ?", (candidate,)).fetchone() is None:
                return candidate
        raise AssertionError("unreachable")

    def _refuse_fewer_cases(self, p: dict[str, Any], row_id: int, stored_as: str) -> None:
        stored = self.con.execute("SELECT COUNT(*) FROM results WHERE run_ref = ?", (row_id,)).fetchone()[0]
        if len(p["rows"]) < stored:
            raise FewerCasesError(
                f"{p['dir']}: run {p['run_id']} now holds {len(p['rows'])} case(s) where its stored copy {stored_as} "
                f"holds {stored} (a truncated results.jsonl?); not replaced: pass --allow-fewer-cases to replace it")

    def write(self, p: dict[str, Any], commit_time: str | None, branch: str | None) -> tuple[str, str]:
        """One run in one transaction: ('added' | 'replaced' (its files changed since) | 'unchanged', the id it is
        stored under). FewerCasesError when the changed run holds fewer cases than its copy and that is not allowed."""
        con = self.con
        with transaction(con):
            old = self._stored_copy(p)
            if old and old[1] == p["digest"]:
                return "unchanged", old[2]
            run_id = old[2] if old else self._free_id(p)
            if old and not self.allow_fewer_cases:
                self._refuse_fewer_cases(p, old[0], run_id)
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
        return ("replaced" if old else "added"), run_id

    def add(self, run_dirs: Sequence[Path], on_run: Callable[[Path, str, str], None] | None = None,
            batch: int = 64, jobs: int | None = None, skippable: Collection[Path] = (),
            on_damaged: Callable[[Path, str], None] | None = None) -> dict[str, int]:
        """Ingest the runs (parsed by `jobs` worker processes, default: one per core up to 4, while this process
        writes; git facts looked up for a batch of runs at once); counts per outcome. A run that cannot be read is a
        HistoryError, or, when in `skippable`, left out: counted as 'damaged' and passed to `on_damaged` with why; so is
        a changed run with fewer cases than its stored copy (FewerCasesError) unless `allow_fewer_cases`."""
        counts = {"added": 0, "replaced": 0, "unchanged": 0}
        todo = []
        for d in run_dirs:
            stored_as = self.stored_unchanged(d)  # checked again under the write lock; this only skips the parsing
            if stored_as is not None:
                counts["unchanged"] += 1
                if on_run is not None:
                    on_run(d, stored_as, "unchanged")
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
                    try:
                        outcome, stored_as = self.write(p, times.get(p["commit"]) or p["commit_time"], branch)
                    except FewerCasesError as exc:  # below a directory: skipped like a damaged run
                        if p["dir"] not in skippable:
                            raise
                        counts["damaged"] = counts.get("damaged", 0) + 1
                        if on_damaged is not None:
                            on_damaged(p["dir"], str(exc))
                        continue
                    counts[outcome] += 1
                    if on_run is not None:
                        on_run(p["dir"], stored_as, outcome)
        return counts


def add_runs(db: Path | str, run_dirs: Sequence[Path | str], repo: Path | str | None = None,
             branch: str | None = None, on_run: Callable[[Path, str, str], None] | None = None,
             jobs: int | None = None, on_damaged: Callable[[Path, str], None] | None = None,
             allow_fewer_cases: bool = False) -> dict[str, int]:
    """Ingest run directories (or directories of runs) into the database at `db`, creating it if needed.
    `repo`: the git repository to read commit times and the branch from (default: the one around the current
    directory, if any). A damaged run found below a directory given is skipped (counted as 'damaged', passed to
    `on_damaged` with why); one named is a HistoryError. A changed run with fewer cases than its stored copy is
    treated alike unless `allow_fewer_cases`."""
    from spark_bench.history.rundirs import expand_run_dirs  # it raises HistoryError

    dirs, below = expand_run_dirs(run_dirs)
    con = connect(db, create=True)
    try:
        con.execute("PRAGMA cache_size = -65536")  # 64 MiB: the case index stays in memory while runs stream in
        ingest = Ingest(con, gitinfo.find_repo(repo), branch, allow_fewer_cases)
        return ingest.add(dirs, on_run, jobs=jobs, skippable=below, on_damaged=on_damaged)
    finally:
        con.close()
