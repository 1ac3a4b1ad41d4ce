#!/usr/bin/env bash
# One device call (repo root, GPU machine) for the sandbox: the jail probe, the gpu-marked containment
# and cheat tests (hostile corpus and cheats on CUDA in the jail, compute-sanitizer in the jail), the
# CUDA end-to-end run, and the sandbox's cost per candidate. Logs and JSON land in $OUT.
#   bash bench/gpu_containment.sh
set -uo pipefail
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
source bench/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "from kopt import jail; print('jail probe:', jail.probe() or 'ok')" 2>&1 | tee -a "$out/gpu.txt"
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 280 tests/test_containment.py \
  tests/test_cheats.py tests/test_gpu.py 2>&1 | tee "$out/pytest-gpu-containment.log" | tail -40
timeout 200 python3 bench/sandbox_cost.py --target cuda --runs 3 --out-dir "$out" 2>&1 | tail -12
