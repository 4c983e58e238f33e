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

SCHEMA_VERSION = 1
RUN_SCHEMA = "spark-bench/run"
RUN_FILE, RESULTS_FILE, LOCK_FILE = "run.json", "results.jsonl", ".lock"
STATUSES = ("ok", "mismatch", "error", "crash", "timeout", "oom", "skipped")
FAILED = ("mismatch", "error", "crash", "timeout", "oom")


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


_NUMBER = (int, float)
_NONE = type(None)
# field -> the JSON types it may hold (docs/results.md); REQUIRED fields must be present in every record
RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "case_id": (str,), "op": (str,), "backend": (str,), "params": (dict,), "dtype": (str,), "device": (str,),
    "status": (str,), "error": (str, _NONE), "labels": (list,), "check": (dict, _NONE), "timing": (dict, _NONE),
    "cost": (dict, _NONE), "gbps": (*_NUMBER, _NONE), "tflops": (*_NUMBER, _NONE), "stages": (list, _NONE),
    "extra": (dict, _NONE), "power": (dict, _NONE), "roofline": (dict, _NONE), "duration_s": (*_NUMBER, _NONE),
    "recompiles_during_timing": (int, _NONE), "started": (str, _NONE), "phase": (str, _NONE),
    "worker_log_tail": (str, _NONE), "host": (str, _NONE), "worker": (str, _NONE), "executor": (str, _NONE),
    "memory": (dict, _NONE), "recheck": (dict, _NONE),
    "config": (dict, _NONE), "config_source": (dict, _NONE), "tuned_key": (dict, _NONE),
    "repeat": (int,),  # the n-th re-timing of its case (tune's closing timing of the defaults); absent: the first
    "weights": (str, _NONE),  # the label of the weight file / routing trace the case ran on (older runs: absent)
}
REQUIRED = ("case_id", "op", "backend", "params", "dtype", "device", "status")
RUN_FIELDS: dict[str, tuple[type, ...]] = {
    "run_id": (str,), "created": (str, _NONE), "finished": (str, _NONE), "fingerprint": (dict,),
    "command": (list, _NONE), "spec": (dict, _NONE), "roofline": (dict, _NONE), "summary": (dict, _NONE),
    "stopped_by_budget": (dict, _NONE),  # only after `run --budget` left cases: {budget_s, cases_left}
}
_JSON_NAMES = {str: "a string", dict: "an object", list: "a list", int: "a number", float: "a number",
               bool: "true/false", _NONE: "null"}
# nested fields the commands read, by path: 'a.b' a key of an object, 'a.*' every value of one, 'a[]' every item of a
# list (docs/results.md); a path under a missing field or one of another type is not checked
_NUM, _OBJ, _STR = (*_NUMBER, _NONE), (dict, _NONE), (str, _NONE)
_TIMING_NUMBERS = ("mean", "min", "max", "p10", "p90", "iqr", "ci_low", "ci_high", "ci_level", "rel_ci", "n")
RECORD_NESTED: dict[str, tuple[type, ...]] = {
    "params.*": (str, *_NUMBER, bool, _NONE), "labels[]": (str,), "timing.median": _NUMBER, "timing.timer": _STR,
    "timing.unit": _STR, **{f"timing.{k}": _NUM for k in _TIMING_NUMBERS}, "timing.samples": (list, _NONE),
    "timing.samples[]": _NUMBER, "check.ok": (bool, _NONE), "check.message": _STR, "recheck.ok": (bool, _NONE),
    "recheck.identical": (bool, _NONE),
    **{f"check.{k}": _NUM for k in ("err_ratio", "max_abs", "cosine")},
    **{f"cost.{k}": _NUM for k in ("flops", "bytes", "tokens")},
    "power.avg_w": _NUM, "power.energy_j_per_call": _NUM, "power.source": _STR,
    **{f"roofline.pct_{k}": _NUM for k in ("bw_measured", "bw_datasheet", "flops_measured", "flops_datasheet")},
    **{f"memory.{k}": _NUM for k in ("rss_peak_bytes", "rss_peak_increase_bytes", "device_peak_bytes")},
}
RUN_NESTED: dict[str, tuple[type, ...]] = {
    "fingerprint.device": (dict,), "fingerprint.device.name": _STR, "fingerprint.device.type": _STR,
    **{f"fingerprint.device.{k}": _NUM for k in ("memory_bytes", "l2_bytes", "sm_count")},
    **{f"fingerprint.{k}": _OBJ for k in ("cpu", "versions", "git", "weights", "power")},
    "fingerprint.fingerprint_id": _STR, "fingerprint.power.limit_w": _NUM,
    "fingerprint.weights.size_bytes": _NUM, "fingerprint.weights.routing": _OBJ,
    "roofline.measured": _OBJ, "roofline.datasheet": _OBJ, "stopped_by_budget.cases_left": _NUM,
}

