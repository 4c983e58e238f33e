"""A parameter axis of an op (nvbench's axes): its full and quick sweeps, the values `--set` may add, and how a
command-line value is parsed; and the axis names shared by every op, so one `--set` means the same everywhere."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from spark_bench import op_contract

# Axis names shared by every op, so one `--set` means the same thing everywhere.
SHARED_AXES = {
    "batch": "sequences in the batch",
    "seq_len": "tokens per sequence",
    "varlen": "named pattern of sequence lengths",
    "heads": "attention heads on this GPU (after tensor-parallel slicing)",
    "head_dim": "head dimension where K = V",
    "head_dim_k": "key/query head dimension",
    "head_dim_v": "value head dimension",
    "tokens": "tokens in the batch (T)",
    "hidden": "model width (D)",
    "experts": "routed experts (E)",
    "topk": "experts per token (K)",
    "inter": "expert width (I), after tensor-parallel slicing",
    "groups": "router groups",
    "rows": "matrix rows",
    "cols": "matrix columns",
    "format": "weight format",
    "routing": "routing distribution",
    "dtype": "activation dtype",
}


@dataclasses.dataclass(frozen=True)
class Axis:
    """One parameter axis. `values` is the full (GPU) sweep, `quick` the `--quick`/CPU sweep, `also` what `--set`
    (or a weight file) may give besides them: never swept unless asked for."""

    name: str
    values: Sequence[Any]
    quick: Sequence[Any] | None = None
    doc: str = ""
    also: Sequence[Any] = ()

    def __post_init__(self) -> None:  # plain lists of plain values: numpy ints would not store as JSON numbers
        object.__setattr__(self, "values", op_contract.sweep_values(self.name, "values", self.values))
        if self.quick is not None:
            object.__setattr__(self, "quick", op_contract.sweep_values(self.name, "quick", self.quick))
        object.__setattr__(self, "also", op_contract.sweep_values(self.name, "also", self.also, empty_ok=True))

    def sweep(self, quick: bool) -> list[Any]:
        return list(self.quick if quick and self.quick is not None else self.values)

    def parse(self, text: str) -> Any:
        """Convert one command-line value to this axis's type, judged by its declared values."""
        sample = next(iter(self.values), None)
        if isinstance(sample, bool):
            if text.lower() in ("1", "true", "yes"):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
            raise ValueError(f"axis {self.name!r} takes true/false, not {text!r}")
        if isinstance(sample, int):
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"axis {self.name!r} takes integers, not {text!r}") from None
            declared = [v for v in [*self.values, *(self.quick or [])] if isinstance(v, int)]
            if value < 1 and declared and min(declared) >= 1:  # a size: 0 makes an empty case, -1 an error
                raise ValueError(f"axis {self.name!r} takes positive integers, not {text!r}")
            return value
        if isinstance(sample, float):
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"axis {self.name!r} takes numbers, not {text!r}") from None
            if not math.isfinite(value):  # a typo would otherwise run, and blame the backends for its NaNs
                raise ValueError(f"axis {self.name!r} takes finite numbers, not {text!r}")
            return value
        known = list(dict.fromkeys([*self.values, *(self.quick or []), *self.also]))
        if known and text not in known:
            raise ValueError(f"axis {self.name!r} has no value {text!r}; choose from {', '.join(map(str, known))}")
        return text
