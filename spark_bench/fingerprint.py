"""The environment fingerprint stored with every run: device, driver/CUDA, library versions, CPU, host, git commit.

`fingerprint_id` hashes only what identifies the measuring hardware and software stack (device name, memory, SM count,
driver, CUDA, torch, triton, and a GPU's enforced power limit where NVML reads it: a capped card is slower at the
same clocks' worth of work), and on a GPU Triton's code-generation switches where set (`triton_codegen_env`, e.g.
DISABLE_MMA_V3=1: other machine code for the same kernels), so runs are compared only with runs of the same
fingerprint unless the user insists. The roofline cache keys on the id without those switches.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch

PEERS = ("torch", "triton", "fla-core", "gguf", "vllm", "numpy", "nvidia-ml-py", "plotly", "spark-bench")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_info() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "arch": platform.machine()}


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else version
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def device_info(device: str) -> dict[str, Any]:
    """The device's identity; a CPU's `cores` are the usable ones (a CPU run's times are host code on them)."""
    if not device.startswith("cuda"):
        return {"type": "cpu", "name": cpu_info()["model"], "cores": usable_cores()}
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "type": "cuda", "index": index, "name": props.name, "capability": f"{props.major}.{props.minor}",
        "memory_bytes": int(props.total_memory), "sm_count": int(props.multi_processor_count),
        "l2_bytes": int(getattr(props, "L2_cache_size", 0) or 0), "cuda": torch.version.cuda,
        "driver": _driver_version(),
    }


# (section, key) of each field fingerprint_id hashes, as stack_difference names them
IDENTITY_FIELDS = (("device", "type"), ("device", "name"), ("device", "memory_bytes"), ("device", "sm_count"),
                   ("device", "capability"), ("device", "driver"), ("device", "cuda"), ("device", "cores"),
                   ("versions", "torch"), ("versions", "triton"), ("power", "limit_w"))


def power_info(device: str) -> dict[str, Any] | None:
    """A GPU's enforced and default power limits (W, NVML) and, where NVML says, whether MIG is enabled on it (its
    power and energy then cover every instance); None on a CPU or without NVML."""
    if not device.startswith("cuda"):
        return None
    from spark_bench.telemetry.nvml import open_source

    source, _ = open_source(device)
    limit = source.power_limit_w() if source is not None else None
    if limit is None:
        return None
    default = source.default_power_limit_w()
    out = {"limit_w": round(limit), "default_limit_w": round(default) if default is not None else None}
    if source.mig is not None:  # not hashed: a MIG slice already has its own name, memory and SM count
        out["mig"] = bool(source.mig)
    return out


def stack_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The identifying fields that differ between two fingerprints: `power.limit_w 700 -> 500`, `versions.torch
    '2.11.0' -> '2.13.0'` (a section that is not an object reads as empty)."""
    def field(fp: dict[str, Any], section: str, key: str) -> Any:
        part = fp.get(section)
        return part.get(key) if isinstance(part, dict) else None

    found = [f"{section}.{key} {field(a, section, key)!r} -> {field(b, section, key)!r}"
             for section, key in IDENTITY_FIELDS if field(a, section, key) != field(b, section, key)]
    codegen_a, codegen_b = a.get("triton_codegen_env") or {}, b.get("triton_codegen_env") or {}
    return found + ([f"triton_codegen_env {codegen_a!r} -> {codegen_b!r}"] if codegen_a != codegen_b else [])


def stack_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    """stack_differences as one text ("fingerprint_id differs" when no stored field does)."""
    return ", ".join(stack_differences(a, b)) or "fingerprint_id differs"


def git_info() -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


# Triton's environment variables that change the machine code of the same kernels (its cache-invalidating list also
# holds dump and timing switches, which do not); a false-like value ("0", "false", "off", "no", "") is no change
CODEGEN_VARS = ("DISABLE_MMA_V3", "DISABLE_MMA_V5", "TRITON_F32_DEFAULT", "TRITON_DEFAULT_FP_FUSION",
                "DISABLE_LLVM_OPT", "DISABLE_PTXAS_OPT", "ALLOW_LHS_TMEM_LAYOUT_CONVERSION")


def triton_codegen_env(device: str = "cuda") -> dict[str, str]:
    """The CODEGEN_VARS set now, e.g. DISABLE_MMA_V3=1, which the GPU check sets when a kernel faulted with Hopper's
    wgmma; {} on a CPU (the interpreter compiles nothing)."""
    if not str(device).startswith("cuda"):
        return {}
    return {k: os.environ[k] for k in CODEGEN_VARS
            if os.environ.get(k, "").strip().lower() not in ("", "0", "false", "off", "no")}


def fingerprint(device: str, weights: dict[str, Any] | None = None, codegen: bool = True) -> dict[str, Any]:
    """The run's environment; with a weight spec (--weights/--routing) also `weights`: the file(s), their sizes, the
    layer and a content hash of its tensors (spark_bench.weights.describe), so `compare` can tell runs apart."""
    dev = device_info(device)
    versions = {d: _version(d) for d in PEERS}
    # the build's own spelling: PyPI's CUDA wheels' metadata says "2.11.0" where torch says "2.11.0+cu130"
    versions["torch"] = torch.__version__
    ident = {k: dev.get(k) for k in ("type", "name", "memory_bytes", "sm_count", "capability", "driver", "cuda")}
    ident.update(torch=versions["torch"], triton=versions["triton"])
    power = power_info(device)
    if power:  # only where read: runs without NVML (and every CPU run) keep the ids they had
        ident["power_limit_w"] = power["limit_w"]
    if dev["type"] == "cpu":  # 2 cores or 16 of one CPU model time host code differently (GPU ids unchanged)
        ident["cores"] = dev["cores"]
    codegen = triton_codegen_env(device) if codegen else {}  # codegen=False: the hardware's id (roofline peaks)
    if codegen:  # e.g. DISABLE_MMA_V3=1: other machine code for the same kernels (ids without one unchanged)
        ident["triton_codegen_env"] = codegen
    out = {
        "device": dev, "cpu": cpu_info(), "host": socket.gethostname(), "os": platform.platform(),
        "python": platform.python_version(), "versions": versions, "git": git_info(),
        "env": {k: os.environ[k] for k in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES") if k in os.environ},
        "fingerprint_id": hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16],
    }
    if power:
        out["power"] = power
    if codegen:
        out["triton_codegen_env"] = codegen
    if weights:
        from spark_bench.weights import describe

        out["weights"] = describe(weights)
    return out
