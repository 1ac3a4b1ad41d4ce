#!/usr/bin/env bash
# Device call 2 of 2 (repo root, GPU machine): `kopt optimize` on the three Astra kernels with the
# offline provider, each under a wall-time budget; the summary and each report.json land in $OUT.
#   bash bench/gpu_astra.sh [SECONDS_PER_KERNEL]
set -uo pipefail
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
source bench/gpu_env.sh || exit 1
scratch=/tmp/astra; rm -rf "$scratch"
python3 bench/astra_kernels.py --rounds 40 --max-wall-time "${1:-150}" --out "$scratch"
cp "$scratch"/astra-kernels-*.json "$out/"
for k in silu_and_mul fused_add_rmsnorm merge_attn_states_lse; do
  cp "$scratch/$k/report.json" "$out/report-$k.json" 2>/dev/null
  cp "$scratch/$k.log" "$out/optimize-$k.log" 2>/dev/null
done
