#!/usr/bin/env bash
# The prepared GPU check (one call of the `device` tool, <= 8 minutes on an H200):
#   1. every Triton kernel's correctness in bf16 on the GPU (the quick sweep of all ops, triton backend only),
#   2. our CUDA timers against triton.testing.do_bench,
#   3. the measured roofline (spark-bench calibrate),
#   4. the GPU sweep (every op, every available backend, fla/vLLM as peers where installed) and its HTML report.
# Writes at most 8 files under $OUT (the device tool returns no more). Run from the repo root:
#   run(command="bash tests/gpu/run_gpu_check.sh", carry=[".whl"], timeout_s=540)
# Peer wheels (plotly, fla-core, gguf and what they need) travel in .whl/ (see docs/gpu.md).
set -uo pipefail
OUT=${OUT:-/tmp/spark-gpu-out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-270}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv || true
spark-bench env --json > /tmp/env.json && cp /tmp/env.json "$OUT/env.json"

echo "== 1. Triton kernels, bf16, on the GPU"
timeout 120 spark-bench run --device cuda --backend triton --dtype bf16 --quick --out /tmp/gpu-correct --no-report
echo "correctness exit code: $?"
python3 - <<'PY' > "$OUT/triton_bf16_correctness.json"
import json
rows = [json.loads(l) for l in open("/tmp/gpu-correct/results.jsonl") if l.strip()]
print(json.dumps([{k: r.get(k) for k in ("op", "params", "status", "error")} | {"err_ratio": (r.get("check") or {}).get("err_ratio")} for r in rows], indent=1))
PY

echo "== 2. timers vs triton.testing.do_bench"
timeout 90 python3 tests/gpu/xcheck_do_bench.py "$OUT/timer_xcheck.json"

echo "== 3. calibrate"
timeout 60 spark-bench calibrate --device cuda --json > "$OUT/calibrate.json"

echo "== 4. GPU sweep (budget ${SWEEP_BUDGET_S}s; resumable)"
timeout "$SWEEP_BUDGET_S" spark-bench run --device cuda --max-time 0.3 --out /tmp/gpu-sweep --no-report
echo "sweep exit code: $? (124 = budget reached; the journal keeps every finished case)"
spark-bench report /tmp/gpu-sweep -o "$OUT/report.html"
cp /tmp/gpu-sweep/run.json "$OUT/run.json"
cp /tmp/gpu-sweep/results.jsonl "$OUT/results.jsonl"
ls -la "$OUT"
