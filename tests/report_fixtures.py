"""Synthetic run directories for the report and compare tests, written through the real results store."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from spark_bench.results import SCHEMA_VERSION, RunStore, case_id, summarize_statuses
from spark_bench.stats import summarize

H200 = {"type": "cuda", "index": 0, "name": "NVIDIA H200", "capability": "9.0", "memory_bytes": 150_000_000_000,
        "sm_count": 132, "l2_bytes": 62_914_560, "driver": "570.86.15", "cuda": "12.8"}
# Latency model per backend: fixed overhead (us) + time per token (us).
MODEL = {"triton": (4.0, 0.010), "torch": (9.0, 0.025), "torch_compile": (6.0, 0.015), "reference": (30.0, 0.2)}


def timing_of(samples: np.ndarray, timer: str = "cuda-event") -> dict[str, Any]:
    return {"timer": timer, "unit": "us", **summarize(samples), "samples": [float(x) for x in samples],
            "converged": True, "stop_reason": "converged", "warmup_s": 0.1, "measure_s": 0.5, "setup_s": 0.01,
            "l2_flush": True, "calls_per_sample": 1}


def draw(rng: np.random.Generator, median: float, n: int = 60, spread: float = 0.03) -> np.ndarray:
    """Log-normal samples around `median` with a light right tail, like real kernel timings."""
    s = median * np.exp(rng.normal(0.0, spread, n))
    s[rng.random(n) < 0.05] *= 1.3
    return s


def case(op: str, backend: str, params: dict[str, Any], dtype: str = "bf16", *, samples: np.ndarray | None = None,
         status: str = "ok", error: str | None = None, flops: float = 0.0, nbytes: float = 0.0,
         power: bool = False, device: str = "cuda") -> dict[str, Any]:
    rec: dict[str, Any] = {
        "case_id": case_id(op, backend, params, dtype, device), "op": op, "backend": backend, "params": params,
        "dtype": dtype, "device": device, "status": status, "error": error, "labels": [],
        "check": {"ok": status == "ok", "err_ratio": 2e-3 if status == "ok" else 0.4, "max_abs": 1e-2,
                  "cosine": 1.0, "tolerance": {"err_ratio": 1e-2, "max_abs": None}, "message": ""},
        "timing": None, "cost": None, "gbps": None, "tflops": None, "roofline": None, "power": None,
        "stages": None, "extra": {}, "recompiles_during_timing": 0, "started": "2026-11-30T10:15:03+00:00",
        "duration_s": 0.5, "worker_pid": 1,
    }
    if status == "skipped":
        rec["check"] = None
    if status == "ok" and samples is not None:
        t = timing_of(samples)
        sec = t["median"] * 1e-6
        rec.update(timing=t, cost={"flops": flops, "bytes": nbytes}, gbps=nbytes / sec / 1e9 if nbytes else None,
                   tflops=flops / sec / 1e12 if flops else None)
        if power:
            rec["power"] = {"avg_w": 420.0, "energy_j_per_call": 420.0 * sec, "source": "nvml-energy-counter"}
    return rec


def sweep(rng: np.random.Generator, *, scale: dict[str, float] | None = None, n: int = 60, spread: float = 0.03,
          ops: tuple[str, ...] = ("kda.gate", "moe.experts"), tokens=(1, 16, 256, 4096),
          backends=("triton", "torch", "torch_compile", "reference"), power: bool = True) -> list[dict[str, Any]]:
    """A GPU-like sweep: for each op, tokens x heads x backends, plus an unavailable peer; `scale` multiplies a
    backend's true latency (to inject a regression)."""
    scale = scale or {}
    out = []
    for op in ops:
        for heads in (4, 8):
            for t in tokens:
                params = {"tokens": t, "heads": heads, "head_dim": 128}
                nbytes, flops = 6.0 * t * heads * 128 * 2, 12.0 * t * heads * 128
                if op.startswith("moe"):
                    flops *= 400.0
                for b in backends:
                    base, per_token = MODEL.get(b, (10.0, 0.03))
                    median = (base + per_token * t * heads / 4) * scale.get(b, 1.0)
                    out.append(case(op, b, params, samples=draw(rng, median, n, spread), flops=flops, nbytes=nbytes,
                                    power=power))
                out.append(case(op, "fla", params, status="skipped", error="fla-core not installed"))
    return out


def write_run(path: Path, results: list[dict[str, Any]], *, run_id: str = "run-a", device: dict | None = None,
              fingerprint_id: str = "fp-h200", commit: str = "3f2a1c9d0e", peaks: bool = True,
              roofline: dict | None = None, power: dict | None = None) -> Path:
    device = device or H200
    run = {
        "run_id": run_id, "created": "2026-11-30T10:15:00+00:00", "finished": "2026-11-30T10:25:00+00:00",
        "fingerprint": {"device": device, "cpu": {"model": "AMD EPYC 9654", "cores": 16}, "host": "gpu-node-1",
                        "os": "Linux-6.8", "python": "3.11.7",
                        "versions": {"torch": "2.9.0", "triton": "3.6.0", "spark-bench": "0.1.0"},
                        "git": {"commit": commit, "dirty": False}, "fingerprint_id": fingerprint_id},
        "command": ["spark-bench", "run", "--op", "kda.*"],
        "spec": {"ops": ["kda.*", "moe.*"], "quick": False, "seed": 0, "device": "cuda"},
        "roofline": {"measured": {"gbps": 4300.0, "tflops": 780.0} if peaks else None,
                     "datasheet": {"gbps": 4800.0, "tflops": 989.0} if peaks else None} if roofline is None
        else roofline,
        "summary": summarize_statuses(results),
    }
    if power:
        run["fingerprint"]["power"] = power
    store = RunStore(path)
    store.create(run)
    with open(store.results_file, "a") as f:  # RunStore.append's format, without its fsync per line
        f.writelines(json.dumps({"schema_version": SCHEMA_VERSION, **r}) + "\n" for r in results)
    return path


def standard_run(path: Path, seed: int = 0, **kw: Any) -> Path:
    """A run with every kind of row: timed cases over two ops, a mismatch, an error and skipped peers."""
    rng = np.random.default_rng(seed)
    results = sweep(rng, **{k: kw.pop(k) for k in ("scale", "n", "spread", "ops", "tokens", "power") if k in kw})
    results.append(case("kda.gate", "triton", {"tokens": 4096, "heads": 16, "head_dim": 128}, status="mismatch",
                        error="outputs differ: err_ratio 0.4 > 0.01"))
    results.append(case("moe.experts", "torch_compile", {"tokens": 1, "heads": 16, "head_dim": 128}, status="error",
                        error="RuntimeError: CUDA out of resources\n  at line 3"))
    return write_run(path, results, **kw)


def ratio_of_medians(a: list[float], b: list[float]) -> float:
    return float(np.median(b) / np.median(a)) if a and b else math.nan
