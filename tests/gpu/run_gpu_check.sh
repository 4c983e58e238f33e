#!/usr/bin/env bash
# The prepared GPU check (one call of the `device` tool: its steps' limits add up to ~520 s, within timeout_s=540;
# with the machine's start that is most of a session's 15 minutes, so it is one shot: no rerun fits):
#   0. the quick sweep's and the targets' Triton specialisations compiled in parallel into the JIT's cache (offline
#      machinery of `spark-bench kernels` on the device's own Triton), so the workers do not compile serially,
#   1. the measured roofline (spark-bench calibrate: measured here, before any sweep, which then reads it),
#   2. every Triton kernel's correctness in bf16 on the GPU (the quick sweep of all ops, triton backend only, no
#      energy windows), and each kernel's registers and spills as the driver reports them beside the offline
#      figures; (2b) after a CUDA fault there that could be Triton's wgmma one (locate_faults.wgmma_suspect), the
#      rest compiles without Hopper's wgmma (DISABLE_MMA_V3=1, labelled in every run and verdict),
#   3. our CUDA timers against triton.testing.do_bench,
#   4. the issues' targets (tests/gpu/targets.py: the points issues 12 and 13 name, ours against fla / vLLM / torch
#      and the measured roofline) and their verdicts, then (4b) the launch that faulted for each backend with a CUDA
#      fault (tests/gpu/locate_faults.py), (4c) the per-kernel times of the chunk prefill's stages and the MoE experts'
#      kernels at those points (tests/gpu/profiles.py, torch.profiler, a process per case), (4d) moe.layer decode
#      against the code before issue 13 (tests/gpu/layer_baseline.py, when .baseline-pre13.tar.xz is carried),
#   5. the GPU sweep (every op, every available backend, fla/vLLM as peers where installed), budgeted and resumable,
#      and its HTML report.
# Writes 8 files under $OUT (the device tool returns no more; the runs travel as runs.tar.gz). Run from the repo root:
#   run(command="bash tests/gpu/run_gpu_check.sh", carry=[".whl", ".triton-cache.tar.xz", ".baseline-pre13.tar.xz"],
#       timeout_s=540, kind="nvidia-h200")
# Peer wheels (plotly, fla-core, gguf and what they need) travel in .whl/ (see docs/gpu.md).
set -uo pipefail
OUT=${OUT:-/tmp/spark-gpu-out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
TARGETS_BUDGET_S=${TARGETS_BUDGET_S:-125}  # the steps' limits add up to ~520 s with the installs
SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-15}  # from the command's start, + a hard stop 5 s later: 20 s at most
# a worker start-up (torch, the plugins, the CUDA context) that hangs is announced after 22 s and given up after 45 s,
# not the default 300 s, which would eat a step's whole limit without a word
export SPARK_BENCH_STARTUP_TIMEOUT=${SPARK_BENCH_STARTUP_TIMEOUT:-45}
# One Triton cache for every step: a precompiled one carried as .triton-cache.tar.xz (made with the device's Triton
# version, see docs/kernels.md) is unpacked into it when present; the entries counted before and after each step
# say whether the device's JIT found them (its cache keys include the Triton and ptxas versions).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/spark-triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton-cache.tar.xz ] && python3 tests/gpu/triton_cache.py unpack .triton-cache.tar.xz "$TRITON_CACHE_DIR"
cache_entries() { find "$TRITON_CACHE_DIR" -name '*.json' ! -name '__grp__*' | wc -l; }
# the runs so far into $OUT, written aside and moved: a kill mid-write keeps the previous archive
save_runs() { tar -C /tmp -czf /tmp/runs.tar.gz "$@" 2>/dev/null; mv -f /tmp/runs.tar.gz "$OUT/runs.tar.gz"; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the build imports setuptools from /tmp/site when .whl carries it (>= 77 reads the SPDX license; docs/gpu.md)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
# issue 13's "moe.layer decode >= 1.3x today's": the tree before issue 13, packed here by
# `python3 tests/gpu/layer_baseline.py pack` with its packages laid out as installed (step 4d imports it first)
BASELINE_SITE=/tmp/pre13/site  # its own kernels precompiled in step 0 (run from /tmp: python3 -m puts the cwd first)
[ -f .baseline-pre13.tar.xz ] && mkdir -p /tmp/pre13 && tar -C /tmp/pre13 -xJf .baseline-pre13.tar.xz
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv || true
spark-bench env --json  # the fingerprint (also stored in run.json)

echo "== 0. precompile (budget 55 s; carried cache entries: $(cache_entries))"
# the quick sweep's specialisations (step 2 launches them) and the targets' points (step 4, the chunk prefill's
# first) side by side, 8 jobs each; the general sweep (step 5, 20 s) compiles what it reaches itself. (On the first
# H200 run, 2026-12-05: the quick ones took 25-34 s, each target group 13-20 s; all 472 of the GPU sweep > 65 s.)
timeout 55 bash -c 'spark-bench kernels --quick --no-presets --select all --jobs 8 --triton-cache "$TRITON_CACHE_DIR" \
  --json > /tmp/precompile.json 2> /tmp/precompile.err & quick=$!
  [ -d '"$BASELINE_SITE"' ] && (cd /tmp && PYTHONPATH='"$BASELINE_SITE"'${PYTHONPATH:+:$PYTHONPATH} python3 -m \
    spark_bench kernels --op moe.layer --preset kimi-linear --set tokens=1,8 --set format=bf16,q2k_q3k --select all \
    --jobs 4 --triton-cache "$TRITON_CACHE_DIR" > /dev/null 2>&1) & base=$!  # from /tmp: not this tree'"'"'s
  python3 tests/gpu/targets.py precompile -- --select all --jobs 8 --triton-cache "$TRITON_CACHE_DIR" --json
  wait $quick; echo "quick precompile exit code: $?"; wait $base 2>/dev/null; echo "baseline precompile exit code: $?"'
echo "precompile exit code: $? ($(tail -n 1 /tmp/precompile.err)); cache entries now: $(cache_entries)"

echo "== 1. calibrate (the measured roofline every later run reads)"
timeout 30 spark-bench calibrate --device cuda --force --json > "$OUT/calibrate.json"

echo "== 2. Triton kernels, bf16, on the GPU"
before=$(cache_entries)
# no energy windows (>= 1.5 s a case: 80 cases would not fit) and no crash confirmation (a fresh worker a crash)
timeout 70 spark-bench run --device cuda --backend 'triton*' --dtype bf16 --quick --max-time 0.05 --out /tmp/gpu-correct \
  --no-report --no-energy --no-confirm-crashes
echo "correctness exit code: $?; new JIT cache entries (compiled by the JIT, not found): $(( $(cache_entries) - before ))"
timeout 30 python3 tests/gpu/kernel_metadata.py "$OUT/kernel_metadata.json" \
  results/kernels/offline-quick-sm_90a-triton-3.6.json --budget 15
python3 - <<'PY' > "$OUT/triton_bf16_correctness.json"
import json
rows = [json.loads(l) for l in open("/tmp/gpu-correct/results.jsonl") if l.strip()]
print(json.dumps([{k: r.get(k) for k in ("op", "params", "status", "error")} | {"err_ratio": (r.get("check") or {}).get("err_ratio")} for r in rows], indent=1))
PY

echo "== 2b. a CUDA fault in step 2 that could be wgmma's: the rest compiles without Hopper's wgmma"
# Triton >= 3.6 faults on sm_90 in some kernels with several dots on 32-wide tiles at 4 warps (triton-lang/triton
# #10486, #10573, #11366; clean on 3.5.1), which our chunk prefill and grouped GEMMs have. After such a fault here
# (an op of locate_faults.DOT_OPS, not a misaligned address) the steps below compile without wgmma
# (DISABLE_MMA_V3=1: in every run's fingerprint as triton_codegen_env, so those numbers are labelled), the targets'
# points are compiled again that way, and step 4b runs each fault both ways. Any other fault: step 4b locates it.
if python3 tests/gpu/locate_faults.py --wgmma-suspect /tmp/gpu-correct; then
  export DISABLE_MMA_V3=1
  TARGETS_BUDGET_S=$((TARGETS_BUDGET_S - 40))  # the precompile below: the worst case stays ~520 s
  echo "a CUDA fault in step 2: DISABLE_MMA_V3=1 from here on (targets budget ${TARGETS_BUDGET_S}s)"
  timeout 40 python3 tests/gpu/targets.py precompile -- --select all --jobs 16 --triton-cache "$TRITON_CACHE_DIR" \
    --json > /dev/null 2>&1; echo "targets precompiled without wgmma (exit code $?)"
fi

echo "== 3. timers vs triton.testing.do_bench"
timeout 30 python3 tests/gpu/xcheck_do_bench.py "$OUT/timer_xcheck.json"

echo "== 4. the issues' targets (budget ${TARGETS_BUDGET_S}s)"
python3 tests/gpu/targets.py run /tmp/gpu-targets --budget "$TARGETS_BUDGET_S" -- --device cuda --max-time 0.3 --no-energy
python3 tests/gpu/targets.py verdict /tmp/gpu-targets > "$OUT/targets.json"
python3 -c "import json; [print(t['verdict'], '|', t['target'], *(['| compiled with', t['compiled_with']] if t.get('compiled_with') else [])) for t in json.load(open('$OUT/targets.json'))]"
save_runs gpu-targets gpu-correct  # now, in case the steps below run out of time

echo "== 4b. which launch faulted (CUDA_LAUNCH_BLOCKING=1; the first under compute-sanitizer), per backend with a CUDA fault"
timeout 60 python3 tests/gpu/locate_faults.py /tmp/gpu-faults.jsonl /tmp/gpu-correct /tmp/gpu-targets/* --budget 55

echo "== 4c. per-kernel device time: chunk prefill stages at 64k (TP1, TP8), MoE experts at T = 16k and 1"
mkdir -p /tmp/gpu-profiles
timeout 50 python3 tests/gpu/profiles.py /tmp/gpu-profiles --timeout 12 --budget 45
cp /tmp/gpu-faults.jsonl /tmp/gpu-profiles/ 2>/dev/null
save_runs gpu-targets gpu-correct gpu-profiles

echo "== 4d. moe.layer decode against the code before issue 13 (both trees timed alike, each in its own process)"
mkdir -p /tmp/gpu-layer-baseline
if [ -d "$BASELINE_SITE" ]; then  # unpacked before step 0, which precompiled its kernels
  timeout 30 python3 tests/gpu/layer_baseline.py run /tmp/gpu-layer-baseline/layer_baseline.json \
    --baseline "$BASELINE_SITE" --budget 27 --device cuda
else
  echo "skipped: no .baseline-pre13.tar.xz carried (python3 tests/gpu/layer_baseline.py pack, docs/gpu.md)"
fi
save_runs gpu-targets gpu-correct gpu-profiles gpu-layer-baseline

echo "== 5. GPU sweep (budget ${SWEEP_BUDGET_S}s; resumable)"
before=$(cache_entries)
# --budget: no new point after it (the run ends as usual, run.json and the report say how many cases were left);
# timeout: a hard stop 5 s later if the point in flight is slow (SIGTERM: the journal keeps every finished case)
timeout $((SWEEP_BUDGET_S + 5)) spark-bench run --device cuda --max-time 0.3 --out /tmp/gpu-sweep --no-report \
  --budget "${SWEEP_BUDGET_S}s"
echo "sweep exit code: $? (124 = the hard stop; 0/1: ended within the budget);" \
     "new JIT cache entries: $(( $(cache_entries) - before ))"
spark-bench report /tmp/gpu-sweep -o "$OUT/report.html"
# every run's spec and results (reports can be rebuilt from them here: spark-bench report DIR)
# the workers' logs too: the first H200 run's crashes kept no traceback (every worker died before its first case)
save_runs gpu-sweep gpu-targets gpu-correct gpu-profiles gpu-layer-baseline
ls -la "$OUT"
