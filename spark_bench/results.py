"""The results store: `<run>/run.json` (fingerprint, command, sweep spec, summary) and `<run>/results.jsonl`
(one case per line, appended and flushed as each case ends). Schema: docs/results.md."""

from __future__ import annotations

import datetime as dt
import errno
import json
import math
import os
import secrets
import socket
from collections import Counter
from pathlib import Path
from typing import Any

from spark_bench.op_contract import json_default
from spark_bench.results_schema import RUN_FIELDS, RUN_NESTED, STATUSES, record_problem, schema_problem

SCHEMA_VERSION = 1
RUN_SCHEMA = "spark-bench/run"
RUN_FILE, RESULTS_FILE, LOCK_FILE = "run.json", "results.jsonl", ".lock"


class ResultsError(Exception):
    """A malformed, foreign or missing results file; the message is one line."""


class DiskFullError(ResultsError):
    """A write ran out of space (or of the file size limit); nothing partial was left behind."""


NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id(device: str) -> str:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{device.replace(':', '')}-{secrets.token_hex(2)}"


def case_id(op: str, backend: str, params: dict[str, Any], dtype: str, device: str) -> str:
    return "|".join([op, backend, json.dumps(params, sort_keys=True, separators=(",", ":")), dtype, device])


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ResultsError(f"{path}: not UTF-8 text (undecodable byte at offset {exc.start})") from None
    except OSError as exc:
        raise ResultsError(f"{path}: cannot read ({exc.strerror})") from None


def loads_json(text: str) -> Any:
    """json.loads of a stored file's text; ValueError (its message one line) for anything it cannot take: malformed
    JSON (json.JSONDecodeError), an integer of more digits than Python converts, or a string with an unpaired
    surrogate escape (`"\\ud800"`: JSON's syntax, but no text: printing or storing it fails)."""
    obj = json.loads(text)
    if "\\u" in text:
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds an unpaired surrogate escape (\\ud800-\\udfff)") from None
    return obj


def is_number(x: Any) -> bool:
    """A finite int or float (not a bool): what a stored statistic must be to be computed with."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `path` through a temporary file that is removed if the write fails (a full disk leaves no `.tmp`); the
    temporary file is per process, so two writers of one file (a shared cache) never mix their bytes. A symlink is
    written through (its target replaced, the link kept)."""
    path = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if is_no_space(exc):
            raise DiskFullError(f"no space left writing {path} ({exc.strerror})") from None
        raise


def shell_path(path: str | Path) -> str:
    """A path as it must be typed in a command we suggest (`--resume 'my runs/a'`)."""
    import shlex

    return shlex.quote(str(path))


def write_problem(path: str | Path) -> str | None:
    """Why a file cannot be written (atomically, as the cache and a tuned table are) at `path`, or None (a probe file
    in the nearest existing folder says it: _uncreatable)."""
    if isinstance(path, str) and not path.strip():  # (Path("") is ".", a directory: said below)
        return "an empty path, not a file name"
    path = Path(path)
    if path.is_dir():
        return "is a directory"
    if path.exists() and not path.is_file():  # /dev/null, a FIFO: the atomic write would replace it with a file
        return "is not a regular file"
    found = _uncreatable(path.parent, f".{path.name}.{os.getpid()}.probe")
    if found is None:
        return None
    folder, exc = found
    return f"{folder} is a file, not a folder" if not folder.is_dir() else f"cannot write there ({exc.strerror or exc})"


