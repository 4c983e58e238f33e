"""The H200 targets of issues 12 (KDA kernels) and 13 (MoE kernels) as data: the points each one is measured at, and
the verdict read from the results. The prepared GPU check runs these points before the budgeted general sweep, so
its one call answers the issues' questions first (tests/gpu/run_gpu_check.sh):

    python3 tests/gpu/targets.py precompile -- [spark-bench kernels options]     # their Triton specialisations
    python3 tests/gpu/targets.py run DIR --budget S -- [spark-bench run options]   # one run directory per group
    python3 tests/gpu/targets.py verdict DIR > targets.json                         # per target: points, verdict

A group is targets sharing a preset and backends (one `spark-bench run`, each op at its own points through
`--set OP:AXIS=...`). Groups run in the order below, each within what is left of the budget; a group cut short keeps
its finished cases (the journal), and its targets are then `partial` or `not measured`, never guessed.
Ratios are the peer's median time over ours (above 1: ours is faster); roofline percentages are of the measured
memory bandwidth (`spark-bench calibrate`, run before the targets by the GPU check).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

KDA = ("triton", "fla", "triton_unfused")
MOE = ("triton", "torch", "vllm")


@dataclasses.dataclass(frozen=True)
class Target:
    issue: int
    name: str  # the issue's words
    op: str
    where: dict  # axis -> values: the points
    group: str  # the run it is measured in (GROUPS)
    peers: tuple = ()  # compared with the first of these measured at a point
    min_ratio: float | None = None  # peer time / ours, at every point
    min_pct_bw: float | None = None  # % of the measured memory bandwidth, at every point


# In run order: the cheap points first; the chunk prefill (its fp32 token-loop reference at 64k tokens takes
# seconds) last. SHARES: each group's share of the budget (what an earlier group leaves unused goes to the later ones
# in proportion), so the chunk prefill, issue 12's main target, keeps its share whatever the others take.
GROUPS = {"kda-decode": ("kimi-linear", KDA), "moe-kimi": ("kimi-linear", MOE), "moe-dsv3": ("deepseek-v3", MOE),
          "kda-prefill": ("kimi-linear", ("triton", "fla"))}
SHARES = {"kda-decode": 0.2, "moe-kimi": 0.25, "moe-dsv3": 0.2, "kda-prefill": 0.35}
# Precompiled in this order (the slowest to compile and the most wanted first: a cut precompile leaves the rest to
# the JIT, serially, on the clock)
PRECOMPILE_ORDER = ("kda-prefill", "moe-kimi", "kda-decode", "moe-dsv3")
PREFILL = {"batch": [1], "varlen": ["fixed"], "fused": [True], "seq_len": [4096, 16384, 65536], "heads": [32, 4]}
MOE_T = {"tokens": [1, 8, 64, 512, 4096, 16384], "routing": ["uniform"]}
DECODE_T = {"tokens": [1, 8, 64], "routing": ["uniform"]}
TARGETS = [
    Target(12, "kda.chunk_prefill triton >= 1.0x fla chunk_kda, T = 4k-64k, TP1 and TP8", "kda.chunk_prefill",
           PREFILL, "kda-prefill", peers=("fla",), min_ratio=1.0),
    Target(12, "kda.chunk_prefill >= 40% of the memory roofline", "kda.chunk_prefill", PREFILL, "kda-prefill",
           min_pct_bw=40),
    Target(12, "kda.recurrent_decode >= 80% of the memory roofline, largest decode point", "kda.recurrent_decode",
           {"batch": [512], "seq_len": [1], "heads": [32], "fused": [True]}, "kda-decode", min_pct_bw=80),
    Target(12, "kda.short_conv_decode >= 80% of the memory roofline, largest decode point", "kda.short_conv_decode",
           {"batch": [512], "heads": [32]}, "kda-decode", min_pct_bw=80),
    Target(12, "kda.gate >= 80% of the memory roofline, largest prefill point", "kda.gate",
           {"tokens": [65536], "heads": [32]}, "kda-decode", min_pct_bw=80),
    Target(12, "kda.gated_rmsnorm >= 80% of the memory roofline, largest prefill point", "kda.gated_rmsnorm",
           {"tokens": [65536], "heads": [32]}, "kda-decode", min_pct_bw=80),
    Target(12, "kda.block_decode >= 1.2x its unfused stages (triton_unfused)", "kda.block_decode",
           {"batch": [1, 64, 512], "heads": [32]}, "kda-decode", peers=("triton_unfused",), min_ratio=1.2),
    Target(13, "moe.experts bf16 >= 80% of the memory roofline, T = 1-64, Kimi-Linear", "moe.experts",
           {**DECODE_T, "inter": [1024]}, "moe-kimi", min_pct_bw=80),
    Target(13, "moe.experts bf16 >= 1.0x vLLM fused_experts (torch grouped_mm without vLLM), Kimi-Linear",
           "moe.experts", {**MOE_T, "inter": [1024]}, "moe-kimi", peers=("vllm", "torch"), min_ratio=1.0),
    Target(13, "moe.experts_gguf >= 60% of the memory roofline at its bits per weight, T = 1-8, Kimi-Linear",
           "moe.experts_gguf", {"tokens": [1, 8], "routing": ["uniform"], "inter": [1024]}, "moe-kimi",
           min_pct_bw=60),
    Target(13, "moe.layer decode, ours and torch (its 1.3x over the code before issue 13: step 4d, layer_baseline.py)",
           "moe.layer", {"tokens": [1, 8], "inter": [1024], "format": ["bf16", "q2k_q3k"]}, "moe-kimi",
           peers=("torch",)),
    Target(13, "moe.experts bf16 >= 80% of the memory roofline, T = 1-64, DeepSeek-V3", "moe.experts",
           {**DECODE_T, "inter": [2048]}, "moe-dsv3", min_pct_bw=80),
    Target(13, "moe.experts bf16 >= 1.0x vLLM fused_experts (torch grouped_mm without vLLM), DeepSeek-V3",
           "moe.experts", {**MOE_T, "inter": [2048]}, "moe-dsv3", peers=("vllm", "torch"), min_ratio=1.0),
]


SPARK_BENCH = [sys.executable, "-m", "spark_bench"]  # the spark-bench of the Python running this script


def group_args(group: str, backends: bool = True) -> list[str]:
    """The `spark-bench run` options of one group: its preset, ops, per-op points and backends (bf16)."""
    preset, names = GROUPS[group]
    args = ["--preset", preset, "--dtype", "bf16"]
    ops: dict[str, dict] = {}
    for t in TARGETS:
        if t.group == group:
            merged = ops.setdefault(t.op, {})
            for axis, values in t.where.items():
                merged[axis] = list(dict.fromkeys([*merged.get(axis, []), *values]))
    for op, where in ops.items():
        args += ["--op", op] + [a for axis, values in where.items()
                                for a in ("--set", f"{op}:{axis}={','.join(str(v) for v in values)}")]
    return args + [a for b in (names if backends else ()) for a in ("--backend", b)]


def precompile(extra: list[str]) -> None:
    """`spark-bench kernels` over each group's points (our Triton backends only): fills the Triton cache that
    --triton-cache names, so the targets' runs do not compile on the clock (the general precompile covers the GPU
    sweep without presets)."""
    for group in PRECOMPILE_ORDER:
        code = subprocess.run([*SPARK_BENCH, "kernels", *group_args(group, backends=False), *extra],
                              stdout=subprocess.DEVNULL).returncode
        print(f"targets: precompiled {group}: exit {code}", flush=True)


def run(out: Path, budget_s: float, extra: list[str]) -> None:
    """Each group's run into out/<group>, within its share (SHARES) of what is left of budget_s (a run past it is
    stopped: its journal keeps the finished cases), so a slow group (a peer's autotuning) cannot starve the rest."""
    end = time.monotonic() + budget_s
    groups = list(GROUPS)
    for i, group in enumerate(groups):
        left = (end - time.monotonic()) * SHARES[group] / sum(SHARES[g] for g in groups[i:])
        if left < 5:
            print(f"targets: no time left for {group}", flush=True)
            continue
        cmd = [*SPARK_BENCH, "run", *group_args(group), *extra, "--out", str(out / group), "--no-report"]
        print(f"targets: {group} ({left:.0f} s left): {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd)
        try:
            code = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:  # Ctrl-C first: the run stops its workers and closes its journal
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            code = "budget reached"
        print(f"targets: {group} exit {code}", flush=True)


def _matches(params: dict, where: dict) -> bool:
    return all(params.get(axis) in values for axis, values in where.items())


def _point(rows: list[dict], t: Target, ours: dict) -> dict:
    """One point of target t from our result row `ours` and the peers' rows at the same params."""
    point = {"params": ours["params"], "status": ours["status"], "device": ours.get("device"),
             "labels": ours.get("labels") or []}
    if ours["status"] != "ok":
        point["error"] = ours.get("error")
        return point
    point["us"] = ours["timing"]["median"]
    point["pct_bw"] = (ours.get("roofline") or {}).get("pct_bw_measured")
    for peer in t.peers:
        other = [r for r in rows if r["backend"] == peer and r["params"] == ours["params"] and r["status"] == "ok"]
        if other:
            point.update(peer=peer, peer_us=other[0]["timing"]["median"])
            point["ratio"] = round(point["peer_us"] / point["us"], 3)
            break
    return point


def verdict(rows: list[dict], t: Target) -> dict:
    """{target fields, points, verdict}: verdict is met / not met / partial (every measured point passes, some of
    the target's points were not measured) / failed (a case of ours did not pass its check, or crashed) / not
    measured (none run: cut by the budget, or skipped as unavailable) / measured (a target without a threshold).
    Each point names its device and labels (e.g. interpreted)."""
    ours = [r for r in rows if r["op"] == t.op and r["backend"] == "triton" and r.get("dtype") == "bf16"
            and _matches(r["params"], t.where)]
    points = [_point(rows, t, r) for r in ours if r["status"] != "skipped"]  # skipped: not run here (its reason)
    expected = 1
    for values in t.where.values():
        expected *= len(values)
    out = {"issue": t.issue, "target": t.name, "op": t.op, "group": t.group, "points": points}
    switches = {k: v for r in ours for k, v in (r.get("codegen") or {}).items()}
    if switches:  # e.g. DISABLE_MMA_V3=1: ours (and Triton peers) compiled without wgmma, torch peers unchanged
        out["compiled_with"] = switches
    checks = []  # one per judged value: True, False, or None (not measured: no peer, no roofline)
    for p in points:
        if p["status"] != "ok":
            out["verdict"] = f"failed: {p['status']} at {p['params']}"
            return out
        for value, bound in ((p.get("ratio"), t.min_ratio), (p.get("pct_bw"), t.min_pct_bw)):
            if bound is not None:
                checks.append(None if value is None else value >= bound)
    judged = sum(c is not None for c in checks)
    if not points:
        out["verdict"] = "not measured"
    elif t.min_ratio is None and t.min_pct_bw is None:
        out["verdict"] = "measured"
    elif False in checks:
        out["verdict"] = "not met"
    elif judged < len(checks):
        out["verdict"] = f"partial ({judged} of {len(checks)} values measured: a peer or the roofline missing)"
    else:
        out["verdict"] = "met" if len(points) >= expected else f"partial ({len(points)} of {expected} points)"
    return out


def read_rows(out: Path) -> list[dict]:
    """Every case record of the group runs under `out` (amendments merged, a killed run's partial line skipped), each
    with its run's Triton code-generation switches as `codegen` (e.g. DISABLE_MMA_V3 after step 2b of the check)."""
    from locate_faults import codegen_of, journal

    rows = []
    for path in sorted(out.glob("*/results.jsonl")):
        codegen = codegen_of(path.parent)
        rows += [{**r, "codegen": codegen} for r in journal(path.parent)]
    return rows


def main(argv: list[str]) -> int:
    if argv and argv[0] == "precompile":
        precompile(argv[argv.index("--") + 1:] if "--" in argv else [])
        return 0
    if len(argv) >= 2 and argv[0] == "run":
        budget = float(argv[argv.index("--budget") + 1]) if "--budget" in argv else 120.0
        extra = argv[argv.index("--") + 1:] if "--" in argv else []
        run(Path(argv[1]), budget, extra)
        return 0
    if len(argv) == 2 and argv[0] == "verdict":
        rows = read_rows(Path(argv[1]))
        print(json.dumps([verdict(rows, t) for t in TARGETS], indent=1))
        return 0
    print("usage: targets.py precompile [-- KERNELS_OPTIONS] | run DIR [--budget S] [-- RUN_OPTIONS] | verdict DIR",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
