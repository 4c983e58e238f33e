"""A sweep: which cases to run. A case = (op, backend, parameter point, dtype, device).

The spec is validated up front (unknown op, backend, axis, value or preset -> `UsageError` naming the valid choices)
and is stored in run.json, so `--resume` rebuilds exactly the same case list. Backends of one parameter point run one
after another in a seeded order that differs from point to point (interleaved, never always A before B), so drift
(clocks, temperature) does not favour one backend.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase
from typing import Any, TypeVar

from spark_bench.axis import SHARED_AXES, Axis
from spark_bench.dtypes import DTYPES, canonical_dtype
from spark_bench.op import Op
from spark_bench.registry import Registry
from spark_bench.results import ResultsError, case_id

T = TypeVar("T")


class UsageError(Exception):
    """Bad user input; the message is one line naming the valid choices."""


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    backend: str
    params: dict[str, Any]
    dtype: str
    device: str
    seed: int
    skip: str | None = None  # why the backend cannot run here: recorded as `skipped`, never run
    weights: dict[str, Any] | None = None  # the weight/routing source (spark_bench.weights), loaded in the worker
    configs: dict[str, dict[str, Any]] | None = None  # kernel -> forced config (a `tune` candidate; in the case id)
    tuned: dict[str, Any] | None = None  # a tuned-config table the kernels look their configs up in (`run --tuned`)
    repeat: int = 0  # the n-th re-timing of this case (tune's closing timing of the defaults; in the case id)
    timer: str | None = None  # the CUDA timer kept under --timer auto (run --like: the base's); not in the case id

    @property
    def case_id(self) -> str:
        base = case_id(self.op, self.backend, self.params, self.dtype, self.device)
        if self.configs:
            from spark_bench.tune.space import config_id

            base += "|" + ";".join(f"{k}:{config_id(self.configs[k])}" for k in sorted(self.configs))
        return base + (f"|repeat:{self.repeat}" if self.repeat else "")

    def record_fields(self) -> dict[str, Any]:
        """What every result of this case starts with: its identity (and `repeat`, when a re-timing)."""
        return {"case_id": self.case_id, "op": self.op, "backend": self.backend, "params": self.params,
                "dtype": self.dtype, "device": self.device, **({"repeat": self.repeat} if self.repeat else {})}

    @property
    def group(self) -> str:
        """Cases of one op, point and dtype share inputs and the reference output in a worker."""
        return case_id(self.op, "*", self.params, self.dtype, self.device)

    def input_seed(self) -> int:
        digest = hashlib.sha256(f"{self.seed}|{self.group}".encode()).digest()
        return int.from_bytes(digest[:4], "little")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class SweepSpec:
    ops: list[str] = dataclasses.field(default_factory=list)  # glob patterns; empty = all
    backends: list[str] = dataclasses.field(default_factory=list)  # empty = every default backend
    preset: str | None = None
    overrides: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # axis -> raw strings from --set
    dtypes: list[str] = dataclasses.field(default_factory=list)
    device: str = "cpu"
    quick: bool = False
    seed: int = 0
    weights: dict[str, Any] | None = None  # --weights/--layer/--routing (spark_bench.weights.make_spec)
    tuned: dict[str, Any] | None = None  # --tuned: {"path", "data"} of the tuned-config table (spark_bench.tune)
    timers: dict[str, str] = dataclasses.field(default_factory=dict)  # case id -> timer mode kept (run --like)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields})


def parse_set(text: str) -> tuple[str, list[str]]:
    """'heads=4,8' -> ('heads', ['4', '8']); 'kda.gate:tokens=1,8' -> ('kda.gate:tokens', ['1', '8']): an axis
    qualified by an op glob applies to the ops it matches only (and wins there over the same unqualified axis)."""
    if "=" not in text:
        raise UsageError(f"malformed --set {text!r}: expected AXIS=V1,V2,... (e.g. --set heads=4,8)")
    axis, _, values = text.partition("=")
    axis = axis.strip()
    vals = [v.strip() for v in values.split(",")]
    if not axis or not all(vals):  # tokens=1,,2 or tokens=1, is a typo, not the points 1 and 2
        raise UsageError(f"malformed --set {text!r}: expected AXIS=V1,V2,... with no empty value (e.g. --set "
                         "heads=4,8)")
    return axis, list(dict.fromkeys(vals))  # tokens=1,1 is one point, not two identical cases


def merge_sets(sets: Sequence[str]) -> dict[str, list[str]]:
    """Every --set of a command: the values of an axis given twice add up (`--set tokens=1 --set tokens=64` is
    `--set tokens=1,64`), each value once."""
    overrides: dict[str, list[str]] = {}
    for text in sets:
        axis, values = parse_set(text)
        overrides[axis] = list(dict.fromkeys([*overrides.get(axis, []), *values]))
    return overrides


def split_list(option: str, texts: Sequence[str], choices: str = "") -> list[str]:
    """Repeatable, comma-separated option values -> the names, each once. A value naming none (`--dtype ,`) is a
    UsageError (ending in `choices`, e.g. '; choose from bf16, fp32'), not 'all'."""
    names = []
    for text in texts:
        parts = [d.strip() for d in text.split(",") if d.strip()]
        if not parts:
            raise UsageError(f"{option} {text!r} names nothing{choices}")
        names.extend(parts)
    return list(dict.fromkeys(names))


def dtype_list(texts: Sequence[str]) -> list[str]:
    """--dtype values (repeatable, comma-separated) -> the dtype names, each once."""
    return split_list("--dtype", texts, f"; choose from {', '.join(DTYPES)}")


def unknown_axis(axis_name: str, known: Sequence[str] | set[str], whose: str = "selected ops", hint: str = "") -> str:
    """The one-line error for an axis none of `whose` has, naming the axes they have."""
    if not hint and axis_name in SHARED_AXES:
        hint = f" (a shared axis name, but none of the {whose} has it)"
    return f"unknown axis {axis_name!r}{hint}; the {whose} have: {', '.join(sorted(known)) or '(none)'}"


def select_by_sets(items: list[T], sets: Sequence[str], key: Callable[[T], tuple[str, dict[str, Any]]],
                   where: str = "the run") -> list[T]:
    """The items (`show`'s records, `history trend`'s stored cases; `key(item)` = (op, params)) holding one of the
    values of every AXIS=V1,V2 in `sets` (an axis given twice: its values add up, as in `run`). Each value is read
    by `Axis.parse` of its op's axis, declared by the values the op's items hold, so it compares by value (fused=true
    is True, tokens=064 is 64). An unknown axis, or a value no op's axis takes, is a UsageError; nothing left, a
    ResultsError naming what `where` has (one line each)."""
    keyed = [(item, *key(item)) for item in items]  # (item, op, params)
    for axis, texts in merge_sets(sets).items():
        if not keyed:
            break
        held: dict[str, list[Any]] = {}  # op -> the values its items hold on the axis (scalars: what an axis takes)
        for _, op, params in keyed:
            value = params.get(axis)
            if isinstance(value, (str, int, float)) and value not in held.setdefault(op, []):
                held[op].append(value)
        if not held:
            glob, plain = split_key(axis)
            hint = f" (to select an op's cases: --op {glob} --set {plain}=...)" if glob is not None else ""
            raise UsageError(unknown_axis(axis, {a for _, _, params in keyed for a in params},
                                          "selected cases", hint))
        wanted: dict[str, list[Any]] = {op: [] for op in held}
        for text in texts:
            errors = []
            for op, values in held.items():
                try:
                    wanted[op].append(Axis(axis, values).parse(text))
                except ValueError as exc:
                    errors.append(f"{op}: {exc}")
            if len(errors) == len(held):  # no op's axis takes it: a typo, not a filter that matches nothing
                raise UsageError(errors[0])
        kept = [k for k in keyed if k[2].get(axis) in wanted.get(k[1], ())]
        if not kept:
            have = sorted({v for values in held.values() for v in values},
                          key=lambda v: (isinstance(v, str), str(v) if isinstance(v, str) else v))
            raise ResultsError(f"no case has {axis} in {{{', '.join(texts)}}}; {where} has {axis} = "
                               f"{', '.join(map(str, have))}")
        keyed = kept
    return [item for item, _, _ in keyed]


def _select_ops(reg: Registry, spec: SweepSpec) -> list[Op]:
    try:
        return reg.match(spec.ops)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None


def _dtypes(op: Op, spec: SweepSpec) -> list[str]:
    if spec.dtypes:
        return [d for d in spec.dtypes if d in op.dtypes]
    return op.sweep_dtypes(quick=spec.quick, preset=spec.preset)


def split_key(key: str) -> tuple[str | None, str]:
    """An override's key 'axis' or 'op_glob:axis' -> (op glob or None, axis)."""
    glob, sep, axis = key.rpartition(":")
    return (glob, axis) if sep else (None, key)


