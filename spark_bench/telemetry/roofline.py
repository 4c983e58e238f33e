"""Rooflines: a datasheet table, the measured peaks cached per device fingerprint, and % of peak per result.

`roofline_for(device)` -> {"measured": entry or None, "datasheet": entry or None} for run.json: it reads the cache and
measures (spark_bench.telemetry.calibrate) only when asked. `percent_of_peak(gbps, tflops, dtype, roofline)` gives the
four percentages of one result. An entry is {"bandwidth_gbps": GB/s, "tflops": {dtype: TFLOP/s}, ...}; an unknown
device has no datasheet entry (None), never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from spark_bench.results import write_text_atomic

CACHE_ENV = "SPARK_BENCH_ROOFLINE_CACHE"
CACHE_SCHEMA = "spark-bench/roofline-cache"
DENSE = "NVIDIA datasheet, dense (no sparsity)"


def _entry(name: str, gbps: float, memory_gb: float, bf16: float, tf32: float, fp32: float,
           fp8: float | None = None) -> dict[str, Any]:
    tflops = {"bf16": bf16, "fp16": bf16, "tf32": tf32, "fp32": fp32}
    if fp8:
        tflops["fp8"] = fp8
    return {"name": name, "bandwidth_gbps": gbps, "memory_gb": memory_gb, "tflops": tflops, "source": DENSE}


H100_SXM = dict(bf16=989.4, tf32=494.7, fp32=66.9, fp8=1978.9)
H100_NVL = dict(bf16=835.5, tf32=417.5, fp32=60.0, fp8=1670.5)
A100 = dict(bf16=312.0, tf32=156.0, fp32=19.5)
DATASHEET = {
    "H200 SXM": _entry("H200 SXM", 4800, 141, **H100_SXM),
    "H200 NVL": _entry("H200 NVL", 4800, 141, **H100_NVL),
    "H100 SXM": _entry("H100 SXM", 3350, 80, **H100_SXM),
    "H100 NVL": _entry("H100 NVL", 3900, 94, **H100_NVL),
    "H100 PCIe": _entry("H100 PCIe", 2000, 80, bf16=756.5, tf32=378.0, fp32=51.2, fp8=1513.0),
    "GH200 96GB": _entry("GH200 96GB", 4000, 96, **H100_SXM),
    "GH200 144GB": _entry("GH200 144GB", 4900, 144, **H100_SXM),
    "A100 SXM 80GB": _entry("A100 SXM 80GB", 2039, 80, **A100),
    "A100 SXM 40GB": _entry("A100 SXM 40GB", 1555, 40, **A100),
    "A100 PCIe 80GB": _entry("A100 PCIe 80GB", 1935, 80, **A100),
    "A100 PCIe 40GB": _entry("A100 PCIe 40GB", 1555, 40, **A100),
    "L40S": _entry("L40S", 864, 48, bf16=362.05, tf32=183.0, fp32=91.6, fp8=733.0),
    "L4": _entry("L4", 300, 24, bf16=121.0, tf32=60.0, fp32=30.3, fp8=242.5),
}


def datasheet_key(name: str | None, memory_bytes: int | None = None) -> str | None:
    """Which DATASHEET row a CUDA device name (torch / nvidia-smi spelling) is, or None when unknown. MIG slices
    and ambiguous names are unknown: a datasheet number would be wrong for them."""
    if not name:
        return None
    n = name.lower()
    mem_gb = (memory_bytes or 0) / 1e9
    if "mig" in n.split() or re.search(r"\bmig\b|\d+g\.\d+gb", n):
        return None
    if "gh200" in n:
        return ("GH200 144GB" if mem_gb > 110 or "144" in n else "GH200 96GB") if mem_gb or "144" in n else None
    if "h200" in n:
        return "H200 NVL" if "nvl" in n else "H200 SXM"
    if "h100" in n:
        if "nvl" in n:
            return "H100 NVL"
        if "pcie" in n:
            return "H100 PCIe"
        return "H100 SXM" if ("hbm3" in n or "sxm" in n) else None
    if "a100" in n:
        size = "80GB" if ("80gb" in n or mem_gb > 60) else "40GB"
        return f"A100 {'PCIe' if 'pcie' in n else 'SXM'} {size}"
    if "l40s" in n:
        return "L40S"
    if re.search(r"\bl4\b", n):
        return "L4"
    return None


def datasheet_for(name: str | None, memory_bytes: int | None = None) -> dict[str, Any] | None:
    key = datasheet_key(name, memory_bytes)
    return dict(DATASHEET[key]) if key else None


# --- % of peak --------------------------------------------------------------------------------------------------
def _peak_dtype(dtype: str | None) -> str | None:
    if dtype is None:
        return None
    text = str(dtype).lower()
    if text in ("tf32", "fp8"):
        return text
    from spark_bench.dtypes import canonical_dtype

    try:
        return canonical_dtype(text)
    except ValueError:
        return None


def flops_peak(tflops: dict[str, float], dtype: str | None) -> float | None:
    """The FLOP/s ceiling of a dtype: its own peak, and for 16-bit dtypes at least the fp32 peak, since an op may
    compute them in fp32 (on CPUs without native bf16 the fp32 rate is the higher one; on GPUs the 16-bit one)."""
    if not dtype or tflops.get(dtype) is None:
        return None
    if dtype in ("bf16", "fp16") and tflops.get("fp32"):
        return max(tflops[dtype], tflops["fp32"])
    return tflops[dtype]


def _pct(value: float | None, peak: float | None) -> float | None:
    """100 value / peak to 4 significant digits (an interpreted kernel's 1e-4 % is not 0); None without a peak or
    without work of that kind (an op of no FLOPs has no FLOP roof)."""
    if not value or not peak:
        return None
    return float(f"{100.0 * value / peak:.4g}")


def percent_of_peak(gbps: float | None, tflops: float | None, dtype: str | None,
                    roofline: dict[str, Any] | None) -> dict[str, float | None]:
    """Percent of the measured and the datasheet peaks of one result. FLOPs compare with `flops_peak` of the
    result's dtype (fp32 with the non-tensor-core fp32 peak: above 100% means the kernel used TF32)."""
    roofline = roofline or {}
    key = _peak_dtype(dtype)
    out = {}
    for kind in ("measured", "datasheet"):
        entry = roofline.get(kind) or {}
        out[f"pct_bw_{kind}"] = _pct(gbps, entry.get("bandwidth_gbps"))
        out[f"pct_flops_{kind}"] = _pct(tflops, flops_peak(entry.get("tflops") or {}, key))
    return {k: out[k] for k in ("pct_bw_measured", "pct_bw_datasheet", "pct_flops_measured", "pct_flops_datasheet")}


# --- device identity and the cache ----------------------------------------------------------------------------
def device_identity(device: str) -> dict[str, Any]:
    """What identifies the hardware a peak was measured on: name, memory, driver (CUDA) or CPU model, cores and
    torch threads (CPU), plus the fingerprint key. Uses spark_bench.fingerprint when it is there."""
    import torch

    try:
        from spark_bench.fingerprint import fingerprint

        fp = fingerprint(device, codegen=False)  # peaks do not depend on how Triton compiles
        info, key, key_source = dict(fp["device"]), fp["fingerprint_id"], "spark_bench.fingerprint"
    except Exception:
        info, key, key_source = _own_device_info(device), None, "telemetry.roofline"
    if info.get("type") == "cpu":
        info["threads"] = torch.get_num_threads()  # the measured CPU rate depends on it
        key = None if key_source != "spark_bench.fingerprint" else f"{key}-t{info['threads']}"
    if key is None:
        ident = {k: info.get(k) for k in ("type", "name", "memory_bytes", "driver", "cores", "threads")}
        key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return {"device": info, "fingerprint_id": key, "key_source": key_source}


def _own_device_info(device: str) -> dict[str, Any]:
    import platform

    import torch

    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        from spark_bench.telemetry.nvml import open_source

        source, _ = open_source(device)
        return {"type": "cuda", "index": index, "name": props.name, "memory_bytes": int(props.total_memory),
                "driver": source.driver_version() if source else None, "cuda": torch.version.cuda}
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"type": "cpu", "name": model, "cores": os.cpu_count()}


