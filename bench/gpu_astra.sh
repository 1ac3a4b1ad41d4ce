#!/usr/bin/env bash
# One device call (repo root, GPU machine): `kopt optimize` with the offline provider on Astra
# kernels, each under a wall-time budget, then a cold-L2 A/B of the best against the baseline at
# every bench shape; the summary, each report.json and each log land in $OUT.
#   bash bench/gpu_astra.sh [SECONDS_PER_KERNEL] [KERNELS (comma-separated)] [MIN_GAIN]
set -uo pipefail
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
source bench/gpu_env.sh || exit 1
kernels=${2:-silu_and_mul,fused_add_rmsnorm,merge_attn_states_lse}
scratch=/tmp/astra; rm -rf "$scratch"
python3 bench/astra_kernels.py --rounds 40 --max-wall-time "${1:-110}" --min-gain "${3:-0.005}" \
  --kernels "$kernels" --out "$scratch" 2>&1 | tail -30
cp "$scratch"/astra-kernels-*.json "$out/"
for k in ${kernels//,/ }; do
  cp "$scratch/$k/report.json" "$out/report-$k.json" 2>/dev/null
  cp "$scratch/$k.log" "$out/optimize-$k.log" 2>/dev/null
done
