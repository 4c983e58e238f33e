"""Synthetic run directories for the history tests and benchmark, written through the real results store
(`RunStore.create` and `RunStore.append`, or `append`'s exact line format without its fsync per line when `fast`).

A case's latency is its base time × a per-run machine drift (log-normal, `drift`) × its own step factor, and each run
draws `samples` raw samples around that (log-normal, `spread`, with a light right tail like real kernel timings).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spark_bench.results import SCHEMA_VERSION, RunStore, case_id, summarize_statuses
from spark_bench.stats import summarize

H200 = {"type": "cuda", "index": 0, "name": "NVIDIA H200", "capability": "9.0", "memory_bytes": 150_000_000_000,
        "sm_count": 132, "l2_bytes": 62_914_560, "driver": "570.86.15", "cuda": "12.8"}
START = dt.datetime(2026, 9, 1, 2, 0, tzinfo=dt.timezone.utc)


@dataclasses.dataclass(frozen=True)
class SynthCase:
    op: str
    backend: str
    params: dict[str, Any]
    base_us: float
    dtype: str = "bf16"


def cases(ops: Sequence[str] = ("kda.gate", "moe.experts"), backends: Sequence[str] = ("triton", "torch"),
          tokens: Sequence[int] = (16, 256), heads: Sequence[int] = (4,)) -> list[SynthCase]:
    out = []
    for op in ops:
        for b in backends:
            for h in heads:
                for t in tokens:
                    out.append(SynthCase(op, b, {"tokens": t, "heads": h}, (4.0 if b == "triton" else 9.0) + t / 40))
    return out


def record(c: SynthCase, samples: np.ndarray | None, device: str = "cuda", status: str = "ok",
           error: str | None = None) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "case_id": case_id(c.op, c.backend, c.params, c.dtype, device), "op": c.op, "backend": c.backend,
        "params": c.params, "dtype": c.dtype, "device": device, "status": status, "error": error, "labels": [],
        "check": {"ok": status == "ok", "err_ratio": 2e-3, "max_abs": 1e-2, "cosine": 1.0,
                  "tolerance": {"err_ratio": 1e-2, "max_abs": None}, "message": ""},
        "timing": None, "cost": None, "gbps": None, "tflops": None, "roofline": None, "power": None, "stages": None,
        "extra": {}, "recompiles_during_timing": 0, "started": START.isoformat(), "duration_s": 0.5, "worker_pid": 1}
    if status == "ok" and samples is not None:
        nbytes = 6.0 * c.params.get("tokens", 1) * 4096
        t = {"timer": "cuda-event", "unit": "us", **summarize(samples), "samples": [float(x) for x in samples],
             "converged": True, "stop_reason": "converged", "warmup_s": 0.1, "measure_s": 0.5, "setup_s": 0.01,
             "l2_flush": True, "calls_per_sample": 1}
        rec.update(timing=t, cost={"flops": nbytes * 2, "bytes": nbytes}, gbps=nbytes / (t["median"] * 1e3),
                   tflops=nbytes * 2 / (t["median"] * 1e6))
    return rec


def draw(rng: np.random.Generator, median: float, n: int, spread: float) -> np.ndarray:
    s = median * np.exp(rng.normal(0.0, spread, n))
    s[rng.random(n) < 0.05] *= 1.3
    return s


def write_run(path: Path, records: Sequence[dict[str, Any]], *, run_id: str, commit: str | None,
              created: dt.datetime, device: dict[str, Any] | None = None, fingerprint_id: str = "fp-h200",
              dirty: bool = False, fast: bool = False) -> Path:
    device = device or H200
    run = {"run_id": run_id, "created": created.isoformat(timespec="seconds"),
           "finished": (created + dt.timedelta(minutes=20)).isoformat(timespec="seconds"),
           "fingerprint": {"device": device, "cpu": {"model": "AMD EPYC 9654", "cores": 16}, "host": "gpu-node-1",
                           "os": "Linux-6.8", "python": "3.11.7",
                           "versions": {"torch": "2.9.0", "triton": "3.6.0", "spark-bench": "0.1.0"},
                           "git": {"commit": commit, "dirty": dirty if commit else None},
                           "fingerprint_id": fingerprint_id},
           "command": ["spark-bench", "run", "--op", "kda.*", "--op", "moe.*"],
           "spec": {"ops": ["kda.*", "moe.*"], "quick": False, "seed": 0, "device": "cuda"},
           "roofline": {"measured": None, "datasheet": None}, "summary": summarize_statuses(list(records))}
    store = RunStore(path)
    store.create(run)
    if fast:  # RunStore.append's line format, without its fsync per line
        with open(store.results_file, "a") as f:
            f.writelines(json.dumps({"schema_version": SCHEMA_VERSION, **r}, allow_nan=True) + "\n" for r in records)
    else:
        for r in records:
            store.append(r)
    return path


def write_history(root: Path, commits: Sequence[str | None], *, case_list: Sequence[SynthCase] | None = None,
                  steps: dict[int, tuple[int, float]] | None = None, seed: int = 0, samples: int = 40,
                  spread: float = 0.03, drift: float = 0.01, fast: bool = False, **run_kw: Any) -> list[Path]:
    """One run per commit (None: a run without a git commit), a day apart; `steps` maps a case index to
    (first run index that is affected, factor). Returns the run directories in order."""
    rng = np.random.default_rng(seed)
    case_list = list(case_list or cases())
    steps = steps or {}
    out = []
    for i, commit in enumerate(commits):
        machine = float(np.exp(rng.normal(0.0, drift)))
        recs = []
        for k, c in enumerate(case_list):
            at, factor = steps.get(k, (len(commits) + 1, 1.0))
            median = c.base_us * machine * float(np.exp(rng.normal(0.0, drift))) * (factor if i >= at else 1.0)
            recs.append(record(c, draw(rng, median, samples, spread)))
        run_id = f"{(START + dt.timedelta(days=i)).strftime('%Y%m%d-%H%M%S')}-cuda-{i:04d}"
        out.append(write_run(root / run_id, recs, run_id=run_id, commit=commit, created=START + dt.timedelta(days=i),
                             fast=fast, **run_kw))
    return out


def git_repo(path: Path, n: int) -> list[str]:
    """A git repository at `path` with `n` commits a day apart (committer dates set); returns their shas in order."""
    import os
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GIT_AUTHOR_NAME": "dev", "GIT_AUTHOR_EMAIL": "dev@example.com",
           "GIT_COMMITTER_NAME": "dev", "GIT_COMMITTER_EMAIL": "dev@example.com"}

    def git(*args: str, **extra: str) -> str:
        return subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True, text=True,
                              env={**env, **extra}).stdout.strip()

    git("init", "-q", "-b", "main")
    shas = []
    for i in range(n):
        when = (START - dt.timedelta(hours=3) + dt.timedelta(days=i)).isoformat()
        (path / "kernel.txt").write_text(f"version {i}\n")
        git("add", "kernel.txt")
        git("commit", "-q", "-m", f"change {i}", GIT_AUTHOR_DATE=when, GIT_COMMITTER_DATE=when)
        shas.append(git("rev-parse", "HEAD"))
    return shas
