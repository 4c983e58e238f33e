"""Declared launch configurations: each kernel's tunable parameters as data, not constants in its wrapper.

A `ConfigSpace` names the kernel, the shape parameters that can change the best choice (`key`), a small list of
candidate configs and the default (the one chosen on paper, checked offline for sm_90a by `spark-bench kernels`: it
compiles, fits in shared memory and does not spill). A config is a dict of the kernel's tunable constexprs plus
`num_warps` / `num_stages`. `buckets` refine the default by key: the first (bounds, config) whose bounds all hold
(`shape[k] <= bound`, or `lo <= shape[k] <= hi` for a `(lo, hi)` bound; equality for a non-numeric key such as a
dtype) wins. `per_target` holds such rules for one
GPU family (`triton_env.target_name`: sm_80, sm_90a, sm_100a), tried before `buckets` on that family only: a
per-device table, as vLLM keeps, for where the paper choice does not fit another GPU (`spark-bench kernels --target
sm_80` compiles the launches as they would be picked there).

Wrappers launch with `space.pick(**key)`. What it returns, in order: a forced config (`spark-bench tune` timing one
candidate: source "candidate"), the nearest entry of an installed tuned table (`run --tuned`: "tuned" at the key it
was tuned at, "tuned-nearest" at another key), else the bucket or default ("default"). A tuned config the space no
longer declares (its parameters or candidates changed since the tune) is ignored: the declared choice runs, as
"default". While `recording()` is active every pick is logged with its key and source, which is how a result says
which config ran and how `tune` learns which kernels a backend launches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

LAUNCH_OPTIONS = ("num_warps", "num_stages")
SOURCES = ("candidate", "tuned", "tuned-nearest", "default")


@dataclasses.dataclass(frozen=True)
class ConfigSpace:
    kernel: str
    default: Mapping[str, Any]
    candidates: Sequence[Mapping[str, Any]] = ()
    key: Sequence[str] = ()
    buckets: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]] = ()
    doc: str = ""
    per_target: Mapping[str, Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]] = dataclasses.field(
        default_factory=dict)

    def __post_init__(self) -> None:
        from spark_bench.kernelgate.targets import TARGETS

        unknown_targets = set(self.per_target) - set(TARGETS)
        if unknown_targets:
            raise ValueError(f"{self.kernel}: per_target names {sorted(unknown_targets)}; known: {', '.join(TARGETS)}")
        rules = [*self.buckets, *(rule for target_rules in self.per_target.values() for rule in target_rules)]
        known = [dict(c) for c in self.candidates]
        extra = [dict(c) for c in [self.default, *(cfg for _, cfg in rules)] if dict(c) not in known]
        object.__setattr__(self, "candidates", [*{config_id(c): c for c in extra + known}.values()])
        for bounds, _ in rules:
            unknown = set(bounds) - set(self.key)
            if unknown:
                raise ValueError(f"{self.kernel}: bucket bounds {sorted(unknown)} are not key parameters {self.key}")

    def declared(self, target: str | None = None, **key: Any) -> dict[str, Any]:
        """The declared choice at these key values on `target` (default: where this process launches,
        `triton_env.target_name()`): the first of that target's rules, then of the buckets, whose bounds hold; else
        the default."""
        if target is None and self.per_target:  # only then: this runs on every launch
            from spark_bench import triton_env

            target = triton_env.target_name()
        for bounds, config in [*self.per_target.get(target, ()), *self.buckets]:
            if all(k in key and _within(key[k], v) for k, v in bounds.items()):
                return dict(config)
        return dict(self.default)

    def pick(self, **key: Any) -> dict[str, Any]:
        """The config for a launch at these key values (forced, tuned, else declared; see the module doc)."""
        key = {k: key[k] for k in self.key if k in key} or dict(key)
        config, source, entry_key = _STATE.forced.get(self.kernel), "candidate", None
        if config is None and _STATE.table is not None:
            memo = (self.kernel, repr(sorted(key.items())))  # repr: a key value need not be hashable
            if memo not in _STATE.tuned:  # once per kernel and key: pick runs on every launch, timed ones included
                _STATE.tuned[memo] = self._tuned(key)
            config, source, entry_key = _STATE.tuned[memo]
        if config is None:
            config, source = self.declared(**key), "default"
        config = dict(config)
        if _STATE.log is not None:
            _STATE.log.append({"kernel": self.kernel, "key": key, "config": config, "source": source,
                               "tuned_key": entry_key})
        return config

    def _tuned(self, key: dict[str, Any]) -> tuple[Any, str, Any]:
        """(config, source, entry key) the applied table gives at `key`, or (None, "candidate", None). A stale entry
        (its config renamed or dropped since) is skipped; so is a nearest one from another declared bucket: the
        buckets mark regimes (decode sizes, few heads) a winner elsewhere says nothing of."""
        found = _STATE.table.nearest(self.kernel, key)
        if found is None or dict(found[0]["config"]) not in self.candidates:
            return None, "candidate", None
        if found[1] != 0 and self.declared(**found[0]["key"]) != self.declared(**key):
            return None, "candidate", None
        return found[0]["config"], "tuned" if found[1] == 0 else "tuned-nearest", found[0]["key"]


def stale_entries(table: Any) -> dict[str, int]:
    """kernel -> how many of a tuned table's entries hold a config its declared space no longer has (`pick` skips
    them: the declared config runs). Our kernels' spaces are imported here; a kernel whose space no module of this
    process declares (a plugin's, not loaded) is not judged."""
    import importlib

    out: dict[str, int] = {}
    for kernel, entry in table.entries():
        if kernel not in SPACES:
            try:
                importlib.import_module("spark_bench.kernels." + kernel.rpartition(".")[0])
            except ImportError:
                pass
        space = SPACES.get(kernel)
        if space is not None and dict(entry["config"]) not in space.candidates:
            out[kernel] = out.get(kernel, 0) + 1
    return out


def stale_text(stale: dict[str, int]) -> str:
    """One line naming the stale entries of a table (stale_entries), for a warning."""
    n = sum(stale.values())
    return (f"{', '.join(sorted(stale))}: {n} tuned entr{'y' if n == 1 else 'ies'} with a config the kernel no "
            "longer declares (its space changed since the tune); the declared configs run there: tune again")


def _within(value: Any, bound: Any) -> bool:
    """A bucket bound holds: value <= bound for numbers, lo <= value <= hi for a (lo, hi) bound, value == bound for
    anything else (a dtype's name)."""
    if isinstance(bound, tuple):
        lo, hi = bound
        return lo <= value <= hi
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, bound))
    return value <= bound if numeric else value == bound


