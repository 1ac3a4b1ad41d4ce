#!/usr/bin/env bash
# Device call 1 of 2 (repo root, GPU machine): carried wheels, the gpu-marked tests, the noise
# floor / %SOL / overhead benchmark and the compile-time benchmark. Logs and JSON land in $OUT.
#   bash bench/gpu_session.sh
set -uo pipefail
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
source bench/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 --continue-on-collection-errors tests 2>&1 | tee "$out/pytest-gpu.log" | tail -25
timeout 150 python3 bench/noise_floor.py --out-dir "$out" 2>&1 | tail -25
timeout 60 python3 bench/compile_time.py --runs 5 --out-dir "$out" 2>&1 | tail -5
