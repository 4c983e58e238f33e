"""Correctness check of a backend's outputs against the op's reference, before any timing, and again after it.

Metrics per output: error ratio RMS(out - ref) / RMS(ref) (kda.md's measure), max |out - ref|, cosine similarity.
Outputs are compared in fp64. A non-finite value where the reference is finite fails the check: together with
`poisoned_allocations()` (every torch.empty-style allocation made by the backend during the check call is filled with
NaN) this catches output elements a kernel never writes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
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


def stray_leaves(out: Any, name: str = "") -> list[str]:
    """Names and types of the values in an output that are neither tensors, containers of them, nor None: the
    default check cannot compare them (a float, a numpy array), so an op whose reference returns one is refused
    rather than every backend passing unchecked."""
    if isinstance(out, torch.Tensor) or out is None:
        return []
    if isinstance(out, dict):
        return [s for k, v in out.items() for s in stray_leaves(v, f"{name}.{k}" if name else str(k))]
    if isinstance(out, (tuple, list)):
        return [s for i, v in enumerate(out) for s in stray_leaves(v, f"{name}.{i}" if name else str(i))]
    return [f"{name or 'the output'} ({type(out).__name__})"]


def tensor_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    if out.shape != ref.shape:
        return {"error": f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"}
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    finite = torch.isfinite(r)
    bad = ~torch.isfinite(o) & finite
    if bad.any():
        return {"error": f"{int(bad.sum())} of {o.numel()} values are NaN/inf where the reference is finite "
                         "(unwritten output or overflow)", "nonfinite": int(bad.sum())}
    # where the reference itself is NaN or +-inf (a masked logit, a log of 0) the output must be that same value:
    # those positions leave the error ratio, so a poisoned NaN, an inf of the other sign or any number there
    # would pass unseen
    unlike = ~finite & ~((torch.isnan(o) & torch.isnan(r)) | (o == r))
    if unlike.any():
        return {"error": f"{int(unlike.sum())} of {o.numel()} values differ where the reference is NaN/inf "
                         "(unwritten output, or a masked value computed)", "nonfinite": int(unlike.sum())}
    if o.numel() == 0:  # nothing was compared: an empty output is not a perfect match
        return {"error": f"output is empty (shape {tuple(out.shape)}): nothing to check"}
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
    stray = stray_leaves(ref)
    if stray or not refs:
        what = f"non-tensor values: {', '.join(stray)}" if stray else "no tensor"
        return {}, False, (f"the reference returned {what}; the check compares tensors only (return tensors, or "
                           "give the op a compare function)")
    if len(outs) != len(refs):
        return {}, False, f"backend returned {len(outs)} tensors, the reference {len(refs)}"
    per, problems = {}, []
    for (name, o), (_, r) in zip(outs, refs, strict=True):
        m = tensor_metrics(o, r)
        per[name] = m
        if "error" in m:
            problems.append(f"output {name}: {m['error']}")
        elif not m["err_ratio"] <= tol.err_ratio:  # written so that a NaN on either side fails
            problems.append(f"output {name}: error ratio {m['err_ratio']:.3g} > {tol.err_ratio:.3g}")
        elif tol.max_abs is not None and not m["max_abs"] <= tol.max_abs:
            problems.append(f"output {name}: max |diff| {m['max_abs']:.3g} > {tol.max_abs:.3g}")
    numeric = [m for m in per.values() if "err_ratio" in m]
    metrics = {
        "err_ratio": max((m["err_ratio"] for m in numeric), default=None),
        "max_abs": max((m["max_abs"] for m in numeric), default=None),
        "cosine": min((m["cosine"] for m in numeric), default=None),
        "outputs": per,
    }
    return metrics, not problems, "; ".join(problems)


def dtype_problems(out: Any, inputs: dict[str, Any], dtype: str) -> list[str]:
    """A floating output must have the case's dtype or that of a floating input (an fp32 state of a bf16 op): an
    fp64 output of an fp32 op passes the value check but is not the op (its bytes, and so its GB/s, are wrong)."""
    from spark_bench.dtypes import torch_dtype

    allowed = {torch_dtype(dtype)} | {t.dtype for _, t in flatten_outputs(inputs) if t.is_floating_point()}
    names = ", ".join(sorted(str(d).replace("torch.", "") for d in allowed))
    return [f"output {name}: dtype {str(t.dtype).replace('torch.', '')}, expected {names}"
            for name, t in flatten_outputs(out) if t.is_floating_point() and t.dtype not in allowed]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, as raw bytes (one pass, no temporaries: cheap on a 64k-token output); NaN equals the same NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def _global_rng_states() -> list:
    """The process-wide random states an unseeded factory draws from: torch (CPU and the current CUDA device),
    numpy, Python's random."""
    import random

    import numpy as np

    states = [torch.random.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _same_states(a: list, b: list) -> bool:
    """The states both lists hold are equal (CUDA's joins the list when the factory is the first to initialise it)."""
    import numpy as np

    def equal(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        return bool(np.array_equal(x, y)) if isinstance(x, np.ndarray) else x == y

    return all(equal(x, y) for x, y in zip(a, b, strict=False))


def factory_is_seeded(op: Op, device: str) -> bool:
    """Whether the op's input factory gives the same inputs for the same seed, at its smallest point: an unseeded
    factory's numbers cannot be reproduced by a later run or `--resume` (the runner labels them). Unseeded means
    both: the two calls' inputs differ, and a global random state moved (a `torch.empty` output buffer differs
    between calls too, drawing nothing). Any failure answers True: the factory's own errors fail its cases."""
    try:
        before = _global_rng_states()
        a, b = (flatten_outputs(op.make_inputs(None, device=device, dtype=op.quick_dtypes[0], seed=7))
                for _ in range(2))
        if [n for n, _ in a] == [n for n, _ in b] and all(same_bits(x, y) for (_, x), (_, y) in zip(a, b, strict=True)):
            return True
        return _same_states(before, _global_rng_states())
    except Exception:  # noqa: BLE001
        return True


def untouched_slots(index: str, *pools: str) -> Callable[[dict[str, Any]], dict[str, torch.Tensor]]:
    """`Op.untouched` of an op that updates `pools` in place at the rows `inputs[index]` names: every other row."""
    def rows(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        out = {}
        for pool in pools:
            keep = torch.ones(inputs[pool].shape[0], dtype=torch.bool, device=inputs[pool].device)
            keep[inputs[index].long().to(keep.device)] = False
            out[pool] = keep.nonzero().flatten()
        return out

    return rows


def changed_rows(rows: dict[str, torch.Tensor], before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One problem per input whose given rows (dim 0) differ bitwise after the call from before it."""
    problems = []
    for name, index in rows.items():
        a, b = (t[name].index_select(0, index.to(t[name].device)).contiguous() for t in (before, after))
        changed = int((a.flatten(1).view(torch.uint8) != b.flatten(1).view(torch.uint8)).any(1).sum())  # 0 rows: 0
        if changed:
            problems.append(f"{name}: {changed} of the {len(index)} slots the call must not touch changed")
    return problems


def mutated_inputs(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names of the tensor inputs a call changed in place (bitwise; NaN equals NaN)."""
    return [name for name, t in after.items()
            if isinstance(t, torch.Tensor) and isinstance(before.get(name), torch.Tensor)
            and not same_bits(before[name], t)]


def _declared_in_place(outputs: Any, inputs: dict[str, Any]) -> set[str]:
    """The inputs an op's `outputs=` returns (in-place outputs, e.g. a state pool): the same storage as a checked
    output. Every other input must come back bit for bit."""
    storages = {t.untyped_storage().data_ptr() for _, t in flatten_outputs(outputs) if t.numel()}
    return {name for name, t in inputs.items() if isinstance(t, torch.Tensor) and t.numel()
            and t.untyped_storage().data_ptr() in storages}


def check_outputs(op: Op, out: Any, ref: Any, inputs: dict[str, Any], dtype: str,
                  pristine: dict[str, Any] | None = None, backend: str | None = None) -> dict[str, Any]:
    """The `check` record of a result: metrics, ok, tolerance and a message naming what failed.

    Besides the values: floating outputs must have the op's dtype (`dtype_problems`; not for the fp64 `reference`
    backend), and given `pristine` (a copy of the inputs before the call) the inputs must come back unchanged, unless
    those the op declares as in-place outputs (`outputs=`): a backend that overwrites its inputs is timed on other
    data."""
    tol = op.tolerance_for(dtype)
    if op.outputs is not None:
        out = op.outputs(out, inputs)
    if op.compare is not None:
        metrics, ok, message = op.compare(out, ref, inputs, dtype)
    else:
        metrics, ok, message = default_compare(out, ref, tol)
    problems = [] if backend == "reference" else dtype_problems(out, inputs, dtype)
    if pristine is not None:
        declared = _declared_in_place(out, inputs) if op.outputs is not None else set()
        problems += [f"input {name} was modified in place (every timed call would run on other data; an in-place "
                     "op declares outputs=, and only those may change)"
                     for name in mutated_inputs(pristine, inputs) if name not in declared]
    if pristine is not None and op.untouched is not None:
        problems += changed_rows(op.untouched(pristine), pristine, inputs)
    if problems:
        ok, message = False, "; ".join(filter(None, [*problems, message]))
    return {**metrics, "ok": bool(ok), "message": message,
            "tolerance": {"err_ratio": tol.err_ratio, "max_abs": tol.max_abs}}


def output_snapshot(op: Op, out: Any, inputs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """A host copy of what `check_outputs` compares (the returned tensors, or an in-place op's declared outputs), for
    `recheck_outputs`: kept on the host, so the timed calls have the device memory they had without it."""
    named = flatten_outputs(op.outputs(out, inputs) if op.outputs is not None else out)
    return [(name, t.detach().to("cpu", copy=True)) for name, t in named]


def recheck_outputs(op: Op, out: Any, first: list[tuple[str, torch.Tensor]], ref: Any, inputs: dict[str, Any],
                    dtype: str, pristine: dict[str, Any], backend: str | None = None) -> dict[str, Any]:
    """The `recheck` record of a call on the checked inputs after the timing: `identical` when its outputs equal the
    checked call's bit for bit (NaN equals NaN); otherwise the full check against the reference again, with the
    outputs that `differ`. Catches a kernel that is right once and wrong on repeated calls (scratch reused without
    being reset, a race that shows under load), and names one whose bits vary within tolerance (atomics)."""
    now = output_snapshot(op, out, inputs)
    differ = [name for (name, a), (_, b) in zip(now, first, strict=False) if not same_bits(a, b)]
    if len(now) == len(first) and not differ:
        return {"identical": True, "ok": True}
    again = check_outputs(op, out, ref, inputs, dtype, pristine=pristine, backend=backend)
    return {"identical": False, "ok": again["ok"], "differ": differ, "err_ratio": again.get("err_ratio"),
            "max_abs": again.get("max_abs"), "message": again["message"]}


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
