"""`spark-bench kernels`: does every Triton kernel the sweep launches compile, fit and use tensor cores on each GPU
generation, without a GPU? Exit 0: all pass; 1: a compile error, a launch-resource overflow or a spill; 2: usage."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from spark_bench.kernelgate import compare as comparing
from spark_bench.kernelgate import gate
from spark_bench.kernelgate.capture import DEFAULT_BACKENDS
from spark_bench.kernelgate.offline import compile_all, default_cache_dir
from spark_bench.kernelgate.targets import REQUIRED, TARGETS, parse_targets
from spark_bench.options import OutputPath
from spark_bench.sweep import UsageError, dtype_list, merge_sets

VERDICT_STYLE = {"ok": "green", "spills": "bold yellow", "launch-resources": "bold red", "compile-error": "bold red"}


def _kb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024:.0f}"


def table(rows: list[dict]) -> Table:
    t = Table(header_style="bold", show_lines=False)
    for col, justify in [("kernel", "left"), ("target", "left"), ("dtypes", "left"), ("constexprs", "left"),
                         ("warps", "right"), ("stages", "right"), ("regs", "right"), ("spill B", "right"),
                         ("smem KB", "right"), ("CTA/SM", "right"), ("tensor core", "left"), ("grid CTAs", "right"),
                         ("compile s", "right"), ("verdict", "left")]:
        t.add_column(col, justify=justify, overflow="fold", no_wrap=col in ("kernel", "verdict", "tensor core"))
    for r in sorted(rows, key=lambda r: (r["module"], r["kernel"], r["target"], r["dtypes"], str(r["constexprs"]))):
        spill = None if r["spill_stores"] is None else r["spill_stores"] + r["spill_loads"]
        ctas = r["grid_ctas"]
        verdict = f"[{VERDICT_STYLE[r['verdict']]}]{r['verdict']}[/]"
        if r["error"] and r["verdict"] != "ok":
            verdict += f" {escape(r['error'][:160])}"
        t.add_row(escape(r["kernel"]), r["target"], r["dtypes"],
                  escape(" ".join(f"{k}={v}" for k, v in r["constexprs"].items())),
                  str(r["num_warps"] or "-"), str(r["num_stages"] or "-"), str(r["regs"] or "-"),
                  "-" if spill is None else (f"[bold yellow]{spill}[/]" if spill else "0"),
                  _kb(r["shared"]), "-" if r["ctas_per_sm"] is None else str(r["ctas_per_sm"]), r["tensor_core"],
                  "-" if not ctas else (f"{ctas[0]}" if ctas[0] == ctas[1] else f"{ctas[0]}-{ctas[1]}"),
                  "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}", verdict)
    return t


def summary(rows: list[dict], targets: list[str], triton_version: str) -> str:
    parts = []
    for target in targets:
        mine = [r for r in rows if r["target"] == target]
        count = {v: sum(r["verdict"] == v for r in mine) for v in VERDICT_STYLE}
        kernels = len({(r["module"], r["kernel"]) for r in mine})
        parts.append(f"{target}: {len(mine)} specialisations of {kernels} kernels, "
                     f"{count['ok']} ok, {count['compile-error']} compile errors, "
                     f"{count['launch-resources']} launch-resource failures, {count['spills']} with spills")
    return f"triton {triton_version}; " + "; ".join(parts)


@click.command("kernels")
@click.option("--op", "ops", multiple=True, help="Op name or glob (repeatable; default: all ops).")
@click.option("--backend", "backends", multiple=True,
              help=f"Backends whose launches are captured, as globs (default: {', '.join(DEFAULT_BACKENDS)}).")
@click.option("--preset", default=None, help="Only this model preset (default: the GPU sweep and every preset).")
@click.option("--no-presets", is_flag=True, help="Only the plain GPU sweep, no model presets.")
@click.option("--set", "sets", multiple=True, metavar="AXIS=V1,V2", help="Override an axis, as for `run`.")
@click.option("--dtype", "dtypes", multiple=True, help="Only these dtypes (default: the GPU sweep's).")
@click.option("--target", "target_text", default=REQUIRED, show_default=True,
              help=f"Comma-separated GPU targets: {', '.join(TARGETS)}.")
@click.option("--select", "selection", type=click.Choice(gate.SELECTIONS), default="classes", show_default=True,
              help="cover: every constexpr value once; classes: every distinct specialisation but for alignment "
                   "attributes; all: every specialisation.")
@click.option("--quick", is_flag=True, help="The quick (CPU) sweep's shapes instead of the GPU sweep's.")
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="Parallel compiles (default: CPU count).")
@click.option("--cache-dir", type=OutputPath(file_okay=False), default=None,
              help="Compile-result cache (default: ~/.cache/spark-bench/kernelgate).")
@click.option("--no-cache", is_flag=True, help="Compile everything again.")
@click.option("--triton-cache", type=OutputPath(file_okay=False), default=None,
              help="Fill this Triton cache directory (to carry to a GPU with the same Triton); implies --no-cache.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@click.option("--markdown", "markdown_path", type=OutputPath(file=True), default=None,
              help="Also write a per-kernel summary table (markdown) to this file.")
@click.option("--candidates", is_flag=True,
              help="Also compile every declared candidate config of each kernel and key (what `spark-bench tune` "
                   "would time; docs/tune.md), once per key: exit 1 when one cannot compile, launch or avoid spills.")
@click.option("--compare", "compare_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="BASE.json",
              help="Compare with an earlier `kernels --json` (e.g. results/kernels/*.json): the specialisations "
                   "whose registers, spills, shared memory, CTAs per SM or tensor cores changed; exit 1 when one got "
                   "worse (fewer CTAs per SM, a new spill, no longer compiles, lost wgmma).")
def kernels(ops, backends, preset, no_presets, sets, dtypes, target_text, selection, quick, jobs, cache_dir, no_cache,
            triton_cache, as_json, markdown_path, candidates, compare_path) -> None:
    """Compile every Triton kernel specialisation the GPU sweep launches for GPU targets, offline (no GPU): compile
    errors, registers, spills, shared memory against the limit, CTAs per SM and the tensor-core instruction of every
    tl.dot. Exit 1 when anything fails to compile, cannot launch, or spills (or, with --compare, got worse)."""
    baseline = None if compare_path is None else comparing.load(compare_path)  # before minutes of compiling
    try:
        targets = parse_targets(target_text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    overrides = merge_sets(sets)
    from spark_bench.registry import registry

    reg = registry()  # validate names here; the capture runs in its own process
    try:
        matched = reg.match(list(ops))
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None
    if preset is not None and no_presets:
        raise UsageError(f"--preset {preset} and --no-presets contradict each other; pass one")
    if preset is None:
        presets = [None] if no_presets else [None, *gate.presets_of(list(ops))]
    elif any(preset in op.presets for op in matched):
        presets = [preset]
    else:
        have = sorted({p for op in matched for p in op.presets})
        raise UsageError(f"unknown preset {preset!r}; the selected ops have: {', '.join(have) or '(none)'}")
    from spark_bench.sweep import SweepSpec, point_count

    dtypes = dtype_list(dtypes)  # repeatable or comma-separated, as in `run`
    notes: list[str] = []
    points = 0
    for p in presets:  # unknown axes, values and dtypes: one line here, not a traceback from the capture process
        points += point_count(reg, SweepSpec(ops=list(ops), backends=list(backends or DEFAULT_BACKENDS), preset=p,
                                             overrides=dict(overrides), dtypes=dtypes, quick=quick), notes)
    if not points:  # nothing compiled is no pass
        raise UsageError("nothing to compile: the selection has no parameter point"
                         + "".join(f"; {n}" for n in dict.fromkeys(notes)))
    err = click.get_text_stream("stderr")
    for note in dict.fromkeys(notes):
        err.write(f"note: {note}\n")
    started = time.monotonic()
    tty = err.isatty()

    def progress(done: int, total: int, result) -> None:
        if tty or done == total or done % max(1, total // 10) == 0:
            text = f"compiled {done}/{total} ({time.monotonic() - started:.0f} s)"
            err.write("\r" + text if tty else text + "\n")
            err.flush()

    chosen, results, errors, cases, sweeps, candidate_rows = [], [], [], 0, [], []
    for target in targets:  # each target captured on its own: grids and split factors follow its SM count
        err.write(f"{target.name}: capturing launches: {len(matched)} ops, {len(presets)} sweeps ...\n")
        captured = gate.capture_sweeps(list(ops), list(backends) or list(DEFAULT_BACKENDS), presets, overrides,
                                       dtypes, quick, target.name)  # CaptureFailed: one line (options.SparkGroup)
        mine = gate.select(captured.specs, selection)
        err.write(f"{target.name}: {captured.cases} cases launch {len(captured.specs)} specialisations of "
                  f"{len({s.kernel for s in captured.specs})} kernels; compiling {len(mine)} ({selection}) ...\n")
        results += compile_all(mine, [target.name], jobs=jobs,
                               cache_dir=None if no_cache else (cache_dir or default_cache_dir()),
                               triton_cache=triton_cache, progress=progress)
        if tty:
            err.write("\n")
        chosen += mine
        if candidates:
            candidate_rows += _candidates(captured.specs, target.name, jobs, None if no_cache else
                                          (cache_dir or default_cache_dir()), err)
        errors += [{**e, "target": target.name} for e in captured.errors]
        cases += captured.cases
        sweeps = captured.sweeps
    import triton

    rows = gate.rows(chosen, results)
    line = summary(rows, [t.name for t in targets], triton.__version__)
    compared = None if baseline is None else comparing.diff(baseline["rows"], rows)
    if compared is not None:
        compared["summary"] = comparing.summary(compared, compare_path, baseline.get("triton"), triton.__version__,
                                                baseline.get("selection"), selection)
    if as_json:
        click.echo(json.dumps({"triton": triton.__version__, "selection": selection, "sweeps": sweeps,
                               "cases": cases, "capture_errors": errors, "rows": rows,
                               "candidates": candidate_rows if candidates else None,
                               "summary": line, **({"compare": compared} if compared else {})}, indent=1,
                              default=str))
    else:
        from spark_bench.console import console

        out = console()
        out.print(table(rows))
        for e in errors[:20]:
            out.print(f"[yellow]capture failed[/] {escape(e['op'])} {escape(e['backend'])} {e['dtype']} "
                      f"{escape(json.dumps(e['params']))}: {escape(e['message'])}")
        if len(errors) > 20:
            out.print(f"[yellow]capture failed[/] for {len(errors) - 20} more cases (--json lists every one)")
        out.print(line)
        for r in candidate_rows:
            if r["status"] != "ok":
                out.print(f"[bold red]candidate pruned[/] {escape(r['space'])} {escape(r['config'])} on "
                          f"{r['target']}: {escape(r['reason'] or '')}")
        if candidates:
            bad = sum(r["status"] != "ok" for r in candidate_rows)
            out.print(f"declared candidates: {len(candidate_rows)} (kernel, key, config) compiled, {bad} failing")
        if compared is not None:
            if compared["changed"]:
                out.print(comparing.table(compared))
            out.print(escape(compared["summary"]))
    if markdown_path is not None:  # checked writable before compiling (OutputPath); its folder may not exist yet
        from spark_bench.results import write_text_atomic

        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(markdown_path, gate.markdown(rows, f"<!-- {line} -->"))
    failed = gate.failures(results)
    if failed or errors or any(r["status"] != "ok" for r in candidate_rows) or (compared and compared["worse"]):
        sys.exit(1)


def _candidates(specs, target: str, jobs, cache_dir, err) -> list[dict]:
    """Every declared candidate of each captured (kernel, key), compiled for `target` (spark_bench/tune/plan.py)."""
    from spark_bench.tune import plan as planning

    the_plan = planning.build(gate.launched_cases(specs), target, jobs=jobs, cache_dir=cache_dir, one_per_key=True,
                              say=lambda line: err.write(line.replace("tune: ", f"{target}: ") + "\n"))
    return gate.candidate_rows(the_plan, target)
