"""Plugin discovery: every `spark_bench.plugins` entry point, plus modules named in $SPARK_BENCH_PLUGINS.

An entry point resolves to a module (its module-level `Op`s and `Extension`s are registered), an `Op`, an
`Extension`, or an iterable of them. The built-in ops register themselves exactly this way (pyproject.toml).
A plugin that fails to import is recorded in `Registry.errors` and shown by `spark-bench list`; it is never fatal.
$SPARK_BENCH_PLUGINS (comma-separated module names, like PYTEST_PLUGINS) loads plugins that are not installed,
e.g. test plugins; worker processes inherit it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import os
import traceback
import types
from importlib.metadata import entry_points

from spark_bench.op import Extension, Op, collect

GROUP = "spark_bench.plugins"
ENV_VAR = "SPARK_BENCH_PLUGINS"


@dataclasses.dataclass
class LoadError:
    source: str  # entry point name or module name
    message: str  # one line
    detail: str  # the traceback


class Registry:
    def __init__(self) -> None:
        self.ops: dict[str, Op] = {}
        self.errors: list[LoadError] = []
        self._pending: list[tuple[str, Extension]] = []

    # --- loading ------------------------------------------------------------------------------------------------
    def load_object(self, source: str, obj: object) -> None:
        if isinstance(obj, types.ModuleType):
            objects = list(vars(obj).values())
        elif isinstance(obj, (Op, Extension)):
            objects = [obj]
        else:
            objects = list(obj)  # type: ignore[call-overload]
        ops, extensions = collect(objects)
        if not ops and not extensions:
            raise ValueError(f"{source} defines no Op or Extension")
        for op in ops:
            if op.name in self.ops and self.ops[op.name] is not op:
                raise ValueError(f"op {op.name!r} is registered twice (again by {source})")
            self.ops[op.name] = op
        self._pending.extend((source, ext) for ext in extensions)
        self._apply_extensions()

    def _apply_extensions(self) -> None:
        waiting = []
        for source, ext in self._pending:
            op = self.ops.get(ext.name)
            if op is None:
                waiting.append((source, ext))
                continue
            for backend in ext.backends.values():
                if op.backends.get(backend.name) is not backend:
                    op.add_backend(backend)
        self._pending = waiting

    def _guarded(self, source: str, load) -> None:
        try:
            self.load_object(source, load())
        except Exception as exc:
            self.errors.append(LoadError(source, f"{type(exc).__name__}: {exc}".splitlines()[0],
                                         traceback.format_exc()))

    def discover(self) -> Registry:
        for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
            self._guarded(ep.name, ep.load)
        for name in filter(None, (m.strip() for m in os.environ.get(ENV_VAR, "").split(","))):
            self._guarded(name, lambda name=name: importlib.import_module(name))
        for source, ext in self._pending:
            self.errors.append(LoadError(source, f"extends unknown op {ext.name!r}", ""))
        self._pending = []
        return self

    # --- queries ------------------------------------------------------------------------------------------------
    def get(self, name: str) -> Op:
        if name not in self.ops:
            raise KeyError(f"unknown op {name!r}; choose from {', '.join(sorted(self.ops)) or '(none loaded)'}")
        return self.ops[name]

    def match(self, patterns: list[str] | tuple[str, ...]) -> list[Op]:
        """Ops whose names match any glob pattern (all ops for no pattern); raises KeyError for a pattern that
        matches nothing."""
        if not patterns:
            return [self.ops[n] for n in sorted(self.ops)]
        chosen: dict[str, Op] = {}
        for pattern in patterns:
            hits = [n for n in sorted(self.ops) if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise KeyError(f"no op matches {pattern!r}; choose from {', '.join(sorted(self.ops))}")
            chosen.update((n, self.ops[n]) for n in hits)
        return [chosen[n] for n in sorted(chosen)]


_REGISTRY: Registry | None = None


def registry() -> Registry:
    """The process-wide registry, discovered on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        from spark_bench import triton_env

        triton_env.configure()  # before any plugin imports triton
        _REGISTRY = Registry().discover()
    return _REGISTRY


def get_op(name: str) -> Op:
    return registry().get(name)