def op_overrides(overrides: dict[str, list[str]], op_name: str) -> dict[str, list[str]]:
    """The raw --set values that apply to op `op_name`. Of the keys setting one axis the most specific wins, whatever
    their order: 'OP:axis' with OP the op's exact name, then 'GLOB:axis' with a glob matching it, then 'axis'. Two
    globs that match the op and set one axis are a UsageError (neither is more specific): name the op exactly."""
    keys: dict[str, list[tuple[int, str]]] = {}  # axis -> (specificity, key) of every key that applies
    for key in overrides:
        glob, axis = split_key(key)
        if glob is None or fnmatchcase(op_name, glob):
            keys.setdefault(axis, []).append((0 if glob is None else 2 if glob == op_name else 1, key))
    chosen = {}
    for axis, ranked in keys.items():
        best = max(rank for rank, _ in ranked)
        tied = [key for rank, key in ranked if rank == best]
        if len(tied) > 1:
            raise UsageError(f"--set {' and --set '.join(tied)} both set {axis} of {op_name}; name the op to "
                             f"choose: --set {op_name}:{axis}=...")
        chosen[axis] = overrides[tied[0]]
    return chosen


def _typed_overrides(op: Op, overrides: dict[str, list[str]]) -> dict[str, list[Any]]:
    typed = {}
    for axis_name, raw in op_overrides(overrides, op.name).items():
        if axis_name not in op.axis_names:
            continue
        axis = op.axis(axis_name)
        try:
            parsed = [axis.parse(v) for v in raw]
        except ValueError as exc:
            raise UsageError(f"{op.name}: {exc}") from None
        typed[axis_name] = [v for i, v in enumerate(parsed) if v not in parsed[:i]]  # tokens=1,01: one point
    return typed


