"""Registers, spills and shared memory of every Triton kernel as the GPU driver reports them (step 2 of
run_gpu_check.sh), beside the offline figures `spark-bench kernels` computed without a GPU (issue 11).

Runs the triton backends of every op in-process on the GPU at each quick-sweep point (bf16 where the op has it),
then reads each compiled kernel from the JIT caches: `n_regs` / `n_spills` after the driver loaded it, and
`metadata.shared`. With an offline JSON (`spark-bench kernels --quick --select all --json` made with the same
Triton), each kernel is matched by (name, constexprs, num_warps, num_stages) and both figures are written side by
side. Usage: python tests/gpu/kernel_metadata.py OUT.json [OFFLINE.json] [--budget S]: within S seconds (default 30)
it stops launching (checked per point) and writes what compiled so far, as on SIGTERM (on the first H200 run
`timeout 40` killed it before it wrote anything: the JIT compiled every kernel on the clock).
"""

from __future__ import annotations

import json
import signal
import sys
import time


def _compiled_kernels():
    """(JITFunction, CompiledKernel) for every kernel compiled in this process."""
    from triton.runtime.jit import JITFunction

    seen = []
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("spark_bench.kernels"):
            continue
        for obj in vars(module).values():
            if isinstance(obj, JITFunction) and obj not in [s for s, _ in seen]:
                for cache in getattr(obj, "device_caches", {}).values():
                    for kernel in cache[0].values():
                        seen.append((obj, kernel))
    return seen


def _constexprs(fn, kernel) -> dict:
    names = [p.name for p in fn.params]
    constants = getattr(kernel.src, "constants", {}) or {}
    out = {}
    for path, value in constants.items():
        index = path[0] if isinstance(path, tuple) else names.index(path)
        if names[index] in [p.name for p in fn.params if p.is_constexpr]:
            out[names[index]] = value if isinstance(value, (bool, int, float, str)) or value is None else repr(value)
    return out


def main(out_path: str, offline_path: str | None = None, budget_s: float = 30.0) -> None:
    import torch

    from spark_bench.registry import registry

    reg = registry()
    ran, failed = 0, []
    start = time.monotonic()
    skipped = []
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout`: stop launching, still write what compiled
    try:
        for op in reg.ops.values():
            backends = [b for name, b in op.backends.items() if name.startswith("triton")]
            dtype = "bf16" if "bf16" in op.tolerance else next(iter(op.tolerance))
            for params in op.points(quick=True):
                if time.monotonic() - start > budget_s:  # per point: one op's serial JIT compiles can take long
                    skipped.append({"op": op.name, "params": params})
                    continue
                try:
                    inputs = op.make_inputs(params, device="cuda", dtype=dtype, seed=0)
                    for backend in backends:
                        backend.fn(**inputs)
                        ran += 1
                    torch.cuda.synchronize()
                except Exception as exc:  # recorded; the sweep in step 2 has the details
                    failed.append({"op": op.name, "params": params, "error": f"{type(exc).__name__}: {exc}"[:300]})
    except KeyboardInterrupt:
        skipped.append("interrupted (SIGTERM): the points after it")
    offline = {}
    if offline_path:
        for row in json.load(open(offline_path))["rows"]:
            key = (row["kernel"], json.dumps(row["all_constexprs"], sort_keys=True), row["num_warps"],
                   row["num_stages"])
            offline[key] = row
    rows = []
    for fn, kernel in _compiled_kernels():
        try:
            kernel._init_handles()
        except Exception as exc:
            rows.append({"kernel": fn.fn.__name__, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        meta = kernel.metadata
        constexprs = _constexprs(fn, kernel)
        row = {"kernel": fn.fn.__name__, "constexprs": constexprs, "num_warps": meta.num_warps,
               "num_stages": meta.num_stages, "driver_n_regs": kernel.n_regs, "driver_n_spills": kernel.n_spills,
               "shared": meta.shared}
        match = offline.get((row["kernel"], json.dumps(constexprs, sort_keys=True), meta.num_warps,
                             meta.num_stages))
        if match:
            row.update(offline_regs=match["regs"], offline_spill_bytes=match["spill_stores"] + match["spill_loads"],
                       offline_shared=match["shared"], offline_triton=match["triton"])
        rows.append(row)
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "calls": ran, "failed": failed, "not_run": skipped,
                   "seconds": time.monotonic() - start, "kernels": rows}, f, indent=1)
    print(f"{len(rows)} compiled kernels ({sum('offline_regs' in r for r in rows)} matched offline), {ran} calls, "
          f"{len(failed)} failed, {len(skipped)} points not run (budget), {time.monotonic() - start:.0f} s")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    args = sys.argv[1:]
    budget = float(args.pop(args.index("--budget") + 1)) if "--budget" in args else 30.0
    args = [a for a in args if a != "--budget"]
    main(*args, budget_s=budget)
