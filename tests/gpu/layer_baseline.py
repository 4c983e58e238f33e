"""Issue 13's "moe.layer decode >= 1.3x today's": our layer against the code before issue 13, timed alike.

"Today's" is the tree at BASELINE, the commit before issue 13's first (dbee4d4). The same measuring code runs once
per tree, each in a process of its own (the baseline's packages come first on PYTHONPATH, laid out as installed):
the `triton` backend of moe.layer at the target's points (Kimi-Linear, T = 1 and 8, bf16 and Q2_K/Q3_K experts),
checked against that tree's own fp32 reference, then timed by CUDA events around each call after a 2x-L2 flush,
eagerly and as a CUDA graph replay where the call can be captured. The verdict compares medians of the same timer,
so the ratio is the two trees' kernels and launches, not two harnesses:

    python3 tests/gpu/layer_baseline.py pack [DEST]            # here, from git: the baseline tree as a .tar.xz
    python3 tests/gpu/layer_baseline.py run OUT.json [--baseline DEST|DIR] [--budget S] [--device cuda] [--quick]
    python3 tests/gpu/layer_baseline.py measure OUT.jsonl [--device D] [--quick] [--iters N]   # the tree imported

`--quick` takes the op's quick shapes (the CPU test, Triton interpreted); a point is written as soon as it is timed,
so a budget that runs out keeps the points done.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

BASELINE = "4f27877229cd1355b8d991773dd8bc65bbdd44d8"  # dbee4d4^: the last commit before issue 13's kernels
DEFAULT_PACK = ".baseline-pre13.tar.xz"
POINTS = [{"tokens": 1, "format": "bf16"}, {"tokens": 8, "format": "bf16"},
          {"tokens": 1, "format": "q2k_q3k"}, {"tokens": 8, "format": "q2k_q3k"}]  # the target's, most wanted first
MIN_RATIO = 1.3
REPO = Path(__file__).resolve().parents[2]
LAYOUT = {"spark_bench": "spark_bench", "plugins": "spark_bench/plugins", "kernels": "spark_bench/kernels"}


def pack(dest: str = DEFAULT_PACK, commit: str = BASELINE) -> Path:
    """The tree at `commit` with its packages laid out as pyproject's package-dir installs them, as a .tar.xz."""
    with tempfile.TemporaryDirectory() as tmp:
        src, site = Path(tmp, "src"), Path(tmp, "site")
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit], check=True,
                                 capture_output=True).stdout
        Path(tmp, "src.tar").write_bytes(archive)
        with tarfile.open(Path(tmp, "src.tar")) as tar:
            tar.extractall(src, filter="data")
        for top, where in LAYOUT.items():
            shutil.copytree(src / top, site / where, dirs_exist_ok=True)
        (site / "BASELINE").write_text(commit + "\n")
        with tarfile.open(dest, "w:xz") as tar:
            tar.add(site, arcname="site")
    return Path(dest)


def points_for(quick: bool) -> list[dict]:
    """The target's points; the quick (interpreted) run takes the bf16 ones (the interpreted GGUF layer takes
    minutes)."""
    return [p for p in POINTS if not quick or p["format"] == "bf16"]


def point_params(op, shapes: dict, point: dict, quick: bool) -> dict:
    """Every axis of the op: the point's value, else the model's (Kimi-Linear; not in the quick run), else the
    axis's first."""
    model = {} if quick else shapes
    return {a.name: point.get(a.name, model.get(a.name, a.sweep(quick)[0])) for a in op.axes}


def time_us(call, device: str, iters: int, graph: bool) -> list[float]:
    """Per-call times: CUDA events around each call (or graph replay) after a flush of 2x the L2; on a CPU the wall
    clock (the CPU test: mechanics only)."""
    import torch

    if not device.startswith("cuda"):
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            call()
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        call = g.replay
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.uint8, device=device)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for _ in range(3):
        call()
    for start, end in pairs:
        flush.zero_()
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in pairs]


