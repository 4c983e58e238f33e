"""`spark-bench memcheck`: every Triton backend's launches interpreted on the CPU with each access bounds-checked,
launched as on a GPU target (its SM count, its config rules). Exit 0: no access out of bounds; 1: one or more (or a
case that failed otherwise, or no case launched an interpreted kernel: nothing checked); 2: usage. Slow as the
interpreter is: the quick shapes by default, `--set` for others."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

import click
import numpy as np

from spark_bench.kernelgate.targets import TARGETS
from spark_bench.sweep import SweepSpec, dtype_list, merge_sets, runnable


def _progress(kernel: str, ran, grid, seconds: float) -> None:
    """One line on stderr per launch of a case that takes a while (a full-size one at its edges)."""
    if seconds >= 5:
        of = f"{ran} of {'x'.join(map(str, grid))} programs" if ran is not None else f"grid {grid}"
        click.echo(f"  {kernel}: {of}, {seconds:.0f} s", err=True)


def _checked_call(op, backend, case, target, edges: bool, forced=None, table=None) -> tuple[str, str, list]:
    """(status, detail, the declared-kernel picks) of one backend call under memcheck, with `forced` configs, else
    the tuned `table`'s (a `TunedStore`, as `run --tuned` applies it), else the declared ones."""
    from spark_bench.kernelgate.memcheck import edge_programs, memcheck, out_of_bounds_in
    from spark_bench.tune.space import applied, recording

    inputs = op.make_inputs(case.params, device="cpu", dtype=case.dtype, seed=case.seed)
    try:
        with (applied(forced, table), recording() as picks,
              memcheck(target, programs=edge_programs if edges else None, on_launch=_progress) as counts,
              np.errstate(all="ignore") if edges else contextlib.nullcontext()):  # unrun programs leave garbage
            backend.fn(**inputs)
    except Exception as exc:  # noqa: BLE001 - the interpreter wraps the kernel's exception in InterpreterError
        cause = out_of_bounds_in(exc)
        if cause is not None:
            return "out-of-bounds", str(cause), []
        return "error", f"{type(exc).__name__}: {exc}"[:300], []
    if not counts["launches"]:
        return "no-kernel", "nothing checked", picks
    tuned = sum(p["source"] in ("tuned", "tuned-nearest") for p in picks)
    return "ok", (f"{counts['launches']} launches" + (", their edge programs only" if edges else "")
                  + (f", {tuned} of {len(picks)} configs from the tuned table" if table is not None else "")), picks


def check_case(op, backend, case, target, edges: bool, candidates: bool = False, table=None) -> tuple[str, str]:
    """(status, detail) of one case's backend call under memcheck: ok, no-kernel (it launched no interpreted Triton
    kernel: nothing was checked), out-of-bounds or error; with a tuned `table`, launched with its configs. With
    `candidates`, the call again with each declared candidate config of each kernel it launched (one kernel forced at
    a time, as `spark-bench tune` times them)."""
    from spark_bench.tune.space import SPACES, config_id

    status, detail, picks = _checked_call(op, backend, case, target, edges, table=table)
    if status != "ok" or not candidates:
        return status, detail
    kernels = sorted({p["kernel"] for p in picks} & SPACES.keys())
    tried = 0
    for kernel in kernels:
        for config in SPACES[kernel].candidates:
            tried += 1
            status, why, _ = _checked_call(op, backend, case, target, edges, {kernel: dict(config)}, table)
            if status != "ok":
                return status, f"{kernel} candidate {config_id(config)}: {why}"
    return "ok", f"{detail}; {tried} candidate configs of {len(kernels)} kernel(s)"


def _tuned_table(path: str | None):
    """`--tuned FILE` as a TunedStore (a missing or invalid file: one line, exit 2), with run's warnings on stderr."""
    if path is None:
        return None
    from spark_bench.tune.space import stale_entries, stale_text
    from spark_bench.tune.store import TunedStore, describe_device

    table = TunedStore.load(path)
    click.echo(f"tuned table {path}: measured on {describe_device(table.data['device'])}", err=True)
    stale = stale_entries(table)
    if stale:
        click.echo(f"warning: {path}: {stale_text(stale)}", err=True)
    return table


