"""Profile one case: torch.profiler trace plus a per-kernel time breakdown, and (optionally) Nsight Compute metrics.

`profile_case(op, backend, sets=["tokens=512"], dtype=, device=, out_dir=)` builds the case's inputs with
op.make_inputs, runs the backend's setup, warms up, then records `iters` calls under torch.profiler (CPU and, on a
GPU, CUDA activity). It writes trace.json (Chrome/Perfetto), kernels.json and kernels.txt. On a GPU a "kernel" is a
device kernel (or memcpy/memset); on CPU it is an aten op's self CPU time.
`profiler_time(fn, device, iters)` is the summed kernel time per call in seconds: a timer for decode-size ops where
CUDA events inflate the latency. `run_ncu(...)` re-runs the case in a child process under `ncu` for DRAM and SM
throughput and achieved occupancy of each kernel of one call.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MARK = "spark_bench.call"
NCU_METRICS = {
    "gpu__time_duration.sum": "duration",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_throughput_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_throughput_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
}


class ProfileError(Exception):
    """A bad request (unknown op, backend, axis, dtype; no ncu): one line, exit code 2."""


def resolve_case(op_name: str, backend_name: str, sets: Sequence[str] = (), dtype: str | None = None,
                 device: str = "cpu", weights: dict[str, Any] | None = None) -> tuple[Any, Any, dict[str, Any], str]:
    """(op, backend, params, dtype) of a request, or ProfileError naming the valid choices. With a weight spec
    (spark_bench.weights.make_spec) the axes the file fixes come from it."""
    from spark_bench import triton_env
    from spark_bench.dtypes import canonical_dtype

    triton_env.configure(device)  # before any plugin imports triton
    from spark_bench.registry import registry

    try:
        op = registry().get(op_name)
    except KeyError as exc:
        raise ProfileError(exc.args[0]) from None
    if backend_name not in op.backends:
        raise ProfileError(f"op {op.name} has no backend {backend_name!r}; choose from {', '.join(op.backends)}")
    backend = op.backends[backend_name]
    params: dict[str, Any] = {}
    seen: set[str] = set()
    for item in sets:
        axis_name, sep, text = item.partition("=")
        axis_name, text = axis_name.strip(), text.strip()
        if not sep or not axis_name or not text or "," in text:
            raise ProfileError(f"malformed --set {item!r}: expected AXIS=VALUE (one value per axis)")
        if axis_name in seen:  # `run` sweeps both values; a profile is of one case, so it would keep the last
            raise ProfileError(f"--set {axis_name} given twice: profile takes one case, one value per axis")
        seen.add(axis_name)
        if axis_name == "dtype":
            dtype = text
            continue
        if axis_name not in op.axis_names:
            raise ProfileError(f"op {op.name} has no axis {axis_name!r}; choose from {', '.join(op.axis_names)}")
        try:
            params[axis_name] = op.axis(axis_name).parse(text)
        except ValueError as exc:
            raise ProfileError(str(exc)) from None
    if weights:
        from spark_bench.weights import WeightError
        from spark_bench.weights.plan import fixed_point

        try:
            params.update(fixed_point(op, weights, {k: str(v) for k, v in params.items()}))
        except WeightError as exc:
            raise ProfileError(str(exc)) from None
    params = {**op.default_params(), **params}
    why = op.invalid_reason(params)
    if why:
        raise ProfileError(f"invalid point for {op.name}: {why}")
    try:
        dtype = canonical_dtype(op.dtypes[0] if dtype is None else dtype)  # --dtype '': an error, not the default
    except ValueError as exc:
        raise ProfileError(str(exc)) from None
    if dtype not in op.dtypes:  # as `run`: a tolerance entry alone does not make a dtype the op's
        raise ProfileError(f"op {op.name} does not take dtype {dtype}; choose from {', '.join(op.dtypes)}")
    why = backend.unavailable(device)
    if why:
        raise ProfileError(f"backend {op.name}/{backend.name} cannot run on {device}: {why}")
    return op, backend, params, dtype


def build_call(op: Any, backend: Any, params: dict[str, Any], dtype: str, device: str,
               seed: int = 0) -> Callable[[], Any]:
    """A zero-argument call of the backend on the case's inputs, set up (compiled, autotuned) already."""
    inputs = op.make_inputs(params, device=device, dtype=dtype, seed=seed)
    body = backend.prepared(inputs)
    return lambda: body(**inputs)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def record(fn: Callable[[], Any], device: str, iters: int = 10, warmup: int = 3) -> Any:
    """Warm up, then run fn `iters` times under torch.profiler; returns the finished profiler."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(warmup):
        fn()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(iters):
            with record_function(MARK):
                fn()
        _sync(device)
    return prof


def kernel_rows(prof: Any, device: str, iters: int) -> list[dict[str, Any]]:
    """Per-kernel breakdown, largest first: name, calls, total_us, mean_us, per_call_us (per profiled call), share."""
    from torch.autograd import DeviceType

    totals: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.name.startswith((MARK, "ProfilerStep")) or getattr(evt, "is_user_annotation", False):
            continue
        if device.startswith("cuda"):
            if evt.device_type != DeviceType.CUDA:
                continue
            us = evt.self_device_time_total
        else:
            if evt.device_type != DeviceType.CPU:
                continue
            us = evt.self_cpu_time_total
        entry = totals.setdefault(evt.name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    grand = sum(t for _, t in totals.values()) or 1.0
    rows = [{"name": name, "calls": n, "total_us": t, "mean_us": t / n, "per_call_us": t / iters, "share": t / grand}
            for name, (n, t) in totals.items()]
    return sorted(rows, key=lambda r: -r["total_us"])


def profiler_time(fn: Callable[[], Any], device: str, iters: int = 20, warmup: int = 3) -> float:
    """Seconds per call of fn: its summed kernel time (GPU) or aten-op self time (CPU) under torch.profiler —
    launch gaps and Python overhead excluded."""
    rows = kernel_rows(record(fn, device, iters, warmup), device, iters)
    return sum(r["total_us"] for r in rows) / iters / 1e6


def format_rows(rows: list[dict[str, Any]], limit: int = 25) -> str:
    lines = [f"{'kernel':<60} {'calls':>6} {'total us':>11} {'mean us':>10} {'share':>7}"]
    for r in rows[:limit]:
        name = r["name"] if len(r["name"]) <= 60 else r["name"][:57] + "..."
        lines.append(f"{name:<60} {r['calls']:>6} {r['total_us']:>11.1f} {r['mean_us']:>10.2f} {r['share']:>7.1%}")
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more in kernels.json")
    return "\n".join(lines)


def profile_case(op_name: str, backend_name: str, *, sets: Sequence[str] = (), dtype: str | None = None,
                 device: str = "cpu", out_dir: str | Path = "results/profile", iters: int = 10, warmup: int = 3,
                 seed: int = 0, weights: dict[str, Any] | None = None) -> dict[str, Any]:
    """Profile one case; writes trace.json, kernels.json, kernels.txt under out_dir and returns the summary.
    weights: a weight spec (--weights/--layer/--routing): the inputs come from that layer (docs/weights.md)."""
    from spark_bench.timing import on_device
    from spark_bench.triton_env import interpreted_launches
    from spark_bench.weights import using

    op, backend, params, dtype = resolve_case(op_name, backend_name, sets, dtype, device, weights=weights)
    with using(weights), on_device(device):  # cuda:N current: Triton launches on the current device
        call = build_call(op, backend, params, dtype, device, seed)
        with interpreted_launches() as launches:
            prof = record(call, device, iters, warmup)
    rows = kernel_rows(prof, device, iters)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / "trace.json"))
    labels = backend.labels_for(device)
    if launches[0] and "interpreted" not in labels:  # Triton interpreted, undeclared (as `run` labels it)
        labels.append("interpreted")
    what = "cuda kernels (device time)" if device.startswith("cuda") else "aten ops (self CPU time)"
    if "interpreted" in labels:  # the interpreter's own Python/numpy work is no aten op: the rows miss most of it
        what += (" in the Triton interpreter's calls (interpreted: host time, not a GPU kernel; the interpreter's "
                 "own Python work is not an aten op, so see the wall time per call)")
    spans = [e.cpu_time_total for e in prof.events() if e.name == MARK]  # each call's wall span, in us
    summary = {
        "op": op.name, "backend": backend.name, "params": params, "dtype": dtype, "device": device, "iters": iters,
        "weights": weights, "labels": labels, "what": what,
        "kernel_us_per_call": sum(r["total_us"] for r in rows) / iters, "kernels": rows,
        "wall_us_per_call": sum(spans) / len(spans) if spans else None,  # host wall time of a call (its launches)
        "files": {"trace": str(out / "trace.json"), "kernels": str(out / "kernels.json"),
                  "table": str(out / "kernels.txt")},
    }
    (out / "kernels.json").write_text(json.dumps(summary, indent=1))
    (out / "kernels.txt").write_text(format_rows(rows, limit=len(rows)) + "\n")
    return summary


# --- Nsight Compute -------------------------------------------------------------------------------------------
def run_ncu(op_name: str, backend_name: str, *, sets: Sequence[str] = (), dtype: str | None = None,
            device: str = "cuda", out_dir: str | Path = "results/profile", timeout_s: float = 600) -> dict[str, Any]:
    """Metrics of each kernel of one call (after setup and warm-up), from `ncu` in a child process."""
    ncu = shutil.which("ncu")
    if ncu is None:
        raise ProfileError("ncu (Nsight Compute) is not on PATH; install it or drop --ncu")
    if not device.startswith("cuda"):
        raise ProfileError("--ncu needs a CUDA device (--device cuda)")
    op, backend, params, dtype = resolve_case(op_name, backend_name, sets, dtype, device)
    spec = json.dumps({"op": op.name, "backend": backend.name, "params": params, "dtype": dtype, "device": device})
    cmd = [ncu, "--profile-from-start", "off", "--csv", "--metrics", ",".join(NCU_METRICS),
           sys.executable, "-m", "spark_bench.telemetry.profile", "--ncu-child", spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ProfileError(f"ncu did not finish in {timeout_s:.0f} s") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ncu.csv").write_text(proc.stdout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ProfileError(f"ncu failed (exit {proc.returncode}): {tail[0]}")
    kernels = parse_ncu_csv(proc.stdout)
    (out / "ncu.json").write_text(json.dumps({"metrics": NCU_METRICS, "kernels": kernels}, indent=1))
    return {"kernels": kernels, "files": {"csv": str(out / "ncu.csv"), "json": str(out / "ncu.json")}}


def parse_ncu_csv(text: str) -> list[dict[str, Any]]:
    """ncu --csv (details page) -> [{"kernel", "id", metric short name: value, "<name>_unit": unit}]."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    kernels: dict[str, dict[str, Any]] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        key = row.get("ID", "")
        entry = kernels.setdefault(key, {"id": key, "kernel": row.get("Kernel Name")})
        name = NCU_METRICS.get(row.get("Metric Name", ""), row.get("Metric Name"))
        raw = (row.get("Metric Value") or "").replace(",", "")
        try:
            entry[name] = float(raw)
        except ValueError:
            entry[name] = raw or None
        entry[f"{name}_unit"] = row.get("Metric Unit")
    return list(kernels.values())


def _ncu_child(spec_json: str) -> None:
    import torch

    from spark_bench.devices import use_device

    spec = json.loads(spec_json)
    op, backend, params, dtype = resolve_case(spec["op"], spec["backend"], [], spec["dtype"], spec["device"])
    use_device(spec["device"])  # cuda:N current: Triton launches on the current device
    call = build_call(op, backend, {**params, **spec["params"]}, dtype, spec["device"])
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--ncu-child":
        _ncu_child(sys.argv[2])
    else:
        sys.exit("usage: python -m spark_bench.telemetry.profile --ncu-child SPEC_JSON (used by spark-bench profile)")
