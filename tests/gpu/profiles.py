"""Per-kernel device time of the multi-kernel ops at the points the issues name (the GPU check's step 4b).

kernel-review.md section 6 item 2 asks for the chunk prefill's stage times (`_chunk_intra`, `_chunk_state`,
`_chunk_output`) at 64k tokens, TP1 and TP8, and the MoE experts' kernels at T = 16k and 1: whole-op times (step 4)
say whether a target is met, these say which kernel to work on next. One process per case (an
illegal memory access poisons its process's CUDA context: on the first H200 run the 64k chunk prefill's fault failed
the four cases after it in the same process), torch.profiler through `spark-bench profile`'s own code
(spark_bench/telemetry/profile.py), each case's table printed and its kernels.json / kernels.txt / trace.json written
under OUT_DIR/<name>/. A case that fails is printed and skipped. `python tests/gpu/profiles.py OUT_DIR [--device cpu
--dry] [--case NAME] [--timeout S] [--budget S]`: --dry only resolves the cases (the test suite checks that every
axis value here exists); --case runs one in this process; each case gets at most --timeout seconds and at most what
is left of --budget (so an outer `timeout` does not cut one off mid-way; a case with under 3 s left is skipped).
"""

from __future__ import annotations

import subprocess
import sys
import time
import traceback

KIMI_MOE = ["hidden=2304", "experts=256", "topk=8", "inter=1024", "routing=uniform"]
KIMI_CHUNK = ["batch=1", "varlen=fixed", "seq_len=65536", "head_dim_k=128", "head_dim_v=128", "fused=True"]
CASES = {  # name -> (op, backend, --set values): Kimi-Linear, bf16
    "kda-chunk-64k-tp1": ("kda.chunk_prefill", "triton", KIMI_CHUNK + ["heads=32"]),
    "kda-chunk-64k-tp8": ("kda.chunk_prefill", "triton", KIMI_CHUNK + ["heads=4"]),
    "moe-experts-t16k": ("moe.experts", "triton", KIMI_MOE + ["tokens=16384"]),
    "moe-experts-t1": ("moe.experts", "triton", KIMI_MOE + ["tokens=1"]),
    "moe-gguf-t1": ("moe.experts_gguf", "triton", KIMI_MOE + ["tokens=1"]),
}


def profile_one(name: str, out_dir: str, device: str, dry: bool) -> int:
    from spark_bench.telemetry.profile import format_rows, profile_case, resolve_case

    op, backend, sets = CASES[name]
    try:
        if dry:
            resolve_case(op, backend, sets, "bf16", device)
            return 0
        summary = profile_case(op, backend, sets=sets, dtype="bf16", device=device, out_dir=f"{out_dir}/{name}",
                               iters=5, warmup=2)
        print(f"-- {name}: {summary['kernel_us_per_call']:.1f} us of {summary['what']} per call", flush=True)
        print(format_rows(summary["kernels"]), flush=True)
        return 0
    except Exception:  # noqa: BLE001 - printed; the other cases run in their own processes
        print(f"-- {name}: failed\n{traceback.format_exc(limit=3)}", flush=True)
        return 1


def main(out_dir: str, device: str = "cuda", dry: bool = False, timeout_s: float = 60.0,
         budget_s: float | None = None) -> int:
    """Every case, each in a fresh process within `timeout_s` and what is left of `budget_s` (--dry: all here,
    nothing launched)."""
    if dry:
        return max(profile_one(name, out_dir, device, True) for name in CASES)
    failed, end = 0, time.monotonic() + (budget_s if budget_s is not None else float("inf"))
    for name in CASES:
        limit = min(timeout_s, end - time.monotonic())
        if limit < 3:
            failed += 1
            print(f"-- {name}: no time left in the budget", flush=True)
            continue
        cmd = [sys.executable, __file__, out_dir, "--device", device, "--case", name]
        try:
            failed += subprocess.run(cmd, timeout=limit).returncode != 0
        except subprocess.TimeoutExpired:
            failed += 1
            print(f"-- {name}: no result within {limit:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    device = args[args.index("--device") + 1] if "--device" in args else "cuda"
    if "--case" in args:
        sys.exit(profile_one(args[args.index("--case") + 1], args[0], device, "--dry" in args))
    timeout = float(args[args.index("--timeout") + 1]) if "--timeout" in args else 60.0
    budget = float(args[args.index("--budget") + 1]) if "--budget" in args else None
    sys.exit(main(args[0], device=device, dry="--dry" in args, timeout_s=timeout, budget_s=budget))