def validate(reg: Registry, spec: SweepSpec) -> list[Op]:
    """Check the spec against the registry; returns the selected ops."""
    ops = _select_ops(reg, spec)
    if "dtype" in spec.overrides:
        spec.dtypes = spec.dtypes or list(spec.overrides.pop("dtype"))
    try:
        spec.dtypes = [canonical_dtype(d) for d in spec.dtypes]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    known_axes = {a for op in ops for a in op.axis_names}
    for key in spec.overrides:
        glob, axis_name = split_key(key)
        if glob is not None:
            _check_qualified(ops, glob, axis_name)
        elif axis_name not in known_axes:
            raise UsageError(unknown_axis(axis_name, known_axes))
    if spec.preset is not None:
        have = sorted({p for op in ops for p in op.presets})
        if spec.preset not in have:
            raise UsageError(f"unknown preset {spec.preset!r}; the selected ops have: {', '.join(have) or '(none)'}")
    all_backends = sorted({b for op in ops for b in op.backends})
    for name in spec.backends:
        if not any(fnmatchcase(b, name) for b in all_backends):
            raise UsageError(f"unknown backend {name!r}; the selected ops have: {', '.join(all_backends)}")
    if spec.dtypes and not any(set(spec.dtypes) & set(op.dtypes) for op in ops):
        have = sorted({d for op in ops for d in op.dtypes}, key=DTYPES.index)
        raise UsageError(f"no selected op supports dtype {', '.join(spec.dtypes)}; the selected ops have: "
                         f"{', '.join(have)}")
    for op in ops:
        _typed_overrides(op, spec.overrides)
    return ops


def _check_qualified(ops: Sequence[Op], glob: str, axis_name: str) -> None:
    matched = [op for op in ops if fnmatchcase(op.name, glob)]
    if not matched:
        raise UsageError(f"--set {glob}:{axis_name}: no selected op matches {glob!r}; the selected ops: "
                         f"{', '.join(op.name for op in ops)}")
    have = {a for op in matched for a in op.axis_names}
    if axis_name not in have:
        raise UsageError(f"--set {glob}:{axis_name}: unknown axis {axis_name!r} for {glob}; it has: "
                         f"{', '.join(sorted(have))}")


