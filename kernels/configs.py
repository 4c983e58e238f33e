"""Declared launch configurations: each kernel's tunable parameters as data, not constants in its wrapper.

A `ConfigSpace` names the kernel, the shape parameters that can change the best choice (`key`), a small list of
candidate configs and the default (the one chosen on paper, and checked offline for sm_90a by `spark-bench kernels`:
it compiles, fits in shared memory and does not spill). A config is a dict of the kernel's tunable constexprs plus
`num_warps` / `num_stages`. Wrappers launch with `space.pick(...)`, which today is the default; a tuned table can
replace it per key without touching the wrapper.
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
    doc: str = ""

    def __post_init__(self) -> None:
        if dict(self.default) not in [dict(c) for c in self.candidates]:
            object.__setattr__(self, "candidates", [dict(self.default), *self.candidates])

    def pick(self, **shape: Any) -> dict[str, Any]:
        """The config for a launch at these key values (the declared default until a tuned table exists)."""
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