def measure(out_path: str, device: str, quick: bool, iters: int) -> None:
    """The tree on sys.path: each point checked against its reference and timed, one JSON line per point."""
    from spark_bench.plugins.models import KIMI_LINEAR
    from spark_bench.plugins.moe.layer import op

    import spark_bench

    tree = str(Path(spark_bench.__file__).resolve().parent.parent)
    with open(out_path, "a") as out:
        for point in points_for(quick):
            params = point_params(op, KIMI_LINEAR, point, quick)
            row = {"tree": tree, "point": point, "params": params, "device": device}
            try:
                row |= measure_point(op, params, device, iters)
            except Exception as exc:  # noqa: BLE001 - the point fails, the next one runs
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            out.write(json.dumps(row) + "\n")
            out.flush()


def measure_point(op, params: dict, device: str, iters: int) -> dict:
    """One point: the triton backend's error against the tree's reference, then its times by each timer."""
    import torch

    inputs = op.make_inputs(params, device=device, dtype="bf16", seed=0)
    backend = op.backends["triton"]
    fn = backend.setup(backend.fn, inputs) if backend.setup else backend.fn
    got, ref = fn(**inputs).float(), op.reference(**inputs).float()
    row = {"err_ratio": float((got - ref).norm() / ref.norm().clamp_min(1e-30)),
           "tolerance": op.tolerance["bf16"].err_ratio}
    cuda = device.startswith("cuda")
    for timer in ("events", "graph") if cuda else ("events",):  # no graphs on a CPU
        clock = ("cuda-graph" if timer == "graph" else "cuda-event") if cuda else "cpu-perf_counter"
        try:
            samples = time_us(lambda: fn(**inputs), device, iters, graph=timer == "graph")
            row[timer] = {"median_us": statistics.median(samples), "n": len(samples), "clock": clock}
        except Exception as exc:  # noqa: BLE001 - a call that cannot be captured: said, not fatal
            row[timer] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            if cuda:
                torch.cuda.synchronize()
    return row


def run_tree(out_jsonl: str, site: str | None, device: str, quick: bool, iters: int, limit_s: float) -> str:
    """`measure` in a fresh process on one tree (`site` first on PYTHONPATH, else the installed one): its exit."""
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    if not device.startswith("cuda"):
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, __file__, "measure", out_jsonl, "--device", device, "--iters", str(iters)]
    try:
        done = subprocess.run(cmd + ["--quick"] * quick, env=env, timeout=max(limit_s, 1), capture_output=True,
                              text=True)
    except subprocess.TimeoutExpired:
        return f"cut by its {limit_s:.0f} s budget"
    return "ok" if done.returncode == 0 else f"exit code {done.returncode}: {done.stderr.strip()[-400:]}"


def _judge(point: dict, base: dict | None, ours: dict | None) -> dict:
    out = {"point": point}
    if base is None or ours is None:
        return out | {"verdict": "not measured"}
    for who, row in (("baseline", base), ("ours", ours)):
        if "error" in row:
            return out | {"verdict": f"failed: the {who} raised {row['error']}"}
        if not row["err_ratio"] <= row["tolerance"]:
            return out | {"verdict": f"failed: the {who} is wrong (err_ratio {row['err_ratio']:.3g} > "
                                     f"{row['tolerance']})"}
    timer = next((t for t in ("graph", "events") if "median_us" in base.get(t, {}) and "median_us" in
                  ours.get(t, {})), None)
    if timer is None:
        return out | {"verdict": "not measured (no timer measured both)"}
    b, o = base[timer]["median_us"], ours[timer]["median_us"]
    ratio = b / o
    return out | {"timer": timer, "baseline_us": b, "ours_us": o, "ratio": ratio,
                  "err_ratio": {"baseline": base["err_ratio"], "ours": ours["err_ratio"]},
                  "verdict": "met" if ratio >= MIN_RATIO else "not met"}


