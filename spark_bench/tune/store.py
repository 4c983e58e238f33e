"""The tuned-config store: per device, the best config of each kernel per key bucket, as `spark-bench tune` measured it.

One JSON file per device (schema `spark-bench.tuned` v1, human-readable, sorted, mergeable; committed like vLLM's
per-device tables when a team shares them). Layout (docs/tune.md):

    {"schema": "spark-bench.tuned", "schema_version": 1, "device": {...}, "device_id": "...", "updated": "...",
     "versions": {"torch": ..., "triton": ...},
     "kernels": {"<kernel>": [{"key": {...}, "config": {...}, "time_us": t, "default": {"config", "time_us"},
                               "runner_up": {"config", "time_us"} | null, "speedup": d/t, "cases": n,
                               "noise": margin, "timers": [...],
                               "within_noise": {...} | null, "drift": {"max", "cases"} | null, "unranked": n,
                               "untimed": n, "measured": "<iso time>", "run": "<tune dir>"}, ...]}}

A kernel looks its config up at launch (`nearest`: the entry whose key is nearest, spark_bench.tune.space.key_distance);
a kernel or key the store lacks falls back to the declared choice. The device is identified by what decides the best
tile (name, compute capability, SM count, memory), not by driver or library versions, which are kept for the record.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from spark_bench.results import is_number, loads_json
from spark_bench.sweep import UsageError
from spark_bench.tune.space import key_distance, key_id

SCHEMA, SCHEMA_VERSION = "spark-bench.tuned", 1
DEVICE_KEYS = ("type", "name", "capability", "sm_count", "memory_bytes")


class StoreError(UsageError):
    """A tuned-config file that cannot be used; one line naming the file and the problem (exit 2)."""


def device_identity(device_info: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    ident = {k: device_info.get(k) for k in DEVICE_KEYS}
    return ident, hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:12]


def slug(device_info: Mapping[str, Any]) -> str:
    """A file name for a device's store, e.g. 'nvidia-h200-sm90-132sm-<id>'."""
    ident, ident_id = device_identity(device_info)
    parts = [str(ident.get("name") or ident.get("type") or "device")]
    if ident.get("capability"):
        parts.append("sm" + str(ident["capability"]).replace(".", ""))
    if ident.get("sm_count"):
        parts.append(f"{ident['sm_count']}sm")
    name = re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")
    return f"{name}-{ident_id}"


