"""The `spark-bench` command line (click). Usage errors print one line and exit 2, never a traceback."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click
from rich.markup import escape

from spark_bench import results, triton_env
from spark_bench.console import console, failures_table, results_table, summary_line
from spark_bench.devices import check_device, chosen_device
from spark_bench.history.cli import history
from spark_bench.kernelgate.cli import kernels
from spark_bench.kernelgate.memcheck_cli import memcheck_cmd
from spark_bench.kernelgate.traffic import traffic_cmd
from spark_bench.options import (
    RESULTS_ROOT,
    OutputPath,
    SparkGroup,
    check_run_options,
    check_spec,
    parse_duration,
    refuse_sweep_options_with_resume,
    sweep_options,
    sweep_spec,
)
from spark_bench.report.cli import compare, report
from spark_bench.selection import select_records
from spark_bench.sweep import UsageError
from spark_bench.telemetry.cli import calibrate, profile
from spark_bench.tune.cli import load_tuned, tune, tuned
from spark_bench.weights.cli import make_spec, weight_options


@click.group(cls=SparkGroup)
@click.version_option(package_name="spark-bench")
def main() -> None:
    """Benchmark KDA and MoE kernels: every backend checked against the reference, then timed."""


@main.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--device", default=None, help="Judge availability on this device (default: cuda if present, else cpu).")
@click.option("--op", "ops", multiple=True, metavar="GLOB", help="Only these ops (globs, repeatable).")
def list_cmd(as_json: bool, device: str | None, ops: tuple[str, ...]) -> None:
    """Ops, their axes and backends, and why a backend is unavailable."""
    from spark_bench.registry import registry

    device = chosen_device(device)
    triton_env.configure(device)
    reg = registry()
    try:
        chosen = {op.name: op for op in reg.match(ops)}
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None
    from spark_bench.isolate import probe_backends  # a plugin's probe that hangs or crashes costs its own backend

    why = probe_backends([(name, b) for name, op in chosen.items() for b in op.backends.values()], device)
    data = {
        "device": device,
        "ops": {name: {"axes": {a.name: list(a.values) for a in op.axes},
                       "also": {a.name: list(a.also) for a in op.axes if a.also}, "dtypes": list(op.dtypes),
                       "presets": sorted(op.presets),
                       "backends": {b.name: {"available": why[(name, b.name)] is None,
                                             "reason": why[(name, b.name)], "labels": b.labels_for(device),
                                             "default": b.default}
                                    for b in op.backends.values()}}
                for name, op in sorted(chosen.items())},
        "load_errors": [{"source": e.source, "message": e.message} for e in reg.errors],
    }
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    out = console()
    for name, info in data["ops"].items():
        most = None if ops else 6  # every value of the ops asked for; an overview of all
        axes = ", ".join(f"{a}={'/'.join(map(str, v[:most]))}{'…' if most and len(v) > most else ''}"
                         + (f" (--set also: {'/'.join(map(str, info['also'][a]))})" if a in info["also"] else "")
                         for a, v in info["axes"].items())
        presets = f"  presets {', '.join(info['presets'])}" if info["presets"] else ""
        out.print(f"[bold]{escape(name)}[/]  dtypes {'/'.join(info['dtypes'])}  axes {escape(axes)}{escape(presets)}")
        for bname, b in info["backends"].items():
            mark = "[green]available[/]" if b["available"] else f"[yellow]unavailable[/]: {escape(b['reason'])}"
            extra = (" (" + ", ".join(b["labels"]) + ")") if b["labels"] else ""
            extra += "" if b["default"] else " (only when asked: --backend " + bname + ")"
            out.print(f"    {escape(bname):16s} {mark}{escape(extra)}")
    for err in data["load_errors"]:
        out.print(f"[red]plugin {escape(err['source'])} failed to load[/]: {escape(err['message'])}")


@main.command("env")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--device", default=None, help="Device to describe (default: cuda if present, else cpu).")
def env_cmd(as_json: bool, device: str | None) -> None:
    """The environment fingerprint stored with every run."""
    from spark_bench.fingerprint import fingerprint

    fp = fingerprint(chosen_device(device))
    if as_json:
        click.echo(json.dumps(fp, indent=2))
        return
    for key, value in fp.items():
        click.echo(f"{key:15s} {json.dumps(value) if isinstance(value, (dict, list)) else value}")


@main.command("run")
@sweep_options
@click.option("--out", type=OutputPath(), default=None, help="Run directory (default results/<id>).")
@click.option("--resume", type=click.Path(path_type=Path), default=None, help="Finish an interrupted run in DIR.")
@click.option("--like", type=click.Path(path_type=Path), default=None, metavar="BASE_RUN",
              help="Run BASE_RUN's sweep again (its cases and timing) in a new run directory, e.g. after a kernel "
                   "change; then `spark-bench compare BASE_RUN NEW_RUN`.")
@click.option("--timeout", type=float, default=None, help="Seconds a case may spend in one phase before it is killed.")
@click.option("--max-time", type=float, default=None, help="Timing budget per case, seconds.")
@click.option("--budget", default=None, metavar="DURATION",
              help="Start no new parameter point this long after the command starts (90, 90s, 30m, 1.5h), the ops' "
                   "points taken in turn: the tables and report cover what ran, and `--resume` runs the rest.")
@click.option("--min-samples", type=int, default=None, help="Minimum timed samples per case.")
@click.option("--target-ci", type=float, default=None, help="Stop when the median's 95% CI is within this fraction.")
@click.option("--no-flush", is_flag=True, help="Do not flush the cache before each timed call (warm-cache numbers).")
@click.option("--timer", type=click.Choice(["auto", "events", "graph"]), default="auto", show_default=True,
              help="CUDA timer; CPU devices always use the host clock.")
@click.option("--no-energy", is_flag=True, help="Skip the NVML energy window after each GPU case (faster sweeps).")
@click.option("--no-report", is_flag=True, help="Do not write the HTML report at the end.")
@click.option("--executor", "executor_kind", type=click.Choice(["inprocess", "local", "ray"]), default="local",
              show_default=True, help="Where cases run: worker processes here, this process (debugging), or Ray.")
@click.option("--devices", default=None, metavar="0,1,...|all",
              help="One worker per device (GPU indices, or labels on CPU, e.g. cpu0,cpu1); with ray: how many GPUs.")
@click.option("--ray-address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS, else a local one).")
@click.option("--retries", type=int, default=0, show_default=True,
              help="Run a case again, up to N times, when its worker died (crash, lost Ray node).")
@click.option("--dry-run", is_flag=True, help="Print the cases and their estimated duration (from stored results).")
@click.option("--history", "history_db", type=click.Path(path_type=Path), default=None, metavar="DB",
              help="Add the run to this history database when it ends (see `spark-bench history`).")
@click.option("--no-confirm-crashes", is_flag=True,
              help="Record a crash at once, without re-running the case in a fresh worker to confirm it is its own.")
@click.option("--tuned", default=None, metavar="FILE|auto",
              help="Launch the kernels with a tuned-config table (`spark-bench tune`); auto: this device's table "
                   "under results/tuned/ when there is one.")
@weight_options
def run_cmd(ops, backends, preset, sets, dtypes, device, quick, full, out, resume, like, timeout, seed, max_time,
            budget, min_samples, target_ci, no_flush, timer, no_energy, no_report, executor_kind, devices, ray_address,
            retries, dry_run, history_db, no_confirm_crashes, tuned, weights, layer, routing,
            activations) -> None:
    """Sweep ops x backends x shapes x dtypes: check each case against the reference, then time it."""
    from spark_bench.session import Session
    from spark_bench.worker import ENERGY_ENV

    if no_energy:
        os.environ[ENERGY_ENV] = "0"  # inherited by the worker processes
    from spark_bench.executors import make_executor

    session = None
    check_run_options(timeout=timeout, max_time=max_time, min_samples=min_samples, target_ci=target_ci, quick=quick,
                      full=full)
    budget_s = parse_duration("--budget", budget)
    deadline = time.monotonic() + budget_s if budget_s else None  # the budget counts from the command's start
    from spark_bench.runner import check_timeout_variables

    check_timeout_variables()
    if resume is not None and like is not None:
        raise UsageError("--resume finishes a run, --like starts a new one; pass one")
    if resume is None and out is not None:  # before any warning (a tuned table's, the peaks'); the dry run too
        results.RunStore(out).check_new()
    if resume is not None:
        refuse_sweep_options_with_resume(click.get_current_context(), resume)
        session = Session.resume(resume)
        spec = session.spec
        check_device(spec.device)  # else every case would be journaled as a worker crash, and skipped on the GPU
    elif like is not None:  # the base's spec and timing; a tuned table of its own may differ on purpose
        refuse_sweep_options_with_resume(click.get_current_context(), like, "--like", allowed=("out", "tuned"))
        spec, cfg, timeout = Session.stored(like)
        check_device(spec.device)  # a GPU run's sweep again on a machine without its device: one line, exit 2
    else:
        device = chosen_device(device)
        spec = sweep_spec(ops=ops, backends=backends, preset=preset, sets=sets, dtypes=dtypes, device=device,
                          quick=quick, full=full, seed=seed, weights=make_spec(weights, layer, routing, activations))
        check_spec(spec)  # a typo (op, preset, --set) fails before --tuned's warnings
        from spark_bench.timing import config_for  # torch: imported once a run starts, not for every command

        cfg = config_for(device, spec.quick, max_time_s=max_time, min_samples=min_samples, target_rel_ci=target_ci,
                         flush=False if no_flush else None, mode=timer)
    executor = make_executor(executor_kind, device=spec.device, devices=devices, ray_address=ray_address,
                             retries=retries)
    if session is None and tuned is not None:  # a resume keeps its table; --like may take another on purpose
        spec.tuned = load_tuned(tuned, spec.device, RESULTS_ROOT, warn=lambda m: click.echo(f"warning: {m}", err=True))
    if dry_run:
        from spark_bench.executors.plan import print_plan
        from spark_bench.runner import pending

        if history_db is not None:  # ... without creating the database
            from spark_bench.history import connect

            if history_db.exists() and not (history_db.is_file() and history_db.stat().st_size == 0):
                connect(history_db).close()  # an empty file is what the run fills (connect's create)
            elif problem := results.write_problem(history_db):
                raise UsageError(f"--history {history_db}: {problem}")

        cases = session.cases if session else Session._cases(spec)
        print_plan(cases, pending(session.store, cases) if session else cases, executor.describe(),
                   executor.slots_count(), RESULTS_ROOT, echo=click.echo, budget_s=budget_s)
        sys.exit(0)
    if history_db is not None:  # a foreign or corrupt database fails now, not after the sweep
        from spark_bench.history import add_runs, connect

        connect(history_db, create=True).close()
    if session is None:
        roofline = None
        if not spec.device.startswith("cuda"):  # a CPU's peaks first: the workers' start-up would take its cores
            from spark_bench.telemetry import roofline_for

            roofline = roofline_for(spec.device, measure=True)
        executor.prestart(spec.device)  # the workers start up (torch, plugins) while this process finds the cases
        session = Session.create(spec, cfg, out, timeout, command=sys.argv, results_root=RESULTS_ROOT,
                                 own_pids=executor.own_pids(), roofline=roofline)
    code = session.execute(report=not no_report, executor=executor, confirm_crashes=not no_confirm_crashes,
                           budget_s=budget_s, deadline=deadline)
    if like is not None:
        click.echo(f"compare: spark-bench compare {like} {session.store.path}")
    if history_db is not None:
        stored: list[str] = []
        counts = add_runs(history_db, [session.store.path], on_run=lambda _path, run_id, _how: stored.append(run_id))
        renamed = [r for r in stored if r != session.store.path.name]  # another run holds its id: kept beside it
        click.echo(f"history {history_db}: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n)
                   + (f" (stored as {renamed[0]}: the database holds another run of that name)" if renamed else ""))
    sys.exit(code)


@main.command("show")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--failed", is_flag=True, help="Only the cases that did not pass.")
@click.option("--op", "ops", multiple=True, metavar="GLOB", help="Only these ops (globs, repeatable).")
@click.option("--backend", "backends", multiple=True, metavar="GLOB", help="Only these backends (globs, repeatable).")
@click.option("--dtype", "dtypes", multiple=True, help="Only these dtypes (repeatable or comma-separated).")
@click.option("--set", "sets", multiple=True, metavar="AXIS=V1,V2",
              help="Only these values of an axis (repeatable; by value: fused=true, tokens=064).")
@click.option("--limit", default=400, show_default=True, type=click.IntRange(min=1), help="Rows shown at most.")
def show_cmd(run_dir: Path, failed: bool, ops: tuple[str, ...], backends: tuple[str, ...], dtypes: tuple[str, ...],
             sets: tuple[str, ...], limit: int) -> None:
    """The table of a stored run (all of it, or the cases the filters select)."""
    run, every = results.load_run(run_dir)
    records = select_records(every, ops=ops, backends=backends, dtypes=dtypes, sets=sets)
    if failed:
        records = [r for r in records if r["status"] != "ok"]
    out = console()
    dev = run.get("fingerprint", {}).get("device", {})
    out.print(results_table(records, title=f"{run.get('run_id')} on {dev.get('name', '?')} ({dev.get('type', '?')})",
                            limit=limit, among=every))  # x fastest: against every backend of the run
    fails = failures_table(records)
    if fails is not None:
        out.print(fails)
    line = summary_line(results.summarize_statuses(records))
    if len(records) != len(every):  # `--failed` on a run without failures is not an empty run
        line += f" (selected of the run's {len(every)})"
    out.print(line)
    for note in run_state_notes(run, run_dir):
        out.print(note, style="yellow", markup=False, soft_wrap=True)  # a path's [b] is no markup


def run_state_notes(run: dict, run_dir: Path) -> list[str]:
    """What a table of a stored run must say of its run beyond the cases: stopped by its budget, or unfinished."""
    resume = f"`spark-bench {'tune' if run.get('kind') == 'tune' else 'run'} --resume {results.shell_path(run_dir)}`"
    left = (run.get("stopped_by_budget") or {}).get("cases_left")
    if left:
        return [f"stopped by its budget: {left} more cases; {resume} runs them"]
    if not run.get("finished"):
        return [f"unfinished: no end recorded (still running, or stopped before its end); {resume} runs what is left"]
    return []


for _command in (report, compare, calibrate, profile):  # the commands of the report and telemetry packages
    main.add_command(_command)
main.add_command(history)  # spark_bench/history: the performance history across runs and commits
main.add_command(kernels)  # spark_bench/kernelgate: the offline GPU compile gate
main.add_command(memcheck_cmd)  # spark_bench/kernelgate/memcheck.py: out-of-bounds accesses, interpreted
main.add_command(traffic_cmd)  # spark_bench/kernelgate/traffic.py: bytes per kernel, counted in the interpreter
main.add_command(tune)  # spark_bench/tune: the best config of each declared kernel on this device
main.add_command(tuned)