def verdict(base_rows: list[dict], our_rows: list[dict], points: list[dict], device: str = "cuda") -> dict:
    """Per point: the baseline's median over ours with the timer both measured (graph replay first); overall met
    only when every point is measured, right in both trees and >= MIN_RATIO, on a GPU (a CPU run, Triton
    interpreted, checks the mechanics and judges nothing)."""
    def find(rows, point):
        return next((r for r in rows if r["point"] == point), None)

    judged = [_judge(p, find(base_rows, p), find(our_rows, p)) for p in points]
    kinds = [j["verdict"].split(" (")[0].split(":")[0] for j in judged]
    if "failed" in kinds:
        overall = "failed"
    elif all(k == "not measured" for k in kinds):
        overall = "not measured"
    elif "not measured" in kinds:
        overall = f"partial ({kinds.count('not measured')} of {len(kinds)} points not measured)"
    else:
        overall = "met" if all(k == "met" for k in kinds) else "not met"
    if not device.startswith("cuda") and overall != "failed":
        overall = f"not judged: timed on {device} (Triton interpreted: the mechanics only)"
    return {"target": f"moe.layer decode >= {MIN_RATIO}x today's (the tree at {BASELINE[:7]}, before issue 13)",
            "timer": "CUDA events around each call after a 2x-L2 flush, median; graph replay where both trees' "
                     "calls were captured, else eager" if device.startswith("cuda") else
                     "the host's wall clock around each call (perf_counter, no flush), median: the mechanics only",
            "points": judged, "verdict": overall}


def _rows(path: str) -> list[dict]:
    """The points a `measure` process wrote (a line cut by its kill is left out)."""
    rows = []
    for line in open(path) if Path(path).exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def run(out_json: str, baseline: str, budget_s: float, device: str, quick: bool, iters: int) -> dict:
    """Both trees measured (ours first: its kernels are in the check's cache), then the verdict, into out_json.
    baseline: the pack, or the `site` folder it unpacks to (the GPU check's, whose kernels step 0 precompiled)."""
    end = time.monotonic() + budget_s
    work = Path(tempfile.mkdtemp(prefix="layer-baseline-"))
    if not Path(baseline).is_dir():
        with tarfile.open(baseline) as tar:
            tar.extractall(work, filter="data")
        baseline = str(work / "site")
    site = str(Path(baseline).resolve())
    rows, status = {}, {}
    for who, where, share in (("ours", None, 0.4), ("baseline", site, 1.0)):
        path = str(work / f"{who}.jsonl")
        status[who] = run_tree(path, where, device, quick, iters, (end - time.monotonic()) * share)
        rows[who] = _rows(path)
    trees = {who: {r["tree"] for r in rows[who]} for who in rows}
    if rows["baseline"] and trees["baseline"] != {site}:
        raise SystemExit(f"the baseline process imported {trees['baseline']}, not {site}")
    result = verdict(rows["baseline"], rows["ours"], points_for(quick), device) | {
        "status": status, "baseline_commit": BASELINE, "rows": rows}
    Path(out_json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("dest", nargs="?", default=DEFAULT_PACK)
    for name in ("run", "measure"):
        p = sub.add_parser(name)
        p.add_argument("out")
        p.add_argument("--device", default="cuda")
        p.add_argument("--quick", action="store_true")
        p.add_argument("--iters", type=int, default=30)
        if name == "run":
            p.add_argument("--baseline", default=DEFAULT_PACK)
            p.add_argument("--budget", type=float, default=30.0)
    args = parser.parse_args(argv)
    if args.cmd == "pack":
        print(pack(args.dest))
    elif args.cmd == "measure":
        measure(args.out, args.device, args.quick, args.iters)
    else:
        result = run(args.out, args.baseline, args.budget, args.device, args.quick, args.iters)
        print(result["verdict"], "|", result["target"], "|", result["status"])
        for j in result["points"]:
            print(" ", j["point"], j["verdict"], *([f"{j['ratio']:.2f}x ({j['timer']})"] if "ratio" in j else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
