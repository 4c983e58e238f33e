"""The offline GPU gate: which specialisations to compile, and the verdict.

Specialisations come from capturing the GPU sweep (`quick=False`) and every model preset of the selected ops.
Three selections, cheapest first:
- `cover`: per kernel and argument-type signature (the dtypes), a greedy cover of every distinct (constexpr, value)
  and (launch option, value) pair: every block size, flag and warp count the sweep launches is compiled at least
  once. The CI gate (tests/test_kernel_gate.py).
- `classes`: one representative per distinct (signature, constexprs, options): every specialisation but for the
  divisibility attributes of int and pointer arguments. The default of `spark-bench kernels`.
- `all`: every distinct specialisation Triton would compile (tox -e kernels-full).
A specialisation fails on a compile error, a launch-resource overflow (shared memory, registers x threads) or any
register spill.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from typing import Any

from spark_bench.kernelgate.capture import Spec, run_capture
from spark_bench.kernelgate.offline import Compiled

SELECTIONS = ("cover", "classes", "all")
FAILING = ("compile-error", "launch-resources", "spills")


@dataclasses.dataclass
class Capture:
    specs: list[Spec]
    errors: list[dict[str, Any]]
    cases: int
    sweeps: list[str]


def presets_of(ops: list[str]) -> list[str]:
    """Every model preset of the matching ops (all ops for none)."""
    from spark_bench.registry import registry

    return sorted({p for op in registry().match(list(ops)) for p in op.presets})


def capture_sweeps(ops: list[str], backends: list[str], presets: list[str | None], overrides: dict[str, list[str]],
                   dtypes: list[str], quick: bool, target: str) -> Capture:
    """Capture the sweep of each preset (None: the plain GPU sweep) in one child process; specs merged by key."""
    data = run_capture({"ops": ops, "backends": backends, "presets": presets, "overrides": overrides,
                        "dtypes": dtypes, "quick": quick, "target": target})
    return Capture(data["specs"], data["errors"], data["cases"], [p or "(GPU sweep)" for p in presets])


def _pairs(spec: Spec) -> set[tuple[str, str]]:
    return {(f"c:{k}", json.dumps(v)) for k, v in spec.constexprs.items()} | \
        {(f"o:{k}", json.dumps(v)) for k, v in spec.options.items()}


def select(specs: list[Spec], how: str) -> list[Spec]:
    """The specialisations to compile (see the module docstring)."""
    if how not in SELECTIONS:
        raise ValueError(f"unknown selection {how!r}; choose from {', '.join(SELECTIONS)}")
    if how == "all":
        return list(specs)
    classes: dict[str, Spec] = {}
    for spec in specs:
        classes.setdefault(spec.class_key, spec)
    reps = list(classes.values())
    if how == "classes":
        return reps
    groups: dict[tuple[str, str], list[Spec]] = defaultdict(list)
    for spec in reps:
        groups[(spec.kernel, json.dumps(spec.signature, sort_keys=True))].append(spec)
    chosen = []
    for members in groups.values():
        todo = set().union(*(_pairs(s) for s in members))
        while todo:
            best = max(members, key=lambda s: len(_pairs(s) & todo))
            chosen.append(best)
            todo -= _pairs(best)
    return chosen


def failures(results: list[Compiled]) -> list[Compiled]:
    return [r for r in results if r.verdict in FAILING]


def grid_ctas(spec: Spec) -> tuple[int, int] | None:
    """(fewest, most) CTAs over the launches of a specialisation (None when a grid was a callable)."""
    counts = []
    for launch in spec.launches:
        grid = launch.get("grid")
        if not isinstance(grid, list):
            return None
        n = 1
        for g in grid:
            n *= int(g)
        counts.append(n)
    return (min(counts), max(counts)) if counts else None


def dtype_signature(spec: Spec) -> str:
    """The distinct pointer element types, in argument order: 'bf16,fp32,i32'."""
    return ",".join(dict.fromkeys(t.lstrip("*") for t in spec.signature.values() if t.startswith("*")))


def varying_constexprs(specs: list[Spec]) -> dict[str, set[str]]:
    """Per kernel, the constexpr names whose value differs between its specialisations (shown in tables)."""
    values: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for spec in specs:
        for name, value in spec.constexprs.items():
            values[spec.kernel][name].add(json.dumps(value))
    return {k: {n for n, v in names.items() if len(v) > 1} for k, names in values.items()}


def rows(specs: list[Spec], results: list[Compiled]) -> list[dict[str, Any]]:
    """One row per (specialisation, target) for tables and --json."""
    by_key = {s.key: s for s in specs}
    vary = varying_constexprs(specs)
    out = []
    for r in results:
        spec = by_key[r.key]
        ctas = grid_ctas(spec)
        out.append({
            "kernel": spec.name, "module": spec.kernel.partition(":")[0], "target": r.target,
            "dtypes": dtype_signature(spec),
            "constexprs": {k: v for k, v in spec.constexprs.items() if k in vary.get(spec.kernel, ())},
            "all_constexprs": spec.constexprs, "options": spec.options, "verdict": r.verdict, "error": r.error,
            "regs": r.regs, "spill_stores": r.spill_stores, "spill_loads": r.spill_loads, "shared": r.shared,
            "num_warps": r.num_warps, "num_stages": r.num_stages, "ctas_per_sm": r.ctas_per_sm,
            "tensor_core": r.tensor_core, "mma": r.mma, "dots": r.dots, "compile_s": r.seconds,
            "launches": len(spec.launches), "grid_ctas": ctas,
            "ops": sorted({launch["op"] for launch in spec.launches}), "key": r.key, "triton": r.triton,
            # pointer/int alignment, which tells `--select all`'s variants apart (compare.py); one compact string
            "attrs": json.dumps(spec.attrs, sort_keys=True, separators=(",", ":"), default=str),
        })
    return out


def _span(values: list[Any]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    """A per-kernel summary table (markdown) of the rows: the figures docs/kernels.md records."""
    lines = [header, "",
             "| kernel | target | specs | verdicts | regs | spill B | smem KB | CTAs/SM | warps | stages | tensor core "
             "| grid CTAs | compile s (max) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(f"{r['module'].rpartition('.')[2]}.{r['kernel']}", r["target"])].append(r)
    for (kernel, target), rs in sorted(groups.items()):
        verdicts = defaultdict(int)
        for r in rs:
            verdicts[r["verdict"]] += 1
        spills = [None if r["spill_stores"] is None else r["spill_stores"] + r["spill_loads"] for r in rs]
        grids = [g for r in rs if r["grid_ctas"] for g in r["grid_ctas"]]
        shared = [None if r["shared"] is None else round(r["shared"] / 1024) for r in rs]
        tcs = sorted({m for r in rs for m in r["mma"]}) or sorted({r["tensor_core"] for r in rs})
        seconds = [r["compile_s"] for r in rs if r["compile_s"] is not None]
        slowest = f"{max(seconds):.1f}" if seconds else "-"
        lines.append(
            f"| `{kernel}` | {target} | {len(rs)} | {', '.join(f'{n} {v}' for v, n in sorted(verdicts.items()))} "
            f"| {_span([r['regs'] for r in rs])} | {_span(spills)} | {_span(shared)} "
            f"| {_span([r['ctas_per_sm'] for r in rs])} | {_span([r['num_warps'] for r in rs])} "
            f"| {_span([r['num_stages'] for r in rs])} | {', '.join(tcs)} | {_span(grids)} "
            f"| {slowest} |")
    return "\n".join(lines) + "\n"


def launched_cases(specs: list[Spec]) -> list[Any]:
    """The distinct (op, backend, point, dtype) cases whose launches were captured, as sweep Cases."""
    from spark_bench.sweep import Case

    seen: dict[str, Any] = {}
    for spec in specs:
        for launch in spec.launches:
            case = Case(launch["op"], launch["backend"], launch["params"], launch["dtype"], "cpu", 0)
            seen.setdefault(case.case_id, case)
    return list(seen.values())


def candidate_rows(plan: dict[str, Any], target: str) -> list[dict[str, Any]]:
    """One row per declared candidate config (besides the default) of each kernel and key: its offline verdict."""
    rows = []
    for item in plan["items"]:
        for cand in item["candidates"]:
            rows.append({"space": item["kernel"], "target": target, "keys": [k["key"] for k in item["keys"]],
                         "case": f"{item['case']['op']} {item['case']['backend']} {item['case']['dtype']}",
                         "config": cand["id"], "status": cand["status"], "reason": cand["reason"],
                         "score": cand["score"]})
    return rows
