"""The plugin API: an `Op` (axes, inputs, reference, cost model, tolerances) and its `Backend`s.

An op module builds one `Op` at module level and attaches backends with the `@op.backend(...)` decorator.
A third party adds backends to an op it does not own with `Extension("kda.gate")` and the same decorator.
The registry collects every module-level `Op` and `Extension` of each `spark_bench.plugins` entry point.
See docs/plugins.md for a worked example.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from spark_bench import op_contract
from spark_bench.axis import SHARED_AXES, Axis
from spark_bench.dtypes import canonical_dtype

Params = dict[str, Any]
__all__ = ["SHARED_AXES", "Axis", "Backend", "Cost", "Extension", "Op", "Params", "Tolerance", "collect"]

@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Pass criteria: error ratio RMS(out - ref) / RMS(ref), and optionally max |out - ref|."""

    err_ratio: float
    max_abs: float | None = None

    def __post_init__(self) -> None:  # a NaN bound would pass anything (x > nan is False)
        object.__setattr__(self, "err_ratio", op_contract.number("Tolerance", "err_ratio", self.err_ratio))
        object.__setattr__(self, "max_abs", op_contract.number("Tolerance", "max_abs", self.max_abs, optional=True))


@dataclasses.dataclass(frozen=True)
class Cost:
    """The op's cost model at one parameter point: FLOPs and the minimum bytes moved (each input read once,
    each output written once). `tokens` is used for per-token energy where the op has tokens."""

    flops: float
    bytes: float
    tokens: int | None = None

    def __post_init__(self) -> None:  # every GB/s, TFLOP/s and roofline % divides by these
        object.__setattr__(self, "flops", op_contract.number("Cost", "flops", self.flops))
        object.__setattr__(self, "bytes", op_contract.number("Cost", "bytes", self.bytes))
        tokens = op_contract.number("Cost", "tokens", self.tokens, optional=True)
        if tokens is not None and not tokens.is_integer():
            raise ValueError(f"Cost: tokens={self.tokens!r} (a count of tokens)")
        object.__setattr__(self, "tokens", None if tokens is None else int(tokens))


Probe = Callable[[str], "str | None"]


@dataclasses.dataclass
class Backend:
    """One implementation of an op.

    fn: called as fn(**inputs) and returns the op's outputs (a tensor, a tuple, or a dict of tensors).
    probe: probe(device) returns None when the backend can run on that device, else the reason ("needs CUDA").
    setup: setup(fn, inputs) -> callable, one-off work kept out of the timings (compile, autotune); it returns
        the callable that is then checked and timed.
    labels: shown beside every number of this backend (e.g. "interpreted"); may be a callable(device) -> labels.
    default: False for backends that run only when asked by name (the fp32 `reference`).
    stages: stages(inputs) -> [(stage_name, zero-arg callable), ...] for composite ops (a whole block or layer):
        each callable runs one stage on precomputed intermediates; the runner times each one like the case itself
        and stores the per-stage breakdown with the result.
    traced: the callable is traced by torch.compile. The check then poisons only the CUDA caching allocator, not
        torch.empty & co. (swapping those functions would fail Dynamo's guards and recompile inside the check).
    """

    name: str
    fn: Callable[..., Any]
    probe: Probe | None = None
    setup: Callable[[Callable[..., Any], dict[str, Any]], Callable[..., Any]] | None = None
    labels: Sequence[str] | Callable[[str], Sequence[str]] = ()
    default: bool = True
    doc: str = ""
    stages: Callable[[dict[str, Any]], list[tuple[str, Callable[[], Any]]]] | None = None
    traced: bool = False

    def __call__(self, **inputs: Any) -> Any:
        """`op.backends["triton"](**inputs)`: the backend's function on the op's inputs (no setup applied)."""
        return self.fn(**inputs)

    def prepared(self, inputs: dict[str, Any]) -> Callable[..., Any]:
        """The callable that is checked, timed or counted: `setup(fn, inputs)` (its one-off work done now), or fn."""
        if self.setup is None:
            return self.fn
        fn = self.setup(self.fn, inputs)
        if not callable(fn):
            raise TypeError(f"setup of backend {self.name!r} returned {type(fn).__name__}, not the callable to time")
        return fn

    def __post_init__(self) -> None:
        if isinstance(self.labels, str):  # labels="gpu" is one label, not three
            self.labels = (self.labels,)

    def unavailable(self, device: str) -> str | None:
        """Why this backend cannot run on `device`, or None when it can. A probe returns None or the reason; a bool
        is read as 'available?' (a `torch.cuda.is_available` probe), anything else is refused as the reason."""
        why: Any = None
        if self.probe is not None:
            try:
                why = self.probe(device)
            except Exception as exc:  # a probe must never take the registry down
                return f"probe failed: {type(exc).__name__}: {exc}"
        if why is False:
            return "probe returned False (a probe returns None when the backend can run, else the reason)"
        if why is not None and why is not True and not isinstance(why, str):
            return f"probe returned {type(why).__name__} {why!r}, not None or a reason"
        if isinstance(why, str) and why:
            return why
        try:
            self._labels(device)
        except Exception as exc:  # checked here so that `list` and a run skip it with the reason
            return f"labels failed: {type(exc).__name__}: {exc}"
        return None

    def _labels(self, device: str) -> list[str]:
        labels = self.labels(device) if callable(self.labels) else self.labels
        return [str(labels)] if isinstance(labels, str) else [str(x) for x in labels]

    def labels_for(self, device: str) -> list[str]:
        """The labels shown beside this backend's numbers on `device` ([] when its labels callable fails: the
        backend is then unavailable, see `unavailable`)."""
        try:
            return self._labels(device)
        except Exception:  # noqa: BLE001
            return []

