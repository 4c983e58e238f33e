"""Whether two runs can be compared at all: the same device fingerprint, the same weights, and at least one case in
both (each refusal a CompareError of one line)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from spark_bench.report.model import RunData, match_key

if TYPE_CHECKING:
    from spark_bench.report.compare import CaseDiff


class CompareError(Exception):
    """Runs that cannot be compared (different devices, no case in common, bad threshold); the message is one line."""


def device_difference(base: RunData, new: RunData) -> str | None:
    """'H200 [fp-a] vs A100 [fp-b]: device.name ...' when the runs' device fingerprints differ, else None."""
    a, b = base.fingerprint.get("fingerprint_id"), new.fingerprint.get("fingerprint_id")
    if a == b:
        return None
    from spark_bench.fingerprint import stack_difference

    return (f"{base.device_name} [{a}] vs {new.device_name} [{b}]: "
            f"{stack_difference(base.fingerprint, new.fingerprint)}")


def check_same_device(base: RunData, new: RunData) -> None:
    differs = device_difference(base, new)
    if differs:
        raise CompareError(f"runs were measured on different device fingerprints ({differs}); "
                           "pass --allow-different-device to compare anyway")


def weights_identity(run: RunData) -> dict[str, Any] | None:
    """What identifies a run's weights (docs/weights.md): the layer's content hash and the routing file's."""
    w = run.fingerprint.get("weights")
    if not w:
        return None
    return {"layer_sha256": w.get("sha256"), "layer": w.get("layer"),
            "routing_sha256": (w.get("routing") or {}).get("sha256"),
            "activations_sha256": (w.get("activations") or {}).get("sha256")}


def check_same_weights(base: RunData, new: RunData) -> None:
    """Runs on different weight files (or one on a file, one on random weights) are not compared silently."""
    a, b = weights_identity(base), weights_identity(new)
    if a != b:
        def name(run):
            w = run.fingerprint.get("weights") or {}
            if not w:
                return "random weights"
            what = f"{w.get('path')} layer {w.get('layer')}" if w.get("path") else "random weights"
            return what + (f" + routing {w['routing'].get('path')}" if w.get("routing") else "")
        raise CompareError(f"runs were measured on different weights ({name(base)} vs {name(new)}); pass "
                           "--allow-different-weights to compare anyway")


def _few(values: Iterable[str], most: int = 6) -> str:
    """'a, b, c' sorted (numbers by length first: 64 before 1024), at most `most` of them, then '(+N)'."""
    names = sorted(set(values), key=lambda v: (len(v), v) if v.isdigit() else (0, v))
    return ", ".join(names[:most]) + (f" (+{len(names) - most})" if len(names) > most else "") if names else "no cases"


def _ops(run: RunData) -> str:
    return _few(str(r.get("op")) for r in run.results)


def _differing_axis(base: RunData, new: RunData, ops: set[str]) -> str:
    """What keeps the cases of the shared ops apart: the first axis (backend, dtype, then each parameter) whose values
    in the two runs do not overlap, as 'no backend matches (torch in runs/a; triton in runs/b)'."""
    a = [r for r in base.results if str(r.get("op")) in ops]
    b = [r for r in new.results if str(r.get("op")) in ops]

    def param(name: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: str((r.get("params") or {}).get(name, "unset"))

    names = sorted({k for r in (*a, *b) for k in (r.get("params") or {})})
    axes = [("backend", "", lambda r: str(r.get("backend"))), ("dtype", "", lambda r: str(r.get("dtype"))),
            *(("parameter point", f"{name} = ", param(name)) for name in names)]
    for axis, prefix, value in axes:
        in_a, in_b = {value(r) for r in a}, {value(r) for r in b}
        if in_a.isdisjoint(in_b):
            return f"no {axis} matches ({prefix}{_few(in_a)} in {base.path}; {_few(in_b)} in {new.path})"
    return "no combination of parameters, backend and dtype is in both"


def check_common_cases(base: RunData, new: RunData, diffs: Sequence[CaseDiff], selection: str = "") -> None:
    """Nothing to compare is a usage error: two runs with no case in common (say, of different ops, or of the same
    op at other parameter points), a base run with no case (no results, or none the `selection` filters leave: every
    case would be 'new'; pass no `selection` for a base run that had no results before it), neither run with one, or
    only cases skipped in both. A new run with no case while the base
    has some stays a gate failure: every base case is missing. Runs are named by the paths given."""
    if any(d.base is not None and d.new is not None for d in diffs):
        return
    empty = f"no case selected by {selection}" if selection else "no results"
    if not base.results:
        others = f"{new.path} has {_ops(new)}" if new.results else f"nor has {new.path}"
        raise CompareError(f"nothing to compare: the base run {base.path} has {empty} ({others})")
    if not new.results:
        return  # every base case is 'missing': the gate fails on what was not measured
    skipped = {match_key(r) for r in base.results} & {match_key(r) for r in new.results}
    if skipped:  # compare_runs leaves out a case skipped in both
        raise CompareError(f"nothing to compare: the {len(skipped)} case(s) both runs have were skipped in both")
    shared = {str(r.get("op")) for r in base.results} & {str(r.get("op")) for r in new.results}
    why = (f"both have {_few(shared)}, but {_differing_axis(base, new, shared)}" if shared else
           f"{base.path} has {_ops(base)}; {new.path} has {_ops(new)}")
    raise CompareError(f"the runs have no case in common{f' ({selection})' if selection else ''}: {why}")