def _probe(reg: Registry, ops: Sequence[Op], spec: SweepSpec) -> dict[tuple[str, str], str | None]:
    """Why each selected backend cannot run here; a hanging or crashing plugin probe becomes its reason."""
    import sys

    from spark_bench.isolate import probe_backends

    registry_module = sys.modules["spark_bench.registry"]  # (spark_bench.registry the name is also a function)

    chosen = [(op.name, b) for op in ops for b in selected_backends(op, spec)]
    return probe_backends(chosen, spec.device, isolate=reg is registry_module._REGISTRY)


def selected_backends(op: Op, spec: SweepSpec) -> list:
    """The op's backends that --backend names (names or globs, e.g. 'triton*'), else its default ones."""
    if not spec.backends:
        return [b for b in op.backends.values() if b.default]
    return [b for name, b in op.backends.items() if any(fnmatchcase(name, pattern) for pattern in spec.backends)]


def _points(op: Op, spec: SweepSpec, fixed: dict[str, list[Any]], notes: list[str] | None) -> list[dict[str, Any]]:
    """The op's parameter points under the spec (its --set values, then `fixed` ones: a weight file's), with a note
    when the user's values made a constraint reject points: a rejected point holding a value of the user's that no
    kept point holds (the op's own sweep rejects some points by design: those say nothing)."""
    rejected: list[tuple[dict[str, Any], str]] = []
    user = _typed_overrides(op, spec.overrides)
    kept = op.points({**user, **fixed}, quick=spec.quick, preset=spec.preset, rejected=rejected)
    held = {axis: [k[axis] for k in kept] for axis in user}
    caused = [(p, why) for p, why in rejected if any(p.get(a) not in held[a] for a in user if a in p)]
    if caused and notes is not None:
        notes.append(f"{op.name}: {len(caused)} of {len(kept) + len(rejected)} parameter points excluded "
                     f"({caused[0][1]})")
    return kept


def build_cases(reg: Registry, spec: SweepSpec, notes: list[str] | None = None) -> list[Case]:
    """Every case of the sweep, in run order. Unavailable backends become `skip` cases with the reason; what the
    user should hear about the selection (e.g. ops a weight file cannot feed) is appended to `notes`."""
    ops = validate(reg, spec)
    from spark_bench.weights.plan import bind  # --weights/--routing: the ops a layer feeds and the axes it fixes

    ops, fixed = bind(ops, spec, _typed_overrides, notes)
    cases: list[Case] = []
    probed = _probe(reg, ops, spec)  # third-party probes run isolated, with a timeout (spark_bench/isolate.py)
    for op in ops:
        if spec.preset is not None and spec.preset not in op.presets:
            continue
        backends = selected_backends(op, spec)
        reasons = {b.name: probed[(op.name, b.name)] for b in backends}
        points = _points(op, spec, fixed.get(op.name, {}), notes)
        for dtype in _dtypes(op, spec):
            for params in points:
                group = [Case(op.name, b.name, params, dtype, spec.device, spec.seed, reasons[b.name], spec.weights,
                              tuned=(spec.tuned or {}).get("data")) for b in backends]
                if spec.timers:
                    group = [dataclasses.replace(c, timer=spec.timers.get(c.case_id)) for c in group]
                random.Random(f"{spec.seed}|{group[0].group if group else ''}").shuffle(group)
                cases.extend(group)
    return cases


def runnable(cases: Sequence[Case], nothing: str, say: Callable[[str], None], notes: Sequence[str] = ()) -> list[Case]:
    """The cases that can run here, after `say`ing the `notes` (build_cases') and each unavailable (op, backend) and
    why, once; none: one UsageError, `nothing` followed by those (one line, not a line each and then the error)."""
    skipped = [f"{name}: {why}" for name, why in sorted({(f"{c.op} {c.backend}", c.skip) for c in cases if c.skip})]
    ready = [c for c in cases if not c.skip]
    if not ready:
        raise UsageError(nothing + "".join(f"; {line}" for line in [*notes, *skipped]))
    for line in [*(f"note: {n}" for n in notes), *(f"skipped {s}" for s in skipped)]:
        say(line)
    return ready


def point_count(reg: Registry, spec: SweepSpec, notes: list[str]) -> int:
    """How many parameter points the selected ops have (backends not probed), with notes on those the user's values
    excluded (as build_cases makes them)."""
    count = 0
    for op in validate(reg, spec):
        if spec.preset is not None and spec.preset not in op.presets:
            continue
        count += len(_points(op, spec, {}, notes))
    return count


def order_note(cases: Sequence[Case]) -> str:
    return f"{len(cases)} cases, {len({c.group for c in cases})} parameter points"
