"""The results store: `<run>/run.json` (fingerprint, command, sweep spec, summary) and `<run>/results.jsonl`
(one case per line, appended and flushed as each case ends). Schema: docs/results.md."""

from __future__ import annotations

import datetime as dt
import errno
import json
import os
import secrets
import socket
from collections import Counter
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
RUN_SCHEMA = "spark-bench/run"
RUN_FILE, RESULTS_FILE, LOCK_FILE = "run.json", "results.jsonl", ".lock"
STATUSES = ("ok", "mismatch", "error", "crash", "timeout", "oom", "skipped")
FAILED = ("mismatch", "error", "crash", "timeout", "oom")


class ResultsError(Exception):
    """A malformed, foreign or missing results file; the message is one line."""


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id(device: str) -> str:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{device.replace(':', '')}-{secrets.token_hex(2)}"


def case_id(op: str, backend: str, params: dict[str, Any], dtype: str, device: str) -> str:
    return "|".join([op, backend, json.dumps(params, sort_keys=True, separators=(",", ":")), dtype, device])


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


class RunStore:
    """One run directory. The parent process is the only writer of results.jsonl, and `lock()` makes it the only
    one: a second `run --resume`/`--out` of the same directory is refused while the first holds it."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Own this run directory until the process ends (or `unlock()`): an exclusive flock on `<run>/.lock`, which
        the kernel releases however the owner dies (kill -9 included), so a stale lock never blocks a resume.
        Raises ResultsError naming the holder when another process owns it."""
        import fcntl

        if self._lock_fd is not None:
            return
        if self.path.exists() and not self.path.is_dir():
            raise ResultsError(f"{self.path} is a file, not a run directory; choose another --out")
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise ResultsError(f"{self.path}: cannot lock the run directory ({exc.strerror})") from None
            raise ResultsError(f"{self.path} is in use by {' '.join(holder.split())}: one process owns a run "
                               "directory for the whole run; wait for it to end, then --resume") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    @property
    def run_file(self) -> Path:
        return self.path / RUN_FILE

    @property
    def results_file(self) -> Path:
        return self.path / RESULTS_FILE

    def create(self, run: dict[str, Any]) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise ResultsError(f"{self.path} is a file, not a run directory; choose another --out")
        if self.results_file.exists() and self.results_file.stat().st_size > 0:
            raise ResultsError(f"{self.path} already holds results; use --resume {self.path} or another --out")
        self.path.mkdir(parents=True, exist_ok=True)
        self.write_run({"schema": RUN_SCHEMA, "schema_version": SCHEMA_VERSION, **run})
        self.results_file.touch()

    def write_run(self, run: dict[str, Any]) -> None:
        _write_json_atomic(self.run_file, run)

    def read_run(self) -> dict[str, Any]:
        if not self.run_file.is_file():
            raise ResultsError(f"{self.path} is not a spark-bench run directory (no {RUN_FILE})")
        try:
            run = json.loads(self.run_file.read_text())
        except json.JSONDecodeError as exc:
            raise ResultsError(f"{self.run_file}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        if not isinstance(run, dict) or run.get("schema") != RUN_SCHEMA:
            raise ResultsError(f"{self.run_file}: not a spark-bench run file")
        if run.get("schema_version") != SCHEMA_VERSION:
            raise ResultsError(f"{self.run_file}: schema version {run.get('schema_version')!r}, "
                               f"this spark-bench reads {SCHEMA_VERSION}")
        return run

    def repair_tail(self) -> None:
        """Drop a partial last line left by a killed run, so appends start on a fresh line."""
        if not self.results_file.exists():
            return
        data = self.results_file.read_bytes()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            with open(self.results_file, "r+b") as f:
                f.truncate(cut)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps({"schema_version": SCHEMA_VERSION, **record}, default=str, allow_nan=True)
        with open(self.results_file, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read_results(self) -> list[dict[str, Any]]:
        if not self.results_file.is_file():
            raise ResultsError(f"{self.path} has no {RESULTS_FILE}")
        records, lines = [], self.results_file.read_text().split("\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # a partial last line of a killed run
                    continue
                raise ResultsError(f"{self.results_file}:{number}: malformed line") from None
            if not isinstance(rec, dict) or rec.get("schema_version") != SCHEMA_VERSION or "case_id" not in rec:
                raise ResultsError(f"{self.results_file}:{number}: not a spark-bench v{SCHEMA_VERSION} result")
            records.append(rec)
        return records


def load_run(path: Path | str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(run.json, results) of a run directory; ResultsError with one line on anything malformed."""
    store = RunStore(path)
    if not store.path.is_dir():
        raise ResultsError(f"{path}: no such run directory")
    return store.read_run(), store.read_results()


def summarize_statuses(results: list[dict[str, Any]]) -> dict[str, int]:
    counts = Counter(r["status"] for r in results)
    return {"cases": len(results), **{s: counts.get(s, 0) for s in STATUSES}}
