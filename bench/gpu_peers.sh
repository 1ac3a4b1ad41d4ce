#!/usr/bin/env bash
# One device call (repo root, GPU machine, carry .whl and .peers): kopt's Astra kernels (baseline and
# best) beside FlashInfer and torch.compile in one process (bench/peers.py: it says how .peers is
# made from FlashInfer's wheel). Log and JSON in $OUT.
#   bash bench/gpu_peers.sh [REPS]
set -uo pipefail
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
source bench/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
timeout 280 python3 bench/peers.py run --include .peers --reps "${1:-100}" --out "$out" 2>&1 | tee "$out/peers.log"
