"""Record every Triton launch a sweep would make on a GPU, without a GPU and without the interpreter.

How: Triton's active driver is replaced by one that reports the target (`get_current_target()`), and
`knobs.runtime.jit_cache_hook` (called after Triton's own argument binding and int/pointer specialisation, with
the bound signature, constexprs, attributes and options) records the specialisation and tells Triton to skip the
compile and the launch. The backends are called on inputs that each op's own `make_inputs` builds on the `meta`
device: nothing is allocated, and a view's data_ptr keeps its byte offset, so pointer alignment is specialised as
on a GPU. TRITON_INTERPRET must be unset before the kernels are imported (interpreter-only constexprs then take their
GPU values), so this runs in its own process: `python -m spark_bench.kernelgate.capture` (see `run_capture`).

Which backends: by default every backend whose name matches `triton*` (ours); any JITFunction they launch is
recorded, whichever package defines it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import traceback
from typing import Any

DEFAULT_BACKENDS = ("triton*",)
_grid: contextvars.ContextVar[Any] = contextvars.ContextVar("grid", default=None)


@dataclasses.dataclass
class Spec:
    """One specialisation of one kernel: what Triton would compile for these launches."""

    kernel: str  # module:qualname of the JITFunction
    source_key: str  # JITFunction.cache_key: its source and every function it calls
    signature: dict[str, str]
    constexprs: dict[str, Any]
    attrs: dict[str, list]
    options: dict[str, Any]  # num_warps, num_stages, num_ctas, ...
    launches: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # op, backend, params, dtype, grid

    @property
    def name(self) -> str:
        return self.kernel.rpartition(":")[2]

    @property
    def key(self) -> str:
        """The specialisation: what Triton's own cache key would tell apart."""
        blob = json.dumps([self.kernel, self.source_key, self.signature, self.constexprs, self.attrs, self.options],
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    @property
    def class_key(self) -> str:
        """Specialisations that differ only in the alignment attributes of their int and pointer arguments."""
        blob = json.dumps([self.kernel, self.source_key, self.signature, self.constexprs, self.options],
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Spec:
        return cls(**d)


class CaptureFailed(RuntimeError):
    """The capture process itself failed (not one case): its exit code and last line, or its timeout."""


@dataclasses.dataclass
class CaptureError:
    op: str
    backend: str
    params: dict[str, Any]
    dtype: str
    message: str


class _TargetDriver:
    """Just enough of a Triton driver for binding and specialisation: the target, device 0, stream 0."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("meta")

    def is_active(self) -> bool:
        return True


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return {"repr": repr(value), "type": type(value).__name__}


def _by_name(fn, paths: dict) -> dict[str, Any]:
    names = [p.name for p in fn.params]
    return {".".join([names[path[0]], *map(str, path[1:])]): _jsonable(v) for path, v in paths.items()}


class Recorder:
    """Collects specialisations while active (a context manager)."""

    def __init__(self, target) -> None:
        self.target = target
        self.specs: dict[str, Spec] = {}
        self.context: dict[str, Any] = {}

    def _hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        jit = fn.jit_function
        spec = Spec(
            kernel=f"{jit.fn.__module__}:{jit.fn.__qualname__}",
            source_key=jit.cache_key,
            signature={k: str(v) for k, v in compile["signature"].items()},
            constexprs=_by_name(jit, compile["constants"]),
            attrs={k: _jsonable(v) for k, v in _by_name(jit, compile["configs"][0]).items() if v},
            options={k: compile[k] for k in ("num_warps", "num_stages", "num_ctas") if k in compile},
        )
        spec = self.specs.setdefault(spec.key, spec)
        spec.launches.append({**self.context, "grid": _grid.get()})
        return True  # skip Triton's compile and the launch

    @contextlib.contextmanager
    def active(self):
        from triton import knobs
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction

        original_run = JITFunction.run

        def run(self_, *args, grid, warmup, **kwargs):
            token = _grid.set(_jsonable(grid) if not callable(grid) else "callable")
            try:
                return original_run(self_, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                _grid.reset(token)

        previous = driver._active  # None until a driver is first asked for; there is none without a GPU
        driver.set_active(_TargetDriver(self.target.gpu_target()))
        old_hook, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, self._hook
        JITFunction.run = run
        from spark_bench import triton_env

        triton_env.set_capture_target(self.target)
        try:
            yield self
        finally:
            JITFunction.run = original_run
            knobs.runtime.jit_cache_hook = old_hook
            driver._active = previous
            triton_env.set_capture_target(None)


def capture(ops: list[str], backends: list[str], preset: str | None, overrides: dict[str, list[str]],
            dtypes: list[str], quick: bool, target_name: str) -> tuple[list[Spec], list[CaptureError], int]:
    """Run every case of the sweep on meta tensors; returns (specs, errors, cases run). In this process: the
    caller guarantees TRITON_INTERPRET was unset before the kernels were imported."""
    from spark_bench.kernelgate.targets import TARGETS
    from spark_bench.registry import registry
    from spark_bench.sweep import SweepSpec, _typed_overrides, validate

    reg = registry()
    spec = SweepSpec(ops=list(ops), backends=[], preset=preset, overrides=dict(overrides), dtypes=list(dtypes),
                     device="meta", quick=quick)
    selected = validate(reg, spec)
    recorder = Recorder(TARGETS[target_name])
    errors: list[CaptureError] = []
    cases = 0
    with recorder.active():
        for op in selected:
            if preset is not None and preset not in op.presets:
                continue
            chosen = [b for name, b in op.backends.items()
                      if name != "reference" and any(fnmatch.fnmatchcase(name, p) for p in backends)]
            if not chosen:
                continue
            points = op.points(_typed_overrides(op, spec.overrides), quick=quick, preset=preset)
            dts = [d for d in spec.dtypes if d in op.dtypes] if spec.dtypes else \
                op.sweep_dtypes(quick=quick, preset=preset)
            for dtype in dts:
                for params in points:
                    try:
                        inputs = op.make_inputs(params, device="meta", dtype=dtype, seed=0)
                    except Exception as exc:
                        errors.extend(CaptureError(op.name, b.name, params, dtype, f"inputs: {_one_line(exc)}")
                                      for b in chosen)
                        continue
                    for backend in chosen:
                        cases += 1
                        recorder.context = {"op": op.name, "backend": backend.name, "params": params, "dtype": dtype}
                        try:
                            fn = backend.prepared(inputs)
                            fn(**inputs)
                        except Exception as exc:
                            errors.append(CaptureError(op.name, backend.name, params, dtype, _one_line(exc)))
    return list(recorder.specs.values()), errors, cases


def capture_cases(cases: list[dict[str, Any]], target_name: str) -> tuple[list[Spec], list[dict[str, Any]]]:
    """Capture explicit cases ({op, backend, params, dtype, configs?, weights?}; `configs` forces kernel configs as
    a `tune` candidate would): the specs (each launch names its `case` index) and, per case, the declared-kernel
    picks (spark_bench/tune/space.py) and the error, if any. In this process (as `capture`)."""
    from spark_bench.kernelgate.targets import TARGETS
    from spark_bench.registry import registry
    from spark_bench.tune.space import SPACES, applied, recording
    from spark_bench.weights import using

    reg = registry()
    recorder = Recorder(TARGETS[target_name])
    outcomes: list[dict[str, Any]] = []
    with recorder.active():
        for index, case in enumerate(cases):
            recorder.context = {"case": index, **{k: case[k] for k in ("op", "backend", "params", "dtype")}}
            outcome: dict[str, Any] = {"picks": [], "error": None}
            try:
                op = reg.get(case["op"])
                backend = op.backends[case["backend"]]
                with using(case.get("weights")), applied(case.get("configs")), recording() as picks:
                    inputs = op.make_inputs(case["params"], device="meta", dtype=case["dtype"], seed=0)
                    fn = backend.prepared(inputs)
                    fn(**inputs)
                outcome["picks"] = picks
                outcome["spaces"] = {k: {"candidates": [dict(c) for c in SPACES[k].candidates],
                                         "default": dict(SPACES[k].default)}
                                     for k in {p["kernel"] for p in picks} if k in SPACES}
            except Exception as exc:
                outcome["error"] = _one_line(exc)
            outcomes.append(outcome)
    return list(recorder.specs.values()), outcomes


def _one_line(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" ({os.path.basename(frame[0].filename)}:{frame[0].lineno})" if frame else ""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300] + where


def run_capture(request: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    """Capture in a fresh process with TRITON_INTERPRET unset (see `main` for the request); returns {"specs",
    "errors", "cases"} or raises CaptureFailed with the child's last line (or its timeout)."""
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "TRITON_DEFAULT_FP_FUSION": os.environ.get("TRITON_DEFAULT_FP_FUSION", "1")}
    try:
        proc = subprocess.run([sys.executable, "-m", "spark_bench.kernelgate.capture"], input=json.dumps(request),
                              capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CaptureFailed(f"launch capture did not finish within {timeout:g} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CaptureFailed(f"launch capture failed (exit {proc.returncode}): {tail}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    data["specs"] = [Spec.from_dict(s) for s in data["specs"]]
    return data


def main() -> None:
    """stdin: {"ops", "backends", "presets": [None | name, ...], "overrides", "dtypes", "quick", "target"};
    stdout (last line): {"specs", "errors", "cases"} over every preset's sweep (None: the plain GPU sweep).
    Or stdin {"cases": [...], "target"} (see `capture_cases`)."""
    request = json.loads(sys.stdin.read())
    if "cases" in request:  # explicit cases (spark-bench tune): {"specs", "cases": [{picks, error}, ...]}
        with contextlib.redirect_stdout(sys.stderr):
            specs, outcomes = capture_cases(request["cases"], request.get("target", "sm_90a"))
        print(json.dumps({"specs": [s.to_dict() for s in specs], "cases": outcomes}, default=str))
        return
    merged: dict[str, Spec] = {}
    errors: list[dict[str, Any]] = []
    cases = 0
    with contextlib.redirect_stdout(sys.stderr):  # a backend's prints must not corrupt the answer
        for preset in request.get("presets", [None]):
            specs, errs, n = capture(request.get("ops", []), request.get("backends") or list(DEFAULT_BACKENDS),
                                     preset, request.get("overrides", {}), request.get("dtypes", []),
                                     request.get("quick", False), request.get("target", "sm_90a"))
            cases += n
            errors += [{**dataclasses.asdict(e), "preset": preset} for e in errs]
            for spec in specs:
                for launch in spec.launches:
                    launch["preset"] = preset
                if spec.key in merged:
                    merged[spec.key].launches += spec.launches
                else:
                    merged[spec.key] = spec
    print(json.dumps({"specs": [s.to_dict() for s in merged.values()], "errors": errors, "cases": cases},
                     default=str))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("spark_bench.kernelgate.capture: TRITON_INTERPRET must be unset (the GPU code path is captured)")
    main()
