"""What a plugin's `Op` must declare, checked when it is built: a careless plugin fails to load with one line naming
the field (shown by `spark-bench list`), instead of failing every case later with a raw Python error, sweeping
garbage points, or passing wrong outputs (a NaN tolerance passes anything: `x > nan` is False).

Also the plain-value conversions the results need: numpy scalars become Python numbers, so a plugin's
`np.prod(shape)` cost or `2 ** np.arange(4)` axis values are stored as numbers, not as strings.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any


def plain(value: Any) -> Any:
    """A numpy (or 0-d torch) scalar as the Python number it holds; anything else unchanged."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return item()
    return value


def json_default(value: Any) -> Any:
    """`json.dumps(default=)` for results: a numpy scalar as its number, anything else as its text."""
    converted = plain(value)
    return str(value) if converted is value else converted


def number(owner: str, field: str, value: Any, *, optional: bool = False) -> float | None:
    """`value` as a finite float >= 0, else ValueError naming `owner` and `field`."""
    if value is None and optional:
        return None
    value = plain(value)
    try:
        ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0
        return float(value) if ok else _refuse(owner, field, value)
    except OverflowError:  # an int past a float's range
        return _refuse(owner, field, value)


def _refuse(owner: str, field: str, value: Any):
    text = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
    raise ValueError(f"{owner}: {field}={text} (must be a finite number >= 0)")


def sweep_values(axis: str, field: str, values: Any, *, empty_ok: bool = False) -> list[Any]:
    """An axis' value list as plain values; a string (a sequence of characters) or an empty list is refused."""
    if isinstance(values, (str, bytes)) or not (isinstance(values, Sequence) or hasattr(values, "tolist")):
        raise ValueError(f"axis {axis!r}: {field} must be a list of values, not {type(values).__name__} "
                         f"{values!r}")
    out = [plain(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
    if not out and not empty_ok:
        raise ValueError(f"axis {axis!r}: {field} is empty (an axis needs at least one value)")
    return out


def check_op(op: Any) -> None:
    """Raise ValueError (or TypeError) naming the op and the field for what its plugin declared wrong; make the
    presets' values plain."""
    from spark_bench.dtypes import canonical_dtype
    from spark_bench.op import Tolerance

    for field in ("make_inputs_fn", "reference", "cost"):
        if not callable(getattr(op, field)):
            raise TypeError(f"{op.name}: {field} must be a callable, not {type(getattr(op, field)).__name__}")
    for dtype, tol in op.tolerance.items():
        if not isinstance(tol, Tolerance):
            raise TypeError(f"{op.name}: tolerance[{dtype!r}] must be a Tolerance(err_ratio, max_abs=None), "
                            f"not {type(tol).__name__} {tol!r}")
    missing = [d for d in dict.fromkeys([*op.dtypes, *op.quick_dtypes]) if d not in op.tolerance]
    if missing:
        raise ValueError(f"{op.name}: no tolerance for dtype {', '.join(missing)} (declared in dtypes; "
                         f"tolerance has {', '.join(op.tolerance) or 'none'})")
    for preset, values in op.presets.items():
        for axis, vals in values.items():
            if isinstance(vals, (str, bytes)) or not (isinstance(vals, Sequence) or hasattr(vals, "tolist")):
                raise ValueError(f"{op.name}: preset {preset!r} gives {axis} {vals!r}; a preset gives a list of "
                                 f"values per axis, like {axis}: [{vals!r}]")
            if not len(vals):
                raise ValueError(f"{op.name}: preset {preset!r} gives {axis} no value")
            if axis == "dtype":
                for d in vals:
                    canonical_dtype(d)  # ValueError names the dtype
    op.presets = {name: {axis: sweep_values(axis, f"preset {name!r}", vals) for axis, vals in values.items()}
                  for name, values in op.presets.items()}
    for field in ("compare", "outputs", "untouched", "extra_info", "redraw"):
        value = getattr(op, field)
        if value is not None and not callable(value):
            raise TypeError(f"{op.name}: {field} must be a callable or None, not {type(value).__name__}")


def checked_cost(name: str, cost: Callable[..., Any]) -> Callable[..., Any]:
    """The op's cost model, refusing a return value that is not a `Cost` (its numbers are checked by `Cost`)."""
    from spark_bench.op import Cost

    @functools.wraps(cost)
    def cost_model(params, dtype):
        value = cost(params, dtype)
        if not isinstance(value, Cost):
            raise TypeError(f"{name}: the cost model returned {type(value).__name__}, not a Cost(flops, bytes)")
        return value

    return cost_model
