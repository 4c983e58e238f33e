"""The `report` and `compare` commands (the lead's `spark-bench` group adds them)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from spark_bench.options import OutputPath
from spark_bench.report import write_report
from spark_bench.report.compare import METRICS, compare_runs, parse_threshold, print_table
from spark_bench.report.compare_checks import CompareError, check_common_cases, check_same_device, check_same_weights
from spark_bench.report.model import ResultsError, RunData, load_runs, params_text, select_runs


def _fail(command: str, message: str) -> None:
    """A usage error: one line on stderr, exit status 2, no traceback."""
    click.echo(f"spark-bench: error: {command}: {' '.join(str(message).split())}", err=True)  # one prefix for all
    sys.exit(2)


@click.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--output", type=OutputPath(file=True), default=Path("report.html"), show_default=True,
              help="HTML file to write.")
@click.option("--baseline", default="torch", show_default=True, help="Backend the speedups are relative to.")
@click.option("--op", "ops", multiple=True, metavar="GLOB", help="Only these ops (globs, repeatable).")
@click.option("--backend", "backends", multiple=True, metavar="GLOB", help="Only these backends (globs, repeatable).")
def report(run_dirs: tuple[Path, ...], output: Path, baseline: str, ops: tuple[str, ...],
           backends: tuple[str, ...]) -> None:
    """Write one self-contained, offline HTML report of RUN_DIR... (two or more runs are compared to the first), of
    every case or of the ops and backends selected."""
    try:
        from click.core import ParameterSource

        from spark_bench.results import load_run

        if click.get_current_context().get_parameter_source("baseline") == ParameterSource.COMMANDLINE:
            have = sorted({r["backend"] for d in run_dirs for r in load_run(d)[1]})
            if baseline not in have:
                _fail("report", f"unknown --baseline {baseline!r}; the runs have: {', '.join(have) or '(none)'}")
        path = write_report(run_dirs, output, baseline=baseline, ops=ops, backends=backends,
                            warn=lambda text: click.echo(f"warning: {' '.join(text.split())}", err=True))
    except (ResultsError, OSError) as exc:
        _fail("report", str(exc))
    click.echo(str(path))


# measured: two consecutive `spark-bench run --op kda.gate --op kda.gated_rmsnorm --backend torch --backend
# torch_compile` on the 2-core CI-like VM, 2026-12-04: 16 cases, ratios 0.76-1.34, 6 'slower' and 3 'faster' at 5%
CPU_DRIFT_NOTE = ("note: timed on a CPU, where consecutive runs of the same code drift more than the samples of one "
                  "run show (two runs of one commit on a 2-core VM: 0.76-1.34x), so p-values read too confident; "
                  "compare two runs of the base to see this machine's drift and set --threshold above it")


def _timed_on_cpu(run: RunData) -> bool:
    return run.on_cpu or (run.run.get("spec") or {}).get("device") == "cpu"


@click.command()
@click.argument("base_run", type=click.Path(path_type=Path))
@click.argument("new_run", type=click.Path(path_type=Path))
@click.option("--threshold", default="5%", show_default=True,
              help="Smallest change that counts (e.g. 5%, 0.05); smaller significant shifts are 'same'.")
@click.option("--metric", type=click.Choice(METRICS), default="median", show_default=True,
              help="Timing statistic the ratio is taken of (the test always uses the raw samples).")
@click.option("--allow-different-device", is_flag=True, help="Compare runs of different device fingerprints.")
@click.option("--allow-different-weights", is_flag=True,
              help="Compare runs measured on different weight files, layers or routing files (--weights).")
@click.option("--html", "html_out", type=OutputPath(file=True), default=None,
              help="Also write the comparison as an HTML report.")
@click.option("--all", "show_all", is_flag=True, help="List unchanged ('same') cases too.")
@click.option("--allow-missing", is_flag=True,
              help="Pass although cases of the base run are missing from the new one (a deliberate subset).")
@click.option("--op", "ops", multiple=True, metavar="GLOB", help="Compare only these ops (globs, repeatable).")
@click.option("--backend", "backends", multiple=True, metavar="GLOB",
              help="Compare only these backends (globs, repeatable).")
def compare(base_run: Path, new_run: Path, threshold: str, metric: str, allow_different_device: bool,
            allow_different_weights: bool, html_out: Path | None, show_all: bool, allow_missing: bool,
            ops: tuple[str, ...], backends: tuple[str, ...]) -> None:
    """Compare NEW_RUN against BASE_RUN case by case (or the ops and backends selected). Exit 0: nothing regressed;
    1: something got slower beyond the threshold or stopped passing its check (listed); 2: usage error."""

    try:
        thr = parse_threshold(threshold)
        base, new = load_runs([base_run, new_run])
        base_had = len(base.results)  # before the selection: an empty run is not "none selected"
        select_runs([base, new], ops, backends)  # cases outside the selection are neither compared nor missing
        if not allow_different_device:
            check_same_device(base, new)
        if not allow_different_weights:
            check_same_weights(base, new)
        diffs = compare_runs(base, new, thr, metric)
        selection = " ".join([*(f"--op {o}" for o in ops), *(f"--backend {b}" for b in backends)])
        check_common_cases(base, new, diffs, selection if base_had else "")
    except (ResultsError, CompareError, OSError) as exc:
        _fail("compare", str(exc))
    from spark_bench.console import console as terminal  # one width for every command's tables

    print_table(terminal(), diffs, metric, thr, base.label, new.label, show_all=show_all)
    if html_out is not None:
        try:
            page = write_report([base_run, new_run], html_out, ops=ops, backends=backends, threshold=thr, metric=metric)
            click.echo(f"report: {page}")
        except (ResultsError, OSError) as exc:
            _fail("compare", str(exc))
    # a gate must not pass on what was not measured: cases missing from the new run fail it unless allowed
    regressed = [d for d in diffs if d.regressed or (d.verdict.verdict == "missing" and not allow_missing)]
    drift_note = any(d.verdict.verdict in ("slower", "faster") for d in diffs) and any(map(_timed_on_cpu, (base, new)))
    if drift_note and not regressed:  # a 'faster' on a CPU is as much drift as a 'slower'
        click.echo(CPU_DRIFT_NOTE, err=True)
    if regressed:
        click.echo(f"REGRESSED: {len(regressed)} case(s)", err=True)
        for d in sorted(regressed, key=lambda d: d.sort_key):
            v = d.verdict
            what = f"{v.ratio:.3f}x time (p={v.p_value:.1g})" + (f"; {v.note}" if v.note else "") \
                if v.verdict == "slower" else v.note
            click.echo(f"  {d.op} {d.backend} {d.dtype} {params_text(d.params)}: {v.verdict}, {what}", err=True)
        if drift_note:
            click.echo(CPU_DRIFT_NOTE, err=True)
        sys.exit(1)