def _uncreatable(folder: Path, probe_name: str) -> tuple[Path, OSError] | None:
    """(the nearest existing folder of `folder`, why a file cannot be made there: ENOTDIR when it is a file), or None
    when one can. Creates and removes the file `probe_name` there: permission bits do not say it (root, /proc,
    read-only mounts)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return folder, NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
    probe = folder / probe_name
    try:
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as exc:
        return folder, exc
    return None


def _cannot_create(folder: Path) -> str | None:
    """Why files cannot be made in `folder` (created first where it is missing), as `lock` would say; else None."""
    found = _uncreatable(folder, f".spark-bench.{os.getpid()}.probe")
    return None if found is None else found[1].strerror or str(found[1])


def _write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=json_default) + "\n")


class RunStore:
    """One run directory. The parent process is the only writer of results.jsonl, and `lock()` makes it the only
    one: a second `run --resume`/`--out` of the same directory is refused while the first holds it. `option`: the
    command-line option that named the directory, for the messages (`tune --run-dir`)."""

    def __init__(self, path: Path | str, option: str = "--out") -> None:
        self.path, self.option = Path(path), option
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Own this run directory until the process ends (or `unlock()`): an exclusive flock on `<run>/.lock`, which
        the kernel releases however the owner dies (kill -9 included), so a stale lock never blocks a resume.
        Raises ResultsError naming the holder when another process owns it."""
        import fcntl

        if self._lock_fd is not None:
            return
        if self.path.exists() and not self.path.is_dir():
            raise ResultsError(f"{self.path} is a file, not a run directory; choose another {self.option}")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:  # --out under /proc, a read-only mount, a file in the path
            raise ResultsError(f"{self.path}: cannot create the run directory ({exc.strerror or exc})") from None
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

    def check_new(self) -> None:
        """ResultsError (one line) unless a new run can start here: not a file, holding no results."""
        if self.path.exists() and not self.path.is_dir():
            raise ResultsError(f"{self.path} is a file, not a run directory; choose another {self.option}")
        if self.results_file.exists() and self.results_file.stat().st_size > 0:
            raise ResultsError(f"{self.path} already holds results; use --resume {shell_path(self.path)} or another "
                               f"{self.option}")
        why = _cannot_create(self.path)  # /proc/x, a file in the path: a dry run refuses what the run cannot create
        if why:
            raise ResultsError(f"{self.path}: cannot create the run directory ({why})")

    def create(self, run: dict[str, Any]) -> None:
        self.check_new()
        self.path.mkdir(parents=True, exist_ok=True)
        self.write_run({"schema": RUN_SCHEMA, "schema_version": SCHEMA_VERSION, **run})
        self.results_file.touch()

    def write_run(self, run: dict[str, Any]) -> None:
        _write_json_atomic(self.run_file, run)

    def read_run(self) -> dict[str, Any]:
        if not self.run_file.is_file():
            raise ResultsError(f"{self.path} is not a spark-bench run directory (no {RUN_FILE})")
        try:
            run = loads_json(_read_text(self.run_file))
        except json.JSONDecodeError as exc:
            raise ResultsError(f"{self.run_file}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        except ValueError as exc:
            raise ResultsError(f"{self.run_file}: not valid JSON ({exc})") from None
        if not isinstance(run, dict) or run.get("schema") != RUN_SCHEMA:
            raise ResultsError(f"{self.run_file}: not a spark-bench run file")
        if run.get("schema_version") != SCHEMA_VERSION:
            raise ResultsError(f"{self.run_file}: schema version {json.dumps(run.get('schema_version'))[:40]}, "
                               f"this spark-bench reads {SCHEMA_VERSION}")
        problem = schema_problem(run, RUN_FIELDS) or schema_problem(run, RUN_NESTED)
        if problem:
            raise ResultsError(f"{self.run_file}: {problem}")
        return run

    def repair_tail(self) -> None:
        """Drop a partial last line left by a killed run, so appends start on a fresh line."""
        if not self.results_file.exists():
            return
        if not self.results_file.is_file():
            raise ResultsError(f"{self.results_file} is not a file: this run's results cannot be read or added to")
        data = self.results_file.read_bytes()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            with open(self.results_file, "r+b") as f:
                f.truncate(cut)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps({"schema_version": SCHEMA_VERSION, **record}, default=json_default, allow_nan=True)
        data = (line + "\n").encode()
        fd = os.open(self.results_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError as exc:
                os.ftruncate(fd, size)  # no partial line: the journal ends on the last whole record
                if is_no_space(exc):
                    raise DiskFullError(f"no space left writing {self.results_file} ({exc.strerror})") from None
                raise
        finally:
            os.close(fd)

    def amend(self, target: str, *, label: str | None = None, **fields: Any) -> None:
        """Append an amendment of an earlier record (the journal is append-only): `read_results` merges `fields`
        into the record of case `target` and adds `label` to its labels. An amendment is not a case."""
        self.append({"amends": target, "label": label, "fields": fields, "at": now()})

    def read_results(self) -> list[dict[str, Any]]:
        if not self.results_file.is_file():
            raise ResultsError(f"{self.path} has no {RESULTS_FILE}")
        records, lines = [], _read_text(self.results_file).split("\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = loads_json(line)
            except json.JSONDecodeError:
                if number == len(lines):  # a partial last line of a killed run
                    continue
                raise ResultsError(f"{self.results_file}:{number}: malformed line") from None
            except ValueError as exc:
                raise ResultsError(f"{self.results_file}:{number}: malformed line ({exc})") from None
            if isinstance(rec, dict) and rec.get("schema_version") == SCHEMA_VERSION and "amends" in rec:
                self._apply_amendment(records, rec, number)
                continue
            if not isinstance(rec, dict) or rec.get("schema_version") != SCHEMA_VERSION or "case_id" not in rec:
                raise ResultsError(f"{self.results_file}:{number}: not a spark-bench v{SCHEMA_VERSION} result")
            problem = record_problem(rec)
            if problem:
                raise ResultsError(f"{self.results_file}:{number}: {problem}")
            records.append(rec)
        return records


    def _apply_amendment(self, records: list[dict[str, Any]], amendment: dict[str, Any], number: int) -> None:
        target, fields, label = amendment.get("amends"), amendment.get("fields"), amendment.get("label")
        if not isinstance(target, str) or not isinstance(fields, dict) or not isinstance(label, (str, type(None))):
            raise ResultsError(f"{self.results_file}:{number}: malformed amendment")
        for rec in reversed(records):
            if rec["case_id"] == target:
                rec.update(fields)
                problem = record_problem(rec)
                if problem:
                    raise ResultsError(f"{self.results_file}:{number}: amendment: {problem}")
                if label and label not in rec.setdefault("labels", []):
                    rec["labels"].append(label)
                return


def load_run(path: Path | str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(run.json, results) of a run directory; ResultsError with one line on anything malformed."""
    store = RunStore(path)
    if not store.path.is_dir():
        raise ResultsError(f"{path}: no such run directory")
    return store.read_run(), store.read_results()


def summarize_statuses(results: list[dict[str, Any]]) -> dict[str, int]:
    counts = Counter(r["status"] for r in results)
    return {"cases": len(results), **{s: counts.get(s, 0) for s in STATUSES}}