def cache_path(path: str | Path | None = None) -> Path:
    return Path(path or os.environ.get(CACHE_ENV) or "~/.cache/spark-bench/roofline.json").expanduser()


def load_cache(path: str | Path | None = None) -> dict[str, Any]:
    """fingerprint_id -> measured entry; an absent or unreadable cache is empty (never an error)."""
    try:
        data = json.loads(cache_path(path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("schema") != CACHE_SCHEMA or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def store(entry: dict[str, Any], path: str | Path | None = None) -> Path:
    """Add or replace one measured entry (keyed by its fingerprint_id), atomically; OSError if it cannot be written
    (no temporary file is left behind)."""
    target = cache_path(path)
    entries = load_cache(target)
    entries[entry["fingerprint_id"]] = entry
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(target, json.dumps({"schema": CACHE_SCHEMA, "schema_version": 1, "entries": entries}, indent=1))
    return target


def roofline_for(device: str = "cuda", *, measure: bool = False, force: bool = False,
                 cache: str | Path | None = None, warn_failure: bool = True) -> dict[str, Any]:
    """{"measured": cached (or, with measure=True, freshly measured) peaks of this device or None,
    "datasheet": its datasheet row or None} — the run.json `roofline` field; `reason` (one line) is added when the
    device could not be identified or measuring failed (a warning on stderr unless warn_failure=False). Never raises.
    A CPU measured while busy (calibrate.was_busy) is returned but not cached, unless force (`spark-bench calibrate
    --force` asks for it)."""
    try:
        ident = device_identity(device)
    except Exception as exc:
        return {"measured": None, "datasheet": None, "reason": _one_line("device not identified", exc)}
    info = ident["device"]
    datasheet = datasheet_for(info.get("name"), info.get("memory_bytes")) if info.get("type") == "cuda" else None
    measured = None if force else load_cache(cache).get(ident["fingerprint_id"])
    if measured is None and (measure or force):
        from spark_bench.telemetry.calibrate import calibrate

        try:
            measured = calibrate(device, identity=ident)
        except Exception as exc:  # out of memory, a driver error: this run has no measured peaks
            why = _one_line("measuring the peaks failed", exc)
            if warn_failure:
                print(f"warning: {why}: % of measured peak is left out", file=sys.stderr)
            return {"measured": None, "datasheet": datasheet, "reason": why}
        if force or not measured.get("busy"):  # busy: this run uses the low peaks (labelled); the next re-measures
            try:
                store(measured, cache)
            except OSError as exc:  # this run keeps its peaks; the next one measures again
                print(f"warning: roofline cache {cache_path(cache)} not written ({exc.strerror or exc}): the next "
                      "run measures the peaks again", file=sys.stderr)
    return {"measured": measured, "datasheet": datasheet}


def _one_line(what: str, exc: Exception) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{what} ({type(exc).__name__}: {first})" if first else f"{what} ({type(exc).__name__})"


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