def config_id(config: Mapping[str, Any]) -> str:
    """A config's stable name, e.g. 'BK=64,BV=32,num_warps=4' (constexprs sorted, launch options last)."""
    meta, options = split(config)
    return ",".join(f"{k}={config[k]}" for k in [*sorted(meta), *sorted(options)])


def split(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(constexprs, launch options) of a config."""
    meta = {k: v for k, v in config.items() if k not in LAUNCH_OPTIONS}
    return meta, {k: v for k, v in config.items() if k in LAUNCH_OPTIONS}


def key_id(key: Mapping[str, Any]) -> str:
    return json.dumps({k: key[k] for k in sorted(key)}, separators=(",", ":"), default=str)


def key_distance(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """How far two keys are: inf unless they name the same parameters with the same non-numeric values; else the sum
    of |log2| ratios of the numeric ones (a tuned 4096-token entry is nearer to 3000 tokens than a 64-token one)."""
    if set(a) != set(b):
        return math.inf
    dist = 0.0
    for k, va in a.items():
        vb = b[k]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
        if not numeric:
            if va != vb:
                return math.inf
            continue
        dist += abs(math.log2(max(float(va), 0.0) + 1.0) - math.log2(max(float(vb), 0.0) + 1.0))
    return dist


SPACES: dict[str, ConfigSpace] = {}


def declare(space: ConfigSpace) -> ConfigSpace:
    """Register a kernel's space (kernels declare theirs at import) and return it."""
    SPACES[space.kernel] = space
    return space


class _State:
    """What `pick` consults, for this process (a worker runs one case at a time)."""

    def __init__(self) -> None:
        self.forced: dict[str, Mapping[str, Any]] = {}
        self.table: Any = None  # a TunedStore (.nearest(kernel, key) -> (entry, distance) | None)
        self.log: list[dict[str, Any]] | None = None
        self.tuned: dict[tuple[str, str], tuple[Any, str, Any]] = {}  # (kernel, key) -> what the table gave there


_STATE = _State()


@contextlib.contextmanager
def applied(forced: Mapping[str, Mapping[str, Any]] | None = None, table: Any = None) -> Iterator[None]:
    """Within: `pick` returns `forced[kernel]` for those kernels, else the table's nearest entry, else the declared
    choice."""
    saved = (_STATE.forced, _STATE.table, _STATE.tuned)
    _STATE.forced, _STATE.table, _STATE.tuned = dict(forced or {}), table, {}
    try:
        yield
    finally:
        _STATE.forced, _STATE.table, _STATE.tuned = saved


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """Within: every pick appends {kernel, key, config, source} to the yielded list."""
    saved, _STATE.log = _STATE.log, []
    try:
        yield _STATE.log
    finally:
        _STATE.log = saved


def summarize(picks: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """A result's `config` (kernel -> the config that ran; a list when one case launched it with several),
    `config_source` (kernel -> candidate / tuned / tuned-nearest / default, or mixed) and, when a tuned table chose
    any, `tuned_key` (kernel -> the keys of the table entries it took) from the picks recorded during one call."""
    configs: dict[str, list[dict[str, Any]]] = {}
    sources: dict[str, str] = {}
    tuned_keys: dict[str, list[dict[str, Any]]] = {}
    for p in picks:
        seen = configs.setdefault(p["kernel"], [])
        if p["config"] not in seen:
            seen.append(p["config"])
        old = sources.get(p["kernel"])
        sources[p["kernel"]] = p["source"] if old in (None, p["source"]) else "mixed"
        if p.get("tuned_key") is not None and p["tuned_key"] not in tuned_keys.setdefault(p["kernel"], []):
            tuned_keys[p["kernel"]].append(p["tuned_key"])
    out = {"config": {k: v[0] if len(v) == 1 else v for k, v in configs.items()}, "config_source": sources}
    return {**out, "tuned_key": {k: v for k, v in tuned_keys.items() if v}} if any(tuned_keys.values()) else out