# run.json's `spec`, as `run --resume`, `run --like` and `tune --resume` read it (stored_run.stored_sweep); a field
# absent takes SweepSpec's default
SPEC_NESTED: dict[str, tuple[type, ...]] = {
    **{k: (list,) for k in ("ops", "backends", "dtypes")}, **{f"{k}[]": (str,) for k in ("ops", "backends", "dtypes")},
    "preset": _STR, "overrides": (dict,), "overrides.*": (list,), "overrides.*[]": (str,), "device": (str,),
    "quick": (bool,), "seed": (int,), "weights": _OBJ, "tuned": _OBJ, "timers": (dict,), "timers.*": (str,),
    "timing": (dict,), "timeout_s": _NUMBER, "timing.flush": (bool,), "timing.mode": (str,),
    **{f"timing.{k}": _NUMBER for k in ("warmup_s", "min_time_s", "max_time_s", "target_rel_ci", "graph_target_us")},
    "timing.min_samples": (int,), "timing.max_samples": (int,), "timing.graph_calls": (int, _NONE),
}


def _type_name(value: Any) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _at(value: Any, path: str, name: str = "") -> list[tuple[str, Any]]:
    """(name, value) of each member of `value` that `path` (a key of RECORD_NESTED or RUN_NESTED) names."""
    if not path:
        return [(name, value)]
    part, _, rest = path.partition(".")
    key = part.removesuffix("[]")
    keys = list(value) if key == "*" and isinstance(value, dict) else [key] if isinstance(value, dict) else []
    found = [(f"{name}.{k}" if name else k, value[k]) for k in keys if k in value]
    if part.endswith("[]"):
        found = [(f"{n}[{i}]", x) for n, items in found if isinstance(items, list) for i, x in enumerate(items)]
    return [hit for n, v in found for hit in _at(v, rest, n)]


def schema_problem(obj: dict[str, Any], schema: dict[str, tuple[type, ...]]) -> str | None:
    """The first field of `obj` whose JSON type `schema` (path -> types) does not allow, as one line; else None."""
    for path, types in schema.items():
        for name, value in _at(obj, path):
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                want = " or ".join(dict.fromkeys(_JSON_NAMES[t] for t in types))
                return f"field {name!r} must be {want}, not {_type_name(value)}"
    return None


def record_problem(rec: Any) -> str | None:
    """Why a results.jsonl record (amendments merged) does not follow the schema (one line), or None when it does."""
    if not isinstance(rec, dict):
        return f"not a JSON object but {_type_name(rec)}"
    for key in REQUIRED:
        if key not in rec:
            return f"missing required field {key!r}"
    problem = schema_problem(rec, RECORD_FIELDS)
    if problem is None and rec["status"] not in STATUSES:
        return f"unknown status {rec['status'][:40]!r} (one of {', '.join(STATUSES)})"
    return problem or schema_problem(rec, RECORD_NESTED)


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
    temporary file is per process, so two writers of one file (a shared cache) never mix their bytes."""
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
    """Why a file cannot be written (atomically, as the cache and a tuned table are) at `path`, or None. It creates
    and removes a file in the nearest existing folder: permission bits do not say it (root, /proc, read-only mounts)."""
    if isinstance(path, str) and not path.strip():  # (Path("") is ".", a directory: said below)
        return "an empty path, not a file name"
    path = Path(path)
    if path.is_dir():
        return "is a directory"
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    probe = folder / f".{path.name}.{os.getpid()}.probe"
    try:
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as exc:
        return f"cannot write there ({exc.strerror or exc})"
    return None


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
