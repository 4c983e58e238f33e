"""Correctness check of a backend's outputs against the op's reference, before any timing.

Metrics per output: error ratio RMS(out - ref) / RMS(ref) (kda.md's measure), max |out - ref|, cosine similarity.
Outputs are compared in fp64. A non-finite value where the reference is finite fails the check: together with
`poisoned_allocations()` (every torch.empty-style allocation made by the backend during the check call is filled with
NaN) this catches output elements a kernel never writes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from spark_bench.op import Op, Tolerance


def flatten_outputs(out: Any) -> list[tuple[str, torch.Tensor]]:
    """A tensor, a tuple/list of tensors or a dict of tensors -> named tensors (non-tensors dropped)."""
    if isinstance(out, torch.Tensor):
        return [("0", out)]
    if isinstance(out, dict):
        items = list(out.items())
    elif isinstance(out, (tuple, list)):
        items = [(str(i), v) for i, v in enumerate(out)]
    else:
        return []
    named = []
    for key, value in items:
        named.extend((f"{key}" if sub == "0" and isinstance(value, torch.Tensor) else f"{key}.{sub}", t)
                     for sub, t in flatten_outputs(value))
    return named


def tensor_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    if out.shape != ref.shape:
        return {"error": f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"}
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    bad = (~torch.isfinite(o)) & torch.isfinite(r)
    if bad.any():
        return {"error": f"{int(bad.sum())} of {o.numel()} values are NaN/inf where the reference is finite "
                         "(unwritten output or overflow)", "nonfinite": int(bad.sum())}
    if o.numel() == 0:
        return {"err_ratio": 0.0, "max_abs": 0.0, "cosine": 1.0}
    finite = torch.isfinite(r)
    o, r = o[finite], r[finite]
    diff = o - r
    rms_ref = float(r.pow(2).mean().sqrt())
    rms_diff = float(diff.pow(2).mean().sqrt())
    err_ratio = rms_diff / rms_ref if rms_ref > 0 else (0.0 if rms_diff == 0 else math.inf)
    denom = float(o.norm() * r.norm())
    cosine = float((o * r).sum()) / denom if denom > 0 else (1.0 if rms_diff == 0 else 0.0)
    return {"err_ratio": err_ratio, "max_abs": float(diff.abs().max()) if diff.numel() else 0.0, "cosine": cosine}


def default_compare(out: Any, ref: Any, tol: Tolerance) -> tuple[dict[str, Any], bool, str]:
    outs, refs = flatten_outputs(out), flatten_outputs(ref)
    if len(outs) != len(refs):
        return {}, False, f"backend returned {len(outs)} tensors, the reference {len(refs)}"
    per, problems = {}, []
    for (name, o), (_, r) in zip(outs, refs, strict=True):
        m = tensor_metrics(o, r)
        per[name] = m
        if "error" in m:
            problems.append(f"output {name}: {m['error']}")
        elif m["err_ratio"] > tol.err_ratio:
            problems.append(f"output {name}: error ratio {m['err_ratio']:.3g} > {tol.err_ratio:.3g}")
        elif tol.max_abs is not None and m["max_abs"] > tol.max_abs:
            problems.append(f"output {name}: max |diff| {m['max_abs']:.3g} > {tol.max_abs:.3g}")
    numeric = [m for m in per.values() if "err_ratio" in m]
    metrics = {
        "err_ratio": max((m["err_ratio"] for m in numeric), default=None),
        "max_abs": max((m["max_abs"] for m in numeric), default=None),
        "cosine": min((m["cosine"] for m in numeric), default=None),
        "outputs": per,
    }
    return metrics, not problems, "; ".join(problems)


def check_outputs(op: Op, out: Any, ref: Any, inputs: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The `check` record of a result: metrics, ok, tolerance and a message naming what failed."""
    tol = op.tolerance_for(dtype)
    if op.outputs is not None:
        out = op.outputs(out, inputs)
    if op.compare is not None:
        metrics, ok, message = op.compare(out, ref, inputs, dtype)
    else:
        metrics, ok, message = default_compare(out, ref, tol)
    return {**metrics, "ok": bool(ok), "message": message,
            "tolerance": {"err_ratio": tol.err_ratio, "max_abs": tol.max_abs}}


def clone_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


@torch.no_grad()
def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif t.numel():
        t.fill_(torch.iinfo(t.dtype).max)
    return t


@contextlib.contextmanager
def poisoned_allocations(patch_torch: bool = True) -> Iterator[None]:
    """While active, torch.empty / empty_like / empty_strided / Tensor.new_empty return NaN-filled (float) or
    max-filled (integer) tensors (unless patch_torch is False: torch.compile'd callables), and freed CUDA cache blocks
    are NaN-filled, so unwritten elements show up."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free = torch.cuda.mem_get_info()[0]
        with contextlib.suppress(RuntimeError):
            blob = torch.empty(int(min(free * 0.25, 1 << 30)) // 4, dtype=torch.float32, device="cuda")
            blob.fill_(float("nan"))
            del blob
    if not patch_torch:
        yield
        return
    originals = {name: getattr(torch, name) for name in ("empty", "empty_like", "empty_strided")}
    original_new_empty = torch.Tensor.new_empty

    def wrap(fn):
        def poisoned(*args, **kwargs):
            return _poison(fn(*args, **kwargs))

        return poisoned

    try:
        for name, fn in originals.items():
            setattr(torch, name, wrap(fn))
        torch.Tensor.new_empty = wrap(original_new_empty)
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)
        torch.Tensor.new_empty = original_new_empty
