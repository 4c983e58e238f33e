"""What `spark-bench tune` will time, decided before any device time is spent.

For each base case (op, Triton backend, point, dtype) the launches are captured on meta tensors (the offline gate's
capture, spark_bench/kernelgate/capture.py): that tells which declared kernels the backend launches, at which keys,
and gives each candidate config's specialisations. Every candidate is then compiled offline for the device's target;
one that fails to compile, cannot launch (registers, shared memory, threads) or spills is pruned with the reason.
The survivors are ordered by the offline model so the likely winners are timed first: fuller last wave of CTAs,
then more CTAs per SM, then fewer registers (there is no per-config bytes model: tiles change re-reads, which only
the timing sees).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from spark_bench.sweep import Case
from spark_bench.tune.space import config_id, key_id


def prune_target(device: str, requested: str | None, device_info: dict[str, Any]) -> tuple[str | None, str]:
    """(target or None, why): the device's own target on CUDA, the requested one (`--target`), or sm_90a on a CPU
    (the gate's target: a CPU tune exercises the workflow under the interpreter)."""
    if requested == "none":
        return None, "offline pruning off (--target none)"
    if requested:
        return requested, f"offline pruning for {requested} (--target)"
    if device.startswith("cuda"):
        from spark_bench.kernelgate.targets import family

        target = family(device_info.get("capability"))
        if target is None:
            return None, f"no offline target for compute capability {device_info.get('capability')}: not pruned"
        return target, f"offline pruning for {target} (this GPU)"
    return "sm_90a", "offline pruning for sm_90a (the gate's target; the CPU timing runs interpreted)"


def _capture_request(case: Case, configs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"op": case.op, "backend": case.backend, "params": case.params, "dtype": case.dtype,
            "configs": configs, "weights": case.weights}


def _unique(values: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def build(base: Sequence[Case], target: str | None, *, jobs: int | None = None, cache_dir=None,
          say: Callable[[str], None] = lambda line: None, one_per_key: bool = False,
          deadline_s: float | None = None) -> dict[str, Any]:
    """The plan, stored in the tune's run.json:

        {"items": [{"case", "kernel", "keys": [{"key", "config" (the declared one)}],
                    "candidates": [{"config", "id", "status": ok|pruned, "reason", "score"}]}],
         "untunable": [ids of cases that launch no declared kernel], "capture_errors": [...], "target"}

    `one_per_key`: only the first case of each (kernel, keys) gets an item (what `kernels --candidates` compiles)."""
    from spark_bench.kernelgate.capture import run_capture

    say(f"tune: capturing the launches of {len(base)} case(s) on meta tensors ...")
    first = run_capture({"cases": [_capture_request(c) for c in base], "target": target or "sm_90a"})
    items, untunable, errors = [], [], []
    for case, outcome in zip(base, first["cases"], strict=True):
        if outcome["error"]:
            errors.append(f"{case.case_id}: {outcome['error']}")
            continue
        kernels = _unique([p["kernel"] for p in outcome["picks"]])
        if not kernels:
            untunable.append(case.case_id)
        for kernel in kernels:
            picks = [p for p in outcome["picks"] if p["kernel"] == kernel]
            declared = _unique([p["config"] for p in picks])
            space = outcome.get("spaces", {}).get(kernel, {"candidates": declared})
            candidates = [c for c in space["candidates"] if [c] != declared]
            items.append({"case": case.to_dict(), "kernel": kernel,
                          "keys": _unique([{"key": p["key"], "config": p["config"]} for p in picks]),
                          "candidates": [{"config": c, "id": config_id(c), "status": "ok", "reason": None,
                                          "score": None} for c in candidates]})
    if one_per_key:
        items = list({(i["kernel"], key_id({"k": [k["key"] for k in i["keys"]]})): i for i in reversed(items)}
                     .values())[::-1]
    n = sum(len(i["candidates"]) for i in items)
    if target is not None and n:
        _prune(items, first["specs"], target, jobs, cache_dir, say, deadline_s)
    return {"items": items, "untunable": untunable, "capture_errors": errors, "target": target}


def _prune(items: list[dict[str, Any]], base_specs: list[Any], target: str, jobs, cache_dir, say,
           deadline_s: float | None) -> None:
    from spark_bench.kernelgate.capture import run_capture
    from spark_bench.kernelgate.offline import compile_all
    from spark_bench.kernelgate.targets import TARGETS

    flat = [(item, cand) for item in items for cand in item["candidates"]]
    say(f"tune: capturing {len(flat)} candidate config(s) and compiling them offline for {target} ...")
    requests = [_capture_request(Case(**item["case"]), {item["kernel"]: cand["config"]}) for item, cand in flat]
    captured = run_capture({"cases": requests, "target": target})
    base_keys = {s.key for s in base_specs}
    new_specs = [s for s in captured["specs"] if s.key not in base_keys]  # what a candidate changes
    verdicts = {r.key: r for r in compile_all(new_specs, [target], jobs=jobs, cache_dir=cache_dir,
                                              deadline_s=deadline_s)}
    per_case: dict[int, list[Any]] = {}
    for spec in new_specs:
        for index in {launch["case"] for launch in spec.launches}:
            per_case.setdefault(index, []).append(spec)
    sm_count = TARGETS[target].sm_count
    for index, (_item, cand) in enumerate(flat):
        outcome = captured["cases"][index]
        if outcome["error"]:
            cand.update(status="pruned", reason=f"capture: {outcome['error']}")
            continue
        specs = per_case.get(index, [])
        lost = [verdicts[s.key] for s in specs if "compile worker died" in (verdicts[s.key].error or "")]
        if lost:  # the compiler crashed, not the config: time it rather than drop it unjudged
            cand["reason"] = f"not checked offline ({lost[0].error})"
            continue
        bad = [(s, verdicts[s.key]) for s in specs if verdicts[s.key].verdict != "ok"]
        if bad:
            spec, result = bad[0]
            cand.update(status="pruned", reason=f"{result.verdict} in {spec.name}: {result.error}")
            continue
        cand["score"] = _score([(s, verdicts[s.key]) for s in specs], index, sm_count)
    for item in items:  # the likely winners first; pruned ones last (never timed)
        item["candidates"].sort(key=lambda c: (c["status"] != "ok", _order(c["score"])))


def _score(compiled: list[tuple[Any, Any]], case_index: int, sm_count: int) -> dict[str, Any] | None:
    """The offline model of one candidate: its tuned launches' last-wave fill, CTAs per SM and registers."""
    fills, ctas, regs = [], [], []
    for spec, result in compiled:
        for launch in spec.launches:
            grid = launch.get("grid")
            if launch.get("case") != case_index or not isinstance(grid, list):
                continue
            blocks = math.prod(int(g) for g in grid if isinstance(g, int)) or 1
            per_wave = max(1, result.ctas_per_sm) * sm_count
            fills.append(blocks / (math.ceil(blocks / per_wave) * per_wave))
        ctas.append(result.ctas_per_sm)
        regs.append(result.regs or 0)
    if not ctas:
        return None
    return {"fill": round(min(fills), 3) if fills else None, "ctas_per_sm": min(ctas), "regs": max(regs)}


def _order(score: dict[str, Any] | None) -> tuple[float, float, float]:
    if not score:
        return (0.0, 0.0, 0.0)
    return (-(score["fill"] or 0.0), -score["ctas_per_sm"], score["regs"])


def summary_lines(plan: dict[str, Any]) -> list[str]:
    """How many candidates each kernel keeps and why the others were dropped."""
    lines = []
    by_kernel: dict[str, list[dict[str, Any]]] = {}
    for item in plan["items"]:
        by_kernel.setdefault(item["kernel"], []).extend(item["candidates"])
    for kernel, cands in sorted(by_kernel.items()):
        pruned = [c for c in cands if c["status"] == "pruned"]
        lines.append(f"  {kernel}: {len(cands)} candidate launch(es) besides the default, {len(pruned)} pruned offline")
        for c in _unique([(c["id"], c["reason"]) for c in pruned]):
            lines.append(f"    pruned {c[0]}: {c[1]}")
    return lines
