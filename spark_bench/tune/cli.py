"""`spark-bench tune` (find each declared kernel's best config here, prune offline first) and `spark-bench tuned`
(show or merge tuned-config tables); `load_tuned` is `run --tuned`. docs/tune.md."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from spark_bench.options import (
    RESULTS_ROOT,
    OutputPath,
    check_run_options,
    parse_duration,
    positive,
    refuse_sweep_options_with_resume,
    sweep_options,
    sweep_spec,
)
from spark_bench.sweep import UsageError
from spark_bench.weights.cli import weight_options


def load_tuned(spec: str | None, device: str, root: Path, warn) -> dict[str, Any] | None:
    """`run --tuned FILE|auto` -> {"path", "data"} stored in the run's spec (a resume uses the same table)."""
    if spec is None:
        return None
    from spark_bench.fingerprint import device_info
    from spark_bench.tune.store import TunedStore, default_path, describe_device, device_identity, resolve

    info = device_info(device)
    path = resolve(spec, info, root)
    if path is None:
        warn(f"--tuned auto: no tuned table for this device ({default_path(info, root)}); the declared configs run")
        return None
    table = TunedStore.load(path)
    if table.data["device_id"] != device_identity(info)[1]:
        warn(f"{path} was tuned on {describe_device(table.data['device'])}, not on this "
             f"{describe_device(device_identity(info)[0])}: its configs may not be the best here")
    from spark_bench.tune.space import stale_entries, stale_text

    stale = stale_entries(table)
    if stale:
        warn(f"{path}: {stale_text(stale)}")
    for where, n in table.foreign_entries().items():  # merged in with --force
        warn(f"{path}: {n} entries were measured on {where}: their configs may not be the best here")
    return {"path": str(path), "data": table.data}


@click.command("tune")
@sweep_options
@click.option("--budget", default=None, metavar="DURATION",
              help="How long the whole search may take (90, 90s, 30m, 2h; planning included); the likely winners "
                   "are timed first.")
@click.option("--out", type=OutputPath(file=True), default=None, metavar="FILE",
              help="Tuned-config table to write or merge into (default: results/tuned/<this device>.json; with "
              "--resume, the one the tune was started with).")
@click.option("--run-dir", type=OutputPath(), default=None,
              help="Directory of the tune's journal (default results/tune-<id>).")
@click.option("--resume", type=click.Path(path_type=Path), default=None, help="Finish an interrupted tune in DIR.")
@click.option("--target", default=None, metavar="sm_90a|sm_80|sm_100a|none",
              help="Offline pruning target (default: this GPU's; on a CPU sm_90a); none: no pruning.")
@click.option("--jobs", type=int, default=None, help="Parallel offline compiles (default: all cores).")
@click.option("--timeout", type=float, default=None, help="Seconds a case may spend in one phase before it is killed.")
@click.option("--max-time", type=float, default=None, help="Timing budget per case, seconds.")
@click.option("--min-samples", type=int, default=None, help="Minimum timed samples per case.")
@click.option("--executor", "executor_kind", type=click.Choice(["inprocess", "local"]), default="local",
              show_default=True, help="Where cases run: worker processes here, or this process (debugging).")
@weight_options
def tune(ops, backends, preset, sets, dtypes, device, quick, full, seed, budget, out, run_dir, resume, target,
         jobs, timeout, max_time, min_samples, executor_kind, weights, layer, routing, activations) -> None:
    """Time every declared config of each Triton kernel the selected ops launch (checked, crash-isolated, flushed,
    as `run`), after pruning offline those that cannot compile, launch or avoid spills; write the best per key."""
    from spark_bench.devices import chosen_device
    from spark_bench.executors import make_executor
    from spark_bench.kernelgate.targets import TARGETS
    from spark_bench.runner import check_timeout_variables
    from spark_bench.tune.session import TuneSession
    from spark_bench.weights.cli import make_spec

    check_run_options(timeout=timeout, max_time=max_time, min_samples=min_samples, target_ci=None, quick=quick,
                      full=full)
    budget = parse_duration("--budget", budget)
    positive("--jobs", jobs, integer=True)
    check_timeout_variables()
    if target is not None and target != "none" and target not in TARGETS:
        raise UsageError(f"unknown --target {target!r}; choose from {', '.join(TARGETS)}, none")
    say = lambda line: click.echo(line, err=True)  # noqa: E731
    if resume is not None:
        refuse_sweep_options_with_resume(click.get_current_context(), resume, allowed=("out",))
        if run_dir is not None:  # the directory resumed is the tune's; another one would be silently ignored
            raise UsageError(f"--resume {resume} goes on in that directory; drop --run-dir {run_dir}")
        planning = [f"{opt} {value}" for opt, value in (("--target", target), ("--jobs", jobs)) if value is not None]
        if planning:  # they shape the offline pruning, which the resumed tune did before it was stopped
            raise UsageError(f"--resume {resume} keeps the plan its first run pruned offline; drop "
                             f"{', '.join(planning)}")
        session = TuneSession.resume(resume, out)
        if budget is not None:  # a resumed tune may be given more (or less) time
            session.tune["budget_s"] = budget
    else:
        device = chosen_device(device)
        spec = sweep_spec(ops=ops, backends=backends, preset=preset, sets=sets, dtypes=dtypes, device=device,
                          quick=quick, full=full, seed=seed, weights=make_spec(weights, layer, routing, activations))
        from spark_bench.timing import config_for

        cfg = config_for(device, quick, max_time_s=max_time, min_samples=min_samples)
        session = TuneSession.create(spec, cfg, run_dir=run_dir, out=out, budget_s=budget, target=target, jobs=jobs,
                                     timeout=timeout, command=sys.argv, results_root=RESULTS_ROOT, say=say)
    click.echo(f"spark-bench tune: {session.store.path}", err=True)
    executor = make_executor(executor_kind, device=session.spec.device, devices=None, ray_address=None, retries=0)
    code, path = session.execute(executor=executor, say=say)
    from spark_bench.tune.report import print_table

    print_table(session, path)
    sys.exit(code)


@click.group("tuned")
def tuned() -> None:
    """Tuned-config tables (written by `spark-bench tune`, used by `run --tuned`)."""


@tuned.command("show")
@click.argument("path", type=click.Path(path_type=Path))
def show(path: Path) -> None:
    """Each kernel's tuned config per key, with its time against the default's."""
    from spark_bench.tune.report import print_store
    from spark_bench.tune.store import TunedStore

    print_store(TunedStore.load(path))


@tuned.command("merge")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", type=OutputPath(file=True), required=True, help="The merged table (may be one of PATHS).")
@click.option("--force", is_flag=True, help="Merge tables of different devices.")
def merge(paths: tuple[Path, ...], out: Path, force: bool) -> None:
    """Merge tables of one device: every key any of them holds; the newer measurement wins a key two hold."""
    from spark_bench.results import now
    from spark_bench.tune.store import TunedStore

    tables = [TunedStore.load(p) for p in paths]
    merged = TunedStore(dict(tables[0].data, kernels={}), tables[0].path)
    for table in tables:
        merged.merge(table, force=force)
    merged.save(out, now())  # a directory, a read-only place: one line (StoreError), not a traceback
    click.echo(f"{out}: {sum(len(v) for v in merged.kernels.values())} entries from {len(tables)} table(s)")
