"""Read side of the history database: runs per fingerprint and branch, one run, case selection, and series.

A series is one case on one device fingerprint, in commit order: runs are ordered by their commit time when the
repository told us at ingest, else by when the run was created (a run without a git commit is kept, ordered by its
creation time and shown as 'no commit')."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import sqlite3
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from spark_bench.history.store import HistoryError, case_key
from spark_bench.sweep import dtype_list, select_by_sets

ORDER = "COALESCE(r.commit_time, r.created), r.created, r.run_id"  # oldest first: commit order, then run time
NEWEST_FIRST = "COALESCE(r.commit_time, r.created) DESC, r.created DESC, r.run_id DESC"  # (`ORDER DESC` is not this)


@dataclasses.dataclass(frozen=True)
class CaseKey:
    id: int
    op: str
    backend: str
    dtype: str
    params: dict[str, Any]

    @property
    def params_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in sorted(self.params.items())) or "-"

    @property
    def label(self) -> str:
        return f"{self.op} {self.backend} {self.dtype} {self.params_text}"


def fingerprints(con: sqlite3.Connection, branch: str | None = None) -> list[dict[str, Any]]:
    """One row per (fingerprint, branch): how many runs, the first and last, the latest commit."""
    rows = con.execute(
        f"""SELECT f.fingerprint_id, f.device_type, f.device_name, r.branch, COUNT(*), MIN(r.created), MAX(r.created),
                   SUM(r.git_commit IS NULL)
            FROM runs r JOIN fingerprints f ON f.id = r.fingerprint
            {"WHERE r.branch = ?" if branch else ""}
            GROUP BY f.id, r.branch ORDER BY f.device_name, f.fingerprint_id, r.branch""",
        (branch,) if branch else ()).fetchall()
    out = []
    for fid, dtype, dname, br, n, first, last, no_commit in rows:
        latest = con.execute(
            f"""SELECT r.git_commit FROM runs r JOIN fingerprints f ON f.id = r.fingerprint
                WHERE f.fingerprint_id = ? AND r.branch IS ? ORDER BY {NEWEST_FIRST} LIMIT 1""", (fid, br)).fetchone()
        out.append({"fingerprint_id": fid, "device_type": dtype, "device": dname, "branch": br, "runs": n,
                    "first": first, "last": last, "without_commit": no_commit, "latest_commit": latest[0]})
    return out


FAILED = "'mismatch', 'error', 'crash', 'timeout', 'oom'"  # statuses that count as failed (not skipped)


def runs(con: sqlite3.Connection, fingerprint: str | None = None, branch: str | None = None,
         limit: int | None = None) -> list[dict[str, Any]]:
    where, args = _run_filter(con, fingerprint, branch)
    rows = con.execute(
        f"""SELECT r.run_id, f.fingerprint_id, f.device_name, r.branch, r.git_commit, r.dirty, r.commit_time, r.created,
                   r.finished, r.summary, (SELECT COUNT(*) FROM results x WHERE x.run_ref = r.id),
                   (SELECT COUNT(*) FROM results x WHERE x.run_ref = r.id AND x.status IN ({FAILED}))
            FROM runs r JOIN fingerprints f ON f.id = r.fingerprint {where} ORDER BY {NEWEST_FIRST}
            {"LIMIT ?" if limit else ""}""", (*args, *((limit,) if limit else ()))).fetchall()
    keys = ("run_id", "fingerprint_id", "device", "branch", "commit", "dirty", "commit_time", "created", "finished",
            "summary", "cases", "failed")  # failed: from the stored results (a killed run has no summary)
    out = [dict(zip(keys, r, strict=True)) for r in rows]
    for r in out:
        r["summary"] = json.loads(r["summary"]) if r["summary"] else None
        r["dirty"] = None if r["dirty"] is None else bool(r["dirty"])
    return out


def _run_filter(con: sqlite3.Connection, fingerprint: str | None, branch: str | None) -> tuple[str, list[Any]]:
    clauses, args = [], []
    if fingerprint:
        clauses.append("f.fingerprint_id = ?")
        args.append(resolve_fingerprint(con, fingerprint))
    if branch:
        clauses.append("r.branch = ?")
        args.append(branch)
    return ("WHERE " + " AND ".join(clauses)) if clauses else "", args


def resolve_fingerprint(con: sqlite3.Connection, text: str) -> str:
    """A fingerprint id, a unique prefix of one, or a unique device-name substring -> the fingerprint id."""
    rows = con.execute("SELECT fingerprint_id, device_name FROM fingerprints").fetchall()
    exact = [f for f, _ in rows if f == text]
    hits = exact or [f for f, d in rows if f.startswith(text)] or [f for f, d in rows
                                                                     if text.lower() in str(d).lower()]
    if len(hits) == 1:
        return hits[0]
    known = ", ".join(f"{f} ({d})" for f, d in rows) or "none"
    raise HistoryError(f"--fingerprint {text!r} matches {'no' if not hits else len(hits)} fingerprints; "
                       f"stored: {known}")


def run(con: sqlite3.Connection, ref: str) -> dict[str, Any]:
    """A stored run by run id or unique prefix: its run.json and its records (samples included)."""
    rows = con.execute("SELECT id, run_id, run_json FROM runs WHERE run_id = ? OR run_id LIKE ? ESCAPE '\\'",
                       (ref, ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%")).fetchall()
    exact = [r for r in rows if r[1] == ref]
    rows = exact or rows
    if len(rows) != 1:
        raise HistoryError(f"run {ref!r} matches {len(rows) or 'no'} stored runs"
                           + (f": {', '.join(r[1] for r in rows[:5])}" if rows else " (see `spark-bench history list "
                                                                                    "--runs`)"))
    ref_id, _, blob = rows[0]
    samples = {(op, backend, dtype, params): data for op, backend, dtype, params, data in con.execute(
        """SELECT c.op, c.backend, c.dtype, c.params, x.samples FROM results x JOIN cases c ON c.id = x.case_ref
           WHERE x.run_ref = ?""", (ref_id,))}
    (records_blob,) = con.execute("SELECT records FROM runs WHERE id = ?", (ref_id,)).fetchone()
    records = json.loads(zlib.decompress(records_blob))
    for r in records:
        data = samples.get(case_key(r))
        if data is not None and isinstance(r.get("timing"), dict):
            r["timing"]["samples"] = np.frombuffer(data, dtype="<f8").tolist()
    return {"run": json.loads(zlib.decompress(blob)), "results": records, "stored_id": rows[0][1]}


def select_cases(con: sqlite3.Connection, ops: Sequence[str] = (), backends: Sequence[str] = (),
                 sets: Sequence[str] = (), dtypes: Sequence[str] = ()) -> list[CaseKey]:
    """Stored cases matching op globs, backends, AXIS=V1,V2 values (by value, as `show --set`:
    `sweep.select_by_sets`) and dtypes (each filter optional)."""
    dts = set(dtype_list(dtypes))
    out = []
    for cid, op, backend, dtype, params in con.execute("SELECT id, op, backend, dtype, params FROM cases"):
        if ops and not any(fnmatch.fnmatchcase(op, g) for g in ops):
            continue
        if (backends and backend not in backends) or (dts and dtype not in dts):
            continue
        out.append(CaseKey(cid, op, backend, dtype, json.loads(params)))
    out = select_by_sets(out, sets, key=lambda c: (c.op, c.params), where="the history")
    return sorted(out, key=lambda c: (c.op, c.backend, c.dtype, sorted((k, _value_order(v))
                                                                      for k, v in c.params.items())))


def _value_order(value: Any) -> tuple[bool, float, str]:
    """Numbers in numeric order, then any other value (text, None, a list) by its text: never compared unlike."""
    number = isinstance(value, (int, float))
    return not number, value if number else 0, str(value)


SERIES_COLUMNS = ("case_ref", "fingerprint_id", "device", "run_id", "commit", "dirty", "commit_time", "created",
                  "branch", "status", "median", "ci_low", "ci_high", "p10", "p90", "n", "unit", "timer", "error")


def series_rows(con: sqlite3.Connection, case_ids: Sequence[int], fingerprint: str | None = None,
                branch: str | None = None) -> list[dict[str, Any]]:
    """Every stored result of the cases, per fingerprint in commit order."""
    where, args = _run_filter(con, fingerprint, branch)
    out: list[dict[str, Any]] = []
    ids = list(case_ids)
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        cond = f"x.case_ref IN ({','.join('?' * len(chunk))})"
        where_all = (where + " AND " + cond) if where else "WHERE " + cond
        rows = con.execute(
            f"""SELECT x.case_ref, f.fingerprint_id, f.device_name, r.run_id, r.git_commit, r.dirty, r.commit_time,
                       r.created, r.branch, x.status, x.median, x.ci_low, x.ci_high, x.p10, x.p90, x.n, x.unit,
                       x.timer, x.error
                FROM results x JOIN runs r ON r.id = x.run_ref JOIN fingerprints f ON f.id = r.fingerprint
                {where_all} ORDER BY x.case_ref, f.fingerprint_id, {ORDER}""", (*args, *chunk)).fetchall()
        out.extend(dict(zip(SERIES_COLUMNS, r, strict=True)) for r in rows)
    return out
