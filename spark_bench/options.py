"""What the commands share: the group that turns every usage error into one line (exit 2), the results root, and
the checks of `spark-bench run` / `tune` options that click's types cannot express (each failure one UsageError)."""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from spark_bench.kernelgate.capture import CaptureFailed
from spark_bench.results import ResultsError
from spark_bench.sweep import SweepSpec, UsageError, dtype_list, merge_sets

RESULTS_ROOT = Path("results")  # where runs, tuned tables and history live unless told otherwise


class OutputPath(click.Path):
    """A path the command writes, refused before any work (one line, exit 2): never empty (`--out ''` would write
    into the current directory); for a file (`file=True`), also one that cannot be written there (a directory, a
    file where a folder should be, a read-only place; `results.write_problem`)."""

    def __init__(self, file: bool = False, **kwargs: Any) -> None:
        super().__init__(path_type=Path, **({"dir_okay": False} if file else {}), **kwargs)
        self.file = file

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path", param, ctx)
        path = super().convert(value, param, ctx)
        if self.file:
            from spark_bench.results import write_problem

            problem = write_problem(path)
            if problem:
                self.fail(f"{path}: {problem}", param, ctx)
        return path


def fail_usage(message: str, code: int = 2) -> None:
    """One line: a newline the user typed into a value (a path) is shown as \\n, never breaks the line."""
    message = message.replace("\r", "\\r").replace("\n", "\\n")
    click.echo(f"spark-bench: error: {message}", err=True)
    sys.exit(code)


class SparkGroup(click.Group):
    """Turns click's usage errors and our UsageError / ResultsError / CaptureFailed (the offline gate's capture process
    died or hung, in `kernels` or `tune`) into one line on stderr and exit code 2 (the `spark-bench` group, and a
    subgroup run on its own, e.g. `python -m spark_bench.history`)."""

    def main(self, *args, **kwargs):  # type: ignore[override]
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as exc:
            click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
            sys.exit(0)
        except click.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
            fail_usage(f"{exc.format_message()}{hint}")
        except (UsageError, ResultsError, CaptureFailed) as exc:
            fail_usage(str(exc))
        except click.exceptions.Abort:
            click.echo("aborted", err=True)
            sys.exit(130)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except Exception as exc:  # last: click's Abort and Exit are Exceptions too
            # the environment, not the input: one line, exit 1. Looked up, not imported: the executors import torch,
            # which `python -m spark_bench.history` never loads (a WorkersCannotStart means its module is loaded)
            workers = sys.modules.get("spark_bench.executors.worker_process")
            if workers is not None and isinstance(exc, workers.WorkersCannotStart):
                fail_usage(str(exc), 1)
            raise

# `run` options that define the sweep or how it is measured: fixed in run.json, so `--resume` refuses them
RESUME_FIXED = ("ops", "backends", "preset", "sets", "dtypes", "device", "quick", "full", "out", "seed", "timeout",
                "max_time", "min_samples", "target_ci", "no_flush", "timer", "weights", "layer", "routing",
                "activations", "tuned")


def positive(option: str, value: float | None, *, integer: bool = False) -> None:
    """None (not given), or a finite number above zero."""
    if value is None:
        return
    if integer:
        if value < 1:
            raise UsageError(f"{option} must be 1 or more, not {value}")
        return
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{option} must be a finite number of seconds above 0, not {value}"
                         if option != "--target-ci" else f"{option} must be a fraction above 0, e.g. 0.02, not {value}")


def check_run_options(*, timeout: float | None, max_time: float | None, min_samples: int | None,
                      target_ci: float | None, quick: bool, full: bool) -> None:
    if quick and full:
        raise UsageError("--quick and --full contradict each other; pass one")
    positive("--timeout", timeout)
    positive("--max-time", max_time)
    positive("--min-samples", min_samples, integer=True)
    positive("--target-ci", target_ci)
    if target_ci is not None and target_ci >= 1:
        raise UsageError(f"--target-ci is a fraction of the median below 1 (0.02 = 2%), not {target_ci}")


