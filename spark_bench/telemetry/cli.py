"""`spark-bench calibrate` and `spark-bench profile` (click commands; the main group adds them).

Bad requests print one line on stderr and exit 2, like the rest of the CLI.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from spark_bench.options import OutputPath, fail_usage
from spark_bench.weights.cli import make_spec, weight_options
from spark_bench.weights.errors import WeightError


def _device(device: str | None) -> str:
    """--device checked as `run` checks it (devices.chosen_device), failing in one line when called on its own."""
    from spark_bench.devices import chosen_device
    from spark_bench.sweep import UsageError

    try:
        return chosen_device(device)
    except UsageError as exc:
        fail_usage(str(exc))


def _num(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:,.1f} {unit}" if value >= 10 else f"{value:.3g} {unit}"


def _provenance(measured: dict[str, Any], cached: bool, seconds: float) -> str:
    """'measured now in 12.3 s', or 'cached, 5.0 h old; --force measures again'."""
    if not cached:
        return f"measured now in {seconds:.1f} s"
    import datetime as dt

    try:
        age = time.time() - dt.datetime.strptime(str(measured.get("measured_at")), "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return "cached; --force measures again"
    old = f"{age / 3600:.1f} h" if age >= 3600 else f"{max(age, 0) / 60:.0f} min"
    return f"cached, {old} old; --force measures again"


@click.command()
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present, else cpu).")
@click.option("--json", "as_json", is_flag=True, help="Print the roofline as JSON.")
@click.option("--cache", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Cache file (default $SPARK_BENCH_ROOFLINE_CACHE or ~/.cache/spark-bench/roofline.json).")
@click.option("--force", is_flag=True, help="Measure again even when this device is cached.")
def calibrate(device: str | None, as_json: bool, cache: Path | None, force: bool) -> None:
    """Measure this device's memory bandwidth and matmul peaks (cached per device fingerprint), beside the
    datasheet."""
    from spark_bench.results import write_problem
    from spark_bench.telemetry.roofline import cache_path, load_cache, percent_of_peak, roofline_for

    device = _device(device)
    problem = write_problem(cache) if cache is not None else None  # before measuring: the peaks would be lost
    if problem:
        fail_usage(f"--cache {cache}: {problem}")
    start = time.perf_counter()
    if not as_json:
        click.echo(f"calibrating {device} (cache {cache_path(cache)})...", err=True)
    before = {} if force else load_cache(cache)
    roof = roofline_for(device, measure=True, force=force, cache=cache, warn_failure=False)
    if roof["measured"] is None:
        fail_usage(f"no peaks measured on {device}: {roof.get('reason') or 'unknown error'}", 1)
    measured, sheet = roof["measured"], roof["datasheet"] or {}
    cached = bool(measured) and before.get(measured.get("fingerprint_id")) == measured
    if as_json:
        click.echo(json.dumps(roof, indent=1))
        return
    name = (measured.get("device") or {}).get("name", device)
    click.echo(f"{name}  fingerprint {measured.get('fingerprint_id')}  measured {measured.get('measured_at')}"
               f"  ({_provenance(measured, cached, time.perf_counter() - start)})")
    click.echo(f"datasheet: {sheet.get('name', 'unknown device (no datasheet row)')}")
    click.echo(f"{'peak':<16} {'measured':>16} {'datasheet':>16} {'% of datasheet':>15}")
    bw = percent_of_peak(measured.get("bandwidth_gbps"), None, None, {"datasheet": sheet})
    click.echo(f"{'bandwidth':<16} {_num(measured.get('bandwidth_gbps'), 'GB/s'):>16} "
               f"{_num(sheet.get('bandwidth_gbps'), 'GB/s'):>16} {_num(bw['pct_bw_datasheet'], '%'):>15}")
    for dtype, rate in (measured.get("tflops") or {}).items():
        pct = percent_of_peak(None, rate, dtype, {"datasheet": sheet})["pct_flops_datasheet"]
        peak = (sheet.get("tflops") or {}).get(dtype)
        click.echo(f"{'matmul ' + dtype:<16} {_num(rate, 'TFLOP/s'):>16} {_num(peak, 'TFLOP/s'):>16} "
                   f"{_num(pct, '%'):>15}")
    from spark_bench.telemetry.calibrate import clock_notes

    for note in clock_notes(measured):
        click.echo(f"warning: measured slowed, {note}: that peak is likely low", err=True)
    if measured.get("busy"):
        from spark_bench.telemetry.calibrate import busy_text

        cached = load_cache(cache).get(measured.get("fingerprint_id")) == measured
        click.echo(f"warning: the machine was {busy_text(measured)}: these peaks are likely low and "
                   f"{'are cached' + (' (--force)' if force else '') if cached else 'were not cached'}; measure "
                   "again when it is idle (`spark-bench calibrate --force`)", err=True)


@click.command()
@click.option("--op", "op_name", required=True, help="Op name, e.g. kda.gate.")
@click.option("--backend", required=True, help="Backend name, e.g. torch, triton.")
@click.option("--set", "sets", multiple=True, metavar="AXIS=V", help="One axis value (repeatable).")
@click.option("--dtype", default=None, help="bf16, fp16, fp32 (default: the op's first dtype).")
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present, else cpu).")
@click.option("--out", type=OutputPath(file_okay=False), default=None,
              help="Output directory (default results/profile/<op>-<backend>-<time>).")
@click.option("--iters", default=10, show_default=True, type=click.IntRange(1, 10_000), help="Profiled calls.")
@click.option("--ncu", is_flag=True, help="Also collect Nsight Compute metrics (needs ncu on PATH and a GPU).")
@weight_options
def profile(op_name: str, backend: str, sets: tuple[str, ...], dtype: str | None, device: str | None,
            out: Path | None, iters: int, ncu: bool, weights: Path | None, layer: int | None,
            routing: Path | None, activations: Path | None) -> None:
    """Profile one case with torch.profiler: trace.json (Chrome/Perfetto) and a per-kernel time breakdown."""
    from spark_bench.telemetry.profile import ProfileError, format_rows, profile_case, resolve_case, run_ncu

    device = _device(device)
    from spark_bench.results import write_problem

    out = out or Path("results/profile") / f"{op_name}-{backend}-{time.strftime('%Y%m%d-%H%M%S')}"
    problem = write_problem(out / "kernels.json")  # before profiling: the trace would be lost
    if problem:
        fail_usage(f"--out {out}: {problem}")
    try:
        if ncu:
            import shutil

            if weights is not None:
                raise ProfileError("--ncu profiles synthetic inputs only (its child process does not load "
                                   "--weights): drop one of them")
            if shutil.which("ncu") is None:
                raise ProfileError("ncu (Nsight Compute) is not on PATH; install it or drop --ncu")
            if not device.startswith("cuda"):
                raise ProfileError("--ncu needs a CUDA device (--device cuda)")
        spec = make_spec(weights, layer, routing, activations)
        resolve_case(op_name, backend, sets, dtype, device, weights=spec)  # validate before anything runs
        summary = profile_case(op_name, backend, sets=sets, dtype=dtype, device=device, out_dir=out, iters=iters,
                               weights=spec)
        ncu_summary = run_ncu(op_name, backend, sets=sets, dtype=dtype, device=device, out_dir=out) if ncu else None
    except (ProfileError, WeightError) as exc:
        fail_usage(str(exc))
    params = " ".join(f"{k}={v}" for k, v in summary["params"].items())
    wall = summary.get("wall_us_per_call")
    click.echo(f"{summary['op']} / {summary['backend']}  {params}  {summary['dtype']}  {device}  "
               f"{iters} calls: {summary['kernel_us_per_call']:.2f} us of {summary['what']} per call"
               + (f"; {wall:.2f} us wall per call on the host" if wall is not None else ""))
    click.echo(format_rows(summary["kernels"]))
    if ncu_summary:
        click.echo(f"{'ncu kernel':<60} {'dram %':>8} {'sm %':>8} {'occup. %':>9}")
        for k in ncu_summary["kernels"]:
            click.echo(f"{str(k.get('kernel'))[:60]:<60} {k.get('dram_throughput_pct', '-'):>8} "
                       f"{k.get('sm_throughput_pct', '-'):>8} {k.get('achieved_occupancy_pct', '-'):>9}")
    click.echo(f"trace: {summary['files']['trace']}  (open in https://ui.perfetto.dev or chrome://tracing)")