class _BackendHost:
    """Shared `@x.backend(...)` decorator of ops and extensions."""

    backends: dict[str, Backend]
    name: str

    def backend(
        self,
        name: str,
        *,
        probe: Probe | None = None,
        setup: Callable[..., Callable[..., Any]] | None = None,
        labels: Sequence[str] | Callable[[str], Sequence[str]] = (),
        default: bool = True,
        stages: Callable[[dict[str, Any]], list[tuple[str, Callable[[], Any]]]] | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.add_backend(
                Backend(name, fn, probe=probe, setup=setup, labels=labels, default=default,
                        doc=(fn.__doc__ or ""), stages=stages)
            )
            return fn

        return register

    def add_backend(self, backend: Backend) -> Backend:
        if backend.name in self.backends:
            raise ValueError(f"{self.name}: backend {backend.name!r} is registered twice")
        self.backends[backend.name] = backend
        return backend


@dataclasses.dataclass(eq=False)
class Op(_BackendHost):
    """An op: what it computes (reference), on what inputs (axes, factory), at what cost, to what tolerance.

    make_inputs(params, device=, dtype=, seed=) -> dict of keyword arguments for the backends. Inputs are random
        with realistic distributions, never zeros.
    reference(**inputs) -> outputs in fp32/fp64, our own exact code.
    cost(params, dtype) -> Cost.
    tolerance: dtype name -> Tolerance for the error ratio against the reference.
    constraints: functions params -> reason string when the point is invalid (skipped from sweeps), else None.
    presets: name -> {axis: [values]} (model shapes, tensor-parallel slicing).
    dtypes / quick_dtypes: the dtype sweep (dtype is an axis too: `--dtype` or `--set dtype=`).
    compare(out, ref, inputs, dtype) -> (metrics, ok, message): replaces the default element-wise check where
        outputs need op-specific matching (e.g. router ids as sets).
    outputs(returned, inputs) -> tuple of tensors to check, when a backend's return value is not all of them
        (e.g. a state pool updated in place).
    outputs is applied to the reference's result (with its own inputs) as well.
    untouched(inputs) -> {input name: int64 indices of its rows (dim 0) the call must leave bit-identical}: an
        in-place op's pool rows outside the slots it updates; the check compares them with a copy taken before the
        call (an error ratio over the whole pool would let a kernel round or scribble on other sequences' state).
    extra_info(inputs, params) -> dict stored with every result of a case (e.g. realised expert load).
    rotate: input names redrawn between timed calls (from `input_sets` draws of the factory).
    redraw(params, device=, dtype=, seed=) -> dict of just the `rotate` inputs: spares a full factory call (and a
        second copy of the weights) per rotated set.
    """

    name: str
    make_inputs_fn: Callable[..., dict[str, Any]]
    reference: Callable[..., Any]
    cost: Callable[[Params, str], Cost]
    axes: Sequence[Axis]
    tolerance: Mapping[str, Tolerance]
    dtypes: Sequence[str] = ("bf16",)
    quick_dtypes: Sequence[str] | None = None
    presets: Mapping[str, Mapping[str, Sequence[Any]]] = dataclasses.field(default_factory=dict)
    constraints: Sequence[Callable[[Params], str | None]] = ()
    compare: Callable[..., tuple[dict[str, Any], bool, str]] | None = None
    outputs: Callable[[Any, dict[str, Any]], Any] | None = None
    untouched: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    extra_info: Callable[[dict[str, Any], Params], dict[str, Any]] | None = None
    rotate: Sequence[str] = ()
    redraw: Callable[..., dict[str, Any]] | None = None
    doc: str = ""
    backends: dict[str, Backend] = dataclasses.field(default_factory=dict)
    from_weights: Any = None  # spark_bench.weights.FromWeights: inputs from a model's weight file (docs/weights.md)

    def __post_init__(self) -> None:
        if "." not in self.name:
            raise ValueError(f"op name {self.name!r} must be dotted, like 'kda.gate'")
        if isinstance(self.dtypes, str) or isinstance(self.quick_dtypes, str):
            raise ValueError(f"{self.name}: dtypes and quick_dtypes are lists, like ['bf16']")
        self.dtypes = [canonical_dtype(d) for d in self.dtypes]
        self.quick_dtypes = [canonical_dtype(d) for d in (self.quick_dtypes or self.dtypes[:1])]
        self.tolerance = {canonical_dtype(k): v for k, v in self.tolerance.items()}
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: duplicate axis names {names}")
        for preset, values in self.presets.items():
            unknown = set(values) - set(names) - {"dtype"}
            if unknown:
                raise ValueError(f"{self.name}: preset {preset!r} names unknown axes {sorted(unknown)}")
        op_contract.check_op(self)
        self.cost = op_contract.checked_cost(self.name, self.cost)
        self.add_backend(Backend("reference", self.reference, default=False, labels=("fp32-reference",)))
        if self.from_weights is not None:
            self._bind_weights()

    def _bind_weights(self) -> None:
        """While a weight source is active (spark_bench.weights.using), the factory and redraw build the inputs from
        it; otherwise they are the op's own random ones."""
        from spark_bench.weights import active

        binding, factory, redraw = self.from_weights, self.make_inputs_fn, self.redraw

        @functools.wraps(factory)
        def make_inputs_fn(params, *, device, dtype, seed):
            src = active()
            if src is None:
                return factory(params, device=device, dtype=dtype, seed=seed)
            return binding.make_inputs(params, src, device=device, dtype=dtype, seed=seed, factory=factory)

        self.make_inputs_fn = make_inputs_fn
        if redraw is not None or binding.redraw is not None:
            def redraw_fn(params, *, device, dtype, seed):
                src = active()
                if src is None or binding.redraw is None:
                    fn = redraw or factory
                    return fn(params, device=device, dtype=dtype, seed=seed)
                return binding.redraw(params, src, device=device, dtype=dtype, seed=seed, factory=factory)

            self.redraw = redraw_fn

    # --- public API -------------------------------------------------------------------------------------------
    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    def axis(self, name: str) -> Axis:
        for axis in self.axes:
            if axis.name == name:
                return axis
        raise KeyError(name)

    @property
    def axis_names(self) -> list[str]:
        return [a.name for a in self.axes]

    def default_params(self) -> Params:
        """The first value of every axis' quick sweep: a small, valid point for tests and examples."""
        return {a.name: a.sweep(quick=True)[0] for a in self.axes}

    def make_inputs(self, params: Params | None = None, *, device: str = "cpu", dtype: str = "bf16",
                    seed: int = 0) -> dict[str, Any]:
        """Seeded inputs for one point; missing axes take their default (see `default_params`)."""
        full = {**self.default_params(), **(params or {})}
        return self.make_inputs_fn(full, device=device, dtype=canonical_dtype(dtype), seed=seed)

    def tolerance_for(self, dtype: str) -> Tolerance:
        dtype = canonical_dtype(dtype)
        if dtype not in self.tolerance:
            raise KeyError(f"{self.name}: no tolerance declared for dtype {dtype}")
        return self.tolerance[dtype]

    def invalid_reason(self, params: Params) -> str | None:
        for rule in self.constraints:
            try:
                reason = rule(params)
            except Exception as exc:  # a plugin's bug costs its own points, never the sweep (no traceback)
                return f"constraint failed: {type(exc).__name__}: {exc}"
            if reason:
                return reason
        return None

    def points(self, overrides: Mapping[str, Sequence[Any]] | None = None, *, quick: bool = False,
               preset: str | None = None, rejected: list[tuple[Params, str]] | None = None) -> list[Params]:
        """The cartesian product of the axes (preset, then overrides, replace an axis' values), minus points
        that a constraint rejects (appended to `rejected` with the reason, when given)."""
        values = {a.name: a.sweep(quick) for a in self.axes}
        if preset is not None:
            if preset not in self.presets:
                raise KeyError(preset)
            values.update({k: list(v) for k, v in self.presets[preset].items() if k != "dtype"})
        for name, vals in (overrides or {}).items():
            if name in values:
                values[name] = list(vals)
        names = list(values)
        points = [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(values[n] for n in names))]
        kept = []
        for p in points:
            why = self.invalid_reason(p)
            if why is None:
                kept.append(p)
            elif rejected is not None:
                rejected.append((p, why))
        return kept

    def sweep_dtypes(self, *, quick: bool, preset: str | None = None) -> list[str]:
        if preset is not None and "dtype" in self.presets.get(preset, {}):
            return [canonical_dtype(d) for d in self.presets[preset]["dtype"]]
        return list(self.quick_dtypes if quick else self.dtypes)


@dataclasses.dataclass(eq=False)
class Extension(_BackendHost):
    """Backends that a plugin adds to an op registered elsewhere: `ext = Extension("kda.gate")`, then
    `@ext.backend("mine")`."""

    name: str
    backends: dict[str, Backend] = dataclasses.field(default_factory=dict)


def collect(objects: Iterable[Any]) -> tuple[list[Op], list[Extension]]:
    """The ops and extensions among a plugin module's attributes (or an iterable an entry point returned)."""
    ops, extensions = [], []
    for obj in objects:
        if isinstance(obj, Op):
            ops.append(obj)
        elif isinstance(obj, Extension):
            extensions.append(obj)
    return ops, extensions
