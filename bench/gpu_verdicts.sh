#!/usr/bin/env bash
# One device call (repo root, GPU machine) after a change to checks or timing: the gpu-marked cheat,
# containment and end-to-end tests; each Astra baseline judged against itself with `kopt evaluate`
# (correct, "same"); the noise floor and harness overhead (bench/noise_floor.py); the sandbox's
# cost per candidate (bench/sandbox_cost.py). Logs and JSON land in $OUT.
#   bash bench/gpu_verdicts.sh
set -uo pipefail
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
source bench/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$out/gpu.txt"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 190 tests/test_cheats.py \
  tests/test_containment.py tests/test_gpu.py 2>&1 | tee "$out/pytest-gpu.log" | tail -30
for k in silu_and_mul fused_add_rmsnorm merge_attn_states_lse; do
  timeout 100 python3 -m frontend.cli evaluate kernels/$k --candidate kernels/$k/kernel.cu --target cuda --json \
    > "$out/evaluate-$k.json" 2>/tmp/evaluate-$k.err
  python3 -c "import json,sys; v=json.load(open(sys.argv[1])); print(sys.argv[2], v['correct'], v['reason'], \
v['verdict'], v['speedup_geomean'], v['speedup_ci'], v['seconds'])" "$out/evaluate-$k.json" $k
done
timeout 220 python3 bench/noise_floor.py --out-dir "$out" \
  --also kernels/fused_add_rmsnorm,kernels/merge_attn_states_lse 2>&1 | tail -30
timeout 120 python3 bench/sandbox_cost.py --target cuda --runs 3 --out-dir "$out" 2>&1 | tail -8
