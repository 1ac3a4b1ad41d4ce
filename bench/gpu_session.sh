#!/usr/bin/env bash
# One device call: install carried wheels, run the gpu tests, a full CUDA optimization run and the
# compile benchmark; everything worth keeping lands in $OUT. Usage (repo root, on the GPU machine):
#   bash bench/gpu_session.sh [ROUNDS]
set -uo pipefail
rounds=${1:-5}
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 KOPT_HOME=/tmp/kopt-home
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
gpu_class=$(python3 -c "from gpu_worker.device import local_gpus; print(local_gpus()[0][2])")
echo "gpu class: $gpu_class"
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/pytest-gpu.log" | tail -15
python3 -m kopt.cli optimize kernels/silu_and_mul --target cuda --gpu-class "$gpu_class" --rounds "$rounds" \
  --report-dir "$out/report" 2>&1 | tee "$out/optimize.log"
python3 bench/compile_time.py --runs 5 2>&1 | tail -8
cp bench/results/compile_time-*.json "$out/" 2>/dev/null || true
