"""Plugin discovery: every `spark_bench.plugins` entry point, plus modules named in $SPARK_BENCH_PLUGINS.

An entry point resolves to a module (its module-level `Op`s and `Extension`s are registered), an `Op`, an
`Extension`, or an iterable of them. The built-in ops register themselves exactly this way (pyproject.toml).
A plugin that fails to import is recorded in `Registry.errors` and shown by `spark-bench list`; it is never fatal.
The built-in ops load first: a plugin that defines an op of the same name is refused, never a silent replacement.
$SPARK_BENCH_PLUGINS (comma-separated module names, like PYTEST_PLUGINS) loads plugins that are not installed,
e.g. test plugins; worker processes inherit it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import importlib
import os
import sys
import traceback
import types
from collections.abc import Iterable
from importlib.metadata import entry_points

from spark_bench.op import Extension, Op, collect

GROUP = "spark_bench.plugins"
ENV_VAR = "SPARK_BENCH_PLUGINS"


@dataclasses.dataclass
class LoadError:
    source: str  # entry point name or module name
    message: str  # one line
    detail: str  # the traceback


BUILTIN = "spark-bench"  # the distribution whose entry points are the built-in ops: they load first and win


class Registry:
    def __init__(self) -> None:
        self.ops: dict[str, Op] = {}
        self.sources: dict[str, str] = {}  # op name -> the entry point or module that registered it
        self.errors: list[LoadError] = []
        self._pending: list[tuple[str, Extension]] = []

    # --- loading ------------------------------------------------------------------------------------------------
    def load_object(self, source: str, obj: object, origin: str | None = None) -> None:
        """Register what `obj` defines, all or nothing: a plugin that redefines a registered op is refused whole.
        `origin` (default `source`) is how a later duplicate's message names this plugin."""
        if isinstance(obj, types.ModuleType):
            objects = list(vars(obj).values())
        elif isinstance(obj, (Op, Extension)):
            objects = [obj]
        elif isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
            objects = list(obj)
        else:
            raise TypeError(f"the entry point gives a {type(obj).__name__}; it must name a module, an Op, an "
                            "Extension or an iterable of them")
        ops, extensions = collect(objects)
        if not ops and not extensions:
            raise ValueError(f"{source} defines no Op or Extension")
        for i, op in enumerate(ops):
            if op.name in self.ops and self.ops[op.name] is not op:
                raise ValueError(f"op {op.name!r} is already defined by {self.sources[op.name]}; not loaded")
            if any(o.name == op.name and o is not op for o in ops[:i]):
                raise ValueError(f"op {op.name!r} is defined twice in it")
        for op in ops:
            self.ops[op.name] = op
            self.sources.setdefault(op.name, origin or source)
        self._pending.extend((source, ext) for ext in extensions)
        self._apply_extensions()

    def _apply_extensions(self) -> None:
        """Add each waiting extension's backends to its op once the op is registered, all of them or none: one
        whose backend name the op already has is dropped with an error of its own plugin's."""
        waiting = []
        for source, ext in self._pending:
            op = self.ops.get(ext.name)
            if op is None:
                waiting.append((source, ext))
                continue
            taken = [b.name for b in ext.backends.values() if b.name in op.backends and op.backends[b.name] is not b]
            if taken:
                self.errors.append(LoadError(source, f"backend {', '.join(map(repr, taken))} already exists on "
                                                     f"{ext.name}; the extension is not loaded", ""))
                continue
            for backend in ext.backends.values():
                if op.backends.get(backend.name) is not backend:
                    op.add_backend(backend)
        self._pending = waiting

    def _guarded(self, source: str, load, origin: str | None = None) -> None:
        """Load one plugin; whatever it raises or prints (SystemExit, argparse's exit, a banner on stdout that
        would corrupt `list --json`) costs only that plugin, as a LoadError naming it."""
        try:
            with contextlib.redirect_stdout(sys.stderr):
                self.load_object(source, load(), origin)
        except (Exception, SystemExit) as exc:
            name = type(exc).__name__
            text = f"{name}: {exc}" if str(exc) else name
            self.errors.append(LoadError(source, text.splitlines()[0], traceback.format_exc()))

    def discover(self) -> Registry:
        def order(ep):
            dist = getattr(ep, "dist", None)
            return (getattr(dist, "name", None) != BUILTIN, ep.name)

        for ep in sorted(entry_points(group=GROUP), key=order):
            dist = getattr(getattr(ep, "dist", None), "name", None)
            self._guarded(ep.name, ep.load, f"{dist}'s entry point {ep.name}" if dist else None)
        for name in filter(None, (m.strip() for m in os.environ.get(ENV_VAR, "").split(","))):
            self._guarded(name, lambda name=name: importlib.import_module(name))
        for source, ext in self._pending:
            self.errors.append(LoadError(source, f"extends unknown op {ext.name!r}", ""))
        self._pending = []
        return self

    def failed_note(self) -> str:
        """'; 2 plugin load error(s) (a, b: see spark-bench list)' when any plugin failed, for 'no such op' messages."""
        if not self.errors:
            return ""
        names = ", ".join(dict.fromkeys(e.source for e in self.errors))
        return f"; {len(self.errors)} plugin load error(s) ({names}: see spark-bench list)"

    # --- queries ------------------------------------------------------------------------------------------------
    def get(self, name: str) -> Op:
        if name not in self.ops:
            raise KeyError(f"unknown op {name!r}; choose from {', '.join(sorted(self.ops)) or '(none loaded)'}"
                           f"{self.failed_note()}")
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
                raise KeyError(f"no op matches {pattern!r}; choose from {', '.join(sorted(self.ops))}"
                               f"{self.failed_note()}")
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
