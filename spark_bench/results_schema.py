"""The stored files' schema as JSON types: each record of results.jsonl and run.json's fields (and its sweep spec,
as a resumed run reads it), checked field by field so a damaged or foreign file is one line naming the field.
docs/results.md describes the fields."""

from __future__ import annotations

from typing import Any

STATUSES = ("ok", "mismatch", "error", "crash", "timeout", "oom", "skipped")
FAILED = ("mismatch", "error", "crash", "timeout", "oom")

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
NULLABLE_NUMBER, NULLABLE_OBJECT, NULLABLE_STR = (*_NUMBER, _NONE), (dict, _NONE), (str, _NONE)
PARAM_VALUE = (str, *_NUMBER, bool, _NONE)  # a case's axis value
_NUM, _OBJ, _STR = NULLABLE_NUMBER, NULLABLE_OBJECT, NULLABLE_STR
_TIMING_NUMBERS = ("mean", "min", "max", "p10", "p90", "iqr", "ci_low", "ci_high", "ci_level", "rel_ci", "n")
RECORD_NESTED: dict[str, tuple[type, ...]] = {
    "params.*": PARAM_VALUE, "labels[]": (str,), "timing.median": _NUMBER, "timing.timer": _STR,
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
    "fingerprint.fingerprint_id": _STR, "fingerprint.power.limit_w": _NUM, "fingerprint.power.mig": (bool, _NONE),
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