def parse_duration(option: str, text: str | None) -> float | None:
    """Seconds from '90', '90s', '30m', '1.5h' (None stays None); anything else is a UsageError."""
    if text is None:
        return None
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([smh]?)", text.strip().lower(), flags=re.ASCII)
    if match is None:
        raise UsageError(f"{option} {text!r}: give seconds or one number with a unit, e.g. 90, 90s, 30m or 1.5h")
    seconds = float(match.group(1)) * {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}[match.group(2)]
    if not seconds > 0:
        raise UsageError(f"{option} {text!r}: give a duration above zero")
    if not math.isfinite(seconds):  # 400 nines: float() says inf, which no deadline or estimate can use
        raise UsageError(f"{option} {text!r}: give a finite duration, e.g. 90, 90s, 30m or 1.5h")
    return seconds


def refuse_sweep_options_with_resume(ctx: Any, resume: Any, option: str = "--resume",
                                     allowed: tuple[str, ...] = ()) -> None:
    """`--resume DIR` (or `--like DIR`, which may name its own `allowed` options) runs the sweep stored in DIR:
    sweep options beside it would be silently ignored."""
    from click.core import ParameterSource

    given = [p.opts[0] for p in ctx.command.params
             if p.name in RESUME_FIXED and p.name not in allowed
             and ctx.get_parameter_source(p.name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)]
    if given:
        raise UsageError(f"{option} {resume} runs the sweep stored in its run.json; drop {', '.join(given)} "
                         "(or start a new run)")


def sweep_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The options that choose a sweep's cases, shared by `run` and `tune` (their values go to `sweep_spec`)."""
    options = [
        click.option("--op", "ops", multiple=True, help="Op name or glob (repeatable), e.g. 'kda.*'. Default: all."),
        click.option("--backend", "backends", multiple=True, help="Backend name or glob (repeatable), e.g. "
                     "'triton*'. Default: every default one."),
        click.option("--preset", default=None, help="Named model shape set, e.g. kimi-linear."),
        click.option("--set", "sets", multiple=True, metavar="[OP:]AXIS=V1,V2",
                     help="Sweep these values of an axis (OP:AXIS: only on the ops the name or glob OP matches). "
                     "On one op, an exact OP beats a glob, a glob beats a plain AXIS; two globs are an error."),
        click.option("--dtype", "dtypes", multiple=True, help="bf16, fp16, fp32 (repeatable or comma-separated)."),
        click.option("--device", default=None, help="cpu or cuda[:N] (default: cuda if present, else cpu)."),
        click.option("--quick", is_flag=True, help="Small shapes and a short timing budget: every op in minutes."),
        click.option("--full", is_flag=True, help="On CPU, sweep the full (GPU) shapes instead of the quick ones."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of every input factory."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def sweep_spec(*, ops, backends, preset, sets, dtypes, device: str, quick: bool, full: bool, seed: int,
               weights: dict[str, Any] | None = None) -> SweepSpec:
    """The SweepSpec of `sweep_options` values (device already checked). CPU sweeps are quick unless --full."""
    return SweepSpec(ops=list(ops), backends=list(backends), preset=preset, overrides=merge_sets(sets),
                     dtypes=dtype_list(dtypes), device=device,
                     quick=quick or (device == "cpu" and not full), seed=seed, weights=weights)


def check_spec(spec: SweepSpec) -> None:
    """The spec's ops, backends, preset, dtypes and --set values checked (UsageError) before a command prints
    anything (`Session._cases` checks them again as it builds the cases)."""
    from spark_bench import triton_env
    from spark_bench.registry import registry
    from spark_bench.sweep import validate

    triton_env.configure(spec.device)  # before the plugins import triton, as Session._cases
    validate(registry(), spec)