@click.command("memcheck")
@click.option("--op", "ops", multiple=True, help="Op name or glob (repeatable; default: all ops).")
@click.option("--backend", "backends", multiple=True, default=("triton*",), show_default=True,
              help="Backends to check, as globs (Triton ones: others launch no interpreted kernel).")
@click.option("--set", "sets", multiple=True, metavar="AXIS=V1,V2", help="Override an axis, as for `run`.")
@click.option("--preset", default=None, help="A model preset's shapes.")
@click.option("--dtype", "dtypes", multiple=True, help="Only these dtypes (default: the quick sweep's).")
@click.option("--target", "target_name", type=click.Choice(list(TARGETS)), default="sm_90a", show_default=True,
              help="Launch as on this GPU: its SM count sizes persistent grids, its rules pick the configs.")
@click.option("--sms", type=click.IntRange(min=1), default=None,
              help="Pretend the target has this many SMs (e.g. 2: a persistent grid loops at small shapes).")
@click.option("--edges", is_flag=True,
              help="Run only the grid's corner programs (first and last two along each axis): a full-size launch "
                   "checked in part, in interpreter time a small one costs. A persistent grid's last items may run "
                   "on a middle program: add --sms large enough for one item per program to check those.")
@click.option("--candidates", is_flag=True,
              help="Also each declared candidate config of each kernel a case launches (what `spark-bench tune` "
                   "would time), one kernel forced at a time.")
@click.option("--tuned", "tuned_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Launch with this tuned-config table's configs (`spark-bench tune`), as `run --tuned FILE` "
                   "would: the table's nearest entry per kernel and key, else the declared config.")
def memcheck_cmd(ops, backends, sets, preset, dtypes, target_name, sms, edges, candidates, tuned_path) -> None:
    """Bounds-check every load, store and atomic of the Triton backends' kernels, interpreted on the CPU, at the quick
    sweep's points (or --set / --preset ones), launched as on a GPU target. Exit 1 when an access is out of bounds."""
    os.environ["TRITON_INTERPRET"] = "1"  # before any plugin imports its kernels
    from spark_bench.registry import registry
    from spark_bench.sweep import build_cases

    reg = registry()
    spec = SweepSpec(ops=list(ops), backends=list(backends), preset=preset, overrides=dict(merge_sets(sets)),
                     dtypes=dtype_list(dtypes), device="cpu", quick=preset is None)
    notes: list[str] = []
    cases = runnable(build_cases(reg, spec, notes), "the selection has no cases to check (no Triton backend or "
                     "parameter point matches)", lambda line: click.echo(line, err=True), notes)
    table = _tuned_table(tuned_path)
    target = TARGETS[target_name] if sms is None else dataclasses.replace(TARGETS[target_name], sm_count=sms)
    bad = unchecked = 0
    for i, case in enumerate(cases, 1):
        op = reg.ops[case.op]
        start = time.monotonic()
        status, detail = check_case(op, op.backends[case.backend], case, target, edges, candidates, table)
        bad += status not in ("ok", "no-kernel")
        unchecked += status == "no-kernel"
        params = " ".join(f"{k}={v}" for k, v in case.params.items())
        click.echo(f"[{i}/{len(cases)} {time.monotonic() - start:.0f}s] {status:13} {case.op} {case.backend} "
                   f"{params} {case.dtype}: {detail}")
    click.echo(f"memcheck on {target.name} ({target.sm_count} SMs{', edge programs' if edges else ''}): "
               f"{len(cases)} cases, {bad} with an access out of bounds or an error"
               + (f", {unchecked} launched no interpreted kernel (nothing checked)" if unchecked else ""))
    sys.exit(1 if bad or unchecked == len(cases) else 0)  # nothing checked is no pass
