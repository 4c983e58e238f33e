"""`spark-bench kernels --compare BASE.json`: did a kernel change cost occupancy, start spilling or lose its tensor
cores, offline? BASE is an earlier `spark-bench kernels --json` (results/kernels/*.json are such files).

Specialisations are matched by what a launch asks for (module, kernel, target, pointer dtypes, every constexpr, the
launch options and, where both files recorded it, its arguments' alignment), not by the compile key, which hashes
the kernel's source and so changes with every edit. Against a base without alignments (tables before 2026-12-07)
the alignment variants of one specialisation (`--select all`) are pooled: the most registers, spill bytes and
shared memory, the fewest CTAs per SM. A specialisation is **worse** when its CTAs per SM went down, it spills
where it did not, it no longer compiles or launches, or it lost wgmma (or every tensor-core instruction) that it
had; registers and shared memory that change without that are shown, not judged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spark_bench.sweep import UsageError

_NUMBER = (int, type(None))  # a row's field -> its JSON types
_FIELDS: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("module", "kernel", "target", "dtypes", "verdict"), (str,)), "tensor_core": (str, type(None)),
    "all_constexprs": (dict,), "options": (dict,),
    **dict.fromkeys(("regs", "spill_stores", "spill_loads", "shared", "ctas_per_sm"), _NUMBER)}
_VERDICTS = {"ok": 0, "spills": 1, "launch-resources": 2, "compile-error": 3}  # worse last; compiled: the first two


def load(path: Path) -> dict[str, Any]:
    """The baseline file as `kernels --json` wrote it; a file that is not one is a one-line UsageError."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise UsageError(f"--compare {path}: cannot read it as JSON ({reason})") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise UsageError(f"--compare {path}: not the output of `spark-bench kernels --json` (no \"rows\" list)")
    for i, row in enumerate(rows):
        missing = [f for f in _FIELDS if not isinstance(row, dict) or f not in row]
        if missing:
            raise UsageError(f"--compare {path}: row {i} lacks {', '.join(missing)}")
        wrong = [f for f, types in _FIELDS.items() if not isinstance(row[f], types) or isinstance(row[f], bool)]
        if wrong:
            raise UsageError(f"--compare {path}: row {i} has {wrong[0]} of the wrong type ({row[wrong[0]]!r:.40})")
    return data


def identity(row: dict[str, Any], names: set[str] | None = None, aligned: bool = False) -> tuple[str, ...]:
    """What a launch asks for; `names`: only these constexprs (those the kernel has on both sides); `aligned`: its
    arguments' alignment too (when both sides recorded it)."""
    constexprs = {k: v for k, v in row["all_constexprs"].items() if names is None or k in names}
    return (row["module"], row["kernel"], row["target"], row["dtypes"], json.dumps(constexprs, sort_keys=True,
            default=str), json.dumps(row["options"], sort_keys=True, default=str),
            row["attrs"] if aligned else "")


def common_constexprs(base_rows: list[dict[str, Any]], new_rows: list[dict[str, Any]]) -> dict[tuple, set[str]]:
    """Per kernel, the constexpr names both sides have: a constexpr added or dropped since the base is left out of
    the match (the specialisations it tells apart are pooled)."""
    def names(rows):
        out: dict[tuple, set[str]] = {}
        for row in rows:
            out.setdefault((row["module"], row["kernel"]), set()).update(row["all_constexprs"])
        return out

    base, new = names(base_rows), names(new_rows)
    return {kernel: base[kernel] & new[kernel] for kernel in base.keys() & new.keys()}


def _name(row: dict[str, Any]) -> str:
    return f"{row['module'].rpartition('.')[2]}.{row['kernel']}"  # as the tables write it: experts_decode._decode_down


def pooled(rows: list[dict[str, Any]], names: dict[tuple, set[str]] | None = None, aligned: bool = False
           ) -> dict[tuple[str, ...], dict[str, Any]]:
    """Per specialisation, its figures (`names`: the constexprs matched, per kernel); without `aligned`, its alignment
    variants' worst."""
    out: dict[tuple[str, ...], dict[str, Any]] = {}
    for row in rows:
        spill = None if row["spill_stores"] is None else row["spill_stores"] + (row["spill_loads"] or 0)
        matched = None if names is None else names.get((row["module"], row["kernel"]))
        new = {"kernel": _name(row), "target": row["target"], "dtypes": row["dtypes"],
               "constexprs": {k: v for k, v in row["all_constexprs"].items() if matched is None or k in matched},
               "verdict": row["verdict"],
               "regs": row["regs"], "spill": spill, "shared": row["shared"], "ctas_per_sm": row["ctas_per_sm"],
               "tensor_core": row["tensor_core"] or "-"}
        have = out.setdefault(identity(row, matched, aligned), new)
        if have is new:
            continue
        for field, pick in (("regs", max), ("spill", max), ("shared", max), ("ctas_per_sm", min)):
            values = [v for v in (have[field], new[field]) if v is not None]
            have[field] = pick(values) if values else None
        have["verdict"] = max(have["verdict"], new["verdict"], key=lambda v: _VERDICTS.get(v, len(_VERDICTS)))
    return out


def _compiled(figures: dict[str, Any]) -> bool:
    return _VERDICTS.get(figures["verdict"], len(_VERDICTS)) <= _VERDICTS["spills"]


