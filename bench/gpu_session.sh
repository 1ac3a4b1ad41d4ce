#!/usr/bin/env bash
# One device call (repo root, GPU machine): carried wheels, the gpu-marked tests, the noise floor /
# %SOL / overhead benchmark (self A/B of all three Astra baselines) and the compile-time benchmark.
# Logs and JSON land in $OUT.
#   bash bench/gpu_session.sh [extra pytest args, e.g. -k 'not fault']
set -uo pipefail
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
source bench/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
KOPT_FAULT_SUMMARY="$out/fault-gpu.json" timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 400 \
  --continue-on-collection-errors tests "$@" 2>&1 | tee "$out/pytest-gpu.log" | tail -25
timeout 240 python3 bench/noise_floor.py --out-dir "$out" \
  --also kernels/fused_add_rmsnorm,kernels/merge_attn_states_lse 2>&1 | tail -40
timeout 60 python3 bench/compile_time.py --runs 5 --out-dir "$out" 2>&1 | tail -5
