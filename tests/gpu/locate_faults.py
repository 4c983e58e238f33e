"""Which kernel launch faults, for every backend whose case died of a CUDA fault in the GPU check's runs (step 4c).

A CUDA fault (illegal memory access, misaligned address) is reported at the next synchronisation, so a record's
error names no kernel. For each (op, backend) with such a case in the given run directories, its first faulting
case runs again in a fresh process with CUDA_LAUNCH_BLOCKING=1: every launch then waits for its kernel, and the
traceback ends at the launch that faulted (a wrapper in kernels/). The frames under kernels/ and plugins/ and the
error are printed and written as JSON lines. Then, for the first faulting case only and when compute-sanitizer is
installed and 45 s of the budget are left, the same call under `compute-sanitizer --tool memcheck`: its first report
names the kernel, the thread and block, the access and the address (`sanitizer` in the row). Next step, without a
GPU: `spark-bench memcheck` on that kernel at that shape.

Each case runs as its run compiled it (the Triton code-generation switches in its run.json fingerprint, e.g. the
DISABLE_MMA_V3=1 the GPU check exports after a wgmma-suspect fault in step 2), the sanitizer run too; then once more
with DISABLE_MMA_V3 flipped (Triton compiles its dots without Hopper's wgmma, or with it), and the row says how that
went (`without_wgmma` or `with_wgmma`): Triton 3.6 and later fault on sm_90 in kernels with several dots on 32-wide
tiles at 4 warps (triton-lang/triton #10486, #10573, #11366; clean on 3.5.1), which is what `_chunk_intra`,
`_chunk_state` and the grouped MoE GEMMs have. Cases count once per (op, backend, dtype, codegen switches), and a
case a later death marked `suspect` (it may have left an asynchronous fault) counts as faulting. Usage: python
tests/gpu/locate_faults.py OUT.jsonl RUN_DIR... [--budget S]; `--any RUN_DIR...` only exits 0 when some case there
died of a CUDA fault (1 otherwise); `--wgmma-suspect RUN_DIR...` only when such a fault could be the wgmma one
(`wgmma_suspect`: the GPU check then compiles the rest without wgmma).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

FAULTS = ("illegal memory access", "misaligned address", "illegal instruction", "unspecified launch failure")


def journal(run: Path) -> list[dict]:
    """The run's case records with their amendments merged, read tolerantly: a crash can leave a partial last line,
    and RunStore.read_results (strict: it raises on any malformed record) would then hide every fault of the run."""
    path = run / "results.jsonl"
    records: list[dict] = []
    if not path.exists():
        return records
    by_id: dict = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(r, dict):
            continue
        if "amends" in r:  # RunStore.amend: fields and a label for an earlier case
            target = by_id.get(r.get("amends"))
            if target is not None:
                target.update(r.get("fields") or {})
                target["labels"] = [*(target.get("labels") or []), *([r["label"]] if r.get("label") else [])]
        elif "op" in r and "backend" in r:
            records.append(r)
            by_id[r.get("case_id")] = r
    return records


def codegen_of(run: Path) -> dict:
    """The Triton code-generation switches the run's fingerprint recorded ({} where none, or no run.json)."""
    try:
        return dict(json.loads((run / "run.json").read_text())["fingerprint"].get("triton_codegen_env") or {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def faulting_cases(run_dirs: list[Path]) -> list[dict]:
    """The first record per (op, backend, dtype, codegen switches) whose error, worker log or earlier errors name a
    CUDA fault, or which a later case's death marked suspect."""
    seen, out = set(), []
    for run in run_dirs:
        codegen = codegen_of(run)
        for r in journal(run):
            text = " ".join(str(x) for x in (r.get("error"), r.get("worker_log_tail"), r.get("earlier_errors"))).lower()
            faulted = r.get("status") in ("crash", "error") and any(f in text for f in FAULTS)
            key = (r["op"], r["backend"], r.get("dtype"), tuple(sorted(codegen.items())))
            if (faulted or r.get("suspect")) and key not in seen:
                seen.add(key)
                out.append({"op": r["op"], "backend": r["backend"], "dtype": r.get("dtype") or "bf16",
                            "params": r["params"], "device": r.get("device") or "cuda", "run": str(run),
                            "codegen": codegen, "fault": text[:300],
                            "misaligned": "misaligned address" in text})  # anywhere in a worker's log tail
    return out


# The ops whose Triton kernels chain several tl.dot (the chunk core, the grouped expert GEMMs): where Triton >= 3.6's
# Hopper wgmma faults have been reported. A misaligned address is an addressing bug, not that.
DOT_OPS = ("kda.chunk_prefill", "kda.block_prefill", "moe.experts", "moe.experts_gguf", "moe.shared_expert",
           "moe.layer")


def wgmma_suspect(case: dict) -> bool:
    """A faulting case that could be the wgmma fault: an op of DOT_OPS, compiled with wgmma, and not a misaligned
    address."""
    return (case["op"] in DOT_OPS and "DISABLE_MMA_V3" not in case.get("codegen", {})
            and not case.get("misaligned"))


def case_env(case: dict, flip: bool = False) -> dict:
    """The environment the case was compiled in (its run's codegen switches, none of the caller's), with
    CUDA_LAUNCH_BLOCKING=1; flip: DISABLE_MMA_V3 the other way."""
    from spark_bench.fingerprint import CODEGEN_VARS

    env = {k: v for k, v in os.environ.items() if k not in CODEGEN_VARS}
    env.update({**case.get("codegen", {}), "CUDA_LAUNCH_BLOCKING": "1"})
    if flip:
        if "DISABLE_MMA_V3" in case.get("codegen", {}):
            env.pop("DISABLE_MMA_V3")
        else:
            env["DISABLE_MMA_V3"] = "1"
    return env


def run_one(case: dict) -> None:
    """In a process with CUDA_LAUNCH_BLOCKING=1: the case's call, its outcome as one JSON line on stdout."""
    import traceback

    import torch

    from spark_bench import get_op

    op, device = get_op(case["op"]), case.get("device") or "cuda"
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    try:
        inputs = op.make_inputs(case["params"], device=device, dtype=case["dtype"], seed=0)
        sync()  # the inputs are fine: what faults after this is the backend's
        op.backends[case["backend"]].fn(**inputs)
        sync()
        outcome = {"faulted": False}
    except Exception as exc:  # noqa: BLE001 - the fault is the finding
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(exc.__traceback__)
                  if "/kernels/" in f.filename or "/plugins/" in f.filename]
        outcome = {"faulted": True, "error": f"{type(exc).__name__}: {exc}"[:400], "frames": frames}
    print(json.dumps({**case, **outcome}), flush=True)


SANITIZER_MIN_S = 45.0


def sanitizer() -> str | None:
    """compute-sanitizer's path: on the PATH, or in CUDA's usual place."""
    import shutil

    found = shutil.which("compute-sanitizer")
    default = Path("/usr/local/cuda/bin/compute-sanitizer")
    return found or (str(default) if default.exists() else None)


def sanitized(case: dict, tool: str, timeout: float) -> str:
    """The first lines of compute-sanitizer's memcheck report of the case's call."""
    cmd = [tool, "--tool", "memcheck", "--print-limit", "3", "--show-backtrace", "no", sys.executable, __file__,
           "--one", json.dumps(case)]
    code, stdout, stderr = _run_group(cmd, timeout, case_env(case))
    if code is None:
        return f"no report within {timeout:.0f} s"
    lines = [ln for ln in (stdout + stderr).splitlines() if ln.startswith("=========")]
    return "\n".join(lines[:12]) or f"no report (exit {code})"


def _run_group(cmd: list[str], timeout: float, env: dict) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of cmd in a process group of its own; past `timeout` the whole group is killed
    (compute-sanitizer's child, the Python case, would otherwise go on using the GPU into the check's next steps)
    and the code is None."""
    import signal

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, "", ""


def rerun(case: dict, timeout: float, flip: bool = False) -> dict:
    """The case in a fresh process as its run compiled it (flip: DISABLE_MMA_V3 the other way); its row."""
    code, stdout, stderr = _run_group([sys.executable, __file__, "--one", json.dumps(case)], timeout,
                                      case_env(case, flip))
    if code is None:
        return {**case, "error": f"no result within {timeout:.0f} s"}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {**case, "error": f"exit {code}", "stderr": stderr[-1500:]}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        run_one(json.loads(argv[1]))
        return 0
    if argv[:1] == ["--any"]:
        return 0 if faulting_cases([Path(a) for a in argv[1:]]) else 1
    if argv[:1] == ["--wgmma-suspect"]:
        return 0 if any(wgmma_suspect(c) for c in faulting_cases([Path(a) for a in argv[1:]])) else 1
    budget = 60.0
    if "--budget" in argv:
        i = argv.index("--budget")
        budget, argv = float(argv[i + 1]), argv[:i] + argv[i + 2:]
    out, runs = Path(argv[0]), [Path(a) for a in argv[1:]]
    cases = faulting_cases(runs)
    print(f"faults: {len(cases)} (op, backend) with a CUDA fault in {len(runs)} runs", flush=True)
    end, sanitized_one = time.monotonic() + budget, False
    with out.open("w") as f:
        for case in cases:
            left = end - time.monotonic()
            if left < 5:
                print(f"faults: no time left for {case['op']} {case['backend']}", flush=True)
                continue
            row = rerun(case, left)
            print(f"faults: {row['op']} {row['backend']} {row['params']}: {row.get('error', 'no fault')} "
                  f"at {' <- '.join(reversed(row.get('frames') or [])) or '?'}", flush=True)
            left, tool = end - time.monotonic(), sanitizer()
            if row.get("faulted") and tool and left >= SANITIZER_MIN_S and not sanitized_one:
                sanitized_one = True
                row["sanitizer"] = sanitized(case, tool, left - 5)
                print(f"faults: compute-sanitizer:\n{row['sanitizer']}", flush=True)
            left = end - time.monotonic()
            if row.get("faulted") and left >= 5:
                other = rerun(case, left, flip=True)
                field = "with_wgmma" if "DISABLE_MMA_V3" in case.get("codegen", {}) else "without_wgmma"
                row[field] = ("faulted: " + other.get("error", "?")) if other.get("faulted") else (
                    "ran" if other.get("faulted") is False else other.get("error", "?"))
                print(f"faults: the same {field.replace('_', ' ')}: {row[field]}", flush=True)
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