class TunedStore:
    def __init__(self, data: dict[str, Any], path: Path | None = None) -> None:
        self.data, self.path = data, path

    @classmethod
    def new(cls, device_info: Mapping[str, Any], versions: Mapping[str, Any]) -> TunedStore:
        ident, ident_id = device_identity(device_info)
        return cls({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "device": ident, "device_id": ident_id,
                    "updated": None, "versions": dict(versions), "kernels": {}})

    @classmethod
    def load(cls, path: Path | str) -> TunedStore:
        path = Path(path)
        try:
            text = path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise StoreError(f"tuned-config file {path}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise StoreError(f"tuned-config file {path}: cannot read it ({exc})") from None
        try:
            data = loads_json(text)
        except json.JSONDecodeError as exc:
            raise StoreError(f"tuned-config file {path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        except ValueError as exc:
            raise StoreError(f"tuned-config file {path}: not valid JSON ({exc})") from None
        problem = validate(data)
        if problem:
            raise StoreError(f"tuned-config file {path}: {problem}")
        return cls(data, path)

    @property
    def kernels(self) -> dict[str, list[dict[str, Any]]]:
        return self.data["kernels"]

    def entries(self) -> list[tuple[str, dict[str, Any]]]:
        return [(kernel, e) for kernel in sorted(self.kernels) for e in self.kernels[kernel]]

    def nearest(self, kernel: str, key: Mapping[str, Any]) -> tuple[dict[str, Any], float] | None:
        """(the entry nearest to `key`, its key_distance: 0 at the very key it was tuned at), or None (the kernel's
        declared choice then applies). The key is compared as `tune` stored it, through JSON (a torch.dtype as its
        name, a tuple as a list)."""
        key = json.loads(json.dumps(dict(key), default=str))
        best, best_d = None, math.inf
        for entry in self.kernels.get(kernel, ()):
            d = key_distance(entry["key"], key)
            if d < best_d:
                best, best_d = entry, d
        return (best, best_d) if best is not None else None

    def put(self, kernel: str, entry: dict[str, Any]) -> None:
        """Add or replace the entry of this kernel and key."""
        rows = [e for e in self.kernels.get(kernel, []) if key_id(e["key"]) != key_id(entry["key"])]
        rows.append(entry)
        self.kernels[kernel] = sorted(rows, key=lambda e: key_id(e["key"]))

    def merge(self, other: TunedStore, *, force: bool = False) -> int:
        """Take `other`'s entries (the newer measurement wins a key both hold); returns how many were taken."""
        if other.data["device_id"] != self.data["device_id"] and not force:
            raise StoreError(f"tuned-config file {other.path}: measured on {describe_device(other.data['device'])}, "
                             f"not {describe_device(self.data['device'])} (merge tables of one device)")
        foreign = other.data["device_id"] != self.data["device_id"]  # --force: each entry keeps where it was measured
        taken = 0
        for kernel, entry in other.entries():
            mine = [e for e in self.kernels.get(kernel, []) if key_id(e["key"]) == key_id(entry["key"])]
            if not mine or str(entry.get("measured") or "") > str(mine[0].get("measured") or ""):
                self.put(kernel, {**entry, **({"measured_on": entry.get("measured_on") or {
                    "device_id": other.data["device_id"], "device": describe_device(other.data["device"])}}
                    if foreign else {})})
                taken += 1
        return taken

    def foreign_entries(self) -> dict[str, int]:
        """Entries a forced merge took from another device's table: device -> how many."""
        out: dict[str, int] = {}
        for _, entry in self.entries():
            where = entry.get("measured_on")
            if isinstance(where, dict) and where.get("device_id") != self.data["device_id"]:
                out[str(where.get("device"))] = out.get(str(where.get("device")), 0) + 1
        return out

    def save(self, path: Path | str, updated: str) -> Path:
        """Write the table to `path` (an --out): a directory or a read-only place is one line (StoreError)."""
        from spark_bench.results import write_text_atomic

        path = Path(path)
        self.data["updated"] = updated
        self.data["kernels"] = {k: self.kernels[k] for k in sorted(self.kernels)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(self.data, indent=1, sort_keys=False) + "\n")
        except OSError as exc:
            raise StoreError(f"--out {path}: {exc.strerror or exc}") from None
        self.path = path
        return path


@contextlib.contextmanager
def locked(path: Path | str) -> Iterator[None]:
    """Within: this process alone reads-merges-writes the table at `path` (an exclusive flock on its folder, which
    leaves no lock file beside a committed table): two tunes of one device finishing together keep both entries."""
    import fcntl

    folder = Path(path).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise StoreError(f"--out {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def open_out(path: Path | str, device_info: Mapping[str, Any]) -> TunedStore | None:
    """`tune --out FILE`, checked before any tuning: the table to merge into, or None when FILE is new. StoreError
    for a directory, an unwritable place, a file that is not a tuned-config table, or another device's table."""
    from spark_bench.results import write_problem

    path = Path(path)
    problem = write_problem(path)
    if problem:
        raise StoreError(f"--out {path}: {problem}")
    if not path.exists():
        return None
    table = TunedStore.load(path)
    ident, ident_id = device_identity(device_info)
    if table.data["device_id"] != ident_id:
        raise StoreError(f"--out {path}: measured on {describe_device(table.data['device'])}, not this "
                         f"{describe_device(ident)}; pass another --out")
    return table


def describe_device(ident: Mapping[str, Any]) -> str:
    name = ident.get("name") or ident.get("type") or "?"
    return f"{name} (sm {ident['capability']})" if ident.get("capability") else str(name)


def _config_problem(config: Any) -> str | None:
    if not isinstance(config, dict) or not config:
        return "must be a non-empty object of parameter -> integer"
    for k, v in config.items():
        if not isinstance(v, int) or isinstance(v, bool):
            return f"parameter {k!r} must be an integer, not {json.dumps(v)[:30]}"
    return None


def _timed_problem(obj: Any, where: str = "") -> str | None:
    """Why `obj` (an entry, or its `where` = "default." / "runner_up.") is not {"config", "time_us"}, or None."""
    if not isinstance(obj, dict):
        return f"\"{where.rstrip('.')}\" must be an object with \"config\" and \"time_us\""
    problem = _config_problem(obj.get("config"))
    if problem:
        return f"\"{where}config\" {problem}"
    time_us = obj.get("time_us")
    return None if is_number(time_us) and time_us > 0 else f"\"{where}time_us\" must be a finite number > 0"


def _entry_problem(entry: Any) -> str | None:
    """Why one entry is not what `tune` writes (the fields `tuned show` and the report print), or None."""
    if not isinstance(entry, dict) or not isinstance(entry.get("key"), dict):
        return "needs a \"key\" object"
    problem = _timed_problem(entry) or _timed_problem(entry.get("default"), "default.")
    if problem:
        return problem
    if entry.get("runner_up") is not None and (problem := _timed_problem(entry["runner_up"], "runner_up.")):
        return problem
    if not (is_number(entry.get("speedup")) and entry["speedup"] > 0):
        return "\"speedup\" must be a finite number > 0"
    if entry.get("noise") is not None and not (is_number(entry["noise"]) and entry["noise"] >= 0):
        return "\"noise\" must be null or a finite number >= 0"
    close = entry.get("within_noise")
    if close is not None and not (isinstance(close, dict) and is_number(close.get("speedup"))
                                  and "noise" in close
                                  and (close["noise"] is None or is_number(close["noise"]))):
        return "\"within_noise\" must be null or an object with a numeric \"speedup\" and \"noise\" (null: unknown)"
    drift = entry.get("drift")
    if drift is not None and not (isinstance(drift, dict) and is_number(drift.get("max"))
                                  and isinstance(drift.get("cases"), int)):
        return "\"drift\" must be null or an object with a numeric \"max\" and an integer \"cases\""
    labels = entry.get("labels")
    if labels is not None and not (isinstance(labels, list) and all(isinstance(x, str) for x in labels)):
        return "\"labels\" must be a list of strings"
    return None


def validate(data: Any) -> str | None:
    """Why `data` is not a usable store (one line), or None."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return f"not a spark-bench tuned-config table (no \"schema\": \"{SCHEMA}\")"
    if data.get("schema_version") != SCHEMA_VERSION:
        return f"schema version {json.dumps(data.get('schema_version'))[:20]}, this spark-bench reads {SCHEMA_VERSION}"
    if not isinstance(data.get("device"), dict) or not isinstance(data.get("device_id"), str):
        return "missing its \"device\" object or \"device_id\""
    kernels = data.get("kernels")
    if not isinstance(kernels, dict):
        return "\"kernels\" must be an object of kernel -> list of entries"
    for kernel, rows in kernels.items():
        if not isinstance(rows, list):
            return f"kernel {kernel!r}: must be a list of entries"
        for i, entry in enumerate(rows):
            problem = _entry_problem(entry)
            if problem:
                return f"kernel {kernel!r} entry {i}: {problem}"
    return None


def resolve(spec: str, device_info: Mapping[str, Any], root: Path) -> Path | None:
    """`--tuned FILE|auto`: the file, or (auto) this device's store under root/tuned/ when there is one."""
    if spec != "auto":
        return Path(spec)
    path = default_path(device_info, root)
    return path if path.is_file() else None


def default_path(device_info: Mapping[str, Any], root: Path) -> Path:
    return Path(root) / "tuned" / f"{slug(device_info)}.json"
