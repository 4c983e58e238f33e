#!/usr/bin/env bash
# The prepared GPU tune (a second call of the `device` tool, after run_gpu_check.sh, <= 5 minutes on an H200):
# `spark-bench tune` of the Kimi-Linear preset's Triton kernels within a budget, then `run --tuned` of the same preset
# beside a default run, so the note can give measured tuned-vs-default speedups. Writes the table, both runs' results
# and the tune's journal under $OUT (commit the table under results/tuned/ with the device fingerprint). From the repo:
#   run(command="bash tests/gpu/run_gpu_tune.sh", carry=[".whl", ".triton-cache.tar.xz"], timeout_s=330)
set -uo pipefail
OUT=${OUT:-/tmp/spark-gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_tune.log") 2>&1
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/spark-triton-cache}
TUNE_BUDGET_S=${TUNE_BUDGET_S:-150}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton-cache.tar.xz ] && python3 tests/gpu/triton_cache.py unpack .triton-cache.tar.xz "$TRITON_CACHE_DIR"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the build imports setuptools from /tmp/site when .whl carries it (>= 77 reads the SPDX license; docs/gpu.md)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
spark-bench env --json > "$OUT/fingerprint.json"
# The tune's points (~10 cases; the full preset would not fit the budget): the preset's decode and a 4k prefill of
# each op with declared kernels that matter most, full heads (no tensor-parallel slice), uniform routing.
# (kda.recurrent_decode is left out: its seq_len is tokens per step, unrolled in the kernel; 4096 is no decode.)
POINTS=(--preset kimi-linear --op kda.chunk_prefill --op kda.short_conv --op moe.experts --op moe.experts_gguf
        --set heads=32 --set tokens=1,4096 --set seq_len=4096 --set batch=1 --set varlen=fixed --set inter=1024
        --set routing=uniform --dtype bf16)

echo "== tune (budget ${TUNE_BUDGET_S}s; pruned offline for this GPU's target first)"
timeout $((TUNE_BUDGET_S + 60)) spark-bench tune --device cuda "${POINTS[@]}" --budget "$TUNE_BUDGET_S" --jobs 16 \
  --max-time 0.2 --run-dir /tmp/gpu-tune --out "$OUT/tuned.json"
echo "tune exit code: $?"
echo "== default vs tuned (same points, triton backends)"
timeout 45 spark-bench run --device cuda "${POINTS[@]}" --backend triton --max-time 0.2 --no-energy --out /tmp/gpu-default --no-report
timeout 45 spark-bench run --device cuda "${POINTS[@]}" --backend triton --max-time 0.2 --no-energy --tuned "$OUT/tuned.json" \
  --out /tmp/gpu-tuned --no-report
spark-bench compare /tmp/gpu-default /tmp/gpu-tuned --threshold 3% > "$OUT/tuned_vs_default.txt" 2>&1
tar -C /tmp -czf "$OUT/tune-runs.tar.gz" gpu-tune gpu-default gpu-tuned 2>/dev/null
echo "done"
