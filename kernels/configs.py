"""Declared launch configurations: each kernel's tunable parameters as data, not constants in its wrapper.

A `ConfigSpace` names the kernel, the shape parameters that can change the best choice (`key`), a small list of
candidate configs and the default (the one chosen on paper, and checked offline for sm_90a by `spark-bench kernels`:
it compiles, fits in shared memory and does not spill). A config is a dict of the kernel's tunable constexprs plus
`num_warps` / `num_stages`. `buckets` refine the default by key: the first (bounds, config) whose bounds all hold
(`shape[k] <= bound`) wins. Wrappers launch with `space.pick(**shape)`; a tuned table can replace the choice per key
without touching the wrapper.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

LAUNCH_OPTIONS = ("num_warps", "num_stages")


@dataclasses.dataclass(frozen=True)
class ConfigSpace:
    kernel: str
    default: Mapping[str, Any]
    candidates: Sequence[Mapping[str, Any]] = ()
    key: Sequence[str] = ()
    buckets: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]] = ()
    doc: str = ""

    def __post_init__(self) -> None:
        known = [dict(c) for c in self.candidates]
        extra = [dict(c) for c in [self.default, *(cfg for _, cfg in self.buckets)] if dict(c) not in known]
        object.__setattr__(self, "candidates", [*{str(c): c for c in extra + known}.values()])
        for bounds, _ in self.buckets:
            unknown = set(bounds) - set(self.key)
            if unknown:
                raise ValueError(f"{self.kernel}: bucket bounds {sorted(unknown)} are not key parameters {self.key}")

    def pick(self, **shape: Any) -> dict[str, Any]:
        """The config for a launch at these key values: the first bucket whose bounds hold, else the default."""
        for bounds, config in self.buckets:
            if all(k in shape and shape[k] <= v for k, v in bounds.items()):
                return dict(config)
        return dict(self.default)


def split(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(constexprs, launch options) of a config."""
    meta = {k: v for k, v in config.items() if k not in LAUNCH_OPTIONS}
    return meta, {k: v for k, v in config.items() if k in LAUNCH_OPTIONS}


SPACES: dict[str, ConfigSpace] = {}


def declare(space: ConfigSpace) -> ConfigSpace:
    """Register a kernel's space (kernels declare theirs at import) and return it."""
    SPACES[space.kernel] = space
    return space