def _why_worse(base: dict[str, Any], new: dict[str, Any]) -> list[str]:
    if not _compiled(new):
        return [f"{base['verdict']} -> {new['verdict']}"] if _compiled(base) else []
    why = []
    if not base["spill"] and new["spill"]:
        why.append(f"spills {new['spill']} B")
    if base["ctas_per_sm"] and new["ctas_per_sm"] is not None and new["ctas_per_sm"] < base["ctas_per_sm"]:
        why.append(f"CTA/SM {base['ctas_per_sm']} -> {new['ctas_per_sm']}")
    if "wgmma" in base["tensor_core"] and "wgmma" not in new["tensor_core"]:
        why.append(f"tensor core {base['tensor_core']} -> {new['tensor_core']}")
    elif base["tensor_core"] != "-" and new["tensor_core"] == "-":
        why.append(f"tensor core {base['tensor_core']} -> none")
    return why


def diff(base_rows: list[dict[str, Any]], new_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The specialisations compiled both times whose figures changed (worse first), and those compiled only once."""
    names = common_constexprs(base_rows, new_rows)
    unmatched = {}  # per kernel, constexprs added or dropped since the base: left out of the match
    for row in (*base_rows, *new_rows):
        extra = set(row["all_constexprs"]) - names.get((row["module"], row["kernel"]), set(row["all_constexprs"]))
        if extra:
            unmatched.setdefault(_name(row), set()).update(extra)
    aligned = all(isinstance(row.get("attrs"), str) for row in (*base_rows, *new_rows))  # tables since 2026-12-07
    base, new = pooled(base_rows, names, aligned), pooled(new_rows, names, aligned)
    changed = []
    figures = ("verdict", "regs", "spill", "shared", "ctas_per_sm", "tensor_core")
    for ident in sorted(base.keys() & new.keys()):
        b, n = base[ident], new[ident]
        if all(b[f] == n[f] for f in figures):
            continue
        changed.append({"kernel": n["kernel"], "target": n["target"], "dtypes": n["dtypes"],
                        "constexprs": n["constexprs"], "worse": _why_worse(b, n),
                        **{f"{f}_base": b[f] for f in figures}, **{f: n[f] for f in figures}})
    values: dict[str, dict[str, set[str]]] = {}  # per kernel and matched constexpr, its values on either side
    every = [*base.values(), *new.values()]
    for spec in every:
        for k, v in spec["constexprs"].items():
            values.setdefault(spec["kernel"], {}).setdefault(k, set()).add(json.dumps(v, default=str))
    for spec in every:  # an int argument equal to 1 is a constexpr to Triton, else absent: shown as '-'
        for k, seen in values.get(spec["kernel"], {}).items():
            if k not in spec["constexprs"]:
                seen.add("-")
    for c in changed:  # shown: the constexprs that tell the kernel's specialisations apart
        shown = [k for k, seen in values.get(c["kernel"], {}).items() if len(seen) > 1]
        c["constexprs"] = {k: c["constexprs"].get(k, "-") for k in shown}
    changed.sort(key=lambda c: (not c["worse"], c["kernel"], c["target"], json.dumps(c["constexprs"], default=str)))
    only = {side: sorted({f"{mine[ident]['kernel']} ({ident[2]})" for ident in mine.keys() - other.keys()})
            for side, mine, other in (("base", base, new), ("new", new, base))}
    return {"matched": len(base.keys() & new.keys()), "aligned": aligned, "changed": changed,
            "worse": sum(bool(c["worse"]) for c in changed), "only_in_base": len(base.keys() - new.keys()),
            "only_in_new": len(new.keys() - base.keys()), "kernels_only_in_base": only["base"],
            "kernels_only_in_new": only["new"], "constexprs_not_matched": {k: sorted(v) for k, v in
                                                                            sorted(unmatched.items())}}


def summary(result: dict[str, Any], path: Path, base_triton: Any, triton_version: str, base_selection: Any = None,
            selection: str | None = None) -> str:
    line = (f"against {path}: {result['matched']} specialisations in both, {len(result['changed'])} changed, "
            f"{result['worse']} worse; {result['only_in_new']} only here, {result['only_in_base']} only in the base")
    if result["constexprs_not_matched"]:
        line += ("; constexprs on one side only, pooled: " + ", ".join(
            f"{kernel} {'/'.join(names)}" for kernel, names in result["constexprs_not_matched"].items()))
    if not result.get("aligned") and base_selection and selection and (base_selection == "all") != (selection == "all"):
        line += (f" (the base is --select {base_selection}, this {selection}: a specialisation's alignment variants, "
                 "pooled at their worst on the 'all' side, can differ from the one the other side compiled)")
    if str(base_triton) != triton_version:
        line += f" (the base was compiled by triton {base_triton}, this by {triton_version}: some changes are Triton's)"
    return line


def table(result: dict[str, Any]):
    from rich.markup import escape
    from rich.table import Table

    t = Table(header_style="bold")
    for col in ("kernel", "target", "dtypes", "constexprs", "regs", "spill B", "smem KB", "CTA/SM", "tensor core",
                "worse"):
        t.add_column(col, justify="right" if col in ("regs", "spill B", "smem KB", "CTA/SM") else "left",
                     overflow="fold")

    def pair(c: dict[str, Any], field: str, fmt=str) -> str:
        b, n = c[f"{field}_base"], c[field]
        show = (lambda v: "-" if v is None else fmt(v))
        return show(n) if b == n else f"{show(b)} -> {show(n)}"

    for c in result["changed"]:
        t.add_row(escape(c["kernel"]), c["target"], c["dtypes"],
                  escape(" ".join(f"{k}={v}" for k, v in c["constexprs"].items())), pair(c, "regs"),
                  pair(c, "spill"), pair(c, "shared", lambda v: f"{v / 1024:.0f}"), pair(c, "ctas_per_sm"),
                  pair(c, "tensor_core"), f"[bold red]{escape('; '.join(c['worse']))}[/]" if c["worse"] else "")
    return t
